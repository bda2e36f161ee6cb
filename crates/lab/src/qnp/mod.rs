//! QingNiao (`flatmesh_qnp`) under load.
//!
//! - [`load`]: closed-loop load generators (PingPong, Zipf key-value GETs, the benchmark's
//!   dispatch workload; [`load::pipelined`] batches system calls so one core can load a server
//!   core) and the demo's comparison of dispatch modes.
//! - [`bench`]: the dispatch benchmark: modes side by side, sweeps of skip-and-checks and rules,
//!   Markdown tables and SVG plots.
//! - [`services`]: the example apps' services and the demo's rules.
//! - [`kv_store`]: the RocksDB store behind the key-value GET service (the `kv` feature).

pub mod bench;
#[cfg(feature = "kv")]
pub mod kv_store;
pub mod load;
pub mod services;

/// Whether this build has the RocksDB key-value example (the `kv` feature).
pub const KV_BUILT: bool = cfg!(feature = "kv");

/// The workloads `flatmesh qnp demo` runs by default: both apps when the key-value example is
/// built, PingPong alone otherwise.
pub const DEFAULT_WORKLOADS: &str = if KV_BUILT { "kv,pingpong" } else { "pingpong" };
