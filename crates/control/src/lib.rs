//! flatmesh control center (E3, papers/001): models of clusters, microservices and application
//! DAGs; placement on heterogeneous compute nodes (HCM, simulated annealing, ILP); the energy and
//! cost model; the data-plane orchestrator and failover; the simulator behind `flatmesh simulate`;
//! and [`serve`], the control center serving all of it over xDS (`flatmesh control`).
#![forbid(unsafe_code)]

pub mod agent;
#[cfg(feature = "serve")]
pub mod console;
pub mod endpoints;
pub mod energy;
pub mod error;
pub mod failover;
pub mod heartbeat;
pub mod model;
pub mod orchestrator;
pub mod placement;
#[cfg(feature = "serve")]
pub mod serve;
pub mod simulate;
pub mod topology;
pub mod workload;

pub use error::{ControlError, Result};
