//! Human and machine views of a RuleProgram: `flatmesh check --explain` and the admin `/rules`.

use std::fmt::Write as _;

use flatmesh_config::duration;
use serde_json::{json, Value};

use crate::matcher::{HeaderCond, HostMatch, PathCond, QueryCond, RuleMatch, ValueMatch};
use crate::program::{CompiledRoute, RouteAction, RuleProgram, TableKind};
use crate::tier::Placement;

const LEGEND: &str = "tiers: N = NIC table image, K = kernel eBPF, U4 = user L4 relay, U7 = user L7 executor
eligible = every tier that could decide the rule, cheapest first; tier = where it runs in this build";

impl RuleProgram {
    /// Every table, every rule, its match, action, eligible tiers and the tier it runs in.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "RuleProgram: {} listeners, {} clusters",
            self.listeners.len(),
            self.clusters.len()
        );
        let _ = writeln!(out, "{LEGEND}");
        for (lid, l) in self.listeners.iter().enumerate() {
            out.push('\n');
            let header = ["#", "name", "match", "action", "eligible", "tier", "why"];
            match &l.kind {
                TableKind::Tcp(rule) => {
                    let _ = writeln!(out, "listener {lid} `{}` tcp {}: 1 rule", l.name, l.address);
                    let row = placement_row(
                        "0".into(),
                        l.name.clone(),
                        "* (every connection)".into(),
                        format!("forward {}", self.cluster_name(rule.cluster)),
                        &rule.placement,
                    );
                    table(&mut out, &header, &[row]);
                }
                TableKind::Http(t) => {
                    let s = t.index_stats();
                    let _ = writeln!(
                        out,
                        "listener {lid} `{}` http {}: {} routes, first match wins; index: {} exact, {} prefix, {} regex, {} any path",
                        l.name,
                        l.address,
                        t.routes.len(),
                        s.exact,
                        s.prefix,
                        s.regex,
                        s.any
                    );
                    let rows: Vec<_> = t
                        .routes
                        .iter()
                        .map(|r| {
                            placement_row(
                                r.id.to_string(),
                                r.name.clone(),
                                r.matches.describe(),
                                self.describe_action(r),
                                &r.placement,
                            )
                        })
                        .collect();
                    table(&mut out, &header, &rows);
                    // Only a run of eligible routes from the top can leave U7 (first match wins).
                    let prefix = |tier| match self.decidable_prefix(lid, tier) {
                        Some(crate::Decidable::Http(r)) => r.len(),
                        _ => 0,
                    };
                    let _ = writeln!(
                        out,
                        "  (no match: 404)  first-match-safe prefix: K could decide routes 0..{}, N routes 0..{}",
                        prefix(crate::Tier::Kernel),
                        prefix(crate::Tier::Nic)
                    );
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
                ]
            })
            .collect();
        table(
            &mut out,
            &["id", "name", "lb", "protocol", "endpoints"],
            &rows,
        );
        out
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
            let _ = write!(text, "; retries {}", retry.attempts);
        }
        text
    }

    /// The program as JSON for the admin `/rules` endpoint.
    pub fn to_json(&self) -> Value {
        let listeners: Vec<Value> = self
            .listeners
            .iter()
            .enumerate()
            .map(|(id, l)| match &l.kind {
                TableKind::Tcp(rule) => json!({
                    "id": id,
                    "name": l.name,
                    "address": l.address.to_string(),
                    "protocol": "tcp",
                    "rule": {
                        "action": { "forward": self.cluster_name(rule.cluster) },
                        "eligible": rule.placement.eligible,
                        "tier": rule.placement.tier,
                        "reason": rule.placement.reason,
                    },
                }),
                TableKind::Http(t) => json!({
                    "id": id,
                    "name": l.name,
                    "address": l.address.to_string(),
                    "protocol": "http",
                    "index": t.index_stats(),
                    "routes": t.routes.iter().map(|r| self.route_json(r)).collect::<Vec<_>>(),
                }),
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
                })
            })
            .collect();
        json!({ "listeners": listeners, "clusters": clusters })
    }

    fn route_json(&self, r: &CompiledRoute) -> Value {
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
            "eligible": r.placement.eligible,
            "tier": r.tier,
            "reason": r.placement.reason,
        })
    }
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
    })
}

fn placement_row(
    id: String,
    name: String,
    matches: String,
    action: String,
    p: &Placement,
) -> Vec<String> {
    vec![
        id,
        name,
        matches,
        action,
        p.eligible.label(),
        p.tier.as_str().to_string(),
        p.reason.to_string(),
    ]
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
