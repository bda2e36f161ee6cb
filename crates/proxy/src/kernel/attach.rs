//! Attaching tier K, and what each config snapshot asks of the kernel's maps: the plan,
//! worked out without touching the kernel, and its installation, which changes only the
//! difference from what is installed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use flatmesh_config::{Config, ListenerProtocol};
use flatmesh_kernel::{CaptureConfig, HopPort, KernelConfig, KernelEntry, KernelTier};
use flatmesh_rules::TableKind;
use parking_lot::Mutex;

use super::conn_limit::{self, ConnLimitPlan};
use super::KernelBinding;
use crate::snapshot::Snapshot;

/// What is in the kernel's maps now, so a reload only changes the difference.
#[derive(Default)]
pub(super) struct Installed {
    services: BTreeSet<(SocketAddr, SocketAddr)>,
    redirect_ports: BTreeMap<u16, HopPort>,
    l7_ports: BTreeSet<u16>,
    /// Why the last route table could not be installed, if it could not.
    pub(super) table_error: Option<String>,
}

/// What a snapshot asks of the kernel, worked out without touching it.
#[derive(Debug, Default, PartialEq)]
pub struct KernelPlan {
    /// Captured service address → the node listener that takes it.
    pub services: BTreeSet<(SocketAddr, SocketAddr)>,
    /// Ports whose local hops sk_msg shortens, and which ends of their connections join.
    pub redirect_ports: BTreeMap<u16, HopPort>,
    /// Http listener ports whose connections the verdict decides.
    pub l7_ports: BTreeSet<u16>,
    /// The L7 listener's route table, as the tier-K lowering made it.
    pub routes: Vec<KernelEntry>,
    /// tcp listeners' `connection_rate_limit`, by bound port.
    pub conn_limits: BTreeMap<u16, ConnLimitPlan>,
}

/// Attaches tier K if the config has a `kernel:` section and the host can run it. Without
/// privileges or kernel support it logs one line saying what is missing and returns why
/// tier K is off (for `/rules`): the node then runs on the user tiers.
pub fn attach(config: &Config) -> Result<KernelBinding, String> {
    let Some(k) = config.kernel.as_ref() else {
        return Err("the config has no `kernel:` section".into());
    };
    if let Some(line) = flatmesh_kernel::probe() {
        tracing::warn!("{line}");
        let missing = flatmesh_kernel::missing_requirements().join(", ");
        return Err(format!("missing {missing}"));
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
        own_netns_only: true,
        // The connection rate-limit filter, when a tcp listener has a limit at start.
        conn_limit: config
            .listeners
            .iter()
            .any(|l| l.protocol == ListenerProtocol::Tcp && l.connection_rate_limit.is_some()),
    };
    if cfg.capture.is_none() && !cfg.redirect && !cfg.l7_dispatch && !cfg.conn_limit {
        tracing::info!("the kernel section enables nothing; tier K stays off");
        return Err("the kernel section enables nothing".into());
    }
    let tier = match KernelTier::attach(&cfg) {
        Ok(tier) => tier,
        Err(err) => {
            tracing::warn!("tier K (eBPF) could not attach: {err}; running on the user tiers");
            return Err(format!("it could not attach: {err}"));
        }
    };
    if cfg.capture.is_some() {
        // The node's own upstream connections must never be captured back to itself.
        if let Err(err) = tier.bypass_pid(std::process::id()) {
            tracing::warn!("tier K: cannot exempt the node from capture ({err}); capture is off");
            let _ = tier.detach();
            return Err(format!("cannot exempt the node from capture: {err}"));
        }
    }
    tracing::info!(
        pin_dir = %cfg.pin_dir.display(),
        capture = cfg.capture.is_some(),
        redirect = cfg.redirect,
        l7_dispatch = k.l7_dispatch,
        tcp_splice = k.tcp_splice,
        conn_limit = cfg.conn_limit,
        "tier K (eBPF) attached"
    );
    Ok(KernelBinding {
        tier,
        installed: Mutex::new(Installed::default()),
        conn: Default::default(),
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
    if let Some(capture) = &k.capture {
        for s in &capture.services {
            if let Some(addr) = bound(&s.listener) {
                plan.services
                    .insert((s.address, reachable(addr, s.address.is_ipv4())));
            }
        }
    }
    for (lid, l) in snapshot.listeners.iter().enumerate() {
        let table = &snapshot.program.listeners()[lid];
        let port = bound(&l.name).map(|a| a.port());
        match (&table.kind, port) {
            // The lowering says which listener's routes the kernel decides (none that
            // terminates TLS or has authorization policies).
            (TableKind::Http(_), Some(port))
                if snapshot.program.kernel().l7_listener() == Some(lid) =>
            {
                plan.l7_ports.insert(port);
                plan.routes = snapshot.program.kernel().entries.clone();
                // The accepted end belongs to the sk_skb dispatcher, which must see the
                // client's bytes come in through TCP; the client end joins the sockhash so a
                // decided connection can go socket direct.
                if k.redirect {
                    plan.redirect_ports.insert(port, HopPort::ClientOnly);
                }
            }
            // tcp listeners and the other http listeners: both ends of the local hop.
            (_, Some(port)) if k.redirect => {
                plan.redirect_ports.insert(port, HopPort::Both);
            }
            _ => {}
        }
    }
    plan.conn_limits = conn_limit::plan(config, bound);
    if k.redirect {
        // Local backends: the proxy's upstream hop to them is shortened, and with the client
        // end they make socket direct possible.
        for c in &snapshot.clusters {
            for e in c.endpoints.iter().filter(|e| e.ip().is_loopback()) {
                plan.redirect_ports.entry(e.port()).or_insert(HopPort::Both);
            }
        }
    }
    plan
}

/// A listener bound to the unspecified address is reached on loopback, in the captured
/// service's family when the listener is dual stack ([::] takes IPv4 on 127.0.0.1).
fn reachable(addr: SocketAddr, for_ipv4: bool) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() && for_ipv4 => {
            (Ipv4Addr::LOCALHOST, addr.port()).into()
        }
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
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
        for port in installed.redirect_ports.keys() {
            if !plan.redirect_ports.contains_key(port) {
                if let Err(e) = self.tier.remove_redirect_port(*port) {
                    log("unmark a redirect port", e);
                }
            }
        }
        for (port, mode) in &plan.redirect_ports {
            if installed.redirect_ports.get(port) != Some(mode) {
                if let Err(e) = self.tier.add_hop_port(*port, *mode) {
                    log(&format!("shorten hops on port {port}"), e);
                }
            }
        }
        for port in installed.l7_ports.difference(&plan.l7_ports) {
            if let Err(e) = self.tier.remove_l7_port(*port) {
                log("unmark an L7 port", e);
            }
        }
        if !plan.l7_ports.is_empty() {
            // Table before port: a connection registered on the port must find the new routes.
            let result = self.tier.set_routes(&plan.routes);
            installed.table_error = result.as_ref().err().map(|e| e.to_string());
            if let Err(e) = result {
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
        drop(installed);
        self.install_conn_limits(&plan.conn_limits);
    }
}
