//! The lowerings: the one RuleProgram turned into each cheaper tier's own form.
//!
//! [`compile`](crate::compile) runs every lowering; each returns plain data: the entries its tier
//! installs, and for every rule whether the tier decides it or hands it on, and why ([`Verdict`]).
//! The rule's tier (`Placement`), `flatmesh check --explain`, the admin `/rules` and the kernel
//! loader all read that output; nothing else predicts what a tier does.
//!
//! - [`kernel`]: tier K, the sk_skb verdict's route table (`fm_routes`) and the tcp splice;
//! - [`nic`]: tier N, a QingNiao Matcher image ([`crate::image`]) of every http listener.
//!
//! **First match wins across the whole table, in every tier.** A lowering keeps that order with
//! *supersets*: a route the tier cannot decide still gets an entry, one that matches at least
//! every request the route could match and hands it to the user tier. So whenever a lower tier
//! answers, no earlier route could have taken the request, and the answer is the user tier's.
//! A request no entry matches goes to the user tier too. The property test
//! (`tests/lowering.rs`) checks exactly that with each lowering's reference executor
//! ([`Lowering::decide`]).

pub mod kernel;
pub mod nic;

use serde::Serialize;

use crate::reason::Reason;
use crate::tier::Tier;
use crate::{ListenerId, Request, RouteId};

/// What one tier does with one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The tier decides the rule's requests itself (tier K: for connections speaking the
    /// route's cluster protocol).
    Decides,
    /// The tier hands the rule's requests to a more capable tier, for this reason.
    Host(Reason),
}

impl Verdict {
    pub fn decides(self) -> bool {
        self == Verdict::Decides
    }

    /// Why the tier does not decide the rule; `None` if it does.
    pub fn reason(self) -> Option<Reason> {
        match self {
            Verdict::Decides => None,
            Verdict::Host(r) => Some(r),
        }
    }

    /// The route-level reason `route` if there is one, else `table`: a route that the tier
    /// could never decide says why, not where the table stopped.
    pub(crate) fn host(route: Result<(), Reason>, table: Reason) -> Verdict {
        Verdict::Host(route.err().unwrap_or(table))
    }
}

impl Serialize for Verdict {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("decides", &self.decides())?;
        m.serialize_entry("why", &self.reason())?;
        m.end()
    }
}

/// One tier's lowering of a program, as the property test and `--explain` see it.
pub trait Lowering {
    /// The tier the lowering is for.
    fn tier(&self) -> Tier;

    /// What the tier does with route `route` of http listener `listener` (`None`: no such route).
    fn verdict(&self, listener: ListenerId, route: RouteId) -> Option<Verdict>;

    /// The reference executor: the route the tier's installed form decides for `req` on
    /// `listener`, or `None` when the tier hands the request to the user tier. Runs the
    /// lowering's output (the entries, the image), not the program.
    fn decide(&self, listener: ListenerId, req: &Request<'_>) -> Option<RouteId>;
}
