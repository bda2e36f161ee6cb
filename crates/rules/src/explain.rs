//! Human and machine views of a RuleProgram: `flatmesh check --explain` and the admin `/rules`.

use std::fmt::Write as _;

use flatmesh_config::duration;
use serde_json::{json, Value};

use crate::image;
use crate::lower::kernel::{self, KernelAction};
use crate::lower::{nic, Lowering};
use crate::matcher::{HeaderCond, HostMatch, PathCond, QueryCond, RuleMatch, ValueMatch};
use crate::program::{CompiledRoute, RouteAction, RuleProgram, TableKind};
use crate::runtime::NodeTiers;
use crate::tier::Tier;
use crate::{ListenerId, RouteId};

const LEGEND: &str = "tiers: N = NIC table image, K = kernel eBPF, U4 = user L4 relay, U7 = user L7 executor
eligible = every tier whose lowering can decide the rule when its table has room, cheapest first
K = the kernel's route table: h1/h2 = entry e decides it for HTTP/1.x / HTTP/2 connections, punt = entry e hands it to the user tier, - = no entry
N = the NIC image: qN = decided, queue N; host = handed to the host (queue 0); - = not in the image
tier = where the rule runs (N is an emitted image: no NIC runs it here); why = why it runs there";

impl RuleProgram {
    /// Every table, every rule, its match, action, what each lowering does with it and the
    /// tier it runs in, as the config asks.
    pub fn explain(&self) -> String {
        self.explain_on(&NodeTiers::default())
    }

    /// As [`explain`](Self::explain), with the tiers `node` actually runs.
    pub fn explain_on(&self, node: &NodeTiers) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "RuleProgram: {} listeners, {} clusters; {}",
            self.listeners.len(),
            self.clusters.len(),
            node.describe()
        );
        let _ = writeln!(out, "{LEGEND}");
        for (lid, l) in self.listeners.iter().enumerate() {
            out.push('\n');
            let header = [
                "#", "name", "match", "action", "eligible", "K", "N", "tier", "why",
            ];
            match &l.kind {
                TableKind::Tcp(rule) => {
                    let _ = writeln!(out, "listener {lid} `{}` tcp {}: 1 rule", l.name, l.address);
                    let (tier, why) = node.place(&rule.placement, Tier::UserL4);
                    let k = if rule.placement.tier == Tier::Kernel {
                        "splice"
                    } else {
                        "-"
                    };
                    let row = vec![
                        "0".into(),
                        l.name.clone(),
                        "* (every connection)".into(),
                        format!("forward {}", self.cluster_name(rule.cluster)),
                        rule.placement.eligible.label(),
                        k.into(),
                        "-".into(),
                        tier.to_string(),
                        why.into_owned(),
                    ];
                    table(&mut out, &header, &[row]);
                    explain_authz(&mut out, l);
                    self.explain_listener_rate_limit(&mut out, l, node);
                }
                TableKind::Qnp(rule) => {
                    let _ = writeln!(
                        out,
                        "listener {lid} `{}` qnp {}: skip-and-check rules over {} workers (their image: below, after the program)",
                        l.name, l.address, rule.workers
                    );
                    let (tier, why) = qnp_place(&rule.placement);
                    let row = vec![
                        "*".into(),
                        l.name.clone(),
                        "first packet: app, type, TLV field bytes".into(),
                        format!(
                            "send to one of workers 0..={} by the rules",
                            rule.workers.saturating_sub(1)
                        ),
                        rule.placement.eligible.label(),
                        if tier == Tier::Kernel { "image" } else { "-" }.into(),
                        "image".into(),
                        tier.to_string(),
                        why.into_owned(),
                    ];
                    table(&mut out, &header, &[row]);
                }
                TableKind::Hbone(rule) => {
                    let _ = writeln!(
                        out,
                        "listener {lid} `{}` hbone {}: 1 rule",
                        l.name, l.address
                    );
                    let (tier, why) = node.place(&rule.placement, Tier::UserL4);
                    let row = vec![
                        "0".into(),
                        l.name.clone(),
                        "* (every CONNECT stream)".into(),
                        "deliver to its :authority, within hbone.destinations".into(),
                        rule.placement.eligible.label(),
                        "-".into(),
                        "-".into(),
                        tier.to_string(),
                        why.into_owned(),
                    ];
                    table(&mut out, &header, &[row]);
                    explain_authz(&mut out, l);
                    self.explain_listener_rate_limit(&mut out, l, node);
                }
                TableKind::Http(t) => {
                    let s = t.index_stats();
                    let _ = writeln!(
                        out,
                        "listener {lid} `{}` http {}: {} routes, first match wins; index: {} exact, {} prefix, {} regex, {} any path; {}",
                        l.name,
                        l.address,
                        t.routes.len(),
                        s.exact,
                        s.prefix,
                        s.regex,
                        s.any,
                        t.paths.describe()
                    );
                    let rows: Vec<_> = t
                        .routes
                        .iter()
                        .map(|r| {
                            let (tier, why) = node.place_route(r);
                            vec![
                                r.id.to_string(),
                                r.name.clone(),
                                r.matches.describe(),
                                self.describe_action(r),
                                r.placement.eligible.label(),
                                self.kernel_cell(lid, r.id),
                                self.nic_cell(lid, r.id),
                                tier.to_string(),
                                why.into_owned(),
                            ]
                        })
                        .collect();
                    table(&mut out, &header, &rows);
                    let _ = writeln!(out, "  (no match: 404)");
                    explain_authz(&mut out, l);
                    self.explain_listener_rate_limit(&mut out, l, node);
                    self.explain_kernel_table(&mut out, lid);
                    self.explain_image(&mut out, lid);
                }
            }
        }
        out.push('\n');
        let _ = writeln!(out, "clusters: {}", self.clusters.len());
        let rows: Vec<Vec<String>> = self
            .clusters
            .iter()
            .enumerate()
            .map(|(id, c)| {
                let endpoints: Vec<String> = c.endpoints.iter().map(|e| e.to_string()).collect();
                vec![
                    id.to_string(),
                    c.name.clone(),
                    json_str(&c.lb),
                    json_str(&c.protocol),
                    endpoints.join(", "),
                    describe_breaker(&c.breaker),
                    c.outlier
                        .as_ref()
                        .map_or_else(|| "off".into(), describe_outlier),
                    c.health_check
                        .as_ref()
                        .map_or_else(|| "off".into(), describe_health_check),
                    describe_weights(&c.weights),
                ]
            })
            .collect();
        table(
            &mut out,
            &[
                "id",
                "name",
                "lb",
                "protocol",
                "endpoints",
                "circuit breaker",
                "outlier detection",
                "health check",
                "weights, priorities, locality",
            ],
            &rows,
        );
        out
    }

    /// `h1 e3`, `punt e0` or `-`: the kernel table's entry for a route.
    fn kernel_cell(&self, listener: ListenerId, route: RouteId) -> String {
        let k = self.kernel();
        if k.l7_listener() != Some(listener) {
            return "-".into();
        }
        match k.entry_of(route).map(|e| (e, &k.entries[e].action)) {
            Some((e, KernelAction::Forward { protocols, .. })) => {
                format!("{} e{e}", protocols.label())
            }
            Some((e, KernelAction::Punt(_))) => format!("punt e{e}"),
            None => "-".into(),
        }
    }

    /// `q3`, `host` or `-`: what the image does with a route.
    fn nic_cell(&self, listener: ListenerId, route: RouteId) -> String {
        let Some(l) = self.nic().listeners.get(listener) else {
            return "-".into();
        };
        match l.routes.get(route) {
            Some(r) if r.verdict.decides() => r
                .queue(route)
                .map_or_else(|| "-".into(), |q| format!("q{q}")),
            Some(r) if l.app_id.is_some() && !r.rules.is_empty() => "host".into(),
            _ => "-".into(),
        }
    }

    /// One line about the kernel's table, for the listener it holds.
    fn explain_kernel_table(&self, out: &mut String, listener: ListenerId) {
        let k = self.kernel();
        if k.listener != Some(listener) {
            return;
        }
        if let Err(why) = k.splice {
            let _ = writeln!(
                out,
                "  tier K: its route table is not installed, no connection is spliced: {why}"
            );
            return;
        }
        let decided = k
            .entries
            .iter()
            .filter(|e| matches!(e.action, KernelAction::Forward { .. }))
            .count();
        let _ = writeln!(
            out,
            "  tier K: {} of {} route table entries, {decided} decide, {} punt; a request no entry matches goes to the user tier",
            k.entries.len(),
            kernel::ENTRIES_MAX,
            k.entries.len() - decided
        );
    }

    /// The listener's part of the NIC image: its entries, and why any route stays on the host.
    fn explain_image(&self, out: &mut String, listener: ListenerId) {
        let Some(l) = self.nic().listeners.get(listener) else {
            return;
        };
        let Some(app) = l.app_id else {
            let why = l
                .routes
                .first()
                .and_then(|r| r.verdict.reason())
                .map_or_else(String::new, |r| format!(": {r}"));
            let _ = writeln!(out, "  tier N: not in the image{why}");
            return;
        };
        let decided: Vec<String> = l
            .routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.verdict.decides())
            .map(|(id, _)| format!("#{id}"))
            .collect();
        let _ = writeln!(
            out,
            "  tier N: app {app} type {}, image entries {}..{} ({} of {}), {} rules; routes it decides: {}; no match: queue 0 (host)",
            nic::REQ_TYPE,
            l.entries.start,
            l.entries.end,
            l.entries.len(),
            image::TABLE_ENTRIES,
            l.rules.len(),
            if decided.is_empty() {
                "none".to_string()
            } else {
                decided.join(", ")
            }
        );
        for (id, r) in l.routes.iter().enumerate() {
            if let Some(why) = r.verdict.reason() {
                let _ = writeln!(out, "    route {id} stays on the host: {why}");
            }
        }
    }

    /// `forward api`, `split api:90 canary:10`, `respond 200 (2 bytes)`, then modifiers.
    fn describe_action(&self, r: &CompiledRoute) -> String {
        let mut text = match &r.action {
            RouteAction::Forward(c) => format!("forward {}", self.cluster_name(*c)),
            RouteAction::Split(s) => {
                let parts: Vec<String> = s
                    .entries()
                    .iter()
                    .map(|(c, w)| format!("{}:{w}", self.cluster_name(*c)))
                    .collect();
                format!("split {}", parts.join(" "))
            }
            RouteAction::DirectResponse { status, body } => {
                format!("respond {} ({} bytes)", status.as_u16(), body.len())
            }
        };
        for (name, _) in &r.request_headers_to_add {
            let _ = write!(text, "; set {name}");
        }
        for name in &r.request_headers_to_remove {
            let _ = write!(text, "; remove {name}");
        }
        for (name, _) in &r.response_headers_to_add {
            let _ = write!(text, "; response set {name}");
        }
        if let Some(t) = &r.timeout {
            let _ = write!(text, "; timeout {}", duration::format(t));
        }
        if let Some(retry) = &r.retries {
            let _ = write!(text, "; {}", retry_text(retry));
        }
        if let Some(fault) = &r.fault {
            let _ = write!(text, "; fault {}", fault.describe());
        }
        if let Some(m) = &r.mirror {
            let _ = write!(
                text,
                "; mirror {} ({}%)",
                self.cluster_name(m.cluster),
                m.share.percent
            );
        }
        if let Some(limit) = &r.rate_limit {
            let _ = write!(text, "; {}", describe_rate_limit(limit, "requests"));
        }
        text
    }

    /// (listener, route, tier) of every http route: where each runs on `node`, as `/rules`
    /// shows it. The node labels its request metrics with it.
    pub fn route_tiers_on(&self, node: &NodeTiers) -> Vec<(&str, &str, Tier)> {
        let mut out = Vec::new();
        for l in &self.listeners {
            if let TableKind::Http(t) = &l.kind {
                for r in &t.routes {
                    out.push((l.name.as_str(), r.name.as_str(), node.place_route(r).0));
                }
            }
        }
        out
    }

    /// The program as JSON, tiers as the config asks.
    pub fn to_json(&self) -> Value {
        self.to_json_on(&NodeTiers::default())
    }

    /// The program as JSON for the admin `/rules` endpoint: `tier` and `reason` are where each
    /// rule runs on `node`; `kernel` and `nic` are what each lowering does with it.
    pub fn to_json_on(&self, node: &NodeTiers) -> Value {
        let listeners: Vec<Value> = self
            .listeners
            .iter()
            .enumerate()
            .map(|(id, l)| match &l.kind {
                TableKind::Tcp(rule) => {
                    let (tier, reason) = node.place(&rule.placement, Tier::UserL4);
                    json!({
                        "id": id,
                        "name": l.name,
                        "address": l.address.to_string(),
                        "protocol": "tcp",
                        "rule": {
                            "action": { "forward": self.cluster_name(rule.cluster) },
                            "eligible": rule.placement.eligible,
                            "tier": tier,
                            "reason": reason,
                            "kernel": self.kernel().tcp_verdict(id),
                        },
                        "tls": l.tls,
                        "authorization": l.authz.as_ref().map(|a| a.summary()),
                        "rate_limit": l.rate_limit,
                        "rate_limit_tier": l.rate_limit.as_ref().map(|_| self.conn_limit_tier(l, node).as_str()),
                    })
                }
                TableKind::Qnp(rule) => {
                    let (tier, reason) = qnp_place(&rule.placement);
                    json!({
                        "id": id,
                        "name": l.name,
                        "address": l.address.to_string(),
                        "protocol": "qnp",
                        "rule": {
                            "action": { "dispatch": { "workers": rule.workers } },
                            "eligible": rule.placement.eligible,
                            "tier": tier,
                            "reason": reason,
                        },
                    })
                }
                TableKind::Hbone(rule) => {
                    let (tier, reason) = node.place(&rule.placement, Tier::UserL4);
                    json!({
                        "id": id,
                        "name": l.name,
                        "address": l.address.to_string(),
                        "protocol": "hbone",
                        "rule": {
                            "action": "deliver",
                            "eligible": rule.placement.eligible,
                            "tier": tier,
                            "reason": reason,
                            "kernel": self.kernel().tcp_verdict(id),
                        },
                        "tls": l.tls,
                        "authorization": l.authz.as_ref().map(|a| a.summary()),
                        "rate_limit": l.rate_limit,
                    })
                }
                TableKind::Http(t) => {
                    let nic = &self.nic().listeners[id];
                    json!({
                        "id": id,
                        "name": l.name,
                        "address": l.address.to_string(),
                        "protocol": "http",
                        "index": t.index_stats(),
                        "paths": t.paths.to_json(),
                        "kernel_entries": (self.kernel().l7_listener() == Some(id)).then(|| self.kernel().entries.len()),
                        "nic": {
                            "app_id": nic.app_id,
                            "entries": [nic.entries.start, nic.entries.end],
                            "rules": nic.rules.len(),
                        },
                        "routes": t.routes.iter().map(|r| self.route_json(id, r, node)).collect::<Vec<_>>(),
                        "tls": l.tls,
                        "authorization": l.authz.as_ref().map(|a| a.summary()),
                        "rate_limit": l.rate_limit,
                    })
                }
            })
            .collect();
        let clusters: Vec<Value> = self
            .clusters
            .iter()
            .enumerate()
            .map(|(id, c)| {
                json!({
                    "id": id,
                    "name": c.name,
                    "lb": c.lb,
                    "protocol": c.protocol,
                    "endpoints": c.endpoints.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
                    "circuit_breaker": c.breaker,
                    "outlier_detection": c.outlier,
                    "health_check": c.health_check,
                    "endpoint_weights": c.weights.entries,
                    "node_locality": c.weights.node_locality,
                    "overprovisioning_factor": c.weights.overprovisioning,
                    "slow_start": c.weights.slow_start,
                })
            })
            .collect();
        json!({ "node": node.to_json(), "listeners": listeners, "clusters": clusters })
    }

    fn route_json(&self, listener: ListenerId, r: &CompiledRoute, node: &NodeTiers) -> Value {
        let action = match &r.action {
            RouteAction::Forward(c) => json!({ "forward": self.cluster_name(*c) }),
            RouteAction::Split(s) => json!({
                "split": s.entries().iter()
                    .map(|(c, w)| json!({ "cluster": self.cluster_name(*c), "weight": w }))
                    .collect::<Vec<_>>(),
            }),
            RouteAction::DirectResponse { status, body } => json!({
                "direct_response": { "status": status.as_u16(), "body": String::from_utf8_lossy(body) },
            }),
        };
        let pairs = |v: &[(http::HeaderName, http::HeaderValue)]| -> Value {
            v.iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Value::from(String::from_utf8_lossy(v.as_bytes()).into_owned()),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let (tier, reason) = node.place_route(r);
        json!({
            "id": r.id,
            "name": r.name,
            "match": match_json(&r.matches),
            "match_text": r.matches.describe(),
            "action": action,
            "timeout": r.timeout.as_ref().map(duration::format),
            "request_headers_to_add": pairs(&r.request_headers_to_add),
            "request_headers_to_remove": r.request_headers_to_remove.iter().map(|h| h.as_str()).collect::<Vec<_>>(),
            "response_headers_to_add": pairs(&r.response_headers_to_add),
            "retries": r.retries,
            "fault": r.fault.as_ref().map(fault_json),
            "mirror": r.mirror.as_ref().map(|m| json!({
                "cluster": self.cluster_name(m.cluster),
                "percent": m.share.percent,
            })),
            "rate_limit": r.rate_limit,
            "eligible": r.placement.eligible,
            "tier": tier,
            "reason": reason,
            "kernel": self.kernel_json(listener, r.id),
            "nic": self.nic_json(listener, r.id),
        })
    }

    /// What the kernel's table does with a route: its verdict, entry and protocols.
    fn kernel_json(&self, listener: ListenerId, route: RouteId) -> Value {
        let k = self.kernel();
        let entry = (k.l7_listener() == Some(listener))
            .then(|| k.entry_of(route))
            .flatten();
        let protocols = entry.and_then(|e| match &k.entries[e].action {
            KernelAction::Forward { protocols, .. } => Some(protocols.label()),
            KernelAction::Punt(_) => None,
        });
        let verdict = k.verdict(listener, route);
        json!({
            "decides": verdict.is_some_and(|v| v.decides()),
            "why": verdict.and_then(|v| v.reason()),
            "entry": entry,
            "protocols": protocols,
        })
    }

    /// What the NIC image does with a route: its verdict and queue.
    fn nic_json(&self, listener: ListenerId, route: RouteId) -> Value {
        let r = self
            .nic()
            .listeners
            .get(listener)
            .and_then(|l| l.routes.get(route));
        json!({
            "decides": r.is_some_and(|r| r.verdict.decides()),
            "why": r.and_then(|r| r.verdict.reason()),
            "queue": r.and_then(|r| r.queue(route)),
        })
    }
}

/// `fault:` as `/rules` shows it: the config's own shape.
fn fault_json(f: &crate::FaultAction) -> Value {
    let abort = f.abort.map(|(status, share)| match status {
        crate::AbortStatus::Http(s) => json!({ "status": s.as_u16(), "percent": share.percent }),
        crate::AbortStatus::Grpc(code) => json!({ "grpc_status": code, "percent": share.percent }),
    });
    let delay = f
        .delay
        .map(|(d, share)| json!({ "duration": duration::format(&d), "percent": share.percent }));
    json!({ "abort": abort, "delay": delay })
}

fn match_json(m: &RuleMatch) -> Value {
    let value = |v: &ValueMatch| match v {
        ValueMatch::Exact(s) => json!({ "exact": s }),
        ValueMatch::Prefix(s) => json!({ "prefix": s }),
        ValueMatch::Present(p) => json!({ "present": p }),
        ValueMatch::Regex(r) => json!({ "regex": r.source }),
    };
    let named = |name: &str, v: &ValueMatch| {
        let mut obj = value(v);
        if let Some(o) = obj.as_object_mut() {
            o.insert("name".into(), name.into());
        }
        obj
    };
    json!({
        "host": m.host.as_ref().map(|h| match h {
            HostMatch::Any => json!("*"),
            HostMatch::Exact(h) => json!({ "exact": h }),
            HostMatch::Suffix(s) => json!({ "suffix": s }),
        }),
        "path": m.path.as_ref().map(|p| match p {
            PathCond::Exact(p) => json!({ "exact": p }),
            PathCond::Prefix(p) => json!({ "prefix": p }),
            PathCond::Regex(r) => json!({ "regex": r.source }),
        }),
        "method": m.method.as_ref().map(|m| m.as_str()),
        "headers": m.headers.iter().map(|h: &HeaderCond| named(h.name.as_str(), &h.value)).collect::<Vec<_>>(),
        "query": m.query.iter().map(|q: &QueryCond| named(&q.name, &q.value)).collect::<Vec<_>>(),
        "grpc_field": m.grpc_field.as_ref().map(|f| {
            let mut obj = value(&f.value);
            if let Some(o) = obj.as_object_mut() {
                o.insert("number".into(), f.number.into());
            }
            obj
        }),
    })
}

/// A serde enum's wire name (`round_robin`), so explain and the YAML use the same words.
fn json_str<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => "?".to_string(),
    }
}

/// Left-aligned columns, two spaces apart, indented by two; the last column is not padded.
fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::from(" ");
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            line.push(' ');
            line.push_str(cell);
            if i + 1 < row.len() {
                line.extend(std::iter::repeat_n(' ', w - cell.chars().count() + 1));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// A listener's authorization policies, in the order they are tried, and what a request no
/// policy matches gets.
fn explain_authz(out: &mut String, l: &crate::ListenerTable) {
    let Some(authz) = &l.authz else {
        return;
    };
    let summary = authz.summary();
    let _ = writeln!(
        out,
        "  authorization (user tier; a matching deny wins, else an allow must match when any exists): no match -> {}",
        summary.unmatched
    );
    let rows: Vec<Vec<String>> = summary
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            vec![
                i.to_string(),
                p.name.clone(),
                p.action.to_string(),
                p.conditions.clone(),
            ]
        })
        .collect();
    if !rows.is_empty() {
        table(out, &["#", "policy", "action", "when"], &rows);
    }
}

/// A rate limit in a line: `rate limit 100 requests/s, burst 10, per header x-user`.
fn describe_rate_limit(limit: &flatmesh_config::RateLimit, what: &str) -> String {
    let key = match &limit.key {
        None => String::new(),
        Some(flatmesh_config::RateLimitKey::Named(_)) => ", per client address".into(),
        Some(flatmesh_config::RateLimitKey::Header { header }) => format!(", per header {header}"),
    };
    format!(
        "rate limit {} {what}/s, burst {}{key}",
        limit.requests_per_s,
        limit.burst()
    )
}

/// Which tier counts a tcp listener's `connection_rate_limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnLimitTier {
    /// This node's tier K: a socket filter on the listening sockets.
    Kernel,
    /// No running node consulted, and the config has a `kernel:` section.
    KernelWhenAttached,
    User,
}

impl ConnLimitTier {
    fn as_str(self) -> &'static str {
        match self {
            ConnLimitTier::Kernel => "kernel",
            ConnLimitTier::KernelWhenAttached => "kernel when tier K is attached, else user",
            ConnLimitTier::User => "user",
        }
    }
}

impl RuleProgram {
    fn conn_limit_tier(&self, l: &crate::ListenerTable, node: &NodeTiers) -> ConnLimitTier {
        if node.kernel_conn_limits.contains(&l.name) {
            ConnLimitTier::Kernel
        } else if node.kernel == crate::KernelRuntime::AsConfigured && self.kernel_configured {
            ConnLimitTier::KernelWhenAttached
        } else {
            ConnLimitTier::User
        }
    }

    /// A listener's own rate limit, as a line under its table.
    fn explain_listener_rate_limit(
        &self,
        out: &mut String,
        l: &crate::ListenerTable,
        node: &NodeTiers,
    ) {
        let Some(limit) = &l.rate_limit else {
            return;
        };
        const KERNEL: &str = "in the kernel (socket filter on the listening sockets: a SYN over the limit is dropped unanswered, before the proxy sees a connection; the client retries it)";
        const USER: &str = "in user space (accepted, then reset when over)";
        let (what, before, over) = match (&l.kind, self.conn_limit_tier(l, node)) {
            (TableKind::Tcp(_), ConnLimitTier::Kernel) => (
                "connections",
                format!("each new connection, {KERNEL}"),
                "SYN dropped",
            ),
            (TableKind::Tcp(_), ConnLimitTier::KernelWhenAttached) => (
                "connections",
                format!("each new connection, {KERNEL} when tier K is attached, else {USER}"),
                "SYN dropped (kernel) or closed (user space)",
            ),
            (TableKind::Tcp(_), ConnLimitTier::User) => (
                "connections",
                format!("each new connection, {USER}"),
                "closed",
            ),
            _ => (
                "requests",
                "every request before routing, in the user tier".to_string(),
                "429 with retry-after, gRPC RESOURCE_EXHAUSTED",
            ),
        };
        let _ = writeln!(
            out,
            "  {} (node-wide; {before}; over it: {over})",
            describe_rate_limit(limit, what),
        );
    }
}

/// A route's retry policy with the defaults in force: `retries 2 on 5xx,unavailable, per try
/// 1s, backoff 25ms..250ms, budget 20% + 10/s, bodies kept to 65536 bytes`.
fn retry_text(r: &flatmesh_config::RetryPolicy) -> String {
    let on: Vec<&str> = r.on.iter().map(|o| o.as_str()).collect();
    let (backoff, budget) = (r.backoff(), r.budget());
    let mut text = format!("retries {} on {}", r.attempts, on.join(","));
    if let Some(t) = &r.per_try_timeout {
        let _ = write!(text, ", per try {}", duration::format(t));
    }
    let _ = write!(
        text,
        ", backoff {}..{}, budget {}% + {}/s, bodies kept to {} bytes",
        duration::format(&backoff.base),
        duration::format(&backoff.max()),
        budget.ratio * 100.0,
        budget.min_per_s,
        r.max_replay_body()
    );
    text
}

/// A circuit breaker in a table cell: `connections 1024, pending 1024, requests 1024, retries 3`.
fn describe_breaker(b: &flatmesh_config::CircuitBreaker) -> String {
    format!(
        "connections {}, pending {}, requests {}, retries {}",
        b.max_connections, b.max_pending, b.max_requests, b.max_retries
    )
}

/// An active health check in a table cell: the probe, then the timing and thresholds.
fn describe_health_check(h: &flatmesh_config::HealthCheck) -> String {
    let probe = match h.kind() {
        flatmesh_config::HealthCheckKind::Http(http) => {
            format!("http GET {} expects {}", http.path, http.expect)
        }
        flatmesh_config::HealthCheckKind::Tcp => "tcp connect".into(),
        flatmesh_config::HealthCheckKind::Grpc(g) if g.service.is_empty() => {
            "grpc Health/Check".into()
        }
        flatmesh_config::HealthCheckKind::Grpc(g) => format!("grpc Health/Check `{}`", g.service),
    };
    format!(
        "{probe} every {} (timeout {}); out after {} failures, back after {} passes",
        duration::format(&h.interval),
        duration::format(&h.timeout),
        h.unhealthy_threshold,
        h.healthy_threshold
    )
}

/// Weights, priorities and localities in a table cell: each priority level (a priority, and
/// within it the endpoints' locality against the node's), its endpoints with their weights,
/// then the overprovisioning factor and slow start. `equal` when every endpoint is plain.
fn describe_weights(w: &crate::program::Weights) -> String {
    let plain = w.entries.iter().all(flatmesh_config::Endpoint::is_plain);
    let mut parts = Vec::new();
    if plain {
        parts.push("equal".to_owned());
    } else {
        let mut priorities: Vec<u32> = w.entries.iter().map(|e| e.priority).collect();
        priorities.sort_unstable();
        priorities.dedup();
        for p in priorities {
            let endpoints: Vec<String> = w
                .entries
                .iter()
                .filter(|e| e.priority == p)
                .map(|e| {
                    let mut s = format!("{} w{}", e.address, e.weight);
                    if let Some(l) = &e.locality {
                        let _ = write!(s, " {l}");
                        if w.node_locality.as_deref() == Some(l.as_str()) {
                            s.push_str(" (local)");
                        }
                    }
                    s
                })
                .collect();
            parts.push(format!("P{p}: {}", endpoints.join(", ")));
        }
        parts.push(format!(
            "failover at healthy x {}% < 100%",
            w.overprovisioning
        ));
        if let Some(l) = &w.node_locality {
            parts.push(format!("node locality {l} first"));
        }
    }
    if let Some(s) = &w.slow_start {
        parts.push(format!(
            "slow start {} (aggression {}, min {}%)",
            duration::format(&s.window),
            s.aggression,
            s.min_weight_percent
        ));
    }
    parts.join("; ")
}

/// Outlier detection in a table cell: the kinds that eject (streaks, then the interval's
/// judgements), then the timing and the cap.
fn describe_outlier(o: &flatmesh_config::OutlierDetection) -> String {
    let kinds: Vec<String> = [
        ("5xx", o.consecutive_5xx),
        ("gateway errors", o.consecutive_gateway_errors),
        ("connect failures", o.consecutive_connect_failures),
    ]
    .iter()
    .filter(|(_, n)| *n > 0)
    .map(|(what, n)| format!("{n} {what}"))
    .collect();
    let per = duration::format(&o.interval);
    let mut rules = Vec::new();
    if !kinds.is_empty() {
        rules.push(format!("{} in a row", kinds.join(" or ")));
    }
    let sr = &o.success_rate;
    if sr.enforcing {
        rules.push(format!(
            "a success rate {} stdev below the mean (of >= {} endpoints with >= {} requests per {per})",
            f64::from(sr.stdev_factor) / 1000.0,
            sr.minimum_hosts,
            sr.request_volume
        ));
    }
    let fp = &o.failure_percentage;
    if fp.enforcing {
        rules.push(format!(
            ">= {}% failed (of >= {} endpoints with >= {} requests per {per})",
            fp.threshold, fp.minimum_hosts, fp.request_volume
        ));
    }
    format!(
        "eject after {} for {} x times ejected; at most {}% out; count decays every {per}",
        rules.join(" or "),
        duration::format(&o.base_ejection_time),
        o.max_ejection_percent,
    )
}

/// Where a qnp listener's rules run: tier K's sk_reuseport program is a program of its own,
/// loaded per listener when the config has a `kernel:` section, whatever else of tier K the
/// node attached. A node that cannot load it for a listener says so once in its log and
/// counts that listener's requests with `tier="user"` (`flatmesh_qnp_requests_total`).
fn qnp_place(p: &crate::Placement) -> (Tier, std::borrow::Cow<'static, str>) {
    (p.tier, p.reason.to_string().into())
}
