//! Lowering routes to the tier-K route table (`fm_routes`).
//!
//! The kernel runs the table in order and the first match wins, as the user tier does. A
//! route the kernel cannot evaluate exactly becomes a *punt* entry whose match is a superset
//! of the route's: a request that might match it is left to user space, so the kernel never
//! answers differently from the user tier. A request that matches no entry also falls back.

use crate::abi::{
    FmRoute, ACT_BACKEND, ACT_PUNT, MATCH_EXACT, MATCH_PREFIX, METHOD_MAX, PATH_MAX, ROUTES_MAX,
};

/// How a route matches the request path (path only: the kernel strips the query).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathMatch {
    /// The path equals this string.
    Exact(String),
    /// The path starts with this string.
    Prefix(String),
    /// Anything else (regex, case-insensitive, templates): the kernel cannot evaluate it.
    Other,
}

/// Connection protocols a route's backend can be spliced for: the backend gets the client's
/// bytes as they are, so it must speak the protocol the client speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Protocols(u32);

impl Protocols {
    pub const NONE: Protocols = Protocols(0);
    /// HTTP/1.0 and HTTP/1.1 (the verdict's FM_PROTO_H1 = 1).
    pub const HTTP1: Protocols = Protocols(1 << 1);
    /// HTTP/2 with prior knowledge, gRPC (FM_PROTO_H2 = 2).
    pub const HTTP2: Protocols = Protocols(1 << 2);

    pub fn contains(self, p: Protocols) -> bool {
        self.0 & p.0 == p.0 && p.0 != 0
    }

    pub(crate) fn bits(self) -> u32 {
        self.0
    }
}

impl std::ops::BitOr for Protocols {
    type Output = Protocols;

    fn bitor(self, other: Protocols) -> Protocols {
        Protocols(self.0 | other.0)
    }
}

/// One route as the rule program has it, reduced to what tier K can look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteSpec {
    /// Rule id, reported back with the decision.
    pub route_id: u32,
    /// Required method (`GET`, `POST`, ...); `None` for any.
    pub method: Option<String>,
    pub path: PathMatch,
    /// The route also matches on headers, query or anything else beyond method and path.
    pub other_conditions: bool,
    /// Backend (cluster) the route forwards to, or `None` when its action needs the user
    /// tier (weighted split, rewrites, direct responses, ...).
    pub backend: Option<u32>,
    /// Which client protocols the backend can be handed: its own protocol.
    pub protocols: Protocols,
}

/// One entry of the kernel route table, as lowered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelRoute {
    pub route_id: u32,
    /// `None`: any method.
    pub method: Option<String>,
    pub path: PathMatch,
    /// `Some(backend)`: the kernel decides; `None`: punt to user space.
    pub backend: Option<u32>,
    /// Connection protocols the backend is decided for; others punt.
    pub protocols: Protocols,
}

impl KernelRoute {
    /// The backend the kernel decides for a connection speaking `protocol` (one of
    /// [`Protocols::HTTP1`], [`Protocols::HTTP2`]) when this route is the first match.
    pub fn backend_for(&self, protocol: Protocols) -> Option<u32> {
        self.backend.filter(|_| self.protocols.contains(protocol))
    }
}

/// Lowers routes (in rule order) to kernel table entries. Always succeeds: whatever does not
/// fit becomes a punt, and past the table size a final catch-all punt ends the table.
pub fn lower_routes(routes: &[RouteSpec]) -> Vec<KernelRoute> {
    let mut out = Vec::new();
    for r in routes {
        if out.len() == ROUTES_MAX - 1 {
            out.push(KernelRoute {
                route_id: r.route_id,
                method: None,
                path: PathMatch::Prefix(String::new()),
                backend: None,
                protocols: Protocols::NONE,
            });
            return out;
        }
        let method = match &r.method {
            Some(m) if m.len() > METHOD_MAX || m.is_empty() => None,
            other => other.clone(),
        };
        let mut exact_enough = method == r.method && !r.other_conditions;
        let path = match &r.path {
            PathMatch::Exact(p) if p.len() <= PATH_MAX => PathMatch::Exact(p.clone()),
            PathMatch::Prefix(p) if p.len() <= PATH_MAX => PathMatch::Prefix(p.clone()),
            PathMatch::Exact(p) | PathMatch::Prefix(p) => {
                exact_enough = false;
                PathMatch::Prefix(truncate(p, PATH_MAX).to_string())
            }
            PathMatch::Other => {
                exact_enough = false;
                PathMatch::Prefix(String::new())
            }
        };
        let backend = if exact_enough { r.backend } else { None };
        let catch_all = method.is_none() && path == PathMatch::Prefix(String::new());
        out.push(KernelRoute {
            route_id: r.route_id,
            method,
            path,
            backend,
            protocols: r.protocols,
        });
        if catch_all {
            // Nothing after a catch-all can match.
            break;
        }
    }
    out
}

/// Longest prefix of `s` of at most `max` bytes that ends on a char boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl KernelRoute {
    pub(crate) fn to_abi(&self) -> FmRoute {
        let mut r = FmRoute::default();
        if let Some(m) = &self.method {
            let b = m.as_bytes();
            let n = b.len().min(METHOD_MAX);
            r.method[..n].copy_from_slice(&b[..n]);
        }
        let (kind, p) = match &self.path {
            PathMatch::Exact(p) => (MATCH_EXACT, p.as_str()),
            PathMatch::Prefix(p) => (MATCH_PREFIX, p.as_str()),
            // lower_routes never emits Other; treat it as a catch-all punt to stay safe.
            PathMatch::Other => (MATCH_PREFIX, ""),
        };
        let p = truncate(p, PATH_MAX).as_bytes();
        r.path[..p.len()].copy_from_slice(p);
        r.path_len = p.len() as u32;
        r.kind = kind;
        match (self.backend, &self.path) {
            (Some(b), PathMatch::Exact(_) | PathMatch::Prefix(_)) => {
                r.action = ACT_BACKEND;
                r.backend = b;
            }
            _ => r.action = ACT_PUNT,
        }
        r.route_id = self.route_id;
        r.protos = self.protocols.bits();
        r
    }
}

/// The user-space reference of the kernel table: what the verdict program decides for
/// `method` and `path` (path without query). Used by tests and by the fallback check.
pub fn decide<'t>(table: &'t [KernelRoute], method: &str, path: &str) -> Option<&'t KernelRoute> {
    table.iter().find(|r| {
        let method_ok = r.method.as_deref().is_none_or(|m| m == method);
        let path_ok = match &r.path {
            PathMatch::Exact(p) => p == path,
            PathMatch::Prefix(p) => path.as_bytes().starts_with(p.as_bytes()),
            PathMatch::Other => true,
        };
        method_ok && path_ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: u32, method: Option<&str>, path: PathMatch, backend: Option<u32>) -> RouteSpec {
        RouteSpec {
            route_id: id,
            method: method.map(str::to_string),
            path,
            other_conditions: false,
            backend,
            protocols: Protocols::HTTP1,
        }
    }

    #[test]
    fn simple_routes_lower_to_backend_entries_in_order() {
        let t = lower_routes(&[
            spec(0, Some("GET"), PathMatch::Exact("/a".into()), Some(1)),
            spec(1, None, PathMatch::Prefix("/api/".into()), Some(2)),
        ]);
        assert_eq!(t.len(), 2);
        assert_eq!(decide(&t, "GET", "/a").and_then(|r| r.backend), Some(1));
        assert_eq!(decide(&t, "POST", "/a"), None);
        assert_eq!(
            decide(&t, "POST", "/api/x").and_then(|r| r.backend),
            Some(2)
        );
    }

    #[test]
    fn undecidable_routes_become_punts_that_shadow_later_rules() {
        let mut header_rule = spec(0, None, PathMatch::Prefix("/api/".into()), Some(1));
        header_rule.other_conditions = true;
        let t = lower_routes(&[
            header_rule,
            spec(1, None, PathMatch::Prefix("/".into()), Some(2)),
        ]);
        // /api/x might match the header rule: the kernel must not decide it.
        assert_eq!(decide(&t, "GET", "/api/x").map(|r| r.backend), Some(None));
        assert_eq!(decide(&t, "GET", "/b").and_then(|r| r.backend), Some(2));
    }

    #[test]
    fn regex_route_punts_everything_after_it() {
        let t = lower_routes(&[
            spec(0, None, PathMatch::Other, Some(1)),
            spec(1, None, PathMatch::Prefix("/".into()), Some(2)),
        ]);
        assert_eq!(t.len(), 1, "nothing after a catch-all punt");
        assert_eq!(decide(&t, "GET", "/x").map(|r| r.backend), Some(None));
    }

    #[test]
    fn long_paths_and_methods_are_punted_conservatively() {
        let long = format!("/{}", "x".repeat(100));
        let t = lower_routes(&[
            spec(0, None, PathMatch::Exact(long.clone()), Some(1)),
            spec(
                1,
                Some("VERYLONGMETHOD"),
                PathMatch::Prefix("/m".into()),
                Some(2),
            ),
        ]);
        assert_eq!(decide(&t, "GET", &long).map(|r| r.backend), Some(None));
        // The long method is widened to any method and punted.
        assert_eq!(decide(&t, "GET", "/m").map(|r| r.backend), Some(None));
        let abi = t[0].to_abi();
        assert_eq!(abi.path_len as usize, PATH_MAX);
        assert_eq!(abi.action, ACT_PUNT);
    }

    #[test]
    fn table_overflow_ends_with_a_catch_all_punt() {
        let many: Vec<_> = (0..100)
            .map(|i| spec(i, None, PathMatch::Exact(format!("/{i}")), Some(i)))
            .collect();
        let t = lower_routes(&many);
        assert_eq!(t.len(), ROUTES_MAX);
        assert_eq!(decide(&t, "GET", "/5").and_then(|r| r.backend), Some(5));
        assert_eq!(decide(&t, "GET", "/99").map(|r| r.backend), Some(None));
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        let s = format!("/{}", "é".repeat(40));
        assert!(truncate(&s, PATH_MAX).len() <= PATH_MAX);
        assert!(s.starts_with(truncate(&s, PATH_MAX)));
    }
}
