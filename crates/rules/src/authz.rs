//! Authorization: a listener's `authorization:` policies compiled into a table the proxy runs
//! on every request (http listeners) or connection (tcp listeners), in Istio's order: a
//! matching `deny` policy denies; otherwise, when the listener has `allow` policies or
//! `default: deny`, only a matching `allow` policy admits; otherwise the request goes on.
//!
//! The caller is its verified SPIFFE ID (the TLS handshake's); a request or connection
//! without one matches no `from.principals` and no `from.namespaces`. Paths are matched as
//! the listener normalised them (`crate::normalize`), the same path the routes see.

use flatmesh_config::{Authorization, AuthzAction, AuthzDefault, AuthzPolicy};
use http::HeaderName;
use serde::Serialize;

use crate::error::RulesError;
use crate::request::{strip_port, Request};

/// Who is calling, as far as the node could verify.
#[derive(Debug, Clone, Copy, Default)]
pub struct Peer<'a> {
    /// The SPIFFE ID of the client certificate, if one was presented and verified.
    pub principal: Option<&'a str>,
}

impl Peer<'_> {
    /// The `ns/NAMESPACE` segment of the principal.
    fn namespace(&self) -> Option<&str> {
        let path = self.principal?.strip_prefix("spiffe://")?;
        let mut parts = path.split('/').skip(1);
        match (parts.next(), parts.next()) {
            (Some("ns"), Some(ns)) => Some(ns),
            _ => None,
        }
    }
}

/// A text pattern: exact, `prefix*`, `*suffix`, or `*` (anything).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    Any,
    Exact(String),
    Prefix(String),
    Suffix(String),
}

impl Pattern {
    /// Reads a pattern the config validation has checked (`*` only first or last).
    fn parse(text: &str, fold_case: bool) -> Pattern {
        let text = if fold_case {
            text.to_ascii_lowercase()
        } else {
            text.to_owned()
        };
        if text == "*" {
            Pattern::Any
        } else if let Some(p) = text.strip_suffix('*') {
            Pattern::Prefix(p.to_owned())
        } else if let Some(s) = text.strip_prefix('*') {
            Pattern::Suffix(s.to_owned())
        } else {
            Pattern::Exact(text)
        }
    }

    fn matches(&self, value: &str) -> bool {
        match self {
            Pattern::Any => true,
            Pattern::Exact(e) => value == e,
            Pattern::Prefix(p) => value.starts_with(p.as_str()),
            Pattern::Suffix(s) => value.ends_with(s.as_str()),
        }
    }
}

/// A principal pattern: a SPIFFE ID, or `ID/*` for every ID under it (a whole segment).
fn principal(text: &str) -> Pattern {
    match text.strip_suffix('*') {
        Some(prefix) if prefix.ends_with('/') => Pattern::Prefix(prefix.to_owned()),
        _ => Pattern::Exact(text.to_owned()),
    }
}

/// One compiled policy: every condition it has must hold; within one, any entry may.
#[derive(Debug, Clone)]
struct Policy {
    name: String,
    deny: bool,
    principals: Vec<Pattern>,
    namespaces: Vec<String>,
    methods: Vec<http::Method>,
    paths: Vec<Pattern>,
    hosts: Vec<Pattern>,
    when: Vec<(HeaderName, Vec<Pattern>)>,
}

impl Policy {
    fn compile(listener: &str, p: &AuthzPolicy) -> Result<Policy, RulesError> {
        let bad = |what: String| RulesError::BadPolicy {
            listener: listener.to_owned(),
            policy: p.name.clone(),
            what,
        };
        let from = p.from.clone().unwrap_or_default();
        let to = p.to.clone().unwrap_or_default();
        let methods = to
            .methods
            .iter()
            .map(|m| {
                http::Method::from_bytes(m.as_bytes())
                    .map_err(|_| bad(format!("`{m}` is not an HTTP method")))
            })
            .collect::<Result<_, _>>()?;
        let when = p
            .when
            .iter()
            .map(|w| {
                let name = HeaderName::try_from(w.header.as_str())
                    .map_err(|_| bad(format!("`{}` is not a header name", w.header)))?;
                Ok((
                    name,
                    w.values.iter().map(|v| Pattern::parse(v, false)).collect(),
                ))
            })
            .collect::<Result<_, RulesError>>()?;
        Ok(Policy {
            name: p.name.clone(),
            deny: p.action == AuthzAction::Deny,
            principals: from.principals.iter().map(|t| principal(t)).collect(),
            namespaces: from.namespaces.clone(),
            methods,
            paths: to.paths.iter().map(|t| Pattern::parse(t, false)).collect(),
            hosts: to.hosts.iter().map(|t| Pattern::parse(t, true)).collect(),
            when,
        })
    }

    /// Whether the caller part (`from`) holds.
    fn caller_matches(&self, peer: Peer<'_>) -> bool {
        let principal_ok = self.principals.is_empty()
            || peer
                .principal
                .is_some_and(|id| self.principals.iter().any(|p| p.matches(id)));
        let namespace_ok = self.namespaces.is_empty()
            || peer
                .namespace()
                .is_some_and(|ns| self.namespaces.iter().any(|n| n == ns));
        principal_ok && namespace_ok
    }

    /// Whether the request parts (`to`, `when`) hold.
    fn request_matches(&self, req: &Request<'_>) -> bool {
        let method_ok = self.methods.is_empty() || self.methods.contains(req.method);
        let path_ok = self.paths.is_empty() || self.paths.iter().any(|p| p.matches(req.path));
        let host_ok = self.hosts.is_empty()
            || req.host.is_some_and(|h| {
                let h = strip_port(h).to_ascii_lowercase();
                self.hosts.iter().any(|p| p.matches(&h))
            });
        // A header sent more than once errs on the safe side: a deny policy holds when any
        // of its values matches, an allow policy only when every one does (and there is one),
        // so a second copy of the header can neither walk around a deny nor into an allow.
        let when_ok = self.when.iter().all(|(name, values)| {
            let mut sent = req.headers.values(name).peekable();
            let matches = |v: &[u8]| {
                std::str::from_utf8(v).is_ok_and(|v| values.iter().any(|p| p.matches(v)))
            };
            if self.deny {
                sent.any(matches)
            } else {
                sent.peek().is_some() && sent.all(matches)
            }
        });
        method_ok && path_ok && host_ok && when_ok
    }
}

/// What the table said, and which policy said it (`None`: no policy matched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthzDecision {
    pub allowed: bool,
    pub policy: Option<usize>,
}

/// One listener's compiled policies.
#[derive(Debug, Clone)]
pub struct ListenerAuthz {
    policies: Vec<Policy>,
    /// With no `allow` policy and `default: allow`, an unmatched request goes on.
    allow_unmatched: bool,
}

impl ListenerAuthz {
    pub(crate) fn compile(
        listener: &str,
        authz: &Authorization,
    ) -> Result<ListenerAuthz, RulesError> {
        let policies = authz
            .policies
            .iter()
            .map(|p| Policy::compile(listener, p))
            .collect::<Result<Vec<_>, _>>()?;
        let has_allow = policies.iter().any(|p| !p.deny);
        Ok(ListenerAuthz {
            allow_unmatched: !has_allow && authz.default == AuthzDefault::Allow,
            policies,
        })
    }

    /// The decision for a request (http listeners), on its normalised path.
    pub fn check_request(&self, req: &Request<'_>, peer: Peer<'_>) -> AuthzDecision {
        self.decide(|p| p.caller_matches(peer) && p.request_matches(req))
    }

    /// The decision for a connection (tcp listeners: their policies have only `from`).
    pub fn check_connection(&self, peer: Peer<'_>) -> AuthzDecision {
        self.decide(|p| p.caller_matches(peer))
    }

    fn decide(&self, matches: impl Fn(&Policy) -> bool) -> AuthzDecision {
        let mut allowed_by = None;
        for (i, p) in self.policies.iter().enumerate() {
            if !matches(p) {
                continue;
            }
            if p.deny {
                return AuthzDecision {
                    allowed: false,
                    policy: Some(i),
                };
            }
            allowed_by = allowed_by.or(Some(i));
        }
        AuthzDecision {
            allowed: allowed_by.is_some() || self.allow_unmatched,
            policy: allowed_by,
        }
    }

    /// The names of the policies, in order (for metrics and logs).
    pub fn policy_names(&self) -> impl Iterator<Item = &str> {
        self.policies.iter().map(|p| p.name.as_str())
    }

    pub fn policy_name(&self, index: usize) -> &str {
        self.policies.get(index).map_or("", |p| p.name.as_str())
    }

    /// What `--explain` and `/rules` show.
    pub fn summary(&self) -> AuthzSummary {
        AuthzSummary {
            unmatched: if self.allow_unmatched {
                "allow"
            } else {
                "deny"
            },
            policies: self
                .policies
                .iter()
                .map(|p| PolicySummary {
                    name: p.name.clone(),
                    action: if p.deny { "deny" } else { "allow" },
                    conditions: p.describe(),
                })
                .collect(),
        }
    }
}

impl Policy {
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        let list = |v: Vec<String>| v.join("|");
        let pat = |p: &Pattern| match p {
            Pattern::Any => "*".to_string(),
            Pattern::Exact(e) => e.clone(),
            Pattern::Prefix(p) => format!("{p}*"),
            Pattern::Suffix(s) => format!("*{s}"),
        };
        if !self.principals.is_empty() {
            parts.push(format!(
                "principal {}",
                list(self.principals.iter().map(pat).collect())
            ));
        }
        if !self.namespaces.is_empty() {
            parts.push(format!("namespace {}", self.namespaces.join("|")));
        }
        if !self.methods.is_empty() {
            parts.push(format!(
                "method {}",
                list(self.methods.iter().map(|m| m.to_string()).collect())
            ));
        }
        if !self.paths.is_empty() {
            parts.push(format!(
                "path {}",
                list(self.paths.iter().map(pat).collect())
            ));
        }
        if !self.hosts.is_empty() {
            parts.push(format!(
                "host {}",
                list(self.hosts.iter().map(pat).collect())
            ));
        }
        for (name, values) in &self.when {
            parts.push(format!(
                "{name}: {}",
                list(values.iter().map(pat).collect())
            ));
        }
        if parts.is_empty() {
            "every request".into()
        } else {
            parts.join(", ")
        }
    }
}

/// A listener's policies as `--explain` and `/rules` show them.
#[derive(Debug, Clone, Serialize)]
pub struct AuthzSummary {
    /// What a request no policy matches gets.
    pub unmatched: &'static str,
    pub policies: Vec<PolicySummary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    pub name: String,
    pub action: &'static str,
    pub conditions: String,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{compile, Lowering, Reason, Verdict};

    fn program(policies: &str, default: &str) -> crate::RuleProgram {
        let yaml = format!(
            "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    authorization: {{ default: {default}, policies: {policies} }}\n    routes: [ {{ match: {{ path: {{ prefix: / }} }}, cluster: a }} ]\nclusters: [ {{ name: a, endpoints: [127.0.0.1:2] }} ]\nkernel: {{ l7_dispatch: true }}\n"
        );
        compile(&serde_norway::from_str(&yaml).unwrap()).unwrap()
    }

    fn check(
        p: &crate::RuleProgram,
        method: &str,
        host: &str,
        path: &str,
        principal: Option<&str>,
    ) -> (bool, Option<String>) {
        let method = http::Method::from_bytes(method.as_bytes()).unwrap();
        let headers = http::HeaderMap::new();
        let req = Request {
            method: &method,
            host: Some(host),
            path,
            query: None,
            headers: (&headers).into(),
            message: None,
        };
        let authz = p.authz(0).unwrap();
        let d = authz.check_request(&req, Peer { principal });
        (d.allowed, d.policy.map(|i| authz.policy_name(i).to_owned()))
    }

    const WEB: Option<&str> = Some("spiffe://td/ns/shop/sa/web");
    const OPS: Option<&str> = Some("spiffe://td/ns/ops/sa/oncall");

    #[test]
    fn deny_wins_then_an_allow_must_match_then_the_default() {
        let p = program(
            "[ { name: d, action: deny, to: { paths: [ /admin* ] } }, \
               { name: a, action: allow, from: { namespaces: [ shop ] } } ]",
            "allow",
        );
        assert_eq!(
            check(&p, "GET", "h", "/admin/x", WEB),
            (false, Some("d".into()))
        );
        assert_eq!(check(&p, "GET", "h", "/x", WEB), (true, Some("a".into())));
        // With an allow policy, the unmatched are denied whatever the default says.
        assert_eq!(check(&p, "GET", "h", "/x", OPS), (false, None));
        assert_eq!(check(&p, "GET", "h", "/x", None), (false, None));
        // Deny-only with default allow: the rest goes on; with default deny, nothing does.
        let p = program(
            "[ { name: d, action: deny, from: { principals: [ \"spiffe://td/ns/ops/*\" ] } } ]",
            "allow",
        );
        assert_eq!(check(&p, "GET", "h", "/x", OPS), (false, Some("d".into())));
        assert_eq!(check(&p, "GET", "h", "/x", WEB), (true, None));
        assert_eq!(check(&p, "GET", "h", "/x", None), (true, None));
        let p = program("[]", "deny");
        assert_eq!(check(&p, "GET", "h", "/x", WEB), (false, None));
    }

    #[test]
    fn a_header_sent_twice_walks_neither_around_a_deny_nor_into_an_allow() {
        let decide = |p: &crate::RuleProgram, tenants: &[&str]| {
            let mut headers = http::HeaderMap::new();
            for t in tenants {
                headers.append("x-tenant", t.parse().unwrap());
            }
            let req = Request {
                method: &http::Method::GET,
                host: Some("h"),
                path: "/",
                query: None,
                headers: (&headers).into(),
                message: None,
            };
            p.authz(0)
                .unwrap()
                .check_request(&req, Peer { principal: None })
                .allowed
        };
        let deny = program(
            "[ { name: d, action: deny, when: [ { header: x-tenant, values: [ evil ] } ] } ]",
            "allow",
        );
        assert!(!decide(&deny, &["evil"]));
        assert!(
            !decide(&deny, &["good", "evil"]),
            "a deny holds on any value"
        );
        assert!(decide(&deny, &["good"]));
        assert!(decide(&deny, &[]));
        let allow = program(
            "[ { name: a, action: allow, when: [ { header: x-tenant, values: [ acme ] } ] } ]",
            "deny",
        );
        assert!(decide(&allow, &["acme"]));
        assert!(decide(&allow, &["acme", "acme"]));
        assert!(
            !decide(&allow, &["other", "acme"]),
            "an allow needs every value"
        );
        assert!(!decide(&allow, &[]), "an allow needs the header");
    }

    #[test]
    fn patterns_methods_and_hosts() {
        let p = program(
            "[ { name: a, action: allow, to: { methods: [ GET, HEAD ], paths: [ \"*.css\", /exact ], hosts: [ \"*.example.org\" ] } } ]",
            "deny",
        );
        assert!(check(&p, "GET", "www.Example.org:8443", "/site.css", None).0);
        assert!(check(&p, "HEAD", "a.example.org", "/exact", None).0);
        assert!(!check(&p, "GET", "a.example.org", "/exact/more", None).0);
        assert!(!check(&p, "POST", "a.example.org", "/exact", None).0);
        assert!(!check(&p, "GET", "example.com", "/exact", None).0);
        // A principal pattern covers whole segments only.
        let p = program(
            "[ { name: a, action: allow, from: { principals: [ \"spiffe://td/ns/shop/*\" ] } } ]",
            "deny",
        );
        assert!(check(&p, "GET", "h", "/", WEB).0);
        assert!(!check(&p, "GET", "h", "/", Some("spiffe://td/ns/shopping/sa/x")).0);
    }

    #[test]
    fn a_listener_with_policies_stays_in_the_user_tier_and_explain_lists_them() {
        let p = program(
            "[ { name: no-admin, action: deny, to: { paths: [ /admin* ] } } ]",
            "allow",
        );
        assert_eq!(
            p.kernel().listener,
            None,
            "the kernel decides no request past a policy"
        );
        assert_eq!(
            p.kernel().verdict(0, 0),
            Some(Verdict::Host(Reason::Authorization))
        );
        assert_eq!(
            p.nic().verdict(0, 0),
            Some(Verdict::Host(Reason::Authorization))
        );
        let text = p.explain();
        assert!(
            text.contains("no-admin") && text.contains("path /admin*"),
            "{text}"
        );
        assert_eq!(
            p.to_json()["listeners"][0]["authorization"]["policies"][0]["action"],
            "deny"
        );
    }
}
