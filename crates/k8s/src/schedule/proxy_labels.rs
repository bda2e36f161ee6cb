//! HeteroK8s-Mesh's choice applied (issue 20, item 3): every round, the scheduler labels each
//! node of the cluster [`NODE_PROXY_LABEL`]`=on` or `off`, and two DaemonSets of
//! deploy/kubernetes/node.yaml follow the labels: `flatmesh-node` runs on host nodes not labelled
//! `off`, `flatmesh-node-dpu` on SmartNIC/DPU nodes labelled `on`. So each server runs exactly
//! one node proxy, where [`super::proxy::proxy_choices`] put it.
//!
//! [`node_proxy_labels`] (which label on which node) and [`label_changes`] (which patches) are
//! pure; [`patch_label`] is the write, a JSON merge patch of the node's labels by field manager
//! [`FIELD_MANAGER`]. Nothing is remembered between rounds but the writes the node watch does not
//! show yet: a failed patch is simply still a difference next round, and is retried.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

use super::bind::ScheduleError;
use super::cluster::{Pu, HOST_ANNOTATION, PU_LABEL};
use super::proxy::{ProxyChoice, ProxyPu};

/// Label the scheduler sets on every node with [`PU_LABEL`]: `on` on the node that runs its
/// server's node proxy, `off` on the others.
pub const NODE_PROXY_LABEL: &str = "flatmesh.io/node-proxy";
/// The field manager of the scheduler's label patches (`kubectl get node -o yaml
/// --show-managed-fields` names it).
pub const FIELD_MANAGER: &str = "flatmesh-scheduler";
pub const ON: &str = "on";
pub const OFF: &str = "off";

/// One label write: [`NODE_PROXY_LABEL`] of `node` from `was` to `value` (None: removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelChange {
    pub node: String,
    /// The host node of the node's server (the node itself for a host); None for a node that
    /// is not the scheduler's (no valid [`PU_LABEL`]) or a SmartNIC/DPU without a host.
    pub server: Option<String>,
    pub value: Option<&'static str>,
    pub was: Option<String>,
}

/// The [`NODE_PROXY_LABEL`] every node should carry, by node name (None: not at all).
///
/// - A host node: `off` when its server's proxy runs on its DPU (a [`ProxyPu::Dpu`] choice),
///   else `on`. A server without pods of ours has no choice: the host CPU, HeteroK8s-Mesh's
///   default.
/// - A SmartNIC or DPU node: `on` when it is the DPU a choice names, else `off`.
/// - A node without a valid [`PU_LABEL`] is not the scheduler's: no label (one it still
///   carries, from when it was, is removed; the host DaemonSet then runs there by default).
///
/// Cordoned nodes are labelled too (DaemonSet pods run on them): a cordoned DPU is never
/// chosen, so it gets `off` and its host `on`.
pub fn node_proxy_labels(
    nodes: &[Node],
    proxies: &[ProxyChoice],
) -> BTreeMap<String, Option<&'static str>> {
    let mut labels = BTreeMap::new();
    for node in nodes {
        let Some(name) = node.metadata.name.clone() else {
            continue;
        };
        let value = match pu_of(node) {
            None => None,
            Some(Pu::Host) => {
                let offloaded = proxies
                    .iter()
                    .any(|p| p.host == name && p.pu == ProxyPu::Dpu && p.dpu.is_some());
                Some(if offloaded { OFF } else { ON })
            }
            Some(Pu::Smartnic | Pu::Dpu) => {
                let chosen = proxies
                    .iter()
                    .any(|p| p.pu == ProxyPu::Dpu && p.dpu.as_deref() == Some(name.as_str()));
                Some(if chosen { ON } else { OFF })
            }
        };
        labels.insert(name, value);
    }
    labels
}

/// The patches that bring `nodes` to `desired`: every node whose label differs, `on` first (so
/// a server's new proxy starts before its old one stops), then `off`, then removals. `written`
/// are labels this scheduler patched that the watch may not show yet (node -> value): they
/// count as the node's.
pub fn label_changes(
    nodes: &[Node],
    desired: &BTreeMap<String, Option<&'static str>>,
    written: &HashMap<String, Option<String>>,
) -> Vec<LabelChange> {
    let mut changes: Vec<LabelChange> = nodes
        .iter()
        .filter_map(|node| {
            let name = node.metadata.name.as_deref()?;
            let value = *desired.get(name)?;
            let was = match written.get(name) {
                Some(written) => written.clone(),
                None => label_of(node),
            };
            if was.as_deref() == value {
                return None;
            }
            Some(LabelChange {
                node: name.to_string(),
                server: server_of(node),
                value,
                was,
            })
        })
        .collect();
    let order = |c: &LabelChange| match c.value {
        Some(ON) => 0,
        Some(_) => 1,
        None => 2,
    };
    changes.sort_by(|a, b| order(a).cmp(&order(b)).then_with(|| a.node.cmp(&b.node)));
    changes
}

/// The node's [`NODE_PROXY_LABEL`] as the API shows it.
pub fn label_of(node: &Node) -> Option<String> {
    node.metadata
        .labels
        .as_ref()?
        .get(NODE_PROXY_LABEL)
        .cloned()
}

/// Writes `change` to its node: a JSON merge patch of the one label (null removes it), by
/// [`FIELD_MANAGER`]. Needs `patch` on nodes.
pub async fn patch_label(client: &kube::Client, change: &LabelChange) -> Result<(), ScheduleError> {
    let api: Api<Node> = Api::all(client.clone());
    let patch = serde_json::json!({ "metadata": { "labels": { NODE_PROXY_LABEL: change.value } } });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    api.patch(&change.node, &params, &Patch::Merge(&patch))
        .await
        .map(|_| ())
        .map_err(|source| ScheduleError::Label {
            node: change.node.clone(),
            value: change.value.unwrap_or("(removed)"),
            source,
        })
}

/// The node's processing unit; None without a valid [`PU_LABEL`].
pub(crate) fn pu_of(node: &Node) -> Option<Pu> {
    Pu::parse(node.metadata.labels.as_ref()?.get(PU_LABEL)?)
}

/// The host node of the node's server.
pub(crate) fn server_of(node: &Node) -> Option<String> {
    match pu_of(node)? {
        Pu::Host => node.metadata.name.clone(),
        Pu::Smartnic | Pu::Dpu => node
            .metadata
            .annotations
            .as_ref()?
            .get(HOST_ANNOTATION)
            .cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::cluster::tests::node;

    fn choice(host: &str, dpu: Option<&str>) -> ProxyChoice {
        ProxyChoice {
            host: host.into(),
            pu: if dpu.is_some() {
                ProxyPu::Dpu
            } else {
                ProxyPu::Host
            },
            dpu: dpu.map(str::to_string),
            reason: String::new(),
        }
    }

    fn labelled(mut node: Node, value: &str) -> Node {
        node.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert(NODE_PROXY_LABEL.into(), value.into());
        node
    }

    /// Server a: host with two DPUs; server b: host and SmartNIC; server c: a host alone; a
    /// node that is not the scheduler's, one that was (it still has the label) and one with
    /// a bad PU label.
    fn nodes() -> Vec<Node> {
        let nic = |name: &str, pu: &str, host: &str| {
            node(
                name,
                &[(PU_LABEL, pu)],
                &[(HOST_ANNOTATION, host)],
                "8",
                "4Gi",
            )
        };
        vec![
            node("a", &[(PU_LABEL, "host")], &[], "12", "64Gi"),
            nic("a-dpu0", "dpu", "a"),
            nic("a-dpu1", "dpu", "a"),
            node("b", &[(PU_LABEL, "host")], &[], "12", "64Gi"),
            nic("b-nic", "smartnic", "b"),
            node("c", &[(PU_LABEL, "host")], &[], "12", "64Gi"),
            node("plain", &[], &[], "4", "8Gi"),
            labelled(node("was", &[], &[], "4", "8Gi"), OFF),
            node("gpu", &[(PU_LABEL, "gpu")], &[], "4", "8Gi"),
        ]
    }

    #[test]
    fn one_proxy_per_server_where_the_choice_puts_it() {
        let nodes = nodes();
        // a offloads to its first DPU, b stays on its host, c has no pods (no choice).
        let proxies = vec![choice("a", Some("a-dpu0")), choice("b", None)];
        let labels = node_proxy_labels(&nodes, &proxies);
        let got: Vec<(&str, Option<&str>)> = labels.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        assert_eq!(
            got,
            vec![
                ("a", Some(OFF)),
                ("a-dpu0", Some(ON)),
                ("a-dpu1", Some(OFF)),
                ("b", Some(ON)),
                ("b-nic", Some(OFF)),
                ("c", Some(ON)),
                ("gpu", None),
                ("plain", None),
                ("was", None),
            ]
        );
        // Exactly one `on` per server.
        for server in ["a", "b", "c"] {
            let on: Vec<&str> = nodes
                .iter()
                .filter(|n| server_of(n).as_deref() == Some(server))
                .filter_map(|n| n.metadata.name.as_deref())
                .filter(|n| labels[*n] == Some(ON))
                .collect();
            assert_eq!(on.len(), 1, "server {server}: {on:?}");
        }
        // A host choice that names no DPU keeps the host on.
        let labels = node_proxy_labels(&nodes, &[choice("a", None)]);
        assert_eq!((labels["a"], labels["a-dpu0"]), (Some(ON), Some(OFF)));
    }

    #[test]
    fn only_differences_are_patched_on_first() {
        let mut nodes = nodes();
        let desired = node_proxy_labels(&nodes, &[choice("a", Some("a-dpu0"))]);
        let changes = label_changes(&nodes, &desired, &HashMap::new());
        // (node, server, value, was)
        type Row<'a> = (&'a str, Option<&'a str>, Option<&'a str>, Option<&'a str>);
        let got: Vec<Row> = changes
            .iter()
            .map(|c| {
                (
                    c.node.as_str(),
                    c.server.as_deref(),
                    c.value,
                    c.was.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a-dpu0", Some("a"), Some(ON), None),
                ("b", Some("b"), Some(ON), None),
                ("c", Some("c"), Some(ON), None),
                ("a", Some("a"), Some(OFF), None),
                ("a-dpu1", Some("a"), Some(OFF), None),
                ("b-nic", Some("b"), Some(OFF), None),
                ("was", None, None, Some(OFF)),
            ]
        );
        // Once the nodes show them, nothing is left to patch ...
        for node in &mut nodes {
            let name = node.metadata.name.clone().unwrap();
            if let Some(Some(value)) = desired.get(&name) {
                *node = labelled(node.clone(), value);
            }
            if name == "was" {
                node.metadata.labels = None;
            }
        }
        assert_eq!(label_changes(&nodes, &desired, &HashMap::new()), vec![]);
        // ... and a write the watch does not show yet counts as made, both ways.
        let back = node_proxy_labels(&nodes, &[]);
        let written = HashMap::from([("a-dpu0".to_string(), Some(OFF.to_string()))]);
        let changes = label_changes(&nodes, &back, &written);
        let got: Vec<(&str, Option<&str>)> =
            changes.iter().map(|c| (c.node.as_str(), c.value)).collect();
        assert_eq!(got, vec![("a", Some(ON))]);
        let written = HashMap::from([("a".to_string(), Some(ON.to_string()))]);
        let desired_a = BTreeMap::from([("a".to_string(), Some(ON))]);
        assert_eq!(label_changes(&nodes, &desired_a, &written), vec![]);
    }
}
