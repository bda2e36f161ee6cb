//! A tcp listener's `connection_rate_limit` in tier K: the kernel's SYN filter
//! (`fm_conn_limit`, crates/kernel/bpf/conn_limit.bpf.c) goes on every listening socket of a
//! limited listener as the socket group is bound, and each snapshot installs the limits in the
//! filter's map by port. A SYN over the limit is dropped before the proxy sees a connection.
//!
//! The accept path asks [`KernelBinding::limits_connections`]: for a listener whose limit the
//! kernel enforces, user space does not count the connection a second time. Anything the
//! kernel cannot enforce stays in user space (accepted, then reset): tier K not attached, a
//! listener bound before tier K had the filter or before the listener had a limit (a reload
//! that adds a limit to a running listener), two limited listeners sharing a port (the filter
//! keeps buckets by port), or an attach that failed.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use arc_swap::ArcSwap;
use flatmesh_config::{Config, ListenerProtocol};
use flatmesh_kernel::{ConnLimit, KernelTier};
use parking_lot::Mutex;

use super::KernelBinding;
use crate::resilience::rate_limit::gcra;

/// One tcp listener's limit, as the kernel would enforce it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnLimitPlan {
    pub listener: String,
    /// The listener's configured address: what the accept path knows the listener by.
    pub address: SocketAddr,
    pub limit: ConnLimit,
}

/// What tier K does about connection rate limits on this node.
#[derive(Default)]
pub(super) struct ConnLimits {
    /// Bound ports whose listening sockets all carry the filter.
    guarded: Mutex<BTreeSet<u16>>,
    /// In the filter's map, by port.
    installed: Mutex<BTreeMap<u16, ConnLimitPlan>>,
    /// Configured addresses of the listeners whose limit the kernel enforces now; read on
    /// every connection of a limited tcp listener, so lock-free.
    enforced: ArcSwap<HashSet<SocketAddr>>,
}

/// The tcp listeners of `config` with a `connection_rate_limit`, by bound port (`bound`
/// gives a listener's actual address). A port two limited listeners share (on different
/// addresses) is left out, since the filter keeps one bucket per port: both stay in user
/// space.
pub(super) fn plan(
    config: &Config,
    bound: &dyn Fn(&str) -> Option<SocketAddr>,
) -> BTreeMap<u16, ConnLimitPlan> {
    let mut by_port: BTreeMap<u16, Vec<ConnLimitPlan>> = BTreeMap::new();
    for l in &config.listeners {
        let (Some(limit), ListenerProtocol::Tcp) = (&l.connection_rate_limit, l.protocol) else {
            continue;
        };
        let Some(actual) = bound(&l.name) else {
            continue;
        };
        let (interval_ns, tolerance_ns) = gcra(&limit.as_rate_limit());
        by_port
            .entry(actual.port())
            .or_default()
            .push(ConnLimitPlan {
                listener: l.name.clone(),
                address: l.address,
                limit: ConnLimit {
                    interval_ns,
                    tolerance_ns,
                },
            });
    }
    by_port
        .into_iter()
        .filter_map(|(port, mut on_port)| match on_port.len() {
            1 => on_port.pop().map(|p| (port, p)),
            _ => {
                let names: Vec<_> = on_port.iter().map(|p| p.listener.as_str()).collect();
                tracing::warn!(port, listeners = ?names, "tcp listeners sharing a port each have a connection_rate_limit; the kernel keeps one bucket per port, so user space enforces them");
                None
            }
        })
        .collect()
}

impl KernelBinding {
    /// Whether this node loaded the kernel's connection rate-limit filter.
    pub fn conn_limit_on(&self) -> bool {
        self.tier.config().conn_limit
    }

    /// Called as listener `name`'s socket group is bound at `actual`, before any worker
    /// accepts on it: a tcp listener with a `connection_rate_limit` gets the kernel's filter
    /// on every socket of the group. Any other listener bound on the port takes the port out
    /// of the kernel's hands.
    pub fn guard_listener(
        &self,
        config: &Config,
        name: &str,
        actual: SocketAddr,
        sockets: &[TcpListener],
    ) {
        let port = actual.port();
        let mut guarded = self.conn.guarded.lock();
        guarded.remove(&port);
        let limited = config.listeners.iter().any(|l| {
            l.name == name
                && l.protocol == ListenerProtocol::Tcp
                && l.connection_rate_limit.is_some()
        });
        if !limited || !self.conn_limit_on() {
            return;
        }
        for socket in sockets {
            if let Err(err) = self.tier.limit_connections(socket) {
                tracing::warn!("tier K: cannot put the connection rate-limit filter on listener `{name}`: {err}; user space enforces its connection_rate_limit");
                return;
            }
        }
        guarded.insert(port);
    }

    /// Whether the kernel enforces the `connection_rate_limit` of the tcp listener configured
    /// at `address` (then the accept path does not count its connections again).
    pub fn limits_connections(&self, address: SocketAddr) -> bool {
        self.conn.enforced.load().contains(&address)
    }

    /// The listeners whose `connection_rate_limit` the kernel enforces, for `/rules`.
    pub fn conn_limited_listeners(&self) -> BTreeSet<String> {
        self.conn
            .installed
            .lock()
            .values()
            .map(|p| p.listener.clone())
            .collect()
    }

    /// SYNs the kernel dropped over each enforced listener's limit, for `/metrics`.
    pub fn conn_limit_drops(&self) -> Vec<(String, u64)> {
        self.conn
            .installed
            .lock()
            .iter()
            .map(|(port, p)| {
                let dropped = self.tier.conn_limit_drops(*port).unwrap_or_else(|err| {
                    tracing::debug!("tier K: reading the SYNs dropped on port {port}: {err}");
                    0
                });
                (p.listener.clone(), dropped)
            })
            .collect()
    }

    /// Brings the filter's map in step with `plan`, for the ports whose sockets carry the
    /// filter. User space takes a limit back before the kernel lets go of it, and hands it
    /// over only once the kernel holds it, so no connection goes uncounted.
    pub(super) fn install_conn_limits(&self, plan: &BTreeMap<u16, ConnLimitPlan>) {
        if !self.conn_limit_on() {
            return;
        }
        let guarded = self.conn.guarded.lock().clone();
        let wanted: BTreeMap<u16, &ConnLimitPlan> = plan
            .iter()
            .filter(|(port, _)| guarded.contains(port))
            .map(|(port, p)| (*port, p))
            .collect();
        let mut installed = self.conn.installed.lock();
        let kept: HashSet<SocketAddr> = installed
            .iter()
            .filter(|&(port, p)| wanted.get(port) == Some(&p))
            .map(|(_, p)| p.address)
            .collect();
        self.conn.enforced.store(Arc::new(kept));
        let tier: &KernelTier = &self.tier;
        for port in installed.keys() {
            if !wanted.contains_key(port) {
                if let Err(err) = tier.remove_conn_limit(*port) {
                    tracing::warn!(
                        "tier K: cannot remove the connection rate limit of port {port}: {err}"
                    );
                }
            }
        }
        let mut now = BTreeMap::new();
        for (port, p) in wanted {
            if installed.get(&port) != Some(p) {
                if let Err(err) = tier.set_conn_limit(port, p.limit) {
                    tracing::warn!("tier K: cannot install listener `{}`'s connection_rate_limit: {err}; user space enforces it", p.listener);
                    continue;
                }
            }
            now.insert(port, p.clone());
        }
        self.conn
            .enforced
            .store(Arc::new(now.values().map(|p| p.address).collect()));
        *installed = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> Config {
        flatmesh_config::parse(yaml, "test.yaml").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_plan_takes_limited_tcp_listeners_by_bound_port() {
        let c = config(
            r#"
listeners:
  - name: db
    address: 127.0.0.1:7000
    protocol: tcp
    cluster: store
    connection_rate_limit: { connections_per_s: 5, burst: 3 }
  - name: plain
    address: 127.0.0.1:7001
    protocol: tcp
    cluster: store
  - name: a
    address: 127.0.0.2:7002
    protocol: tcp
    cluster: store
    connection_rate_limit: { connections_per_s: 5 }
  - name: b
    address: 127.0.0.3:7002
    protocol: tcp
    cluster: store
    connection_rate_limit: { connections_per_s: 5 }
clusters:
  - name: store
    endpoints: [ 127.0.0.1:9 ]
"#,
        );
        let bound = |name: &str| match name {
            "db" => Some(SocketAddr::from(([127, 0, 0, 1], 7000))),
            "plain" => Some(SocketAddr::from(([127, 0, 0, 1], 7001))),
            "a" => Some(SocketAddr::from(([127, 0, 0, 2], 7002))),
            "b" => Some(SocketAddr::from(([127, 0, 0, 3], 7002))),
            _ => None,
        };
        let plan = plan(&c, &bound);
        // `plain` has no limit; `a` and `b` share port 7002 and stay in user space.
        assert_eq!(plan.keys().copied().collect::<Vec<_>>(), vec![7000]);
        assert_eq!(
            plan[&7000],
            ConnLimitPlan {
                listener: "db".into(),
                address: SocketAddr::from(([127, 0, 0, 1], 7000)),
                // 5/s: one every 200 ms, 3 at once.
                limit: ConnLimit {
                    interval_ns: 200_000_000,
                    tolerance_ns: 600_000_000,
                },
            }
        );
    }
}
