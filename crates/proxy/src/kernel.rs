//! Tier K in the node: attach what the config's `kernel:` section asks for, keep the kernel's
//! maps in step with each config snapshot, and the two per-connection paths that hand a
//! connection's bytes to the kernel (docs/kernel.md):
//! - `tcp` listeners: after the upstream connect, [`KernelBinding::splice`] pairs the two
//!   sockets and the sk_skb verdict moves every later byte between them;
//! - the L7 `http` listener: `fm_sockops_l7` registers each accepted connection before any
//!   payload arrives; [`KernelBinding::first_request`] reads the kernel's decision for the
//!   first request and either splices the connection to the decided cluster or hands the
//!   bytes read so far to the user L7 path, which then answers exactly as without tier K.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use flatmesh_config::Config;
use flatmesh_kernel::{
    lower_routes, CaptureConfig, KernelConfig, KernelTier, L7Decision, PathMatch, RouteSpec,
};
use flatmesh_rules::matcher::PathCond;
use flatmesh_rules::{RouteAction, TableKind};
use parking_lot::Mutex;
use tokio::net::TcpStream;

use crate::snapshot::Snapshot;

/// How much of a connection the node reads while the kernel has not decided its first
/// request. The kernel only looks at the first 256 bytes of an HTTP/1.1 request and at the
/// first HEADERS frame of HTTP/2, so a connection past this is the user tier's.
const FIRST_REQUEST_MAX: usize = 16 * 1024;

/// The node's handle on tier K.
pub struct KernelBinding {
    tier: KernelTier,
    installed: Mutex<Installed>,
}

/// What is in the kernel's maps now, so a reload only changes the difference.
#[derive(Default)]
struct Installed {
    services: BTreeSet<(SocketAddr, SocketAddr)>,
    redirect_ports: BTreeSet<u16>,
    l7_ports: BTreeSet<u16>,
}

/// What a snapshot asks of the kernel, worked out without touching it.
#[derive(Debug, Default, PartialEq)]
pub struct KernelPlan {
    /// Captured service address → the node listener that takes it.
    pub services: BTreeSet<(SocketAddr, SocketAddr)>,
    /// Ports whose local hops sk_msg shortens.
    pub redirect_ports: BTreeSet<u16>,
    /// Http listener ports whose connections the verdict decides.
    pub l7_ports: BTreeSet<u16>,
    /// The L7 listener's routes in rule order, for `lower_routes`.
    pub routes: Vec<RouteSpec>,
}

/// The outcome of waiting for the kernel's decision on a connection's first request.
pub enum FirstRequest {
    /// The kernel matched a route that forwards to this cluster.
    Decided {
        cluster: usize,
        cookie: u64,
        buffered: Vec<u8>,
    },
    /// The user tier decides: run the L7 path over these bytes, then the socket.
    UserTier { buffered: Vec<u8> },
    /// The client went away (or sent nothing in time) before a decision.
    Closed,
}

/// Attaches tier K if the config has a `kernel:` section and the host can run it. Without
/// privileges or kernel support it logs one line saying what is missing and returns `None`:
/// the node then runs on the user tiers.
pub fn attach(config: &Config) -> Option<KernelBinding> {
    let k = config.kernel.as_ref()?;
    if let Some(missing) = flatmesh_kernel::probe() {
        tracing::warn!("{missing}");
        return None;
    }
    let cfg = KernelConfig {
        pin_dir: k
            .pin_dir
            .clone()
            .unwrap_or_else(|| flatmesh_kernel::DEFAULT_PIN_DIR.into()),
        cgroup_root: k
            .cgroup_root
            .clone()
            .unwrap_or_else(flatmesh_kernel::default_cgroup_root),
        capture: k.capture.as_ref().map(|c| CaptureConfig {
            cgroup: c.cgroup.clone(),
        }),
        redirect: k.redirect,
        // The splice of tcp listeners runs on the same sk_skb verdict as L7 dispatch.
        l7_dispatch: k.l7_dispatch || k.tcp_splice,
        l7_stream_parser: k.l7_stream_parser,
    };
    if cfg.capture.is_none() && !cfg.redirect && !cfg.l7_dispatch {
        tracing::info!("the kernel section enables nothing; tier K stays off");
        return None;
    }
    let tier = match KernelTier::attach(&cfg) {
        Ok(tier) => tier,
        Err(err) => {
            tracing::warn!("tier K (eBPF) could not attach: {err}; running on the user tiers");
            return None;
        }
    };
    if cfg.capture.is_some() {
        // The node's own upstream connections must never be captured back to itself.
        if let Err(err) = tier.bypass_pid(std::process::id()) {
            tracing::warn!("tier K: cannot exempt the node from capture ({err}); capture is off");
            let _ = tier.detach();
            return None;
        }
    }
    tracing::info!(
        pin_dir = %cfg.pin_dir.display(),
        capture = cfg.capture.is_some(),
        redirect = cfg.redirect,
        l7_dispatch = k.l7_dispatch,
        tcp_splice = k.tcp_splice,
        "tier K (eBPF) attached"
    );
    Some(KernelBinding {
        tier,
        installed: Mutex::new(Installed::default()),
    })
}

/// Works out what `snapshot` asks of the kernel. `bound` gives a listener's actual address
/// (the configured one may have port 0).
pub fn plan(snapshot: &Snapshot, bound: &dyn Fn(&str) -> Option<SocketAddr>) -> KernelPlan {
    let config = &snapshot.config;
    let mut plan = KernelPlan::default();
    let Some(k) = &config.kernel else {
        return plan;
    };
    let (l7_listener, tcp_splice) = (config.kernel_l7_listener(), config.kernel_tcp_splice());
    if let Some(capture) = &k.capture {
        for s in &capture.services {
            if let Some(addr) = bound(&s.listener) {
                plan.services.insert((s.address, reachable(addr)));
            }
        }
    }
    // Clusters whose upstream sockets the sk_skb verdict may own; sk_msg stays off their
    // ports so no socket is driven by both mechanisms.
    let mut spliced_clusters = BTreeSet::new();
    for (lid, l) in snapshot.listeners.iter().enumerate() {
        let table = &snapshot.program.listeners()[lid];
        match &table.kind {
            TableKind::Tcp(rule) if tcp_splice => {
                spliced_clusters.insert(rule.cluster);
            }
            TableKind::Http(t) if Some(l.name.as_str()) == l7_listener => {
                if let Some(addr) = bound(&l.name) {
                    plan.l7_ports.insert(addr.port());
                }
                for r in &t.routes {
                    if let RouteAction::Forward(c) = r.action {
                        spliced_clusters.insert(c);
                    }
                    plan.routes.push(route_spec(r));
                }
            }
            TableKind::Http(_) if k.redirect => {
                if let Some(addr) = bound(&l.name) {
                    plan.redirect_ports.insert(addr.port());
                }
            }
            _ => {}
        }
    }
    if k.redirect {
        for (cid, c) in snapshot.clusters.iter().enumerate() {
            if spliced_clusters.contains(&cid) {
                continue;
            }
            for e in c.endpoints.iter().filter(|e| e.ip().is_loopback()) {
                plan.redirect_ports.insert(e.port());
            }
        }
        for port in &plan.l7_ports {
            plan.redirect_ports.remove(port);
        }
    }
    plan
}

/// A listener bound to the unspecified address is reached on loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// One compiled route, reduced to what the kernel's table can look at.
fn route_spec(r: &flatmesh_rules::CompiledRoute) -> RouteSpec {
    let m = &r.matches;
    RouteSpec {
        route_id: r.id as u32,
        method: m.method.as_ref().map(|m| m.as_str().to_owned()),
        path: match &m.path {
            None => PathMatch::Prefix(String::new()),
            Some(PathCond::Exact(p)) => PathMatch::Exact(p.clone()),
            Some(PathCond::Prefix(p)) => PathMatch::Prefix(p.clone()),
            Some(PathCond::Regex(_)) => PathMatch::Other,
        },
        other_conditions: m.host.is_some() || !m.headers.is_empty() || !m.query.is_empty(),
        // Only a plain forward whose every other effect the kernel keeps (no rewrite,
        // retry or per-request timeout: the classifier's K eligibility) is decided there.
        backend: match r.action {
            RouteAction::Forward(c) if r.placement.eligible.contains(flatmesh_rules::Tier::Kernel) => {
                Some(c as u32)
            }
            _ => None,
        },
    }
}

impl KernelBinding {
    /// Brings the kernel's maps in step with `plan`. Failures are logged per entry: the
    /// user tiers still carry whatever the kernel does not.
    pub fn install(&self, plan: &KernelPlan) {
        let mut installed = self.installed.lock();
        let log = |what: &str, err: flatmesh_kernel::KernelError| {
            tracing::warn!("tier K: cannot {what}: {err}; the user tiers carry it instead");
        };
        for gone in installed.services.difference(&plan.services) {
            if let Err(e) = self.tier.remove_service(gone.0) {
                log("remove a captured service", e);
            }
        }
        for (service, proxy) in plan.services.difference(&installed.services) {
            if let Err(e) = self.tier.add_service(*service, *proxy) {
                log(&format!("capture {service}"), e);
            }
        }
        for port in installed.redirect_ports.difference(&plan.redirect_ports) {
            if let Err(e) = self.tier.remove_redirect_port(*port) {
                log("unmark a redirect port", e);
            }
        }
        for port in plan.redirect_ports.difference(&installed.redirect_ports) {
            if let Err(e) = self.tier.add_redirect_port(*port) {
                log(&format!("shorten hops on port {port}"), e);
            }
        }
        for port in installed.l7_ports.difference(&plan.l7_ports) {
            if let Err(e) = self.tier.remove_l7_port(*port) {
                log("unmark an L7 port", e);
            }
        }
        if !plan.l7_ports.is_empty() {
            // Table before port: a connection registered on the port must find the new routes.
            if let Err(e) = self.tier.set_routes(&lower_routes(&plan.routes)) {
                log("install the L7 route table", e);
            }
        }
        for port in plan.l7_ports.difference(&installed.l7_ports) {
            if let Err(e) = self.tier.add_l7_port(*port) {
                log(&format!("dispatch port {port} in the kernel"), e);
            }
        }
        installed.services = plan.services.clone();
        installed.redirect_ports = plan.redirect_ports.clone();
        installed.l7_ports = plan.l7_ports.clone();
    }

    /// Pairs a tcp listener's client and upstream sockets in the kernel. `None` (logged at
    /// debug) leaves the whole connection to the user relay.
    pub fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Option<(u64, u64)> {
        match self.tier.splice(client, upstream) {
            Ok(cookies) => Some(cookies),
            Err(err) => {
                tracing::debug!(error = %err, "tier K splice refused; the user relay carries the connection");
                None
            }
        }
    }

    /// Drops the kernel's state of finished connections (their sockhash entries go when the
    /// sockets close).
    pub fn forget(&self, cookies: &[u64]) {
        for c in cookies {
            let _ = self.tier.l7_forget(*c);
        }
    }

    /// Reads from `client` until the kernel has decided its first request, and says who
    /// handles the connection. Every byte read is returned, so nothing is lost on fallback.
    pub async fn first_request(&self, client: &TcpStream, timeout: Duration) -> FirstRequest {
        let Ok(cookie) = flatmesh_kernel::socket_cookie(client) else {
            return FirstRequest::UserTier {
                buffered: Vec::new(),
            };
        };
        let mut buffered = Vec::with_capacity(4096);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.tier.l7_decision(cookie) {
                Ok(L7Decision::Backend { backend, .. }) => {
                    return FirstRequest::Decided {
                        cluster: backend as usize,
                        cookie,
                        buffered,
                    }
                }
                Ok(L7Decision::Pending) if buffered.len() < FIRST_REQUEST_MAX => {}
                // Fallback, a connection the kernel never registered, or too much unread.
                _ => {
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::UserTier { buffered };
                }
            }
            // The verdict runs before bytes reach the socket's queue, so the decision is
            // final for everything read so far; read more only while it is pending.
            match tokio::time::timeout_at(deadline, client.readable()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::Closed;
                }
            }
            let start = buffered.len();
            buffered.resize(start + 4096, 0);
            match client.try_read(&mut buffered[start..]) {
                Ok(0) => {
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::Closed;
                }
                Ok(n) => buffered.truncate(start + n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => buffered.truncate(start),
                Err(_) => {
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::Closed;
                }
            }
        }
    }

    /// Splices a decided connection: the upstream joins the sockhash with the client as its
    /// peer, the buffered request goes out, then the client's further bytes go straight to
    /// the upstream. Returns both cookies for [`KernelBinding::forget`], or `None` if the
    /// kernel refused (the caller then relays in user space).
    pub async fn splice_decided(
        &self,
        cookie: u64,
        buffered: &[u8],
        upstream: &mut TcpStream,
    ) -> std::io::Result<Option<(u64, u64)>> {
        use tokio::io::AsyncWriteExt as _;
        let up_cookie = match self.tier.l7_attach_upstream(cookie, upstream) {
            Ok(c) => c,
            Err(err) => {
                tracing::debug!(error = %err, "tier K could not attach the upstream; relaying in user space");
                let _ = self.tier.l7_forget(cookie);
                upstream.write_all(buffered).await?;
                return Ok(None);
            }
        };
        upstream.write_all(buffered).await?;
        if let Err(err) = self.tier.l7_pair(cookie, up_cookie) {
            tracing::debug!(error = %err, "tier K could not pair the connection; relaying in user space");
        }
        Ok(Some((cookie, up_cookie)))
    }
}
