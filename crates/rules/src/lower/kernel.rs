//! Tier K: the http listener `kernel.l7_listener` lowered to the kernel's route table
//! (`fm_routes`, run in order by the sk_skb verdict in `crates/kernel/bpf/dispatch.bpf.c`), and
//! the tcp listeners the kernel splices.
//!
//! The kernel reads a connection's first request line (HTTP/1.x) or `:method`/`:path`
//! (HTTP/2), without the query, and runs the table: the first entry whose method and path match
//! is the answer. It decides plain paths only ([`crate::normalize::is_plain`]: no `%`, `//` or
//! dot segment), which every path normalisation leaves as they are; any other path goes to the
//! user tier, which normalises it as the listener asks before it matches. An entry either forwards (the connection is spliced to the route's cluster)
//! or punts (the user tier decides). `crates/kernel` encodes [`KernelEntry`]s into the map ABI
//! and nothing else; this module decides what they are.
//!
//! A spliced connection carries every later request (HTTP/1.1 keep-alive, every HTTP/2
//! stream) to the first request's endpoint, unseen by the user tier. So the kernel splices an
//! http listener's connections only when every request such a connection could carry gets the
//! answer the user tier would give it ([`splice_safe`]): every route passes [`check`] (it
//! needs nothing per request), they all lead to one cluster, that cluster has one endpoint and
//! nothing that acts per request (health check, outlier detection, its own circuit breaker),
//! a route takes every request (no path condition: no 404 to skip), the listener matches paths as received
//! (no normalisation that rewrites, refuses or redirects a path), and no access log records
//! requests. Any other listener's table is built but not installed: its connections never
//! wait for the kernel, and every route says why (`/rules`, `flatmesh check --explain`).
//!
//! A route passes [`check`] when everything it does can be done by splicing the connection
//! to one cluster: a match of at most a method (≤ 8 bytes) and an exact or prefix path (≤ 64
//! bytes), a plain `cluster` action with no rewrite, retry, per-request timeout, fault,
//! mirror or rate limit, and a cluster that picks its endpoint without reading the request
//! (no `hash_on`). In a lowered listener every route passes; an entry that an earlier entry
//! covers is left out (no request reaches it), and a full table ends with a catch-all punt.
//! The punt entries ([`KernelAction::Punt`]) remain for tables built by hand (the kernel
//! crate's tests) and for paths the kernel cannot read.

use std::collections::HashMap;

use flatmesh_config::UpstreamProtocol;

use crate::lower::{Lowering, Verdict};
use crate::matcher::PathCond;
use crate::normalize::is_plain;
use crate::program::{
    ClusterInfo, CompiledRoute, HttpTable, ListenerTable, RouteAction, TableKind,
};
use crate::reason::Reason;
use crate::tier::Tier;
use crate::{ClusterId, ListenerId, Request, RouteId};

/// Entries in the kernel's route table, the closing catch-all punt included.
pub const ENTRIES_MAX: usize = 64;
/// Path bytes an entry compares.
pub const PATH_MAX: usize = 64;
/// Method bytes an entry compares.
pub const METHOD_MAX: usize = 8;

/// Connection protocols a forward applies to: a spliced connection reaches the cluster as
/// the client spoke it, so only a cluster speaking the same protocol can take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct Protocols(u8);

impl Protocols {
    pub const NONE: Protocols = Protocols(0);
    /// HTTP/1.0 and HTTP/1.1.
    pub const HTTP1: Protocols = Protocols(1);
    /// HTTP/2 with prior knowledge, gRPC.
    pub const HTTP2: Protocols = Protocols(2);

    /// The one protocol a cluster speaks.
    pub fn of(protocol: UpstreamProtocol) -> Protocols {
        match protocol {
            UpstreamProtocol::Http1 => Protocols::HTTP1,
            UpstreamProtocol::Http2 => Protocols::HTTP2,
        }
    }

    /// Whether every protocol of `p` (at least one) is in the set.
    pub fn contains(self, p: Protocols) -> bool {
        self.0 & p.0 == p.0 && p.0 != 0
    }

    /// `h1`, `h2`, `h1 h2` or `-`.
    pub fn label(self) -> &'static str {
        match (self.contains(Self::HTTP1), self.contains(Self::HTTP2)) {
            (true, true) => "h1 h2",
            (true, false) => "h1",
            (false, true) => "h2",
            (false, false) => "-",
        }
    }
}

impl std::ops::BitOr for Protocols {
    type Output = Protocols;

    fn bitor(self, other: Protocols) -> Protocols {
        Protocols(self.0 | other.0)
    }
}

/// How an entry compares the request path (without its query).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PathKey {
    /// The path equals this string.
    Exact(String),
    /// The path starts with this string (`""`: every path).
    Prefix(String),
}

impl PathKey {
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathKey::Exact(p) => p == path,
            PathKey::Prefix(p) => path.starts_with(p.as_str()),
        }
    }

    /// The path string, at most [`PATH_MAX`] bytes for entries the lowering makes.
    pub fn as_str(&self) -> &str {
        match self {
            PathKey::Exact(p) | PathKey::Prefix(p) => p,
        }
    }

    /// Whether `self` matches every path `other` matches.
    fn covers(&self, other: &PathKey) -> bool {
        match (self, other) {
            (PathKey::Prefix(a), PathKey::Prefix(b) | PathKey::Exact(b)) => {
                b.starts_with(a.as_str())
            }
            (PathKey::Exact(a), PathKey::Exact(b)) => a == b,
            (PathKey::Exact(_), PathKey::Prefix(_)) => false,
        }
    }
}

/// What the kernel does with a connection whose first request an entry matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelAction {
    /// Splice the connection to `cluster` if it speaks one of `protocols`; otherwise the user
    /// tier decides.
    Forward {
        cluster: ClusterId,
        protocols: Protocols,
    },
    /// The user tier decides: the entry is a superset of a route the kernel cannot decide.
    Punt(Reason),
}

/// One entry of the kernel's route table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelEntry {
    /// The route the entry stands for, reported back with the kernel's decision.
    pub route: RouteId,
    /// Required method; `None`: any.
    pub method: Option<String>,
    pub path: PathKey,
    pub action: KernelAction,
}

impl KernelEntry {
    /// Whether the entry matches a request line's method and path (no query).
    pub fn matches(&self, method: &str, path: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m == method) && self.path.matches(path)
    }

    /// The cluster the kernel splices a connection speaking `protocol` to, when this entry is
    /// the first match; `None`: the user tier decides.
    pub fn cluster_for(&self, protocol: Protocols) -> Option<ClusterId> {
        match &self.action {
            KernelAction::Forward { cluster, protocols } if protocols.contains(protocol) => {
                Some(*cluster)
            }
            _ => None,
        }
    }

    /// Whether every request `other` matches, this entry matches too.
    fn covers(&self, other: &KernelEntry) -> bool {
        let method = match (&self.method, &other.method) {
            (None, _) => true,
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        };
        method && self.path.covers(&other.path)
    }

    fn catch_all(route: RouteId, why: Reason) -> KernelEntry {
        KernelEntry {
            route,
            method: None,
            path: PathKey::Prefix(String::new()),
            action: KernelAction::Punt(why),
        }
    }
}

/// What the config asks of tier K, as the lowering needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelTarget {
    /// The http listener whose routes the table holds, or why there is none.
    pub l7_listener: Result<ListenerId, Reason>,
    /// Whether tcp listeners are spliced, or why not.
    pub tcp_splice: Result<(), Reason>,
    /// The config has an access log, which records every http request.
    pub access_log: bool,
}

impl KernelTarget {
    /// Reads the config's `kernel:` section; `listener_ids` maps names to ids.
    pub(crate) fn of(
        cfg: &flatmesh_config::Config,
        listener_ids: &HashMap<String, ListenerId>,
    ) -> KernelTarget {
        let Some(k) = &cfg.kernel else {
            return KernelTarget {
                l7_listener: Err(Reason::NoKernelSection),
                tcp_splice: Err(Reason::NoKernelSection),
                access_log: cfg.access_log.is_some(),
            };
        };
        KernelTarget {
            l7_listener: cfg
                .kernel_l7_listener()
                .and_then(|name| listener_ids.get(name).copied())
                .ok_or(if k.l7_dispatch {
                    Reason::OtherL7Listener
                } else {
                    Reason::NoL7Dispatch
                }),
            tcp_splice: if k.tcp_splice {
                Ok(())
            } else {
                Err(Reason::TcpSpliceOff)
            },
            access_log: cfg.access_log.is_some(),
        }
    }
}

/// Tier K's lowering of a program: the route table and what it means for every rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLowering {
    /// The http listener whose routes [`entries`](Self::entries) hold.
    pub listener: Option<ListenerId>,
    /// The route table, in order; empty when no listener is lowered.
    pub entries: Vec<KernelEntry>,
    /// Whether the kernel decides and splices the lowered listener's connections: only when
    /// every request a spliced connection could carry gets the user tier's answer
    /// ([`splice_safe`]). Otherwise the table is not installed, and every route says why.
    pub splice: Result<(), Reason>,
    /// What the kernel does with each listener's rules, by listener id.
    listeners: Vec<ListenerVerdicts>,
}

/// One listener's verdicts.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ListenerVerdicts {
    Tcp(Verdict),
    /// One per route.
    Http(Vec<Verdict>),
}

/// Whether the kernel could decide `route` in a table of its own: `Ok` with the protocols its
/// forward applies to, or the first thing it needs that only the user tier has.
pub fn check(
    route: &CompiledRoute,
    clusters: &[ClusterInfo],
) -> Result<(ClusterId, Protocols), Reason> {
    let m = &route.matches;
    if m.host.is_some() {
        return Err(Reason::HostMatch);
    }
    if !m.headers.is_empty() {
        return Err(Reason::HeaderMatch);
    }
    if !m.query.is_empty() {
        return Err(Reason::QueryMatch);
    }
    if m.grpc_field.is_some() {
        return Err(Reason::GrpcFieldMatch);
    }
    match &m.path {
        Some(PathCond::Regex(_)) => return Err(Reason::RegexPath),
        Some(PathCond::Exact(p) | PathCond::Prefix(p)) if p.len() > PATH_MAX => {
            return Err(Reason::PathTooLong { max: PATH_MAX })
        }
        // The kernel refuses every request whose path is not plain (see `decide`).
        Some(PathCond::Exact(p)) if !is_plain(p) => return Err(Reason::PathNotPlain),
        _ => {}
    }
    if m.method
        .as_ref()
        .is_some_and(|m| m.as_str().len() > METHOD_MAX)
    {
        return Err(Reason::MethodTooLong { max: METHOD_MAX });
    }
    let cluster = match &route.action {
        RouteAction::Forward(c) => *c,
        RouteAction::Split(_) => return Err(Reason::Split),
        RouteAction::DirectResponse { .. } => return Err(Reason::DirectResponse),
    };
    if !route.request_headers_to_add.is_empty()
        || !route.request_headers_to_remove.is_empty()
        || !route.response_headers_to_add.is_empty()
    {
        return Err(Reason::HeaderRewrite);
    }
    if route.retries.is_some() {
        return Err(Reason::Retries);
    }
    if route.timeout.is_some() {
        return Err(Reason::Timeout);
    }
    if route.fault.is_some() {
        return Err(Reason::Fault);
    }
    if route.mirror.is_some() {
        return Err(Reason::Mirror);
    }
    if route.rate_limit.is_some() {
        return Err(Reason::RateLimit);
    }
    // Cluster ids come from compile(), so the lookup cannot miss.
    let info = clusters.get(cluster);
    if info.is_some_and(|c| c.hash_on.is_some()) {
        return Err(Reason::HashOn);
    }
    if info.is_some_and(|c| c.tunnel) {
        return Err(Reason::Tunnel);
    }
    if info.is_some_and(|c| c.tls) {
        return Err(Reason::UpstreamTls);
    }
    let protocol = info.map_or(UpstreamProtocol::Http1, |c| c.protocol);
    Ok((cluster, Protocols::of(protocol)))
}

/// The entry for `route`: exact when `check` passed, else the superset the kernel can compare.
fn entry(route: &CompiledRoute, checked: Result<(ClusterId, Protocols), Reason>) -> KernelEntry {
    let m = &route.matches;
    let method = m
        .method
        .as_ref()
        .map(|m| m.as_str())
        .filter(|m| m.len() <= METHOD_MAX)
        .map(str::to_owned);
    let path = match &m.path {
        None => PathKey::Prefix(String::new()),
        Some(PathCond::Exact(p)) if p.len() <= PATH_MAX => PathKey::Exact(p.clone()),
        Some(PathCond::Exact(p) | PathCond::Prefix(p)) => {
            PathKey::Prefix(truncate(p, PATH_MAX).to_owned())
        }
        Some(PathCond::Regex(r)) => {
            let guard = r.guard();
            let guard = match std::str::from_utf8(&guard) {
                Ok(g) => g,
                Err(e) => std::str::from_utf8(&guard[..e.valid_up_to()]).unwrap_or_default(),
            };
            PathKey::Prefix(truncate(guard, PATH_MAX).to_owned())
        }
    };
    let action = match checked {
        Ok((cluster, protocols)) => KernelAction::Forward { cluster, protocols },
        Err(why) => KernelAction::Punt(why),
    };
    KernelEntry {
        route: route.id,
        method,
        path,
        action,
    }
}

/// Longest prefix of `s` of at most `max` bytes that ends on a char boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Whether a spliced connection of an http listener whose routes are `routes` gets, for
/// every request it could carry, the answer the user tier would give: `Ok` with the one
/// cluster, or why not. `checked` is [`check`] of each route.
fn splice_safe(
    table: &HttpTable,
    checked: &[Result<(ClusterId, Protocols), Reason>],
    clusters: &[ClusterInfo],
    access_log: bool,
) -> Result<ClusterId, Reason> {
    let routes = &table.routes;
    if access_log {
        return Err(Reason::AccessLog);
    }
    if !table.paths.is_raw() {
        return Err(Reason::SplicePaths);
    }
    let mut cluster = None;
    for (r, c) in routes.iter().zip(checked) {
        let (c, _) = c.map_err(|_| Reason::SpliceRoute { route: r.id })?;
        if cluster.is_some_and(|first| first != c) {
            return Err(Reason::SpliceClusters);
        }
        cluster = Some(c);
    }
    // A listener without routes answers every request 404.
    let cluster = cluster.ok_or(Reason::SpliceNoCatchAll)?;
    let info = clusters.get(cluster).ok_or(Reason::SpliceClusters)?;
    if info.endpoints.len() != 1 {
        return Err(Reason::SpliceEndpoints {
            endpoints: info.endpoints.len(),
        });
    }
    if info.health_check.is_some()
        || info.outlier.is_some()
        || info.breaker != flatmesh_config::CircuitBreaker::default()
    {
        return Err(Reason::SpliceClusterChecks);
    }
    // `check` let no host, header or query condition through, so a route with neither a
    // method nor a path condition takes every request. `prefix: /` does not: `OPTIONS *`
    // matches no route in the user tier (404), and would reach the endpoint when spliced.
    let catch_all = routes.iter().any(|r| {
        r.matches.method.is_none()
            && match &r.matches.path {
                None => true,
                Some(PathCond::Prefix(p)) => p.is_empty(),
                Some(_) => false,
            }
    });
    if !catch_all {
        return Err(Reason::SpliceNoCatchAll);
    }
    Ok(cluster)
}

/// Lowers one http listener's routes to the table, in rule order; `checked` is [`check`] of
/// each route.
fn lower_routes(
    routes: &[CompiledRoute],
    checked: &[Result<(ClusterId, Protocols), Reason>],
) -> (Vec<KernelEntry>, Vec<Verdict>) {
    let mut entries: Vec<KernelEntry> = Vec::new();
    let mut verdicts = Vec::with_capacity(routes.len());
    let route_level = |i: usize| checked[i].map(|_| ());
    for (i, r) in routes.iter().enumerate() {
        let e = entry(r, checked[i]);
        if let Some(by) = entries.iter().find(|earlier| earlier.covers(&e)) {
            verdicts.push(Verdict::host(
                route_level(i),
                Reason::Shadowed { by: by.route },
            ));
            continue;
        }
        if entries.len() == ENTRIES_MAX - 1 {
            let full = Reason::KernelTableFull {
                entries: ENTRIES_MAX,
            };
            entries.push(KernelEntry::catch_all(r.id, full));
            verdicts.extend((i..routes.len()).map(|i| Verdict::host(route_level(i), full)));
            break;
        }
        verdicts.push(match &e.action {
            KernelAction::Forward { .. } => Verdict::Decides,
            KernelAction::Punt(why) => Verdict::Host(*why),
        });
        entries.push(e);
    }
    (entries, verdicts)
}

impl KernelLowering {
    /// Lowers the program's listeners as `target` asks.
    pub(crate) fn lower(
        listeners: &[ListenerTable],
        clusters: &[ClusterInfo],
        target: KernelTarget,
    ) -> KernelLowering {
        let mut out = KernelLowering {
            listener: None,
            entries: Vec::new(),
            splice: Err(Reason::NoL7Dispatch),
            listeners: Vec::with_capacity(listeners.len()),
        };
        for (id, l) in listeners.iter().enumerate() {
            let verdicts = match &l.kind {
                TableKind::Tcp(_) if l.tls => {
                    ListenerVerdicts::Tcp(Verdict::Host(Reason::ListenerTls))
                }
                TableKind::Hbone(_) => ListenerVerdicts::Tcp(Verdict::Host(Reason::HboneListener)),
                // Tier K runs a qnp listener's rules in its own program (sk_reuseport), not in
                // the sk_skb route table this lowering fills.
                TableKind::Qnp(_) => {
                    ListenerVerdicts::Tcp(Verdict::Host(Reason::KernelDispatchesQnp))
                }
                TableKind::Tcp(rule) if clusters.get(rule.cluster).is_some_and(|c| c.tunnel) => {
                    ListenerVerdicts::Tcp(Verdict::Host(Reason::Tunnel))
                }
                TableKind::Tcp(rule) if clusters.get(rule.cluster).is_some_and(|c| c.tls) => {
                    ListenerVerdicts::Tcp(Verdict::Host(Reason::UpstreamTls))
                }
                TableKind::Tcp(_) => ListenerVerdicts::Tcp(match target.tcp_splice {
                    Ok(()) => Verdict::Decides,
                    Err(why) => Verdict::Host(why),
                }),
                TableKind::Http(t) if l.tls => {
                    ListenerVerdicts::Http(vec![Verdict::Host(Reason::ListenerTls); t.routes.len()])
                }
                // Every request must pass the policies, and only the user tier runs them.
                TableKind::Http(t) if l.authz.is_some() => ListenerVerdicts::Http(vec![
                    Verdict::Host(Reason::Authorization);
                    t.routes.len()
                ]),
                // Every request must be counted against the limit, in the user tier.
                TableKind::Http(t) if l.rate_limit.is_some() => ListenerVerdicts::Http(vec![
                    Verdict::Host(Reason::ListenerRateLimit);
                    t.routes.len()
                ]),
                TableKind::Http(t) if target.l7_listener == Ok(id) => {
                    let checked: Vec<_> = t.routes.iter().map(|r| check(r, clusters)).collect();
                    let (entries, verdicts) = lower_routes(&t.routes, &checked);
                    out.listener = Some(id);
                    out.entries = entries;
                    out.splice = splice_safe(t, &checked, clusters, target.access_log).map(|_| ());
                    ListenerVerdicts::Http(match out.splice {
                        Ok(()) => verdicts,
                        Err(why) => checked
                            .iter()
                            .map(|c| Verdict::host(c.map(|_| ()), why))
                            .collect(),
                    })
                }
                TableKind::Http(t) => {
                    let why = match target.l7_listener {
                        Err(why) => why,
                        Ok(_) => Reason::OtherL7Listener,
                    };
                    ListenerVerdicts::Http(
                        t.routes
                            .iter()
                            .map(|r| Verdict::host(check(r, clusters).map(|_| ()), why))
                            .collect(),
                    )
                }
            };
            out.listeners.push(verdicts);
        }
        out
    }

    /// The http listener whose connections the kernel decides and splices: the lowered
    /// listener, when splicing its connections is safe ([`KernelLowering::splice`]).
    pub fn l7_listener(&self) -> Option<ListenerId> {
        self.listener.filter(|_| self.splice.is_ok())
    }

    /// The reference executor of the table: the first entry matching `method` and `path`
    /// (without query), as the verdict program finds it.
    pub fn first_match(&self, method: &str, path: &str) -> Option<&KernelEntry> {
        self.entries.iter().find(|e| e.matches(method, path))
    }

    /// The route the table's forward entry decides for `req`, whether or not the table is
    /// installed ([`KernelLowering::splice`]): `None` for a punt, no match, or a path that is
    /// not plain (`%`, `//`, a dot segment: the listener may normalise it into another route's
    /// path, and only the user tier normalises; `dispatch.bpf.c` refuses it too).
    pub fn table_route(&self, req: &Request<'_>) -> Option<RouteId> {
        if !is_plain(req.path) {
            return None;
        }
        let e = self.first_match(req.method.as_str(), req.path)?;
        matches!(e.action, KernelAction::Forward { .. }).then_some(e.route)
    }

    /// The entry that stands for route `route` of the lowered listener, if it has one.
    pub fn entry_of(&self, route: RouteId) -> Option<usize> {
        self.entries.iter().position(|e| e.route == route)
    }

    /// What the kernel does with a tcp listener's connections (`None`: not a tcp listener).
    pub fn tcp_verdict(&self, listener: ListenerId) -> Option<Verdict> {
        match self.listeners.get(listener)? {
            ListenerVerdicts::Tcp(v) => Some(*v),
            ListenerVerdicts::Http(_) => None,
        }
    }
}

impl Lowering for KernelLowering {
    fn tier(&self) -> Tier {
        Tier::Kernel
    }

    fn verdict(&self, listener: ListenerId, route: RouteId) -> Option<Verdict> {
        match self.listeners.get(listener)? {
            ListenerVerdicts::Http(v) => v.get(route).copied(),
            ListenerVerdicts::Tcp(_) => None,
        }
    }

    /// [`KernelLowering::table_route`] on the listener whose table is installed; `None` on
    /// every other listener.
    fn decide(&self, listener: ListenerId, req: &Request<'_>) -> Option<RouteId> {
        self.l7_listener()
            .filter(|l| *l == listener)
            .and_then(|_| self.table_route(req))
    }
}
