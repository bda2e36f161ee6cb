//! Tiers of the data plane, and where each rule runs.
//!
//! DESIGN.md: whatever a cheaper tier can do runs there. A rule carries two facts, both read
//! from the lowerings ([`crate::lower`]): `eligible`, the tiers whose lowering can decide it
//! when the table has room, and `tier`, where it runs as the config asks.
//! `flatmesh check --explain` prints both so nobody mistakes eligibility for placement.

use serde::Serialize;

use crate::lower::kernel::KernelLowering;
use crate::lower::{Lowering, Verdict};
use crate::program::{ClusterInfo, ListenerTable, TableKind};
use crate::reason::Reason;

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

/// Where a rule could run, where it runs, and why not cheaper. Read from the lowerings'
/// output ([`crate::lower`]): nothing here predicts what a tier does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Every tier whose lowering can decide this rule when its table has room for it.
    pub eligible: TierSet,
    /// Where the rule runs, as the config asks (a node may lack a tier: see
    /// [`crate::NodeTiers`]). N is never a place a rule runs: the image is emitted, no NIC here
    /// runs it.
    pub tier: Tier,
    /// Why the rule runs in `tier`: what tier K does with it.
    pub reason: Reason,
}

/// Sets every rule's placement from the lowerings' verdicts.
pub(crate) fn place(
    listeners: &mut [ListenerTable],
    clusters: &[ClusterInfo],
    kernel: &KernelLowering,
) {
    for (lid, l) in listeners.iter_mut().enumerate() {
        match &mut l.kind {
            TableKind::Tcp(rule) => {
                let verdict = kernel
                    .tcp_verdict(lid)
                    .unwrap_or(Verdict::Host(Reason::TcpSpliceOff));
                rule.placement = Placement {
                    eligible: TierSet::of(&[Tier::Kernel, Tier::UserL4]),
                    tier: if verdict.decides() {
                        Tier::Kernel
                    } else {
                        Tier::UserL4
                    },
                    reason: verdict.reason().unwrap_or(Reason::KernelSplices),
                };
            }
            // Placed when compiled (`program::qnp_placement`): no lowering here decides it.
            TableKind::Qnp(_) => {}
            TableKind::Hbone(rule) => {
                rule.placement = Placement {
                    eligible: TierSet::of(&[Tier::UserL4]),
                    tier: Tier::UserL4,
                    reason: Reason::HboneListener,
                };
            }
            TableKind::Http(table) => {
                for r in &mut table.routes {
                    let mut eligible = TierSet::of(&[Tier::UserL7]);
                    if crate::lower::nic::check(r, table.paths).is_ok() {
                        eligible = eligible.with(Tier::Nic);
                    }
                    if crate::lower::kernel::check(r, clusters).is_ok() {
                        eligible = eligible.with(Tier::Kernel);
                    }
                    let verdict = kernel
                        .verdict(lid, r.id)
                        .unwrap_or(Verdict::Host(Reason::NoL7Dispatch));
                    r.placement = Placement {
                        eligible,
                        tier: if verdict.decides() {
                            Tier::Kernel
                        } else {
                            Tier::UserL7
                        },
                        reason: verdict.reason().unwrap_or(Reason::KernelDecides),
                    };
                    r.tier = r.placement.tier;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
