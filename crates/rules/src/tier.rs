//! Tiers of the data plane and the classifier that tags every rule with the cheapest one that can run it.
//!
//! DESIGN.md: whatever a cheaper tier can do runs there. A rule therefore carries two facts:
//! `eligible`, the set of tiers whose mechanism could decide it, and `tier`, where it runs
//! today. They differ while the kernel (issue 4) and NIC (issue 5) backends are not built:
//! `flatmesh check --explain` prints both so nobody mistakes eligibility for placement.

use flatmesh_config::Route;
use serde::Serialize;

/// A data-plane tier. Cost order (cheapest first) is [`Tier::BY_COST`]: N, K, U4, U7.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// eBPF in the kernel: sockmap redirect (L4) or sk_skb first-message dispatch (L7).
    Kernel,
    /// User-space L4 relay: no parsing.
    UserL4,
    /// User-space L7 executor: full HTTP, regex, headers, rewrites.
    UserL7,
    /// NIC/DPU table image (QingNiao RAM/CAM skip-and-check).
    Nic,
}

impl Tier {
    /// Every tier, cheapest first (the NIC spends no host CPU at all).
    pub const BY_COST: [Tier; 4] = [Tier::Nic, Tier::Kernel, Tier::UserL4, Tier::UserL7];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Kernel => "K",
            Tier::UserL4 => "U4",
            Tier::UserL7 => "U7",
            Tier::Nic => "N",
        }
    }

    fn bit(self) -> u8 {
        match self {
            Tier::Nic => 1,
            Tier::Kernel => 2,
            Tier::UserL4 => 4,
            Tier::UserL7 => 8,
        }
    }
}

impl Serialize for Tier {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of tiers (a 4-bit set; copying it is free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TierSet(u8);

impl TierSet {
    pub const EMPTY: TierSet = TierSet(0);

    pub fn of(tiers: &[Tier]) -> TierSet {
        TierSet(tiers.iter().fold(0, |bits, t| bits | t.bit()))
    }

    pub fn contains(self, tier: Tier) -> bool {
        self.0 & tier.bit() != 0
    }

    pub fn with(self, tier: Tier) -> TierSet {
        TierSet(self.0 | tier.bit())
    }

    /// Members, cheapest first.
    pub fn iter(self) -> impl Iterator<Item = Tier> {
        Tier::BY_COST.into_iter().filter(move |t| self.contains(*t))
    }

    /// The cheapest member, if any.
    pub fn cheapest(self) -> Option<Tier> {
        self.iter().next()
    }

    /// `N|K|U7`-style text, cheapest first.
    pub fn label(self) -> String {
        self.iter().map(Tier::as_str).collect::<Vec<_>>().join("|")
    }
}

impl Serialize for TierSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter().map(Tier::as_str))
    }
}

/// Where a rule could run, where it runs today, and why it cannot go cheaper.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Every tier whose mechanism could decide this rule.
    pub eligible: TierSet,
    /// Where the rule runs in this build.
    pub tier: Tier,
    /// One line for `--explain`: what limits the rule to the tiers in `eligible`.
    pub reason: &'static str,
}

/// Placement of a tcp listener's rule: it only picks a cluster for a connection, which the
/// kernel's sockmap redirect could do; today the user-space L4 relay does it.
pub fn classify_tcp() -> Placement {
    Placement {
        eligible: TierSet::of(&[Tier::Kernel, Tier::UserL4]),
        tier: Tier::UserL4,
        reason: "L4 only: kernel sockmap redirect eligible, user L4 relay today",
    }
}

/// Placement of an http route.
///
/// The test, in order, is "what is the first thing this rule needs that only the user tier has":
/// - anything that reads more than the request line (host, headers, query) needs a full HTTP
///   parser; the kernel's sk_skb dispatcher (issue 4) reads only the request line / `:path`;
/// - a regex needs an automaton, which neither eBPF nor a RAM/CAM image runs;
/// - rewriting headers, answering directly, retrying and per-request timeouts act on the
///   request or response itself, which a spliced-in-the-kernel connection never exposes again.
///
/// A rule that passes is decided by the first message: eligible for K. If it also names the
/// method, its whole match is a fixed-offset byte pattern over the request line
/// (`GET /api...`), which is exactly a skip-and-check rule (QingNiao §3.3): eligible for N.
/// Every http rule can run in U7, which is where all of them run today.
pub fn classify_http(route: &Route) -> Placement {
    use flatmesh_config::PathMatch;
    let user = |reason| Placement {
        eligible: TierSet::of(&[Tier::UserL7]),
        tier: Tier::UserL7,
        reason,
    };
    let m = &route.matches;
    if m.host.is_some() {
        return user("host match needs the full request head");
    }
    if !m.headers.is_empty() {
        return user("header match needs the full request head");
    }
    if !m.query.is_empty() {
        return user("query match needs URL decoding");
    }
    if matches!(m.path, Some(PathMatch::Regex(_))) {
        return user("regex runs only in the user tier");
    }
    if route.direct_response.is_some() {
        return user("direct response is answered by the user tier");
    }
    if !route.request_headers_to_add.is_empty()
        || !route.request_headers_to_remove.is_empty()
        || !route.response_headers_to_add.is_empty()
    {
        return user("header rewrite needs the user tier");
    }
    if route.retries.is_some() {
        return user("retries need the user tier");
    }
    if route.timeout.is_some() {
        return user("per-request timeout needs the user tier");
    }
    if m.method.is_some() {
        Placement {
            eligible: TierSet::of(&[Tier::Nic, Tier::Kernel, Tier::UserL7]),
            tier: Tier::UserL7,
            reason: "first message, method + path: K and N eligible, user tier today",
        }
    } else {
        Placement {
            eligible: TierSet::of(&[Tier::Kernel, Tier::UserL7]),
            tier: Tier::UserL7,
            reason: "first message, path only: K eligible, user tier today",
        }
    }
}

/// Entries in tier K's route table (`fm_routes`); the last one is kept for the closing punt.
const KERNEL_ROUTES_MAX: usize = 64;

/// Moves the rules the node's `kernel:` section hands to tier K there: a spliced tcp
/// listener's rule, and the routes of the L7 listener that the kernel's table decides. The
/// table mirrors the kernel crate's lowering: rule order, at most 63 entries, and nothing
/// after the first entry that matches every request (a catch-all or a regex with no method).
pub(crate) fn place_in_kernel(
    cfg: &flatmesh_config::Config,
    listeners: &mut [crate::ListenerTable],
) {
    use crate::matcher::PathCond;
    use crate::{RouteAction, TableKind};
    let l7 = cfg.kernel_l7_listener();
    for l in listeners.iter_mut() {
        match &mut l.kind {
            TableKind::Tcp(rule) if cfg.kernel_tcp_splice() => {
                rule.placement.tier = Tier::Kernel;
                rule.placement.reason =
                    "L4 only: spliced in the kernel (sk_skb), kernel.tcp_splice";
            }
            TableKind::Http(table) if Some(l.name.as_str()) == l7 => {
                for (i, r) in table.routes.iter_mut().enumerate() {
                    if i >= KERNEL_ROUTES_MAX - 1 {
                        break;
                    }
                    if matches!(r.action, RouteAction::Forward(_))
                        && r.placement.eligible.contains(Tier::Kernel)
                    {
                        r.placement.tier = Tier::Kernel;
                        r.placement.reason = "first request decided in the kernel (sk_skb), user tier when it cannot";
                        r.tier = Tier::Kernel;
                    }
                    let matches_all_paths = match &r.matches.path {
                        None | Some(PathCond::Regex(_)) => true,
                        Some(PathCond::Prefix(p)) => p.is_empty(),
                        Some(PathCond::Exact(_)) => false,
                    };
                    if r.matches.method.is_none() && matches_all_paths {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatmesh_config::{NamedMatch, PathMatch, RouteMatch};

    fn route(matches: RouteMatch) -> Route {
        // From YAML, so fields the config model gains later take their defaults.
        let mut r: Route = serde_norway::from_str("cluster: c").unwrap();
        r.matches = matches;
        r
    }

    #[test]
    fn tier_names() {
        let names: Vec<_> = Tier::BY_COST.iter().map(|t| t.as_str()).collect();
        assert_eq!(names, ["N", "K", "U4", "U7"]);
    }

    #[test]
    fn tierset_orders_cheapest_first() {
        let s = TierSet::of(&[Tier::UserL7, Tier::Kernel, Tier::Nic]);
        assert_eq!(s.label(), "N|K|U7");
        assert_eq!(s.cheapest(), Some(Tier::Nic));
        assert!(!s.contains(Tier::UserL4));
        assert_eq!(TierSet::EMPTY.cheapest(), None);
        assert_eq!(
            serde_json::to_value(s).unwrap(),
            serde_json::json!(["N", "K", "U7"])
        );
    }

    #[test]
    fn prefix_path_is_kernel_eligible_and_method_makes_it_nic_eligible() {
        let mut r = route(RouteMatch {
            path: Some(PathMatch::Prefix("/api".into())),
            ..Default::default()
        });
        let p = classify_http(&r);
        assert_eq!(p.eligible.label(), "K|U7");
        assert_eq!(p.tier, Tier::UserL7);
        r.matches.method = Some("GET".into());
        assert_eq!(classify_http(&r).eligible.label(), "N|K|U7");
        // A catch-all is decided by the first message too.
        assert_eq!(
            classify_http(&route(RouteMatch::default()))
                .eligible
                .cheapest(),
            Some(Tier::Kernel)
        );
    }

    #[test]
    fn anything_beyond_the_request_line_is_user_tier() {
        let named = NamedMatch {
            name: "x".into(),
            exact: Some("1".into()),
            prefix: None,
            present: None,
            regex: None,
        };
        let cases = [
            RouteMatch {
                host: Some("a.b".into()),
                ..Default::default()
            },
            RouteMatch {
                headers: vec![named.clone()],
                ..Default::default()
            },
            RouteMatch {
                query: vec![named],
                ..Default::default()
            },
            RouteMatch {
                path: Some(PathMatch::Regex("/.*".into())),
                ..Default::default()
            },
        ];
        for m in cases {
            let p = classify_http(&route(m.clone()));
            assert_eq!(p.eligible.label(), "U7", "{m:?}");
        }
        let mut r = route(RouteMatch::default());
        r.request_headers_to_remove = vec!["x".into()];
        assert_eq!(classify_http(&r).eligible.label(), "U7");
        let mut r = route(RouteMatch::default());
        r.cluster = None;
        r.direct_response = Some(flatmesh_config::DirectResponse {
            status: 200,
            body: String::new(),
        });
        assert_eq!(
            classify_http(&r).reason,
            "direct response is answered by the user tier"
        );
    }

    #[test]
    fn tcp_is_kernel_eligible_runs_in_u4() {
        let p = classify_tcp();
        assert_eq!(p.eligible.label(), "K|U4");
        assert_eq!(p.tier, Tier::UserL4);
    }
}
