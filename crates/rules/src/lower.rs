//! The seam where other tiers' backends plug in: each lowers the same RuleProgram to its own form
//! (issue 4: eBPF map entries for tier K; issue 5: QingNiao RAM/CAM images for tier N).
//!
//! One rule a lowering must keep: first match wins across the WHOLE table. A route eligible for
//! tier K that sits after a U7-only route cannot be decided in the kernel, because a request
//! matching both belongs to the earlier route. [`RuleProgram::decidable_prefix`] gives the
//! routes a tier may decide on its own: the longest run of eligible routes from the top. A
//! request none of them matches must fall through to the user tier, which gives the same answer.

use crate::program::{CompiledRoute, RuleProgram, TableKind, TcpRule};
use crate::tier::Tier;
use crate::ListenerId;

/// A backend for one tier.
pub trait Lowering {
    /// What the backend installs: map entries, a table image, ...
    type Output;
    type Error: std::error::Error;

    /// The tier this backend runs.
    fn tier(&self) -> Tier;

    /// Lower every rule the tier may decide (see [`RuleProgram::decidable_prefix`]).
    fn lower(&self, program: &RuleProgram) -> Result<Self::Output, Self::Error>;
}

/// A listener's rules that one tier may decide.
#[derive(Debug, Clone, Copy)]
pub enum Decidable<'p> {
    /// The tcp listener's only rule, if the tier can run it.
    Tcp(Option<&'p TcpRule>),
    /// The longest run of http routes, from the first, that the tier can run.
    Http(&'p [CompiledRoute]),
}

impl RuleProgram {
    /// The rules of `listener` that `tier` can decide without breaking first-match order.
    pub fn decidable_prefix(&self, listener: ListenerId, tier: Tier) -> Option<Decidable<'_>> {
        Some(match &self.listeners.get(listener)?.kind {
            TableKind::Tcp(rule) => {
                Decidable::Tcp(rule.placement.eligible.contains(tier).then_some(rule))
            }
            TableKind::Http(t) => {
                let n = t
                    .routes
                    .iter()
                    .take_while(|r| r.placement.eligible.contains(tier))
                    .count();
                Decidable::Http(&t.routes[..n])
            }
        })
    }
}
