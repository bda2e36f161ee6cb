//! flatmesh RuleProgram: routes compiled once into a small match-action IR, run by every tier.
//!
//! - [`compile`] turns a [`flatmesh_config::Config`] into a [`RuleProgram`]: one table per
//!   listener, each rule a match ([`RuleMatch`]) and an action ([`RouteAction`]);
//! - the [tier classifier](tier) tags every rule with the tiers that could run it and the one it runs in;
//! - [`RuleProgram::route`] is the user-tier (U7) executor the proxy calls on every request;
//! - [`RuleProgram::explain`] / [`RuleProgram::to_json`] show the program (`check --explain`, `/rules`);
//! - [`lower`] is the seam for the kernel (K) and NIC (N) backends.
//!
//! See docs/rules.md for the semantics and how to read `--explain`.

mod error;
mod explain;
mod index;
pub mod lower;
pub mod matcher;
mod program;
mod request;
mod split;
pub mod tier;

pub use error::RulesError;
pub use index::IndexStats;
pub use lower::{Decidable, Lowering};
pub use matcher::RuleMatch;
pub use program::{
    compile, ClusterInfo, CompiledRoute, HttpTable, ListenerTable, RouteAction, RuleProgram,
    TableKind, TcpRule,
};
pub use request::{strip_port, Headers, Request, Values};
pub use split::WeightedSplit;
pub use tier::{Placement, Tier, TierSet};

/// Index of a listener in `cfg.listeners`.
pub type ListenerId = usize;
/// Index of a cluster in `cfg.clusters`.
pub type ClusterId = usize;
/// Index of a route within its listener's routes.
pub type RouteId = usize;
