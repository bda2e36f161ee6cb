//! Runtime truth: where a rule runs on one running node, which may lack a tier the config
//! asks for (tier K needs root, kernel BTF and cgroup v2). The node fills [`NodeTiers`] from
//! what it attached; `/rules` and `flatmesh check --explain --admin` report through it.

use std::borrow::Cow;
use std::collections::BTreeSet;

use serde::Serialize;

use crate::program::CompiledRoute;
use crate::tier::{Placement, Tier};

/// What a running node has of tier K.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KernelRuntime {
    /// No running node: rules run where the config asks (`flatmesh check --explain`).
    #[default]
    AsConfigured,
    /// Tier K is attached. `verdict`: the sk_skb verdict program is (in-kernel L7 dispatch
    /// and the tcp splice run on it); `table_error`: why the route table could not be
    /// installed, if it could not.
    Attached {
        verdict: bool,
        table_error: Option<String>,
    },
    /// Tier K is not attached on this node, and why (what the host lacks, or the attach error).
    Off(String),
}

/// The tiers a node runs, as it found them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeTiers {
    pub kernel: KernelRuntime,
    /// The tcp listeners (by name) whose `connection_rate_limit` tier K enforces on this
    /// node: a socket filter on their listening sockets drops SYNs over the limit.
    pub kernel_conn_limits: BTreeSet<String>,
}

impl NodeTiers {
    /// Where a rule placed as `p` runs on this node, and why: `p` itself unless it asks for a
    /// tier the node does not run, in which case `fallback` (U7 for http routes, U4 for tcp).
    pub fn place(&self, p: &Placement, fallback: Tier) -> (Tier, Cow<'static, str>) {
        let off = |why: String| (fallback, Cow::Owned(why));
        if p.tier != Tier::Kernel {
            return (p.tier, Cow::Owned(p.reason.to_string()));
        }
        match &self.kernel {
            KernelRuntime::AsConfigured
            | KernelRuntime::Attached {
                verdict: true,
                table_error: None,
            } => (p.tier, Cow::Owned(p.reason.to_string())),
            KernelRuntime::Attached { verdict: false, .. } => off(
                "tier K is attached without its sk_skb verdict (the node started without kernel.l7_dispatch or kernel.tcp_splice); restart the node to attach it".into(),
            ),
            KernelRuntime::Attached {
                table_error: Some(e),
                ..
            } if fallback == Tier::UserL7 => {
                off(format!("the kernel's route table could not be installed: {e}"))
            }
            KernelRuntime::Attached { .. } => (p.tier, Cow::Owned(p.reason.to_string())),
            KernelRuntime::Off(why) => off(format!("tier K is not attached on this node: {why}")),
        }
    }

    /// Where an http route runs on this node (U7 when it cannot run in tier K here): the
    /// `tier` of `/rules`, `flatmesh check --explain` and the request metrics' `tier` label.
    pub fn place_route(&self, route: &CompiledRoute) -> (Tier, Cow<'static, str>) {
        self.place(&route.placement, Tier::UserL7)
    }

    /// The node's tiers as JSON, for `/rules`.
    pub fn to_json(&self) -> serde_json::Value {
        #[derive(Serialize)]
        struct Kernel<'a> {
            state: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            why: Option<&'a str>,
        }
        let kernel = match &self.kernel {
            KernelRuntime::AsConfigured => Kernel {
                state: "as configured",
                why: None,
            },
            KernelRuntime::Attached {
                verdict,
                table_error,
            } => Kernel {
                state: "attached",
                why: table_error.as_deref().or((!verdict).then_some(
                    "attached without its sk_skb verdict: no in-kernel L7 dispatch or tcp splice",
                )),
            },
            KernelRuntime::Off(why) => Kernel {
                state: "off",
                why: Some(why),
            },
        };
        serde_json::json!({ "kernel": kernel })
    }

    /// One line for `--explain`.
    pub fn describe(&self) -> String {
        match &self.kernel {
            KernelRuntime::AsConfigured => {
                "tiers as the config asks (no running node consulted)".into()
            }
            KernelRuntime::Attached {
                verdict: false, ..
            } => "this node: tier K attached without its sk_skb verdict (no in-kernel L7 dispatch or tcp splice)".into(),
            KernelRuntime::Attached {
                table_error: Some(e),
                ..
            } => format!("this node: tier K attached, but its route table could not be installed: {e}"),
            KernelRuntime::Attached { .. } => "this node: tier K attached".into(),
            KernelRuntime::Off(why) => format!("this node: tier K not attached: {why}"),
        }
    }
}
