//! HeteroK8s-Mesh's deployment choice (papers/004 §5.1): the node proxy of a server runs on
//! the host CPU or is offloaded to the server's DPU (`flatmesh pu` splits its network
//! namespace across the two). A pod asks with an annotation; the choice is per server, since
//! one node proxy serves every pod of the server.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;

use super::app::{is_ours, PodKey};
use super::cluster::{Cluster, Pu};

/// Annotation: where the pod wants its node's proxy: `host` (default) or `dpu`.
pub const PROXY_PU_ANNOTATION: &str = "flatmesh.io/proxy-pu";

/// Where a server's node proxy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyPu {
    Host,
    Dpu,
}

/// The node proxy of one server (a host node and its SmartNIC/DPU nodes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProxyChoice {
    /// The host node.
    pub host: String,
    pub pu: ProxyPu,
    /// The DPU (or SmartNIC) node it runs on, when `pu` is `dpu`.
    pub dpu: Option<String>,
    /// Why, in a sentence.
    pub reason: String,
}

/// For each server that runs pods of ours: on the DPU when at least one of its pods asks
/// `dpu` and none asks `host`, and the server has a DPU or SmartNIC node; else on the host
/// (HeteroK8s-Mesh falls back to the CPU when the DPU is missing). `nodes` are the pods' nodes
/// (bound or just planned).
pub fn proxy_choices(
    cluster: &Cluster,
    pods: &[Pod],
    nodes: &HashMap<PodKey, String>,
) -> Vec<ProxyChoice> {
    // Host node of every node of the cluster, and the first DPU/SmartNIC of every host.
    let mut host_of: BTreeMap<&str, &str> = BTreeMap::new();
    let mut dpu_of: BTreeMap<&str, &str> = BTreeMap::new();
    for (id, name) in &cluster.node_names {
        let server = id.split('/').next().unwrap_or_default();
        let host = cluster
            .node_names
            .get(&format!("{server}/host"))
            .map(String::as_str)
            .unwrap_or(name.as_str());
        host_of.insert(name.as_str(), host);
        if cluster.pus.get(name) != Some(&Pu::Host) {
            dpu_of.entry(host).or_insert(name.as_str());
        }
    }
    // Per host: (pods asking dpu, pods asking host, pods asking something else).
    type Asks = (Vec<String>, Vec<String>, Vec<String>);
    let mut asks: BTreeMap<&str, Asks> = BTreeMap::new();
    for pod in pods.iter().filter(|p| is_ours(p)) {
        let key = PodKey::of(pod);
        let Some(host) = nodes.get(&key).and_then(|n| host_of.get(n.as_str())) else {
            continue;
        };
        let ask = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(PROXY_PU_ANNOTATION))
            .map(|v| v.trim().to_string());
        let entry = asks.entry(host).or_default();
        match ask.as_deref() {
            Some("dpu") => entry.0.push(key.to_string()),
            None | Some("host") => entry.1.push(key.to_string()),
            Some(other) => entry.2.push(format!("{key} ({other:?})")),
        }
    }
    asks.into_iter()
        .map(|(host, (dpu, on_host, bad))| {
            let (pu, node, reason) = match (dpu.is_empty(), on_host.is_empty(), dpu_of.get(host)) {
                (true, _, _) => (ProxyPu::Host, None, "no pod asks for the DPU".to_string()),
                (false, false, _) => (
                    ProxyPu::Host,
                    None,
                    format!("pods disagree: {} ask dpu, {} host (or nothing)", dpu.join(", "), on_host.join(", ")),
                ),
                (false, true, None) => (
                    ProxyPu::Host,
                    None,
                    format!("{} ask dpu but the server has no DPU or SmartNIC node: on the host CPU instead", dpu.join(", ")),
                ),
                (false, true, Some(d)) => (
                    ProxyPu::Dpu,
                    Some(d.to_string()),
                    format!("{} ask dpu", dpu.join(", ")),
                ),
            };
            let reason = match bad.is_empty() {
                true => reason,
                false => format!(
                    "{reason}; {PROXY_PU_ANNOTATION} must be host or dpu, ignored on {}",
                    bad.join(", ")
                ),
            };
            ProxyChoice {
                host: host.to_string(),
                pu,
                dpu: node,
                reason,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::app::tests::pod;
    use crate::schedule::cluster::cluster_from_nodes;
    use crate::schedule::cluster::tests::nodes;

    #[test]
    fn dpu_when_asked_and_present_else_host() {
        let cluster = cluster_from_nodes("k8s", &nodes(), &Default::default());
        let mk = |name: &str, ask: Option<&str>| {
            let mut annotations = vec![];
            if let Some(a) = ask {
                annotations.push((PROXY_PU_ANNOTATION, a));
            }
            pod("ns", name, &annotations)
        };
        let pods = vec![
            mk("p1", Some("dpu")),
            mk("p2", Some("dpu")),
            mk("p3", Some("dpu")),
            mk("p4", Some("gpu")),
        ];
        // p1 on host a, p2 on a's SmartNIC; p3 on b (no DPU); p4 nowhere yet.
        let nodes = HashMap::from([
            (PodKey::of(&pods[0]), "a".to_string()),
            (PodKey::of(&pods[1]), "a-nic".to_string()),
            (PodKey::of(&pods[2]), "b".to_string()),
        ]);
        let choices = proxy_choices(&cluster, &pods, &nodes);
        assert_eq!(choices.len(), 2);
        assert_eq!(
            (
                choices[0].host.as_str(),
                choices[0].pu,
                choices[0].dpu.as_deref()
            ),
            ("a", ProxyPu::Dpu, Some("a-nic"))
        );
        assert_eq!(
            (choices[1].host.as_str(), choices[1].pu),
            ("b", ProxyPu::Host)
        );
        assert!(
            choices[1].reason.contains("no DPU"),
            "{}",
            choices[1].reason
        );
        // One pod of server a that wants the host keeps the proxy there.
        let mut pods = pods;
        pods.push(mk("p5", None));
        let mut nodes = nodes;
        nodes.insert(PodKey::of(&pods[4]), "a".into());
        nodes.insert(PodKey::of(&pods[3]), "a".into());
        let choices = proxy_choices(&cluster, &pods, &nodes);
        assert_eq!(choices[0].pu, ProxyPu::Host);
        assert!(
            choices[0].reason.contains("disagree")
                && choices[0].reason.contains("ignored on ns/p4"),
            "{}",
            choices[0].reason
        );
    }
}
