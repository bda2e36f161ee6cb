//! flatmesh's lab: everything that shows, drives or measures the product crates, kept apart
//! from them so that a node, a control center or a PU agent carries none of it.
//!
//! - [`demo`]: `flatmesh demo`, the main job: built-in services, an in-process node proxy, a
//!   load generator and the report.
//! - [`control`]: `flatmesh control demo`: E3's orchestrator on network namespaces, with real
//!   microservices ([`control::services`]), node agents and open-loop load.
//! - [`pu`]: `flatmesh pu demo` and `flatmesh pu bench`, and the echo server they (and the pu
//!   crate's tests) use as the app on a PU.
//! - [`qnp`]: `flatmesh qnp demo` and `flatmesh qnp bench`: QingNiao's dispatch modes under
//!   closed-loop load, the example apps' services (the RocksDB key-value service with the `kv`
//!   feature) and the benchmark's sweeps.
//! - [`svg`]: the one chart writer (line and bar charts) of the benchmarks and the simulator.
//! - [`cpu_use`]: how busy a set of CPUs was, from `/proc/stat`.

pub mod control;
pub mod cpu_use;
pub mod demo;
mod error;
pub mod pu;
pub mod qnp;
pub mod svg;

pub use error::{LabError, Result};
