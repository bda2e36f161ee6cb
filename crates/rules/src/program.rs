//! The RuleProgram: one table per listener, compiled once from the config, run by every tier.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use flatmesh_config::{
    Config, LbPolicy, Listener, ListenerProtocol, NamedMatch, PathMatch, RetryPolicy, Route,
    UpstreamProtocol,
};
use http::{HeaderName, HeaderValue, Method, StatusCode};

use crate::authz::ListenerAuthz;
use crate::fault::{FaultAction, MirrorAction};
use crate::index::{IndexStats, PathIndex};
use crate::lower::kernel::{KernelLowering, KernelTarget};
use crate::lower::nic::NicLowering;
use crate::lower::Lowering;
use crate::matcher::{
    GrpcFieldCond, HeaderCond, HostMatch, PathCond, Pattern, QueryCond, RuleMatch, ValueMatch,
};
use crate::normalize::PathNormalization;
use crate::reason::Reason;
use crate::split::WeightedSplit;
use crate::tier::{Placement, Tier, TierSet};
use crate::{ClusterId, ListenerId, Request, RouteId, RulesError};

/// The compiled program. Immutable: a reload compiles a new one and swaps it in whole.
#[derive(Debug, Clone)]
pub struct RuleProgram {
    pub(crate) listeners: Vec<ListenerTable>,
    pub(crate) clusters: Vec<ClusterInfo>,
    listener_ids: HashMap<String, ListenerId>,
    cluster_ids: HashMap<String, ClusterId>,
    /// Tier K's lowering: the kernel's route table and tcp splice.
    kernel: KernelLowering,
    /// Tier N's lowering: the NIC image of every http listener.
    nic: NicLowering,
    /// The config has a `kernel:` section: tier K runs where the host allows it.
    pub(crate) kernel_configured: bool,
}

/// What the program keeps about a cluster (endpoints and LB live in the proxy).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterInfo {
    pub name: String,
    pub lb: LbPolicy,
    pub protocol: UpstreamProtocol,
    pub endpoints: Vec<SocketAddr>,
    /// The request header a hashing policy hashes on (`hash_on.header`).
    pub hash_on: Option<String>,
    /// The node originates TLS to the endpoints (`tls:`), so only the user tier can carry
    /// bytes to them.
    pub tls: bool,
    /// The node tunnels each connection to the endpoints (`tunnel: hbone`).
    pub tunnel: bool,
    /// The circuit breaker in force (the proxy enforces it; shown by `--explain`).
    pub breaker: flatmesh_config::CircuitBreaker,
    /// Outlier detection, if on (the proxy runs it; shown by `--explain`).
    pub outlier: Option<flatmesh_config::OutlierDetection>,
    /// The active health check, if on (the proxy's checker runs it; shown by `--explain`).
    pub health_check: Option<flatmesh_config::HealthCheck>,
    /// Each endpoint's weight, priority and locality (the proxy's balancer; `--explain`).
    pub weights: Weights,
}

/// A cluster's endpoint weights, priorities and localities, slow start and overprovisioning
/// factor, and the node's locality they are judged against.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    pub entries: Vec<flatmesh_config::Endpoint>,
    pub node_locality: Option<String>,
    /// In percent.
    pub overprovisioning: u32,
    pub slow_start: Option<flatmesh_config::SlowStart>,
}

/// One listener's table.
#[derive(Debug, Clone)]
pub struct ListenerTable {
    pub name: String,
    pub address: SocketAddr,
    pub kind: TableKind,
    /// The listener terminates TLS: its bytes are ciphertext to every tier but the user's.
    pub tls: bool,
    /// The listener's authorization policies, run by the user tier on every request (http)
    /// or connection (tcp).
    pub authz: Option<ListenerAuthz>,
    /// An http listener's `rate_limit`, or a tcp listener's `connection_rate_limit` (as a
    /// rate limit without a key), counted by the user tier.
    pub rate_limit: Option<flatmesh_config::RateLimit>,
}

#[derive(Debug, Clone)]
pub enum TableKind {
    /// L4: every connection goes to one cluster.
    Tcp(TcpRule),
    /// L7: routes in order, first match wins.
    Http(HttpTable),
    /// HBONE tunnels in: each CONNECT stream goes to the destination it names.
    Hbone(HboneRule),
    /// QNP requests in: each goes to one of the listener's local workers, picked by its
    /// skip-and-check rules. The rules themselves are QingNiao's (`flatmesh_qnp::listener`
    /// reads and compiles them into the Matcher image); this table says where they run.
    Qnp(QnpRule),
}

/// A qnp listener's dispatch: its workers, and the tier its skip-and-check rules run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QnpRule {
    pub workers: usize,
    pub placement: Placement,
}

/// An hbone listener's one rule: deliver each stream to its (allowed) destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HboneRule {
    pub placement: Placement,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpRule {
    pub cluster: ClusterId,
    pub placement: Placement,
}

#[derive(Debug, Clone)]
pub struct HttpTable {
    pub routes: Vec<CompiledRoute>,
    /// What the listener does to a request's path before any tier matches it.
    pub paths: PathNormalization,
    /// Some route matches on the first gRPC message (`grpc_field`): the proxy reads it before
    /// deciding a gRPC request.
    pub reads_message: bool,
    index: PathIndex,
}

impl CompiledRoute {
    /// Whether the route lets a request switch to `protocol` (an `Upgrade` header's value,
    /// compared case-insensitively as Envoy compares `upgrade_type`).
    pub fn allows_upgrade(&self, protocol: &[u8]) -> bool {
        self.upgrades
            .iter()
            .any(|u| u.as_bytes().eq_ignore_ascii_case(protocol.trim_ascii()))
    }
}

impl HttpTable {
    /// How many routes sit in each path bucket of the executor's index.
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }
}

/// One compiled http rule: its match, its action, and where it runs.
#[derive(Debug, Clone)]
pub struct CompiledRoute {
    pub id: RouteId,
    pub name: String,
    pub action: RouteAction,
    /// The route's own timeout; `None` means the proxy's `limits.request_timeout`.
    pub timeout: Option<Duration>,
    pub request_headers_to_add: Vec<(HeaderName, HeaderValue)>,
    pub request_headers_to_remove: Vec<HeaderName>,
    pub response_headers_to_add: Vec<(HeaderName, HeaderValue)>,
    pub retries: Option<RetryPolicy>,
    /// Faults injected into a share of the route's requests (user tier only).
    pub fault: Option<FaultAction>,
    /// A copy of a share of the route's requests to another cluster (user tier only).
    pub mirror: Option<MirrorAction>,
    /// Protocol upgrades the route lets through, lower case (`websocket`).
    pub upgrades: Vec<String>,
    /// The route's `rate_limit`, counted by the user tier.
    pub rate_limit: Option<flatmesh_config::RateLimit>,
    /// Where the rule runs as the config asks (same as `placement.tier`).
    pub tier: Tier,
    /// The match half of the rule, for lowerings, explain and the reference executor.
    pub matches: RuleMatch,
    /// Eligible tiers, where it runs and why, read from the lowerings.
    pub placement: Placement,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteAction {
    Forward(ClusterId),
    Split(WeightedSplit),
    DirectResponse { status: StatusCode, body: Bytes },
}

/// A rule's placement until `compile` reads it from the lowerings (never seen outside compile).
const UNPLACED: Placement = Placement {
    eligible: TierSet::EMPTY,
    tier: Tier::UserL7,
    reason: Reason::NoKernelSection,
};

/// Routes per listener are indexed with `u32` ids.
const MAX_ROUTES: usize = u32::MAX as usize - 1;

impl RuleProgram {
    pub fn listener_id(&self, name: &str) -> Option<ListenerId> {
        self.listener_ids.get(name).copied()
    }

    pub fn cluster_id(&self, name: &str) -> Option<ClusterId> {
        self.cluster_ids.get(name).copied()
    }

    /// The cluster's name; `""` for an id this program never handed out.
    pub fn cluster_name(&self, id: ClusterId) -> &str {
        self.clusters.get(id).map_or("", |c| c.name.as_str())
    }

    pub fn clusters(&self) -> &[ClusterInfo] {
        &self.clusters
    }

    pub fn listeners(&self) -> &[ListenerTable] {
        &self.listeners
    }

    /// Tier K's lowering: what the kernel loader installs, and what it means for each rule.
    pub fn kernel(&self) -> &KernelLowering {
        &self.kernel
    }

    /// Tier N's lowering: the NIC image (`flatmesh check --nic-image`), and what it means for
    /// each route.
    pub fn nic(&self) -> &NicLowering {
        &self.nic
    }

    /// Every lowering, cheapest tier first.
    pub fn lowerings(&self) -> [&dyn Lowering; 2] {
        [&self.nic, &self.kernel]
    }

    /// What listener `listener` does to a request's path before matching it: the path
    /// [`route`](Self::route) and every lower tier must be given, and the one forwarded.
    /// Paths as received for a tcp listener or an unknown id.
    /// The listener's authorization policies, if it has any.
    pub fn authz(&self, listener: ListenerId) -> Option<&ListenerAuthz> {
        self.listeners.get(listener)?.authz.as_ref()
    }

    pub fn paths(&self, listener: ListenerId) -> PathNormalization {
        match self.listeners.get(listener).map(|l| &l.kind) {
            Some(TableKind::Http(t)) => t.paths,
            _ => PathNormalization::new(flatmesh_config::PathOptions::RAW),
        }
    }

    /// Whether a gRPC request to `listener` must come with its first message
    /// ([`Request::message`]) to be decided: some route has a `grpc_field` condition.
    pub fn reads_message(&self, listener: ListenerId) -> bool {
        matches!(self.listeners.get(listener).map(|l| &l.kind), Some(TableKind::Http(t)) if t.reads_message)
    }

    /// User-tier (U7) executor: the first route of an http listener whose match holds, for a
    /// request whose path the listener's [`paths`](Self::paths) has normalised.
    /// `None` means no route matched (answer 404), or the listener is not an http listener.
    pub fn route(&self, listener: ListenerId, req: &Request<'_>) -> Option<&CompiledRoute> {
        let TableKind::Http(table) = &self.listeners.get(listener)?.kind else {
            return None;
        };
        let routes = &table.routes;
        let id = table.index.first(req.path, |id| {
            routes[id as usize].matches.matches_except_path(req)
        })?;
        routes.get(id as usize)
    }

    /// The same answer as [`route`](Self::route), found by trying every route in order with no index.
    /// The executor's oracle in tests and fuzzing; never use it on the request path.
    pub fn route_linear(&self, listener: ListenerId, req: &Request<'_>) -> Option<&CompiledRoute> {
        let TableKind::Http(table) = &self.listeners.get(listener)?.kind else {
            return None;
        };
        table.routes.iter().find(|r| r.matches.matches(req))
    }

    /// A tcp listener's cluster (tier K/U4 rule); `None` for http listeners.
    pub fn tcp_cluster(&self, listener: ListenerId) -> Option<ClusterId> {
        match &self.listeners.get(listener)?.kind {
            TableKind::Tcp(rule) => Some(rule.cluster),
            TableKind::Http(_) | TableKind::Hbone(_) | TableKind::Qnp(_) => None,
        }
    }
}

/// Compile a config into a RuleProgram. Refuses what it cannot run, with a message that says what to fix.
pub fn compile(cfg: &Config) -> Result<RuleProgram, RulesError> {
    let mut cluster_ids = HashMap::new();
    let mut clusters = Vec::with_capacity(cfg.clusters.len());
    for (id, c) in cfg.clusters.iter().enumerate() {
        if cluster_ids.insert(c.name.clone(), id).is_some() {
            return Err(RulesError::DuplicateName {
                what: "cluster",
                name: c.name.clone(),
            });
        }
        clusters.push(ClusterInfo {
            name: c.name.clone(),
            lb: c.lb,
            protocol: c.protocol,
            endpoints: c.endpoints.to_vec(),
            hash_on: c.hash_on.as_ref().map(|h| h.header.clone()),
            tls: c.tls.is_some(),
            tunnel: c.tunnel.is_some(),
            breaker: c.breaker(),
            outlier: c.outlier_detection.clone(),
            health_check: c.health_check.clone(),
            weights: Weights {
                entries: c.endpoints.entries().to_vec(),
                node_locality: cfg.node.as_ref().and_then(|n| n.locality.clone()),
                overprovisioning: c.overprovisioning(),
                slow_start: c.slow_start.clone(),
            },
        });
    }
    let mut listener_ids = HashMap::new();
    let mut listeners = Vec::with_capacity(cfg.listeners.len());
    for (id, l) in cfg.listeners.iter().enumerate() {
        if listener_ids.insert(l.name.clone(), id).is_some() {
            return Err(RulesError::DuplicateName {
                what: "listener",
                name: l.name.clone(),
            });
        }
        let kind = match l.protocol {
            ListenerProtocol::Tcp => TableKind::Tcp(compile_tcp(l, &cluster_ids)?),
            ListenerProtocol::Http => TableKind::Http(compile_http(l, &cluster_ids)?),
            ListenerProtocol::Hbone => TableKind::Hbone(HboneRule {
                placement: UNPLACED,
            }),
            ListenerProtocol::Qnp => TableKind::Qnp(QnpRule {
                workers: l.qnp.as_ref().map_or(0, |q| q.workers.len()),
                placement: qnp_placement(cfg),
            }),
        };
        listeners.push(ListenerTable {
            name: l.name.clone(),
            address: l.address,
            kind,
            tls: l.tls.is_some(),
            authz: l
                .authorization
                .as_ref()
                .map(|a| ListenerAuthz::compile(&l.name, a))
                .transpose()?,
            rate_limit: l.rate_limit.clone().or_else(|| {
                l.connection_rate_limit
                    .as_ref()
                    .map(flatmesh_config::ConnectionRateLimit::as_rate_limit)
            }),
        });
    }
    // Every lowering runs on the compiled tables; each rule's placement is read from them.
    let kernel = KernelLowering::lower(&listeners, &clusters, KernelTarget::of(cfg, &listener_ids));
    let nic = NicLowering::lower(&listeners);
    crate::tier::place(&mut listeners, &clusters, &kernel);
    Ok(RuleProgram {
        listeners,
        clusters,
        listener_ids,
        cluster_ids,
        kernel,
        nic,
        kernel_configured: cfg.kernel.is_some(),
    })
}

/// A qnp listener's rules run in tier K's sk_reuseport program when the node has tier K, in
/// the user-space dispatcher otherwise; their image is the NIC's (tier N) form.
fn qnp_placement(cfg: &Config) -> Placement {
    let kernel = cfg.kernel.is_some();
    Placement {
        eligible: TierSet::of(&[Tier::Kernel, Tier::UserL7, Tier::Nic]),
        tier: if kernel { Tier::Kernel } else { Tier::UserL7 },
        reason: if kernel {
            Reason::KernelDispatchesQnp
        } else {
            Reason::NoKernelSection
        },
    }
}

fn compile_tcp(l: &Listener, clusters: &HashMap<String, ClusterId>) -> Result<TcpRule, RulesError> {
    let name = l
        .cluster
        .as_ref()
        .ok_or_else(|| RulesError::TcpWithoutCluster {
            listener: l.name.clone(),
        })?;
    let cluster = *clusters
        .get(name)
        .ok_or_else(|| RulesError::UnknownTcpCluster {
            listener: l.name.clone(),
            cluster: name.clone(),
        })?;
    Ok(TcpRule {
        cluster,
        placement: UNPLACED,
    })
}

fn compile_http(
    l: &Listener,
    clusters: &HashMap<String, ClusterId>,
) -> Result<HttpTable, RulesError> {
    if l.routes.len() > MAX_ROUTES {
        return Err(RulesError::TooManyRoutes {
            listener: l.name.clone(),
            count: l.routes.len(),
            max: MAX_ROUTES,
        });
    }
    let routes = l
        .routes
        .iter()
        .enumerate()
        .map(|(id, r)| compile_route(r, id, r.display_name(&l.name, id), clusters))
        .collect::<Result<Vec<_>, _>>()?;
    let index = PathIndex::build(routes.iter().map(|r| &r.matches)).map_err(|reason| {
        RulesError::RegexSetTooLarge {
            listener: l.name.clone(),
            count: routes
                .iter()
                .filter(|r| matches!(r.matches.path, Some(PathCond::Regex(_))))
                .count(),
            reason,
        }
    })?;
    Ok(HttpTable {
        reads_message: routes.iter().any(|r| r.matches.grpc_field.is_some()),
        routes,
        paths: PathNormalization::new(l.path_options()),
        index,
    })
}

fn compile_route(
    r: &Route,
    id: RouteId,
    name: String,
    clusters: &HashMap<String, ClusterId>,
) -> Result<CompiledRoute, RulesError> {
    let matches = compile_match(r, &name)?;
    let action = compile_action(r, &name, clusters)?;
    let header_name = |n: &str| {
        HeaderName::from_bytes(n.as_bytes()).map_err(|_| RulesError::BadHeaderName {
            route: name.clone(),
            name: n.to_string(),
        })
    };
    let header_pairs = |map: &std::collections::BTreeMap<String, String>| {
        map.iter()
            .map(|(k, v)| {
                let value = HeaderValue::from_str(v).map_err(|_| RulesError::BadHeaderValue {
                    route: name.clone(),
                    name: k.clone(),
                })?;
                Ok((header_name(k)?, value))
            })
            .collect::<Result<Vec<_>, RulesError>>()
    };
    Ok(CompiledRoute {
        id,
        action,
        timeout: r.timeout,
        request_headers_to_add: header_pairs(&r.request_headers_to_add)?,
        request_headers_to_remove: r
            .request_headers_to_remove
            .iter()
            .map(|n| header_name(n))
            .collect::<Result<_, _>>()?,
        response_headers_to_add: header_pairs(&r.response_headers_to_add)?,
        retries: r.retries.clone(),
        fault: r
            .fault
            .as_ref()
            .map(|f| FaultAction::compile(f, &name))
            .transpose()?,
        mirror: match &r.mirror {
            None => None,
            Some(m) => Some(MirrorAction::compile(
                m,
                *clusters
                    .get(&m.cluster)
                    .ok_or_else(|| RulesError::UnknownCluster {
                        route: name.clone(),
                        cluster: m.cluster.clone(),
                    })?,
            )),
        },
        upgrades: r.upgrades.iter().map(|u| u.to_ascii_lowercase()).collect(),
        rate_limit: r.rate_limit.clone(),
        tier: UNPLACED.tier,
        matches,
        placement: UNPLACED,
        name,
    })
}

fn compile_match(r: &Route, route: &str) -> Result<RuleMatch, RulesError> {
    let m = &r.matches;
    let regex = |what: &str, pattern: &str| {
        Pattern::new(pattern).map_err(|reason| RulesError::BadRegex {
            route: route.to_string(),
            what: what.to_string(),
            pattern: pattern.to_string(),
            reason,
        })
    };
    let host = match &m.host {
        None => None,
        Some(h) => Some(HostMatch::parse(h).ok_or_else(|| RulesError::BadHost {
            route: route.to_string(),
            host: h.clone(),
        })?),
    };
    let path = match &m.path {
        None => None,
        Some(PathMatch::Exact(p)) => Some(PathCond::Exact(p.clone())),
        Some(PathMatch::Prefix(p)) => Some(PathCond::Prefix(p.clone())),
        Some(PathMatch::Regex(p)) => Some(PathCond::Regex(regex("path", p)?)),
    };
    let method =
        match &m.method {
            None => None,
            Some(text) => Some(Method::from_bytes(text.trim().as_bytes()).map_err(|_| {
                RulesError::BadMethod {
                    route: route.to_string(),
                    method: text.clone(),
                }
            })?),
        };
    let value = |what: &str, n: &NamedMatch| -> Result<ValueMatch, RulesError> {
        let set = [
            n.exact.is_some(),
            n.prefix.is_some(),
            n.present.is_some(),
            n.regex.is_some(),
        ];
        let count = set.iter().filter(|s| **s).count();
        let kind_error = || RulesError::MatcherKind {
            route: route.to_string(),
            what: what.to_string(),
            name: n.name.clone(),
            count,
        };
        if count != 1 {
            return Err(kind_error());
        }
        Ok(match (&n.exact, &n.prefix, n.present, &n.regex) {
            (Some(v), ..) => ValueMatch::Exact(v.clone()),
            (_, Some(v), ..) => ValueMatch::Prefix(v.clone()),
            (_, _, Some(p), _) => ValueMatch::Present(p),
            (.., Some(v)) => ValueMatch::Regex(regex(&format!("{what} `{}`", n.name), v)?),
            _ => return Err(kind_error()),
        })
    };
    let headers = m
        .headers
        .iter()
        .map(|n| {
            let name = HeaderName::from_bytes(n.name.as_bytes()).map_err(|_| {
                RulesError::BadHeaderName {
                    route: route.to_string(),
                    name: n.name.clone(),
                }
            })?;
            Ok(HeaderCond {
                name,
                value: value("header", n)?,
            })
        })
        .collect::<Result<Vec<_>, RulesError>>()?;
    let query = m
        .query
        .iter()
        .map(|n| {
            Ok(QueryCond {
                name: n.name.clone(),
                value: value("query parameter", n)?,
            })
        })
        .collect::<Result<Vec<_>, RulesError>>()?;
    let grpc_field = match &m.grpc_field {
        None => None,
        Some(f) => {
            let value = match (&f.exact, &f.prefix) {
                (Some(v), None) => ValueMatch::Exact(v.clone()),
                (None, Some(v)) => ValueMatch::Prefix(v.clone()),
                _ => {
                    return Err(RulesError::BadGrpcField {
                        route: route.to_string(),
                        number: f.number,
                    })
                }
            };
            if f.number == 0 || f.number > flatmesh_config::model::GRPC_FIELD_NUMBER_MAX {
                return Err(RulesError::BadGrpcField {
                    route: route.to_string(),
                    number: f.number,
                });
            }
            Some(GrpcFieldCond {
                number: f.number,
                value,
            })
        }
    };
    Ok(RuleMatch {
        host,
        path,
        method,
        headers,
        query,
        grpc_field,
    })
}

fn compile_action(
    r: &Route,
    route: &str,
    clusters: &HashMap<String, ClusterId>,
) -> Result<RouteAction, RulesError> {
    let cluster = |name: &String| {
        clusters
            .get(name)
            .copied()
            .ok_or_else(|| RulesError::UnknownCluster {
                route: route.to_string(),
                cluster: name.clone(),
            })
    };
    match (&r.cluster, &r.split, &r.direct_response) {
        (Some(c), None, None) => Ok(RouteAction::Forward(cluster(c)?)),
        (None, Some(split), None) => {
            let entries = split
                .iter()
                .map(|w| Ok((cluster(&w.cluster)?, w.weight)))
                .collect::<Result<Vec<_>, RulesError>>()?;
            let total: u64 = entries.iter().map(|(_, w)| u64::from(*w)).sum();
            WeightedSplit::new(entries)
                .map(RouteAction::Split)
                .ok_or(RulesError::SplitWeights {
                    route: route.to_string(),
                    total,
                    max: WeightedSplit::MAX_TOTAL,
                })
        }
        (None, None, Some(d)) => {
            let status = StatusCode::from_u16(d.status).map_err(|_| RulesError::BadStatus {
                route: route.to_string(),
                status: d.status,
            })?;
            Ok(RouteAction::DirectResponse {
                status,
                body: Bytes::from(d.body.clone()),
            })
        }
        (c, s, d) => {
            let found: Vec<&str> = [
                (c.is_some(), "`cluster`"),
                (s.is_some(), "`split`"),
                (d.is_some(), "`direct_response`"),
            ]
            .into_iter()
            .filter_map(|(set, name)| set.then_some(name))
            .collect();
            let found = if found.is_empty() {
                "none of them".to_string()
            } else {
                found.join(" and ")
            };
            Err(RulesError::ActionCount {
                route: route.to_string(),
                found,
            })
        }
    }
}
