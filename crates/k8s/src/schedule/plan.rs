//! The scheduling decision: Nodes and Pods in, the nodes of the pending pods out, by E3's HCM
//! (`flatmesh_control::placement::hcm`, the algorithm `flatmesh place` runs by default). A pure
//! function.
//!
//! Pods already bound keep their node: their instances are set down first and take their
//! share of the capacity, and HCM places the rest around them (a pending pod whose caller is
//! bound lands as close to it as HCM finds room). Apps are placed one after another in name
//! order (as E3's simulator deploys them): an app that does not fit leaves its pods pending
//! and the others are placed anyway. For one app on a cluster where nothing of it is bound yet,
//! the result is exactly `flatmesh place --algo hcm` of [`super::App::yaml`] on
//! [`super::Cluster::yaml`].

use std::collections::{BTreeMap, HashMap};

use flatmesh_control::placement::{hcm, State};
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;
use k8s_openapi::api::core::v1::{Node, Pod};

use super::app::{apps_from_pods, is_ours, PodKey};
use super::cluster::{cluster_from_nodes, Cluster, Pu, Reserved};
use super::proxy::{proxy_choices, ProxyChoice};
use super::quantity;

/// Where a pending pod goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub pod: PodKey,
    /// The Kubernetes node.
    pub node: String,
    /// The E3 instance the pod is (`NS/APP/STAGE-SHARD`).
    pub instance: String,
}

/// One round of the scheduler.
#[derive(Debug, Clone)]
pub struct Plan {
    pub cluster: Cluster,
    pub apps: Vec<super::App>,
    pub bindings: Vec<Binding>,
    /// Pending pods that stay pending, and why.
    pub unplaced: Vec<(PodKey, String)>,
    /// Where the node proxy of each host node with our pods runs (HeteroK8s-Mesh).
    pub proxies: Vec<ProxyChoice>,
    /// The node of every pod of ours once the bindings are made (the bound ones' and the
    /// new ones').
    pub placed: HashMap<PodKey, String>,
    /// The IPs of every pod of ours that has one (its `status.podIPs`): the addresses the
    /// nodes' load reports name.
    pub addresses: HashMap<std::net::IpAddr, PodKey>,
}

/// Places the pending pods of `schedulerName: flatmesh` on `nodes`. `bound` are bindings this
/// scheduler made that `pods` may not show yet (pod uid -> node): they count as bound.
pub fn plan(nodes: &[Node], pods: &[Pod], bound: &HashMap<String, String>) -> Plan {
    let node_of = |pod: &Pod| -> Option<String> {
        pod.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .or_else(|| {
                pod.metadata
                    .uid
                    .as_ref()
                    .and_then(|u| bound.get(u))
                    .cloned()
            })
    };
    let cluster = cluster_from_nodes("kubernetes", nodes, &reserved_by_others(pods));
    let apps = apps_from_pods(pods);
    let mut unplaced = apps.errors.clone();
    // Report only pending pods: a bound pod's app error is no news to it.
    let pending = |key: &PodKey| {
        pods.iter()
            .any(|p| PodKey::of(p) == *key && node_of(p).is_none())
    };
    unplaced.retain(|(key, _)| pending(key));
    let node_by_pod: HashMap<PodKey, String> = pods
        .iter()
        .filter(|p| is_ours(p))
        .filter_map(|p| Some((PodKey::of(p), node_of(p)?)))
        .collect();
    let mut bindings = Vec::new();
    let placed = place(&cluster, &apps.apps, &node_by_pod);
    match placed {
        Ok(per_app) => {
            for (app, result) in apps.apps.iter().zip(per_app) {
                match result {
                    Ok(app_bindings) => bindings.extend(app_bindings),
                    Err(why) => unplaced.extend(
                        app.pods
                            .values()
                            .filter(|k| !node_by_pod.contains_key(*k))
                            .map(|k| (k.clone(), why.clone())),
                    ),
                }
            }
        }
        Err(why) => {
            for app in &apps.apps {
                unplaced.extend(
                    app.pods
                        .values()
                        .filter(|k| !node_by_pod.contains_key(*k))
                        .map(|k| (k.clone(), why.clone())),
                );
            }
        }
    }
    let mut final_nodes = node_by_pod.clone();
    final_nodes.extend(bindings.iter().map(|b| (b.pod.clone(), b.node.clone())));
    let proxies = proxy_choices(&cluster, pods, &final_nodes);
    Plan {
        cluster,
        apps: apps.apps,
        bindings,
        unplaced,
        proxies,
        placed: final_nodes,
        addresses: pod_addresses(pods),
    }
}

/// Each IP of a pod of ours, and the pod.
fn pod_addresses(pods: &[Pod]) -> HashMap<std::net::IpAddr, PodKey> {
    pods.iter()
        .filter(|p| is_ours(p))
        .flat_map(|p| {
            let status = p.status.as_ref();
            let ips = status
                .and_then(|s| s.pod_ips.as_ref())
                .into_iter()
                .flatten()
                .map(|ip| ip.ip.as_str())
                .chain(status.and_then(|s| s.pod_ip.as_deref()));
            ips.filter_map(|ip| ip.parse().ok())
                .map(move |ip| (ip, PodKey::of(p)))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Per app: its new bindings, or why its pending pods stay pending. Err when the cluster
/// itself cannot be built (no node, say).
fn place(
    cluster: &Cluster,
    apps: &[super::App],
    node_by_pod: &HashMap<PodKey, String>,
) -> Result<Vec<Result<Vec<Binding>, String>>, String> {
    if cluster.node_names.is_empty() {
        return Err(format!(
            "no node to place on: label nodes {}=host (and SmartNIC/DPU nodes smartnic or dpu); docs/kubernetes.md, \"Scheduler\"",
            super::cluster::PU_LABEL
        ));
    }
    let spec = flatmesh_control::model::parse_cluster("kubernetes", &cluster.yaml())
        .map_err(|e| format!("the nodes do not make an E3 cluster: {e}"))?;
    let topo = Topology::build(&spec).map_err(|e| e.to_string())?;
    let specs: Vec<_> = apps.iter().map(|a| a.spec.clone()).collect();
    let wl = Workload::from_apps(&specs).map_err(|e| e.to_string())?;
    let mut st = State::new(&topo, &wl);
    // Pod of every instance, and the instances already bound (set down first, for every app).
    let mut pod_of: Vec<Option<&PodKey>> = vec![None; wl.instances.len()];
    for app in apps {
        for (id, key) in &app.pods {
            if let Some(i) = wl.instances.iter().position(|inst| &inst.id == id) {
                pod_of[i] = Some(key);
            }
        }
    }
    for (i, key) in pod_of.iter().enumerate() {
        let node = key
            .and_then(|k| node_by_pod.get(k))
            .and_then(|n| cluster.node_id(n))
            .and_then(|id| topo.node_index(id));
        if let Some(n) = node {
            st.place(i, n);
        }
    }
    let mut out = Vec::new();
    for info in &wl.apps {
        let range = info.first_instance..info.end_instance;
        let pending: Vec<usize> = range
            .clone()
            .filter(|&i| pod_of[i].is_some_and(|k| !node_by_pod.contains_key(k)))
            .collect();
        if pending.is_empty() {
            out.push(Ok(Vec::new()));
            continue;
        }
        let before = st.clone();
        match place_app(&mut st, range.clone()) {
            Ok(()) => out.push(Ok(pending
                .iter()
                .filter_map(|&i| {
                    let n = st.assign[i]?;
                    Some(Binding {
                        pod: pod_of[i]?.clone(),
                        node: cluster.node_names.get(&topo.nodes[n].id)?.clone(),
                        instance: wl.instances[i].id.clone(),
                    })
                })
                .collect())),
            Err(why) => {
                st = before;
                out.push(Err(why));
            }
        }
    }
    Ok(out)
}

/// HCM over one app's instances, then the backups of primaries that were already bound (HCM
/// places backups with their primary), then a check that everything is placed.
fn place_app(st: &mut State, range: std::ops::Range<usize>) -> Result<(), String> {
    hcm::run_range(st, range.clone()).map_err(|e| e.to_string())?;
    for i in range.clone() {
        if st.assign[i].is_some() {
            continue;
        }
        let near = st.wl.instances[i].replica_of.and_then(|p| st.assign[p]);
        let n = match near {
            Some(p) => hcm::ms_place(st, i, p),
            None => hcm::find_first_fit(st, i),
        };
        match n {
            Some(n) => st.place(i, n),
            None => return Err(st.no_fit(i).to_string()),
        }
    }
    Ok(())
}

/// What bound pods that are not ours request (cpu and memory), per node: E3 places on what
/// they leave.
fn reserved_by_others(pods: &[Pod]) -> BTreeMap<String, Reserved> {
    let mut reserved: BTreeMap<String, Reserved> = BTreeMap::new();
    for pod in pods.iter().filter(|p| !is_ours(p)) {
        let Some(spec) = &pod.spec else { continue };
        let Some(node) = &spec.node_name else {
            continue;
        };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let entry = reserved.entry(node.clone()).or_default();
        for container in &spec.containers {
            let requests = container
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref());
            let get = |k: &str| {
                requests
                    .and_then(|r| r.get(k))
                    .and_then(|q| quantity::parse(&q.0).ok())
                    .unwrap_or(0.0)
            };
            entry.cores += get("cpu");
            entry.memory_mb += get("memory") / (1024.0 * 1024.0);
        }
    }
    reserved
}

/// The PU of each node of the cluster (for the report of bindings).
pub fn pu_of(cluster: &Cluster, node: &str) -> Option<Pu> {
    cluster.pus.get(node).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::app::tests::{pod, shop};
    use crate::schedule::cluster::tests::nodes;
    use flatmesh_control::model::{parse_app, parse_cluster};
    use flatmesh_control::placement::{place as e3_place, Algorithm};

    /// What `flatmesh place` says for the app and cluster YAML of a plan: pod name -> node name.
    fn flatmesh_place(plan: &Plan) -> BTreeMap<String, String> {
        let topo =
            Topology::build(&parse_cluster("c.yaml", &plan.cluster.yaml()).unwrap()).unwrap();
        let apps: Vec<_> = plan
            .apps
            .iter()
            .map(|a| parse_app("a.yaml", &a.yaml()).unwrap())
            .collect();
        let wl = Workload::from_apps(&apps).unwrap();
        let p = e3_place(&topo, &wl, Algorithm::Hcm, 1).unwrap();
        wl.instances
            .iter()
            .zip(&p.assign)
            .map(|(inst, &n)| {
                let pod = plan.apps.iter().find_map(|a| a.pods.get(&inst.id)).unwrap();
                (
                    pod.name.clone(),
                    plan.cluster.node_names[&topo.nodes[n].id].clone(),
                )
            })
            .collect()
    }

    fn bound(plan: &Plan) -> BTreeMap<String, String> {
        plan.bindings
            .iter()
            .map(|b| (b.pod.name.clone(), b.node.clone()))
            .collect()
    }

    #[test]
    fn pending_pods_get_what_flatmesh_place_gives() {
        let plan = plan(&nodes(), &shop(), &HashMap::new());
        assert!(plan.unplaced.is_empty(), "{:?}", plan.unplaced);
        assert_eq!(plan.bindings.len(), 5);
        assert_eq!(bound(&plan), flatmesh_place(&plan));
        // API gw runs only on hosts (Table 1: the SmartNIC is less efficient for it).
        let gw = plan.bindings.iter().find(|b| b.pod.name == "gw-0").unwrap();
        assert_eq!(pu_of(&plan.cluster, &gw.node), Some(Pu::Host));
    }

    #[test]
    fn bound_pods_stay_and_are_not_bound_again() {
        let first = plan(&nodes(), &shop(), &HashMap::new());
        // The API shows two pods bound; the scheduler remembers binding a third.
        let mut pods = shop();
        for p in &mut pods {
            let name = p.metadata.name.clone().unwrap();
            if name == "gw-0" || name == "count-0" {
                let b = first.bindings.iter().find(|b| b.pod.name == name).unwrap();
                p.spec.as_mut().unwrap().node_name = Some(b.node.clone());
            }
        }
        let kvs0 = first
            .bindings
            .iter()
            .find(|b| b.pod.name == "kvs-0")
            .unwrap();
        let memory = HashMap::from([("uid-kvs-0".to_string(), kvs0.node.clone())]);
        let again = plan(&nodes(), &pods, &memory);
        let names: Vec<&str> = again.bindings.iter().map(|b| b.pod.name.as_str()).collect();
        assert_eq!(names, vec!["count-1", "kvs-1"]);
        // Set down around the bound ones, HCM puts them where it put them before.
        for b in &again.bindings {
            assert!(first.bindings.contains(b), "{b:?}");
        }
    }

    #[test]
    fn what_does_not_fit_stays_pending_with_a_reason() {
        let mut pods = shop();
        // A rate no cluster of two servers can carry: every pod of the app stays pending.
        for p in &mut pods {
            if p.metadata.name.as_deref() == Some("gw-0") {
                p.metadata
                    .annotations
                    .as_mut()
                    .unwrap()
                    .insert(super::super::app::RPS_ANNOTATION.into(), "10000000".into());
            }
        }
        // A second app that fits is placed anyway.
        pods.push(pod(
            "web",
            "solo-0",
            &[
                (super::super::app::APP_ANNOTATION, "solo"),
                (super::super::app::STAGE_ANNOTATION, "solo"),
                (super::super::app::MICROSERVICE_ANNOTATION, "EMA"),
                (super::super::app::RPS_ANNOTATION, "100"),
            ],
        ));
        let plan = plan(&nodes(), &pods, &HashMap::new());
        assert_eq!(plan.unplaced.len(), 5, "{:?}", plan.unplaced);
        assert!(
            plan.unplaced[0].1.contains("fits on no node"),
            "{:?}",
            plan.unplaced
        );
        assert_eq!(bound(&plan).keys().collect::<Vec<_>>(), vec!["solo-0"]);
        // No node at all: a reason that says what to label.
        let none = super::plan(&[], &shop(), &HashMap::new());
        assert_eq!(none.unplaced.len(), 5);
        assert!(
            none.unplaced[0].1.contains("flatmesh.io/pu=host"),
            "{:?}",
            none.unplaced
        );
    }

    #[test]
    fn other_pods_requests_take_capacity() {
        let mut other = pod("kube-system", "dns", &[]);
        let spec = other.spec.as_mut().unwrap();
        spec.scheduler_name = None;
        spec.node_name = Some("b".into());
        spec.containers[0].resources = Some(
            serde_json::from_value(serde_json::json!({"requests": {"cpu": "2", "memory": "1Gi"}}))
                .unwrap(),
        );
        let mut pods = shop();
        pods.push(other);
        let plan = plan(&nodes(), &pods, &HashMap::new());
        let topo =
            Topology::build(&parse_cluster("c.yaml", &plan.cluster.yaml()).unwrap()).unwrap();
        let b = &topo.nodes[topo.node_index("rack0-s1/host").unwrap()];
        assert_eq!((b.cores, b.memory_mb), (10.0, 63 * 1024));
    }
}
