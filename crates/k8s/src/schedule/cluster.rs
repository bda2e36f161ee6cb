//! The API's Nodes as E3's cluster (`flatmesh_control::model::ClusterSpec`): every host node
//! with the SmartNIC/DPU nodes that name it is one server (E3's fault domain), racks come from
//! a label, capacities from the node's allocatable cpu and memory less what pods the scheduler
//! does not place already request. A pure function.
//!
//! E3 names its nodes `RACK-sI/host` and `RACK-sI/nicK` (`flatmesh_control::topology`); a
//! [`Cluster`] keeps which Kubernetes node each of those is. Servers are taken in host-name
//! order within a rack, racks in name order, a server's SmartNICs in name order, so the same
//! nodes always give the same cluster, and its YAML ([`Cluster::yaml`]) given to
//! `flatmesh place --cluster` gives the same ids.

use std::collections::BTreeMap;

use flatmesh_control::model::{
    ClusterSpec, CoreClass, NodeSpec, RackSpec, ServerGroup, ServerType,
};
use k8s_openapi::api::core::v1::Node;

use super::quantity;

/// Label: the processing unit a node is: `host`, `smartnic` or `dpu`. Nodes without it are not
/// the scheduler's.
pub const PU_LABEL: &str = "flatmesh.io/pu";
/// Label: the rack of a host node (and of its SmartNICs); `rack0` when absent.
pub const RACK_LABEL: &str = "flatmesh.io/rack";
/// Annotation of a SmartNIC/DPU node: the name of its host node.
pub const HOST_ANNOTATION: &str = "flatmesh.io/host";
/// Annotation: the node's cores, instead of its `status.allocatable.cpu`.
pub const CORES_ANNOTATION: &str = "flatmesh.io/cores";
/// Annotation: `beefy` or `wimpy` (E3's core classes; which column of Table 1 a microservice
/// costs). Default: `beefy` for a host, `wimpy` for a SmartNIC or DPU.
pub const CORE_ANNOTATION: &str = "flatmesh.io/core";
/// Annotations of E3's energy and cost model (Table 4); defaults are Table 4's Type1-SmartNIC
/// host and LiquidIO figures.
pub const IDLE_WATTS_ANNOTATION: &str = "flatmesh.io/idle-watts";
pub const PEAK_WATTS_ANNOTATION: &str = "flatmesh.io/peak-watts";
pub const COST_ANNOTATION: &str = "flatmesh.io/cost-usd";
/// Annotation: the bandwidth of the node's own ports. Default: 20 for a SmartNIC/DPU and for a
/// host without one; 0 for a host with SmartNICs (E3 §3.2: traffic reaches it through them).
pub const BANDWIDTH_ANNOTATION: &str = "flatmesh.io/bandwidth-gbps";

/// A processing unit, from [`PU_LABEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pu {
    Host,
    Smartnic,
    Dpu,
}

impl Pu {
    pub fn parse(value: &str) -> Option<Pu> {
        match value {
            "host" => Some(Pu::Host),
            "smartnic" => Some(Pu::Smartnic),
            "dpu" => Some(Pu::Dpu),
            _ => None,
        }
    }
}

/// Cores and memory that pods the scheduler does not place already request on a node.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reserved {
    pub cores: f64,
    pub memory_mb: f64,
}

/// The cluster E3 places on, and which Kubernetes node each of its nodes is.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub spec: ClusterSpec,
    /// E3 node id (`rack0-s0/host`) -> Kubernetes node name.
    pub node_names: BTreeMap<String, String>,
    /// Kubernetes node name -> its processing unit.
    pub pus: BTreeMap<String, Pu>,
    /// Kubernetes node name -> its `InternalIP` (where its agent's heartbeats come from).
    pub addresses: BTreeMap<String, std::net::IpAddr>,
    /// Nodes left out, and why (one line each, for the log).
    pub warnings: Vec<String>,
}

impl Cluster {
    /// The cluster as a `flatmesh place --cluster FILE` file.
    pub fn yaml(&self) -> String {
        // A ClusterSpec is plain data (strings, numbers, maps): serializing cannot fail.
        serde_norway::to_string(&self.spec).unwrap_or_default()
    }

    /// The E3 node id of Kubernetes node `name`.
    pub fn node_id(&self, name: &str) -> Option<&str> {
        self.node_names
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(id, _)| id.as_str())
    }
}

/// One node's figures, read and checked.
struct Unit {
    name: String,
    pu: Pu,
    rack: String,
    host: Option<String>,
    spec: NodeSpec,
    /// Whether the bandwidth was given (a host's default depends on its SmartNICs).
    bandwidth_given: bool,
    address: Option<std::net::IpAddr>,
}

/// The cluster of `nodes` (those with [`PU_LABEL`] that are not cordoned), with `reserved`
/// (by node name) taken off their capacity. `name` names the cluster.
pub fn cluster_from_nodes(
    name: &str,
    nodes: &[Node],
    reserved: &BTreeMap<String, Reserved>,
) -> Cluster {
    let mut warnings = Vec::new();
    let mut units: Vec<Unit> = Vec::new();
    for node in nodes {
        match read_unit(node, reserved) {
            Ok(Some(unit)) => units.push(unit),
            Ok(None) => {}
            Err(why) => warnings.push(why),
        }
    }
    units.sort_by(|a, b| a.name.cmp(&b.name));
    let hosts: BTreeMap<&str, &Unit> = units
        .iter()
        .filter(|u| u.pu == Pu::Host)
        .map(|u| (u.name.as_str(), u))
        .collect();
    // Host name -> its SmartNICs, in name order.
    let mut nics: BTreeMap<&str, Vec<&Unit>> = BTreeMap::new();
    for unit in units.iter().filter(|u| u.pu != Pu::Host) {
        match unit.host.as_deref() {
            Some(host) if hosts.contains_key(host) => nics.entry(host).or_default().push(unit),
            Some(host) => warnings.push(format!(
                "node {} is left out: its host node {host:?} ({HOST_ANNOTATION}) is not a node labelled {PU_LABEL}=host",
                unit.name
            )),
            None => warnings.push(format!(
                "node {} is left out: a SmartNIC or DPU node needs the annotation {HOST_ANNOTATION}: HOST_NODE (E3 places by server: a host and its SmartNICs)",
                unit.name
            )),
        }
    }
    let mut racks: BTreeMap<&str, Vec<&Unit>> = BTreeMap::new();
    for host in hosts.values() {
        racks.entry(host.rack.as_str()).or_default().push(host);
    }
    let mut spec = ClusterSpec {
        name: name.to_string(),
        server_types: BTreeMap::new(),
        racks: Vec::new(),
    };
    let mut node_names = BTreeMap::new();
    for (rack, hosts) in racks {
        let mut servers = Vec::new();
        for (ordinal, host) in hosts.iter().enumerate() {
            let server = format!("{rack}-s{ordinal}");
            let mut own: Vec<&Unit> = Vec::new();
            for nic in nics.remove(host.name.as_str()).unwrap_or_default() {
                match own.first() {
                    // E3's server type has one SmartNIC model, so all of a server's must agree.
                    Some(first) if first.spec != nic.spec => warnings.push(format!(
                        "node {} is left out: its cores, memory, watts, cost or bandwidth differ from {}, another SmartNIC of host {}; E3 models a server's SmartNICs as identical",
                        nic.name, first.name, host.name
                    )),
                    _ => own.push(nic),
                }
            }
            let mut host_spec = host.spec.clone();
            if !own.is_empty() && !host.bandwidth_given {
                host_spec.bandwidth_gbps = 0.0;
            }
            node_names.insert(format!("{server}/host"), host.name.clone());
            for (k, nic) in own.iter().enumerate() {
                node_names.insert(format!("{server}/nic{k}"), nic.name.clone());
            }
            spec.server_types.insert(
                host.name.clone(),
                ServerType {
                    description: Some(format!("Kubernetes node {}", host.name)),
                    host: host_spec,
                    smartnic: own.first().map(|n| n.spec.clone()),
                    smartnic_count: own.len() as u32,
                },
            );
            servers.push(ServerGroup {
                server_type: host.name.clone(),
                count: 1,
            });
        }
        spec.racks.push(RackSpec {
            name: rack.to_string(),
            servers,
        });
    }
    let placed: Vec<&Unit> = node_names
        .values()
        .filter_map(|n| units.iter().find(|u| &u.name == n))
        .collect();
    let pus = placed.iter().map(|u| (u.name.clone(), u.pu)).collect();
    let addresses = placed
        .iter()
        .filter_map(|u| Some((u.name.clone(), u.address?)))
        .collect();
    Cluster {
        spec,
        node_names,
        pus,
        addresses,
        warnings,
    }
}

/// A node's figures; `None` when it is not the scheduler's (no PU label, or cordoned).
fn read_unit(node: &Node, reserved: &BTreeMap<String, Reserved>) -> Result<Option<Unit>, String> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let annotations = node.metadata.annotations.clone().unwrap_or_default();
    let Some(pu) = labels.get(PU_LABEL) else {
        return Ok(None);
    };
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Ok(None);
    }
    let left_out = |why: String| format!("node {name} is left out: {why}");
    let pu = Pu::parse(pu).ok_or_else(|| {
        left_out(format!(
            "{PU_LABEL}={pu:?} is not a processing unit; use host, smartnic or dpu"
        ))
    })?;
    let number = |key: &str, default: f64| -> Result<f64, String> {
        match annotations.get(key) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
                _ => Err(left_out(format!(
                    "annotation {key}={v:?} is not a non-negative number"
                ))),
            },
        }
    };
    let allocatable = |resource: &str| -> Result<f64, String> {
        let status = node.status.as_ref();
        let value = status
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(resource))
            .or_else(|| {
                status
                    .and_then(|s| s.capacity.as_ref())
                    .and_then(|c| c.get(resource))
            })
            .ok_or_else(|| left_out(format!("it has no status.allocatable.{resource}")))?;
        quantity::parse(&value.0)
            .map_err(|e| left_out(format!("status.allocatable.{resource}: {e}")))
    };
    let taken = reserved.get(&name).copied().unwrap_or_default();
    let cores = match annotations.get(CORES_ANNOTATION) {
        Some(_) => number(CORES_ANNOTATION, 0.0)?,
        None => allocatable("cpu")?,
    } - taken.cores;
    let memory_mb = (allocatable("memory")? / (1024.0 * 1024.0) - taken.memory_mb).floor();
    if cores <= 0.0 || memory_mb < 1.0 {
        return Err(left_out(format!(
            "no cores or memory left for the scheduler ({cores:.2} cores, {memory_mb} MB after {:.2} cores and {} MB that other pods request)",
            taken.cores, taken.memory_mb
        )));
    }
    let core = match annotations.get(CORE_ANNOTATION).map(String::as_str) {
        None if pu == Pu::Host => CoreClass::Beefy,
        None => CoreClass::Wimpy,
        Some("beefy") => CoreClass::Beefy,
        Some("wimpy") => CoreClass::Wimpy,
        Some(other) => {
            return Err(left_out(format!(
                "annotation {CORE_ANNOTATION}={other:?}: use beefy or wimpy"
            )))
        }
    };
    // Table 4: the host of a Type1-SmartNIC server, and its LiquidIO II.
    let (idle, peak, cost) = match pu {
        Pu::Host => (83.0, 201.0, 4500.0),
        Pu::Smartnic | Pu::Dpu => (15.0, 21.0, 150.0),
    };
    let spec = NodeSpec {
        core,
        cores,
        memory_mb: memory_mb as u64,
        idle_watts: number(IDLE_WATTS_ANNOTATION, idle)?,
        peak_watts: number(PEAK_WATTS_ANNOTATION, peak)?,
        cost_usd: number(COST_ANNOTATION, cost)?,
        bandwidth_gbps: number(BANDWIDTH_ANNOTATION, 20.0)?,
    };
    if spec.peak_watts < spec.idle_watts {
        return Err(left_out(format!(
            "{PEAK_WATTS_ANNOTATION} {} is below {IDLE_WATTS_ANNOTATION} {}; peak power includes idle power",
            spec.peak_watts, spec.idle_watts
        )));
    }
    Ok(Some(Unit {
        rack: labels
            .get(RACK_LABEL)
            .cloned()
            .unwrap_or_else(|| "rack0".into()),
        host: annotations.get(HOST_ANNOTATION).cloned(),
        bandwidth_given: annotations.contains_key(BANDWIDTH_ANNOTATION),
        address: internal_ip(node),
        name,
        pu,
        spec,
    }))
}

/// The node's first `InternalIP` that parses.
fn internal_ip(node: &Node) -> Option<std::net::IpAddr> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    addresses
        .iter()
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse().ok())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use flatmesh_control::model::parse_cluster;
    use flatmesh_control::topology::{NodeKind, Topology};

    /// A node as the test of the API server creates it.
    pub(crate) fn node(
        name: &str,
        labels: &[(&str, &str)],
        annotations: &[(&str, &str)],
        cpu: &str,
        memory: &str,
    ) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "labels": labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            },
            "status": {"allocatable": {"cpu": cpu, "memory": memory}},
        }))
        .unwrap()
    }

    /// Two servers: `a` with SmartNIC `a-nic`, `b` alone; a node without the PU label.
    pub(crate) fn nodes() -> Vec<Node> {
        vec![
            node("b", &[(PU_LABEL, "host")], &[], "12", "64Gi"),
            node(
                "a-nic",
                &[(PU_LABEL, "smartnic")],
                &[(HOST_ANNOTATION, "a")],
                "12",
                "4Gi",
            ),
            node("a", &[(PU_LABEL, "host")], &[], "12", "64Gi"),
            node("other", &[], &[], "4", "8Gi"),
        ]
    }

    #[test]
    fn hosts_and_their_smartnics_become_servers() {
        let cluster = cluster_from_nodes("k8s", &nodes(), &BTreeMap::new());
        assert!(cluster.warnings.is_empty(), "{:?}", cluster.warnings);
        let ids: Vec<(&str, &str)> = cluster
            .node_names
            .iter()
            .map(|(id, n)| (id.as_str(), n.as_str()))
            .collect();
        assert_eq!(
            ids,
            vec![
                ("rack0-s0/host", "a"),
                ("rack0-s0/nic0", "a-nic"),
                ("rack0-s1/host", "b")
            ]
        );
        // Its YAML is a cluster `flatmesh place` takes, with the same node ids and figures.
        let spec = parse_cluster("k8s.yaml", &cluster.yaml()).unwrap();
        let topo = Topology::build(&spec).unwrap();
        let got: Vec<(&str, NodeKind, f64, u64)> = topo
            .nodes
            .iter()
            .map(|n| (n.id.as_str(), n.kind, n.cores, n.memory_mb))
            .collect();
        assert_eq!(
            got,
            vec![
                ("rack0-s0/host", NodeKind::Host, 12.0, 65536),
                ("rack0-s0/nic0", NodeKind::Smartnic, 12.0, 4096),
                ("rack0-s1/host", NodeKind::Host, 12.0, 65536),
            ]
        );
        // A host with a SmartNIC has no ports of its own; one without keeps 20 Gb/s.
        assert_eq!(topo.servers[0].bandwidth_gbps, 20.0);
        assert_eq!(topo.servers[1].bandwidth_gbps, 20.0);
        assert_eq!(topo.nodes[1].core, CoreClass::Wimpy);
        assert_eq!(cluster.pus["a-nic"], Pu::Smartnic);
        assert_eq!(cluster.node_id("b"), Some("rack0-s1/host"));
    }

    #[test]
    fn racks_annotations_and_reservations() {
        let mut nodes = nodes();
        nodes.push(node(
            "c",
            &[(PU_LABEL, "host"), (RACK_LABEL, "r1")],
            &[
                (CORES_ANNOTATION, "24"),
                (CORE_ANNOTATION, "wimpy"),
                (BANDWIDTH_ANNOTATION, "40"),
            ],
            "2",
            "2048Mi",
        ));
        let reserved = BTreeMap::from([(
            "b".to_string(),
            Reserved {
                cores: 2.5,
                memory_mb: 1024.0,
            },
        )]);
        let cluster = cluster_from_nodes("k8s", &nodes, &reserved);
        let topo = Topology::build(&parse_cluster("k8s.yaml", &cluster.yaml()).unwrap()).unwrap();
        assert_eq!(cluster.node_names["r1-s0/host"], "c");
        let c = &topo.nodes[topo.node_index("r1-s0/host").unwrap()];
        assert_eq!(
            (c.cores, c.memory_mb, c.core),
            (24.0, 2048, CoreClass::Wimpy)
        );
        let b = &topo.nodes[topo.node_index("rack0-s1/host").unwrap()];
        assert_eq!((b.cores, b.memory_mb), (9.5, 64 * 1024 - 1024));
        assert_eq!(topo.racks.len(), 2);
    }

    #[test]
    fn bad_nodes_are_left_out_with_a_reason() {
        let nodes = vec![
            node("a", &[(PU_LABEL, "host")], &[], "12", "64Gi"),
            node("gpu", &[(PU_LABEL, "gpu")], &[], "12", "64Gi"),
            node("orphan", &[(PU_LABEL, "dpu")], &[], "8", "16Gi"),
            node(
                "lost",
                &[(PU_LABEL, "dpu")],
                &[(HOST_ANNOTATION, "nowhere")],
                "8",
                "16Gi",
            ),
            node("weird", &[(PU_LABEL, "host")], &[], "lots", "64Gi"),
            node(
                "hot",
                &[(PU_LABEL, "host")],
                &[(PEAK_WATTS_ANNOTATION, "1")],
                "4",
                "1Gi",
            ),
            node("full", &[(PU_LABEL, "host")], &[], "1", "1Gi"),
            node(
                "a-nic0",
                &[(PU_LABEL, "dpu")],
                &[(HOST_ANNOTATION, "a")],
                "8",
                "16Gi",
            ),
            node(
                "a-nic1",
                &[(PU_LABEL, "dpu")],
                &[(HOST_ANNOTATION, "a")],
                "4",
                "16Gi",
            ),
        ];
        let reserved = BTreeMap::from([(
            "full".to_string(),
            Reserved {
                cores: 1.0,
                memory_mb: 0.0,
            },
        )]);
        let cluster = cluster_from_nodes("k8s", &nodes, &reserved);
        let all = cluster.warnings.join("\n");
        for (node, why) in [
            ("gpu", "use host, smartnic or dpu"),
            ("orphan", HOST_ANNOTATION),
            ("lost", "\"nowhere\""),
            ("weird", "not a quantity"),
            ("hot", "below"),
            ("full", "no cores or memory left"),
            ("a-nic1", "identical"),
        ] {
            assert!(
                cluster
                    .warnings
                    .iter()
                    .any(|w| w.starts_with(&format!("node {node} ")) && w.contains(why)),
                "{node}: {all}"
            );
        }
        assert_eq!(cluster.node_names.len(), 2, "{:?}", cluster.node_names);
        assert_eq!(cluster.pus["a-nic0"], Pu::Dpu);
    }
}
