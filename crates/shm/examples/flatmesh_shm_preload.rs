//! The preload library (src/lib.rs) once more, as an example: `cargo test` builds examples but
//! not a cdylib-only library, and the integration tests need a preloadable copy,
//! target/<profile>/examples/libflatmesh_shm_preload.so. Same modules, same sources.
#![cfg_attr(test, allow(dead_code))]

include!("../src/modules.rs");
