// The library's modules, shared by src/lib.rs and examples/flatmesh_shm_preload.rs (both
// `include!` this file; `mod` paths resolve relative to this file, so both build the same
// sources). One concept per module; see lib.rs.
mod arena;
mod conn;
mod group;
mod intercept;
#[cfg(not(test))]
mod interpose;
mod io;
mod lock;
mod multiplex;
mod negotiate;
mod notify;
mod process;
mod proof;
mod real;
mod region;
mod settings;
mod stats;
