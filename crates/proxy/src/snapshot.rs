//! A config snapshot: the validated config, its compiled rule program, and everything derived
//! from them that workers read on the request path. Snapshots are immutable and swapped
//! atomically (arc-swap), so a request that started on one finishes on it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::{ClusterType, Config, LbPolicy, ListenerProtocol, UpstreamProtocol};
use flatmesh_rules::{ClusterId, ListenerId, RuleProgram};
use http::HeaderName;

use crate::error::ProxyError;
use crate::lb::Tables;
use crate::metrics::{ClusterStats, ListenerStats, Metrics, RequestStats, Series, WorkerCounter};
use crate::original_dst::OriginalDstPlan;
use crate::resilience::rate_limit::{RateLimiter, Scope};
use crate::resilience::ClusterGuard;
use crate::tls::{ClusterTlsPlan, ListenerTlsPlan};
use crate::workload::{WorkloadId, Workloads};

pub struct Snapshot {
    pub generation: u64,
    pub config: Arc<Config>,
    pub program: RuleProgram,
    pub listeners: Vec<ListenerPlan>,
    pub clusters: Vec<ClusterPlan>,
    /// The metric series this snapshot counts into.
    pub series: Series,
    /// The admin token in force (`admin.token`, or read from `admin.token_file`).
    pub admin_token: Option<String>,
    /// The node's counts of injected faults, and its mirror copies (cap and counts): the
    /// node's own, shared by every snapshot.
    pub faults: Arc<crate::l7::fault::FaultCounts>,
    pub mirrors: Arc<crate::l7::mirror::MirrorGate>,
    /// The workloads on this node (`workloads:`).
    pub workloads: Workloads,
    /// Some cluster is an `original_dst` one: workers read each connection's original
    /// destination at accept (`crate::original_dst`).
    pub original_dst: bool,
}

pub struct ListenerPlan {
    pub name: String,
    pub address: SocketAddr,
    pub protocol: ListenerProtocol,
    pub stats: Arc<ListenerStats>,
    /// Per route: the request counters for each cluster the route can send to
    /// (`None` = answered by the proxy itself).
    pub route_stats: Vec<Vec<(Option<ClusterId>, Arc<RequestStats>)>>,
    pub no_route_stats: Arc<RequestStats>,
    /// Tier K decides this http listener's first requests (when the node attached tier K).
    pub kernel_l7: bool,
    /// Tier K splices this tcp listener's connections (when the node attached tier K).
    pub kernel_splice: bool,
    /// The listener terminates TLS (`tls:`).
    pub tls: Option<Arc<ListenerTlsPlan>>,
    /// Authorization decisions, [allowed, denied], per policy in order and then for no
    /// policy matched (empty without `authorization:`).
    pub authz_stats: Vec<[Arc<WorkerCounter>; 2]>,
    /// hbone listeners: where tunnels may go (`hbone.destinations`; empty: loopback only).
    pub destinations: Vec<flatmesh_config::destination::Destination>,
    /// The listener's `rate_limit` (http) or `connection_rate_limit` (tcp), shared by every
    /// worker and kept across reloads that leave it alone.
    pub rate_limit: Option<Arc<RateLimiter>>,
    /// Per route, in order: its `rate_limit`.
    pub route_limits: Vec<Option<Arc<RateLimiter>>>,
    /// What a keyed `rate_limit` of the listener (index 0) and of each route (1 + index)
    /// reads from the request.
    pub limit_keys: Vec<LimitKey>,
    /// tcp listeners whose cluster tunnels (connections by source workload) and hbone
    /// listeners (streams by destination workload): per workload, then for none. Empty
    /// without `workloads:`.
    pub workload_stats: Vec<Arc<WorkerCounter>>,
    /// qnp listeners: their workers and checked rules (`crate::qnp`).
    pub qnp: Option<Arc<crate::qnp::QnpPlan>>,
}

/// What a rate limit's buckets are told apart by, ready for the request path.
#[derive(Clone)]
pub enum LimitKey {
    None,
    ClientAddress,
    Header(HeaderName),
}

impl LimitKey {
    fn of(limit: Option<&flatmesh_config::RateLimit>, at: &str) -> Result<LimitKey, ProxyError> {
        use flatmesh_config::RateLimitKey;
        Ok(match limit.and_then(|l| l.key.as_ref()) {
            None => LimitKey::None,
            Some(RateLimitKey::Named(_)) => LimitKey::ClientAddress,
            Some(RateLimitKey::Header { header }) => {
                LimitKey::Header(HeaderName::try_from(header.as_str()).map_err(|_| {
                    ProxyError::Config(format!(
                        "{at}: rate_limit.key.header `{header}` is not a valid header name"
                    ))
                })?)
            }
        })
    }
}

impl ListenerPlan {
    /// Counts a connection or stream of workload `w` (`None`: of no declared workload).
    pub fn count_workload(&self, worker: usize, w: Option<WorkloadId>) {
        let index = w.unwrap_or(self.workload_stats.len().saturating_sub(1));
        if let Some(counter) = self.workload_stats.get(index) {
            counter.add_shared(worker, 1);
        }
    }

    /// Counts an authorization decision.
    pub fn count_authz(&self, worker: usize, d: flatmesh_rules::AuthzDecision) {
        let index = d.policy.unwrap_or(self.authz_stats.len().saturating_sub(1));
        if let Some(counters) = self.authz_stats.get(index) {
            counters[usize::from(!d.allowed)].add_shared(worker, 1);
        }
    }
}

pub struct ClusterPlan {
    pub name: String,
    pub endpoints: Arc<[SocketAddr]>,
    /// `ip:port` of each endpoint, pre-parsed for upstream request URIs.
    pub authorities: Vec<http::uri::Authority>,
    pub policy: LbPolicy,
    pub protocol: UpstreamProtocol,
    pub hash_header: Option<HeaderName>,
    /// Priority levels, weighted schedules, hash tables and slow start (`crate::lb`),
    /// shared by every worker.
    pub table: Arc<Tables>,
    pub connect_timeout: Duration,
    pub stats: Arc<ClusterStats>,
    /// The node originates TLS to the endpoints (`tls:`).
    pub tls: Option<Arc<ClusterTlsPlan>>,
    /// The node tunnels each connection to the endpoints' nodes on this port (`tunnel: hbone`
    /// and `tunnel_port`); the connections are the worker's (`crate::hbone::pool`).
    pub tunnel_port: Option<u16>,
    /// The cluster's circuit breaker and outlier detection, shared by every worker.
    pub guard: ClusterGuard,
    /// Tunnel clusters: the TLS that presents each workload's identity instead of the
    /// cluster's own, by [`WorkloadId`] (`None` for a workload known only by its port).
    pub workload_tls: Vec<Option<Arc<ClusterTlsPlan>>>,
    /// `type: original_dst`: each connection or request goes to where its client dialled,
    /// within the cluster's allow-list; `endpoints` is empty.
    pub original_dst: Option<Arc<OriginalDstPlan>>,
    /// Each endpoint's load counters, in `endpoints` order (`crate::load_report`).
    pub load: Arc<[Arc<crate::load_report::EndpointLoad>]>,
}

impl Snapshot {
    pub fn build(
        config: Config,
        generation: u64,
        metrics: &Metrics,
    ) -> Result<Snapshot, ProxyError> {
        let program =
            flatmesh_rules::compile(&config).map_err(|e| ProxyError::Rules(e.to_string()))?;
        let admin_token = match (&config.admin.token, &config.admin.token_file) {
            (Some(token), _) => Some(token.clone()),
            (None, Some(path)) => {
                Some(flatmesh_config::admin::read_token_file(path).map_err(ProxyError::Config)?)
            }
            (None, None) => None,
        };
        let mut series = Series::default();
        let workloads = Workloads::load(&config)?;
        let node_locality = config.node.as_ref().and_then(|n| n.locality.as_deref());
        let clusters = config
            .clusters
            .iter()
            .map(|c| {
                let endpoints: Arc<[SocketAddr]> = c.endpoints.iter().copied().collect();
                let hash_header = match &c.hash_on {
                    Some(h) => Some(HeaderName::try_from(h.header.as_str()).map_err(|_| {
                        ProxyError::Config(format!(
                            "cluster `{}`: hash_on.header `{}` is not a valid header name",
                            c.name, h.header
                        ))
                    })?),
                    None => None,
                };
                let authorities = endpoints
                    .iter()
                    .map(|e| {
                        http::uri::Authority::try_from(e.to_string().as_str()).map_err(|_| {
                            ProxyError::Config(format!(
                                "cluster `{}`: endpoint {e} is not a usable address",
                                c.name
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?;
                let connect_timeout = c.connect_timeout.unwrap_or(config.limits.connect_timeout);
                let tls = match &c.tls {
                    Some(t) => Some(Arc::new(ClusterTlsPlan::load(c, t, connect_timeout)?)),
                    None => None,
                };
                let workload_tls = match (&c.tls, c.tunnel) {
                    (Some(t), Some(_)) => config
                        .workloads
                        .iter()
                        .map(|w| {
                            w.is_client()
                                .then(|| ClusterTlsPlan::load_as(c, t, w, connect_timeout))
                                .transpose()
                                .map(|plan| plan.map(Arc::new))
                        })
                        .collect::<Result<_, _>>()?,
                    _ => Vec::new(),
                };
                let guard = metrics.resilience.guard(c);
                Ok(ClusterPlan {
                    original_dst: (c.kind == ClusterType::OriginalDst)
                        .then(|| Arc::new(OriginalDstPlan::new(c, &config))),
                    tls,
                    workload_tls,
                    tunnel_port: c
                        .tunnel
                        .map(|_| c.tunnel_port.unwrap_or(flatmesh_config::HBONE_PORT)),
                    name: c.name.clone(),
                    authorities,
                    table: metrics.lb.tables(c, node_locality, guard.out()),
                    load: metrics.loads.cluster(&c.name, &endpoints),
                    endpoints,
                    policy: c.lb,
                    protocol: c.protocol,
                    hash_header,
                    connect_timeout,
                    stats: series.cluster(metrics, &c.name),
                    guard,
                })
            })
            .collect::<Result<Vec<_>, ProxyError>>()?;
        let mut listeners = Vec::with_capacity(config.listeners.len());
        for (lid, l) in config.listeners.iter().enumerate() {
            let tls = match &l.tls {
                Some(t) => Some(Arc::new(ListenerTlsPlan::load(&l.name, t, l.protocol)?)),
                None => None,
            };
            let destinations = l
                .hbone
                .iter()
                .flat_map(|h| &h.destinations)
                .map(|d| {
                    flatmesh_config::destination::Destination::parse(d).map_err(|why| {
                        ProxyError::Config(format!(
                            "listener `{}`: hbone.destinations: {why}",
                            l.name
                        ))
                    })
                })
                .collect::<Result<_, _>>()?;
            let mut route_stats = Vec::with_capacity(l.routes.len());
            let mut route_limits = Vec::with_capacity(l.routes.len());
            let mut limit_keys = vec![LimitKey::of(
                l.rate_limit.as_ref(),
                &format!("listener `{}`", l.name),
            )?];
            for (rid, route) in l.routes.iter().enumerate() {
                let name = route.display_name(&l.name, rid);
                route_limits.push(route.rate_limit.as_ref().map(|limit| {
                    metrics
                        .rate_limits
                        .limiter(&l.name, &name, Scope::Route, limit)
                }));
                limit_keys.push(LimitKey::of(
                    route.rate_limit.as_ref(),
                    &format!("route `{name}`"),
                )?);
                let targets: Vec<Option<ClusterId>> = match (&route.cluster, &route.split) {
                    (Some(c), _) => vec![program.cluster_id(c)],
                    (None, Some(split)) => split
                        .iter()
                        .map(|w| program.cluster_id(&w.cluster))
                        .collect(),
                    (None, None) => vec![None],
                };
                route_stats.push(
                    targets
                        .into_iter()
                        .map(|c| {
                            let cname = c.map(|c| clusters[c].name.as_str()).unwrap_or("");
                            (c, series.requests(metrics, &l.name, &name, cname))
                        })
                        .collect(),
                );
            }
            let authz_stats = match program.authz(lid) {
                Some(a) => a
                    .policy_names()
                    .chain(["(none)"])
                    .map(|p| series.authz(metrics, &l.name, p))
                    .collect(),
                None => Vec::new(),
            };
            let rate_limit = match (&l.rate_limit, &l.connection_rate_limit) {
                (Some(limit), _) => Some(metrics.rate_limits.limiter(
                    &l.name,
                    "",
                    Scope::Listener,
                    limit,
                )),
                (None, Some(limit)) => Some(metrics.rate_limits.limiter(
                    &l.name,
                    "",
                    Scope::Connections,
                    &limit.as_rate_limit(),
                )),
                (None, None) => None,
            };
            // Tunnelled connections are counted by source workload, hbone streams by the
            // workload they are delivered to.
            let by_workload = match l.protocol {
                ListenerProtocol::Tcp => program
                    .tcp_cluster(lid)
                    .is_some_and(|c| clusters[c].tunnel_port.is_some()),
                ListenerProtocol::Hbone => true,
                ListenerProtocol::Http | ListenerProtocol::Qnp => false,
            };
            let workload_stats = if by_workload && !workloads.is_empty() {
                workloads
                    .names()
                    .chain([crate::workload::NONE])
                    .map(|w| series.workload(metrics, &l.name, w))
                    .collect()
            } else {
                Vec::new()
            };
            let stats = series.listener(metrics, &l.name);
            let qnp = match l.protocol {
                ListenerProtocol::Qnp => Some(Arc::new(crate::qnp::QnpPlan::build(
                    l,
                    stats.clone(),
                    metrics,
                )?)),
                _ => None,
            };
            listeners.push(ListenerPlan {
                qnp,
                workload_stats,
                rate_limit,
                route_limits,
                limit_keys,
                authz_stats,
                destinations,
                name: l.name.clone(),
                address: l.address,
                protocol: l.protocol,
                stats,
                route_stats,
                no_route_stats: series.requests(metrics, &l.name, "none", ""),
                kernel_l7: program.kernel().l7_listener() == Some(lid),
                // The lowering says which tcp listeners the kernel may splice (not one that
                // terminates TLS, nor one whose cluster originates it).
                kernel_splice: program
                    .kernel()
                    .tcp_verdict(lid)
                    .is_some_and(|v| v.decides()),
                tls,
            });
        }
        Ok(Snapshot {
            original_dst: clusters.iter().any(|c| c.original_dst.is_some()),
            generation,
            config: Arc::new(config),
            program,
            listeners,
            clusters,
            series,
            admin_token,
            faults: metrics.faults.clone(),
            mirrors: metrics.mirrors.clone(),
            workloads,
        })
    }

    /// The certificates this snapshot presents, for the expiry gauge: (`listener`,
    /// `cluster` or `workload`, its name, the SPIFFE ID), and when the certificate expires (Unix seconds).
    /// Set by whoever puts the snapshot in force, never by a build that may yet be refused.
    pub fn presented_certificates(&self) -> Vec<([String; 3], i64)> {
        let unix = |t: std::time::SystemTime| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        };
        let listeners = self
            .listeners
            .iter()
            .filter_map(|l| Some(("listener", &l.name, &l.tls.as_ref()?.presents)));
        let clusters = self
            .clusters
            .iter()
            .filter_map(|c| Some(("cluster", &c.name, c.tls.as_ref()?.presents.as_ref()?)));
        // Each workload's certificate, as the first tunnel cluster presents it (every tunnel
        // cluster presents the same file).
        let workloads = self
            .clusters
            .iter()
            .find(|c| !c.workload_tls.is_empty())
            .into_iter()
            .flat_map(|c| c.workload_tls.iter().zip(&self.config.workloads))
            .filter_map(|(t, w)| Some(("workload", &w.name, t.as_ref()?.presents.as_ref()?)));
        listeners
            .chain(clusters)
            .chain(workloads)
            .map(|(kind, name, p)| {
                (
                    [kind.to_owned(), name.clone(), p.id.clone()],
                    unix(p.not_after),
                )
            })
            .collect()
    }

    /// The listener configured at `address` (the address as written in the config).
    pub fn listener_at(
        &self,
        address: SocketAddr,
        protocol: ListenerProtocol,
    ) -> Option<ListenerId> {
        self.listeners
            .iter()
            .position(|l| l.address == address && l.protocol == protocol)
    }

    pub fn request_stats(
        &self,
        listener: ListenerId,
        route: usize,
        cluster: Option<ClusterId>,
    ) -> Option<&Arc<RequestStats>> {
        let plan = self.listeners.get(listener)?;
        let targets = plan.route_stats.get(route)?;
        targets
            .iter()
            .find(|(c, _)| *c == cluster)
            .or(targets.first())
            .map(|(_, s)| s)
    }
}
