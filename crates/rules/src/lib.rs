//! flatmesh RuleProgram: routes compiled once into a small match-action IR, run by every tier.
//!
//! - [`compile`] turns a [`flatmesh_config::Config`] into a [`RuleProgram`]: one table per
//!   listener, each rule a match ([`RuleMatch`]) and an action ([`RouteAction`]);
//! - [`lower`] lowers the program to every cheaper tier, as plain data: the kernel's route
//!   table ([`lower::kernel`]) and the NIC image ([`lower::nic`], laid out by [`image`]), each
//!   with what it decides, what it hands on and why; `compile` runs them, and each rule's
//!   [`Placement`] (its [tier]) is read from their output;
//! - [`RuleProgram::route`] is the user-tier (U7) executor the proxy calls on every request,
//!   on the path as the listener's [`PathNormalization`] made it ([`RuleProgram::paths`]);
//! - [`RuleProgram::explain`] / [`RuleProgram::to_json`] show the program (`check --explain`,
//!   `/rules`), with the tiers a running node actually has ([`NodeTiers`]).
//!
//! See docs/rules.md for the semantics and how to read `--explain`.
#![forbid(unsafe_code)]

pub mod authz;
mod error;
mod explain;
pub mod fault;
pub mod image;
mod index;
pub mod lower;
pub mod matcher;
pub mod normalize;
mod program;
pub mod protobuf;
mod reason;
mod request;
mod runtime;
pub mod skipcheck;
mod split;
pub mod tier;

pub use authz::{AuthzDecision, ListenerAuthz, Peer};
pub use error::RulesError;
pub use fault::{AbortStatus, FaultAction, MirrorAction, Share};
pub use index::IndexStats;
pub use lower::{Lowering, Verdict};
pub use matcher::RuleMatch;
pub use normalize::{Normalized, PathNormalization, PathRejection};
pub use program::{
    compile, ClusterInfo, CompiledRoute, HboneRule, HttpTable, ListenerTable, QnpRule, RouteAction,
    RuleProgram, TableKind, TcpRule,
};
pub use reason::Reason;
pub use request::{is_valid_authority, strip_port, Headers, Request, Values};
pub use runtime::{KernelRuntime, NodeTiers};
pub use split::WeightedSplit;
pub use tier::{Placement, Tier, TierSet};

/// Index of a listener in `cfg.listeners`.
pub type ListenerId = usize;
/// Index of a cluster in `cfg.clusters`.
pub type ClusterId = usize;
/// Index of a route within its listener's routes.
pub type RouteId = usize;
