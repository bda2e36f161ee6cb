//! One endpoint's load over one report period: what a node measures (`flatmesh_proxy`'s
//! per-endpoint counters) and what its xDS client reports to the control plane over LRS
//! (`flatmesh_xds::lrs`), which feeds E3's orchestrator on Kubernetes. Here because both
//! sides share it and neither depends on the other.

use std::net::SocketAddr;

/// One endpoint's load over one report period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointReport {
    pub cluster: String,
    pub endpoint: SocketAddr,
    /// Tries started in the period.
    pub issued: u64,
    /// Tries answered below 500 in the period.
    pub succeeded: u64,
    /// Tries answered 5xx, or not answered, in the period.
    pub failed: u64,
    /// Tries outstanding at the end of the period.
    pub in_progress: u64,
    /// Tries answered in the period, and their summed time to the answer's head.
    pub answered: u64,
    pub answer_us: u64,
}
