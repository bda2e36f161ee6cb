//! Accounting for a finished request, whichever codec served it: the request counters by
//! route and cluster (or as unrouted), the node's span when tracing is on (`crate::trace`),
//! and the access log line when logging is on.

use std::net::SocketAddr;
use std::time::Instant;

use flatmesh_rules::{ClusterId, CompiledRoute, ListenerId};

use crate::access_log::AccessRecord;
use crate::context::ConnContext;
use crate::snapshot::Snapshot;
use crate::trace::{FinishedSpan, Started};

/// How one request ended.
pub(crate) struct Outcome<'v> {
    pub route: Option<&'v CompiledRoute>,
    pub cluster: Option<ClusterId>,
    /// The endpoint that answered (or failed).
    pub upstream: Option<SocketAddr>,
    pub status: u16,
    /// The node's span of the request, when tracing is on.
    pub trace: Option<&'v Started>,
}

/// Counts and logs a request that began at `started`. `request` gives its method and target
/// for the log; it is called only when logging is on.
pub(crate) fn finish(
    ctx: &ConnContext,
    snap: &Snapshot,
    listener: ListenerId,
    started: Instant,
    outcome: &Outcome<'_>,
    request: impl FnOnce() -> Option<(String, String)>,
) {
    let elapsed = started.elapsed();
    let stats = match outcome.route {
        Some(r) => snap.request_stats(listener, r.id, outcome.cluster),
        None => snap.listeners.get(listener).map(|l| &l.no_route_stats),
    };
    if let Some(s) = stats {
        s.record(ctx.worker, outcome.status, elapsed);
    }
    if let Some(started) = outcome.trace {
        ctx.tracer.end(
            started,
            FinishedSpan {
                listener: snap.listeners.get(listener).map_or("", |l| l.name.as_str()),
                route: outcome.route.map(|r| r.name.as_str()),
                cluster: outcome.cluster.map(|c| snap.clusters[c].name.as_str()),
                upstream: outcome.upstream,
                client: ctx.peer,
                status: outcome.status,
                elapsed,
            },
        );
    }
    if !ctx.access_log.enabled() {
        return;
    }
    let Some((method, path)) = request() else {
        return;
    };
    ctx.access_log.write(|| AccessRecord {
        listener: snap
            .listeners
            .get(listener)
            .map(|l| l.name.clone())
            .unwrap_or_default(),
        route: outcome.route.map(|r| r.name.clone()).unwrap_or_default(),
        cluster: outcome
            .cluster
            .map(|c| snap.clusters[c].name.clone())
            .unwrap_or_default(),
        method,
        path,
        status: outcome.status,
        duration: elapsed,
        upstream: outcome.upstream,
        peer: ctx.peer,
        principal: ctx.principal.as_deref().map(str::to_owned),
    });
}
