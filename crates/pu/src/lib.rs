//! Split network namespace across processing units: HeteroNet's hetero-netns (HeteroPod §4.1)
//! and the mesh-proxy placement of HeteroK8s-Mesh (§5.1).
//!
//! A pod's processes may run on different processing units (PUs): host CPU and DPU. They still
//! reach each other over `localhost`, and a sidecar-style interception rule still delivers the
//! right `SO_ORIGINAL_DST` to a proxy on the other PU.
//!
//! - [`config`]: the split-namespace file; [`topology`]: names and addresses derived from it.
//! - [`backend`]: what a PU is. [`backend::Emulated`]: network namespace + cpuset + veth.
//! - [`table`]: the global port table (port -> PU): a pinned BPF map that a cgroup bind hook
//!   fills at bind() and uses to refuse, with EADDRINUSE, a port another PU owns.
//! - [`scan`], [`probe`]: seeing this PU's listeners; checking that nothing on this PU still
//!   holds a port before releasing it.
//! - [`rules`]: the nftables rules of §4.1.1 (reverse mapping) and §4.1.2 (split interception).
//! - [`agent`]: the per-PU daemon that ties them together.
//! - [`shm_proof`]: the agent's service that proves, for hetero-socket (crates/shm), that a
//!   connection accepted on this PU ends in a given socket on another.
//! - [`relay`]: a small original-destination TCP relay (what a sidecar proxy does with
//!   SO_ORIGINAL_DST), used by the demo and tests.
//! - [`cleanup`]: finding and removing what a crashed split namespace left behind.
//!
//! The demo, the benchmark and their echo server are lab code: `flatmesh_lab::pu`.

pub mod agent;
pub mod backend;
pub mod cleanup;
pub mod config;
pub mod cpuset;
mod error;
pub mod exec;
pub mod netns;
pub mod pod;
pub mod probe;
pub mod relay;
pub mod rules;
pub mod scan;
pub mod shm_proof;
pub mod table;
pub mod topology;

pub use agent::{Agent, TickReport};
pub use backend::{Emulated, PuBackend};
pub use config::SplitConfig;
pub use error::{PuError, Result};
pub use table::{PortTable, TableState};
pub use topology::Topology;
