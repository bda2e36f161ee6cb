//! What a connection's handlers read: the worker's view of the config (snapshot and upstream
//! state) and the connection's own facts.

use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use flatmesh_config::ListenerProtocol;

use crate::access_log::AccessLog;
use crate::drain::Draining;
use crate::kernel::KernelBinding;
use crate::limits::NodeBudget;
use crate::original_dst::Dialled;
use crate::snapshot::Snapshot;
use crate::trace::Tracer;
use crate::upstream::Upstreams;

/// What one worker reads per request: the snapshot and its own upstream state for it.
pub struct WorkerView {
    pub snapshot: Arc<Snapshot>,
    pub upstreams: Upstreams,
}

/// Per-connection context handed to the L4 / L7 handlers.
#[derive(Clone)]
pub struct ConnContext {
    pub worker: usize,
    /// The listener's address as written in the config (its identity across reloads).
    pub listener_address: SocketAddr,
    pub protocol: ListenerProtocol,
    pub peer: SocketAddr,
    /// The client's IP as a header value, for x-forwarded-for.
    pub peer_ip: http::HeaderValue,
    pub view: Arc<ArcSwap<WorkerView>>,
    pub access_log: AccessLog,
    /// Distributed tracing (`crate::trace`): off unless the config has `tracing`.
    pub tracer: Tracer,
    /// Tier K, when the node attached it.
    pub kernel: Option<Arc<KernelBinding>>,
    /// The node's budgets: the connection's buffers are reserved from its memory budget.
    pub budget: Arc<NodeBudget>,
    /// The client's verified SPIFFE ID (a TLS listener with `client_ca`), for authorization.
    pub principal: Option<Arc<str>>,
    /// The node's drain: once it begins, the connection finishes what it carries and closes.
    pub draining: Draining,
    /// Where the client was going before the connection was sent to the node; read at
    /// accept while the config has an `original_dst` cluster (`crate::original_dst`).
    pub dialled: Option<Dialled>,
}

impl ConnContext {
    /// The caller as authorization policies see it.
    pub fn peer(&self) -> flatmesh_rules::Peer<'_> {
        flatmesh_rules::Peer {
            principal: self.principal.as_deref(),
        }
    }
}
