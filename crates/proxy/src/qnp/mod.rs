//! `qnp` listeners (docs/qnp.md, "QNP in the node"): QingNiao requests over UDP, each sent to
//! one of the listener's local workers, picked by its skip-and-check rules.
//!
//! - The rules are read and checked by `flatmesh_qnp::listener` into a [`QnpPlan`], part of
//!   every config snapshot, so a reload swaps them with the rest of the config.
//! - [`QnpGroup`] owns what the node bound for a listener: its SO_REUSEPORT sockets, and, when
//!   tier K is attached, QingNiao's `sk_reuseport` dispatcher (`flatmesh_qnp::kernel_rsd`) with
//!   the rules' Matcher image in its maps. Then socket *q* receives exactly worker *q*'s
//!   requests. Without tier K, or when the program cannot load (said once, in the log), there
//!   is one socket per node worker and the kernel spreads flows by hash.
//! - [`serve`] runs on a node worker, one task per socket: in user space it decides each
//!   packet with `flatmesh_qnp::dispatch::Rsd` (the same matcher as `flatmesh qnp demo`), in
//!   kernel mode it takes the kernel's decision; either way it relays the packet to the worker
//!   through the client's session ([`session`]), which relays the worker's answers back.

mod group;
mod serve;
mod session;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::Listener;
use flatmesh_qnp::dispatch::Rsd;
use flatmesh_qnp::listener::ListenerRules;

use crate::error::ProxyError;
use crate::metrics::{ListenerStats, Metrics, QnpCounts};

pub use group::{QnpGroup, QnpSocket};
pub use serve::serve;

// Config validation bounds a listener's workers by what the kernel dispatcher can select from.
const _: () = assert!(flatmesh_config::QNP_MAX_WORKERS == flatmesh_qnp::kernel_rsd::MAX_WORKERS);

/// A qnp listener in one config snapshot: its workers, its checked rules and their matcher.
pub struct QnpPlan {
    /// Worker `q`'s UDP address is `workers[q]`.
    pub workers: Vec<SocketAddr>,
    /// The rules and their Matcher image (what tier K runs, what `check --explain` shows).
    pub rules: ListenerRules,
    /// The user-space dispatcher's matcher of the same rules.
    pub rsd: Rsd,
    pub idle_timeout: Duration,
    pub max_sessions: usize,
    stats: Arc<ListenerStats>,
}

impl QnpPlan {
    /// Reads and checks the rules of qnp listener `l` (its rule file is read again at every
    /// load: a reload picks up a changed file).
    pub fn build(
        l: &Listener,
        stats: Arc<ListenerStats>,
        metrics: &Metrics,
    ) -> Result<QnpPlan, ProxyError> {
        let Some(q) = &l.qnp else {
            return Err(ProxyError::Config(format!(
                "qnp listener `{}` has no `qnp` section",
                l.name
            )));
        };
        let rules = flatmesh_qnp::listener::compile(&l.name, q)
            .map_err(|e| ProxyError::Config(e.to_string()))?;
        metrics.qnp_counts(&stats);
        Ok(QnpPlan {
            workers: q.workers.clone(),
            rsd: Rsd::new(rules.rules.clone()),
            rules,
            idle_timeout: q.idle_timeout,
            max_sessions: q.max_sessions,
            stats,
        })
    }

    /// The listener's counters.
    pub fn counts(&self) -> Option<&QnpCounts> {
        self.stats.qnp.get()
    }
}
