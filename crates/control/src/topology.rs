//! The cluster as the placer sees it: a flat list of compute nodes (hosts and SmartNICs) grouped into
//! servers (one fault domain each, §3.5) and racks, and the distances between them.

use serde::Serialize;

use crate::error::Result;
use crate::model::{cluster_server_types, ClusterSpec, CoreClass};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeKind {
    Host,
    Smartnic,
}

/// One compute node: a host processor or one SmartNIC.
#[derive(Debug, Clone, Serialize)]
pub struct Node {
    pub id: String,
    #[serde(skip)]
    pub server: usize,
    #[serde(skip)]
    pub rack: usize,
    pub kind: NodeKind,
    #[serde(skip)]
    pub core: CoreClass,
    pub cores: f64,
    pub memory_mb: u64,
    #[serde(skip)]
    pub idle_watts: f64,
    #[serde(skip)]
    pub peak_watts: f64,
    #[serde(skip)]
    pub cost_usd: f64,
}

#[derive(Debug, Clone)]
pub struct Server {
    pub name: String,
    pub rack: usize,
    pub server_type: String,
    /// Host first, then the SmartNICs.
    pub nodes: Vec<usize>,
    /// Shared by host and SmartNICs: ECMP spreads host traffic over the SmartNIC ports.
    pub bandwidth_gbps: f64,
}

#[derive(Debug, Clone)]
pub struct Rack {
    pub name: String,
    pub servers: Vec<usize>,
}

#[derive(Debug, Clone)]
pub struct Topology {
    pub name: String,
    pub nodes: Vec<Node>,
    pub servers: Vec<Server>,
    pub racks: Vec<Rack>,
    /// All SmartNIC nodes, then all host nodes: the order find_first_fit scans, so the energy-efficient
    /// SmartNICs are tried first (E3's goal) and the hosts take what the SmartNICs cannot.
    pub first_fit_order: Vec<usize>,
}

/// Network hops between two nodes, our avg_hops metric. Same node: 0. Same server: 1 (PCIe).
/// Same rack: 2 (node - ToR - node, §3.1: SmartNICs of one server also talk via the ToR, so they
/// count as 1 only through PCIe to their host). Different racks: 4 (ToR - aggregation - ToR).
pub fn hops(topo: &Topology, a: usize, b: usize) -> u32 {
    if a == b {
        return 0;
    }
    let (na, nb) = (&topo.nodes[a], &topo.nodes[b]);
    if na.server == nb.server {
        // Host <-> SmartNIC is one PCIe hop; SmartNIC <-> SmartNIC goes through the ToR (§3.1).
        if na.kind == NodeKind::Host || nb.kind == NodeKind::Host {
            1
        } else {
            2
        }
    } else if na.rack == nb.rack {
        2
    } else {
        4
    }
}

impl Topology {
    /// That a per-node file (addresses, heartbeat keys) names each node of the topology once
    /// and nothing else: `named` are the file's names; `missing(id)` says what to add for a
    /// node it lacks; `section` goes before a name the topology does not know (`"nodes: "`).
    pub fn check_node_names<'a>(
        &self,
        named: impl Iterator<Item = &'a String> + Clone,
        missing: impl Fn(&str) -> String,
        section: &str,
    ) -> std::result::Result<(), String> {
        let node_ids: Vec<&str> = self.nodes.iter().map(|n| n.id.as_str()).collect();
        if let Some(id) = node_ids.iter().find(|id| !named.clone().any(|n| n == *id)) {
            return Err(missing(id));
        }
        match named.into_iter().find(|n| !node_ids.contains(&n.as_str())) {
            Some(id) => Err(format!(
                "{section}`{id}` is not a node of cluster `{}`{}",
                self.name,
                crate::model::did_you_mean(id, &node_ids)
            )),
            None => Ok(()),
        }
    }

    pub fn build(spec: &ClusterSpec) -> Result<Self> {
        let types = cluster_server_types(spec)?;
        let mut topo = Topology {
            name: spec.name.clone(),
            nodes: Vec::new(),
            servers: Vec::new(),
            racks: Vec::new(),
            first_fit_order: Vec::new(),
        };
        for rack in &spec.racks {
            let rack_idx = topo.racks.len();
            let mut servers = Vec::new();
            let mut ordinal = 0usize;
            for g in &rack.servers {
                // Validation already checked every type exists; skip defensively rather than panic.
                let Some(t) = types.get(&g.server_type) else {
                    continue;
                };
                for _ in 0..g.count {
                    let server_idx = topo.servers.len();
                    let name = format!("{}-s{ordinal}", rack.name);
                    ordinal += 1;
                    let mut nodes = Vec::new();
                    let mut bw = t.host.bandwidth_gbps;
                    let mut push = |id: String, kind: NodeKind, n: &crate::model::NodeSpec| {
                        nodes.push(topo.nodes.len());
                        topo.nodes.push(Node {
                            id,
                            server: server_idx,
                            rack: rack_idx,
                            kind,
                            core: n.core,
                            cores: n.cores,
                            memory_mb: n.memory_mb,
                            idle_watts: n.idle_watts,
                            peak_watts: n.peak_watts,
                            cost_usd: n.cost_usd,
                        });
                    };
                    push(format!("{name}/host"), NodeKind::Host, &t.host);
                    if let Some(nic) = &t.smartnic {
                        for k in 0..t.smartnic_count {
                            push(format!("{name}/nic{k}"), NodeKind::Smartnic, nic);
                            bw += nic.bandwidth_gbps;
                        }
                    }
                    topo.servers.push(Server {
                        name,
                        rack: rack_idx,
                        server_type: g.server_type.clone(),
                        nodes,
                        bandwidth_gbps: bw,
                    });
                    servers.push(server_idx);
                }
            }
            topo.racks.push(Rack {
                name: rack.name.clone(),
                servers,
            });
        }
        let (nics, hosts): (Vec<usize>, Vec<usize>) =
            (0..topo.nodes.len()).partition(|&i| topo.nodes[i].kind == NodeKind::Smartnic);
        topo.first_fit_order = nics.into_iter().chain(hosts).collect();
        Ok(topo)
    }

    pub fn node_index(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    pub fn capex_usd(&self) -> f64 {
        self.nodes.iter().map(|n| n.cost_usd).sum()
    }

    pub fn idle_watts(&self) -> f64 {
        self.nodes.iter().map(|n| n.idle_watts).sum()
    }

    pub fn peak_watts(&self) -> f64 {
        self.nodes.iter().map(|n| n.peak_watts).sum()
    }

    /// E3's hierarchical topology of node `n` (get_hierarchical_topo): levels of nodes that need a
    /// similar communication mechanism, closest first. In a rack (§3.3): 1. the same node; 2. an
    /// adjacent node on the same server; 3. a SmartNIC on an adjacent server; 4. a host on an
    /// adjacent server. Beyond the rack we continue the same way: 5. SmartNICs, 6. hosts of other racks.
    /// The levels are produced lazily so a 1,000-server search that stops at level 1 costs nothing.
    pub fn levels(&self, n: usize) -> [Level<'_>; 6] {
        let node = &self.nodes[n];
        [
            Level::Same(n),
            Level::Server {
                topo: self,
                server: node.server,
                except: n,
            },
            Level::Rack {
                topo: self,
                rack: node.rack,
                except_server: node.server,
                kind: NodeKind::Smartnic,
            },
            Level::Rack {
                topo: self,
                rack: node.rack,
                except_server: node.server,
                kind: NodeKind::Host,
            },
            Level::Remote {
                topo: self,
                except_rack: node.rack,
                kind: NodeKind::Smartnic,
            },
            Level::Remote {
                topo: self,
                except_rack: node.rack,
                kind: NodeKind::Host,
            },
        ]
    }
}

/// One level of the hierarchical topology.
pub enum Level<'a> {
    Same(usize),
    Server {
        topo: &'a Topology,
        server: usize,
        except: usize,
    },
    Rack {
        topo: &'a Topology,
        rack: usize,
        except_server: usize,
        kind: NodeKind,
    },
    Remote {
        topo: &'a Topology,
        except_rack: usize,
        kind: NodeKind,
    },
}

impl Level<'_> {
    /// Calls `f` on every node of the level.
    pub fn for_each(&self, mut f: impl FnMut(usize)) {
        match *self {
            Level::Same(n) => f(n),
            Level::Server {
                topo,
                server,
                except,
            } => topo.servers[server]
                .nodes
                .iter()
                .filter(|&&i| i != except)
                .for_each(|&i| f(i)),
            Level::Rack {
                topo,
                rack,
                except_server,
                kind,
            } => {
                for &s in &topo.racks[rack].servers {
                    if s == except_server {
                        continue;
                    }
                    for &i in &topo.servers[s].nodes {
                        if topo.nodes[i].kind == kind {
                            f(i)
                        }
                    }
                }
            }
            Level::Remote {
                topo,
                except_rack,
                kind,
            } => {
                for (r, rack) in topo.racks.iter().enumerate() {
                    if r == except_rack {
                        continue;
                    }
                    for &s in &rack.servers {
                        for &i in &topo.servers[s].nodes {
                            if topo.nodes[i].kind == kind {
                                f(i)
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{load_cluster, uniform_cluster};

    #[test]
    fn builds_nodes_servers_and_levels() {
        let topo = Topology::build(&load_cluster("preset:3xType1-SmartNIC").unwrap()).unwrap();
        assert_eq!(topo.nodes.len(), 6);
        assert_eq!(topo.servers.len(), 3);
        assert_eq!(topo.nodes[0].id, "rack0-s0/host");
        assert_eq!(topo.nodes[1].id, "rack0-s0/nic0");
        assert_eq!(topo.servers[0].bandwidth_gbps, 20.0);
        // SmartNICs first in first-fit order.
        assert_eq!(topo.first_fit_order, vec![1, 3, 5, 0, 2, 4]);
        let collect = |l: &Level| {
            let mut v = Vec::new();
            l.for_each(|i| v.push(i));
            v
        };
        let levels = topo.levels(0);
        let got: Vec<Vec<usize>> = levels.iter().map(collect).collect();
        assert_eq!(
            got,
            vec![vec![0], vec![1], vec![3, 5], vec![2, 4], vec![], vec![]]
        );
        assert_eq!(hops(&topo, 0, 1), 1);
        assert_eq!(hops(&topo, 1, 3), 2);
        assert_eq!(topo.capex_usd(), 3.0 * 4650.0);
    }

    #[test]
    fn fat_tree_racks_of_forty() {
        let topo = Topology::build(&uniform_cluster("sim", "Type2-SmartNIC", 100, 40)).unwrap();
        assert_eq!(topo.racks.len(), 3);
        assert_eq!(topo.nodes.len(), 500);
        let (a, b) = (topo.servers[0].nodes[0], topo.servers[45].nodes[0]);
        assert_eq!(hops(&topo, a, b), 4);
        let nic = topo.servers[0].nodes[2];
        let mut remote = 0;
        topo.levels(nic)[4].for_each(|_| remote += 1);
        assert_eq!(remote, 60 * 4);
    }
}
