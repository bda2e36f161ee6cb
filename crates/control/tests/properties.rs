//! Property tests of placement (issue 8, §3.3-§3.5): for random clusters and random application
//! DAGs, every algorithm (HCM, annealing, ILP) either returns a placement that respects capacity,
//! pinning and fault domains, or a clear "does not fit" error; and failover after a random server
//! dies keeps the same guarantees.
//!
//! The generator is seeded (cases are reproducible from the seed printed on failure) and the
//! properties are checked here, independently of `placement::verify`.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};

use flatmesh_control::failover::{fail_nodes, Ring};
use flatmesh_control::model::{
    parse_app, parse_cluster, AppSpec, ClusterSpec, CoreClass, NodeSpec, RackSpec, ServerGroup,
    ServerType, StageSpec,
};
use flatmesh_control::placement::{place, Algorithm, State};
use flatmesh_control::topology::{NodeKind, Topology};
use flatmesh_control::workload::Workload;
use flatmesh_control::ControlError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MICROSERVICES: [&str; 16] = [
    "IPsec",
    "BM25",
    "NATv4",
    "NIDS",
    "Count",
    "EMA",
    "KVS",
    "Flow mon.",
    "DDoS",
    "Recommend",
    "KNN",
    "Spike",
    "Bayes",
    "API gw",
    "Top Ranker",
    "SQL",
];

fn random_cluster(rng: &mut StdRng) -> ClusterSpec {
    let mut server_types = BTreeMap::new();
    // A small server type, so that capacity is tight and NoFit happens as well as success.
    let tiny = ServerType {
        description: None,
        host: NodeSpec {
            core: CoreClass::Beefy,
            cores: f64::from(rng.random_range(1..=8u32)),
            memory_mb: rng.random_range(256..=4096),
            idle_watts: 50.0,
            peak_watts: 120.0,
            cost_usd: 2000.0,
            bandwidth_gbps: 0.0,
        },
        smartnic: Some(NodeSpec {
            core: CoreClass::Wimpy,
            cores: f64::from(rng.random_range(1..=4u32)),
            memory_mb: rng.random_range(128..=1024),
            idle_watts: 10.0,
            peak_watts: 15.0,
            cost_usd: 300.0,
            bandwidth_gbps: f64::from(rng.random_range(1..=10u32)),
        }),
        smartnic_count: rng.random_range(0..=2),
    };
    server_types.insert("Tiny".to_string(), tiny);
    let types = [
        "Beefy",
        "Wimpy",
        "Type1-SmartNIC",
        "Type2-SmartNIC",
        "SuperBeefy",
        "Tiny",
        "Tiny",
    ];
    let racks = (0..rng.random_range(1..=3))
        .map(|r| RackSpec {
            name: format!("r{r}"),
            servers: (0..rng.random_range(1..=3))
                .map(|_| ServerGroup {
                    server_type: types[rng.random_range(0..types.len())].to_string(),
                    count: rng.random_range(1..=3),
                })
                .collect(),
        })
        .collect();
    ClusterSpec {
        name: "random".into(),
        server_types,
        racks,
    }
}

fn random_app(rng: &mut StdRng) -> AppSpec {
    let n = rng.random_range(1..=5usize);
    let stages = (0..n)
        .map(|k| {
            // Earlier stages only: a DAG. Stage 0 is always a source; others may be too.
            let after: Vec<String> = (0..k)
                .filter(|_| rng.random_bool(0.5))
                .map(|j| format!("s{j}"))
                .collect();
            StageSpec {
                name: format!("s{k}"),
                microservice: MICROSERVICES[rng.random_range(0..MICROSERVICES.len())].to_string(),
                shards: rng.random_range(1..=6),
                after,
                fraction: [1.0, 1.0, 0.5, 0.01][rng.random_range(0..4)],
            }
        })
        .collect();
    AppSpec {
        name: "app".into(),
        description: None,
        // Log-uniform from 10 to 10M req/s: from trivially small to far beyond any cluster here.
        rps: 10f64.powf(rng.random_range(1.0..7.0)),
        replicas: rng.random_range(0..=2),
        backup_load: [0.0, 0.5, 1.0][rng.random_range(0..3)],
        microservices: BTreeMap::new(),
        stages,
    }
}

/// The properties, checked from scratch: capacity per node and per server, pinning and the offload
/// rule, fault domains, and no instance on a dead node.
fn check(topo: &Topology, wl: &Workload, assign: &[usize], dead: &[bool]) -> Result<(), String> {
    if assign.len() != wl.instances.len() {
        return Err("not every instance is placed".into());
    }
    let mut cores = vec![0.0; topo.nodes.len()];
    let mut mem = vec![0u64; topo.nodes.len()];
    let mut bw = vec![0.0; topo.servers.len()];
    let mut domains: HashMap<(usize, usize), usize> = HashMap::new();
    for (i, &n) in assign.iter().enumerate() {
        let inst = &wl.instances[i];
        let node = topo
            .nodes
            .get(n)
            .ok_or(format!("{} on node {n}", inst.id))?;
        if dead[n] {
            return Err(format!("{} is on dead node {}", inst.id, node.id));
        }
        if inst.microservice == "SQL" && node.kind != NodeKind::Host {
            return Err(format!(
                "SQL instance {} on {} (SQL is host only)",
                inst.id, node.id
            ));
        }
        if node.kind == NodeKind::Smartnic && !inst.offloadable {
            return Err(format!(
                "{} ({}) on SmartNIC {}",
                inst.id, inst.microservice, node.id
            ));
        }
        // The group of a shard: the primary's index.
        let group = inst.replica_of.unwrap_or(i);
        if let Some(other) = domains.insert((group, node.server), i) {
            return Err(format!(
                "{} and {} (replicas of one shard) share server {}",
                inst.id, wl.instances[other].id, topo.servers[node.server].name
            ));
        }
        cores[n] += inst.cores_on(node.core);
        mem[n] += inst.memory_mb;
        bw[node.server] += inst.bandwidth_gbps;
    }
    for (n, node) in topo.nodes.iter().enumerate() {
        if cores[n] > node.cores * (1.0 + 1e-9) + 1e-9 {
            return Err(format!(
                "{} has {} of {} cores",
                node.id, cores[n], node.cores
            ));
        }
        if mem[n] > node.memory_mb {
            return Err(format!(
                "{} has {} of {} MB",
                node.id, mem[n], node.memory_mb
            ));
        }
    }
    for (s, server) in topo.servers.iter().enumerate() {
        if bw[s] > server.bandwidth_gbps * (1.0 + 1e-9) + 1e-9 {
            return Err(format!(
                "{} needs {} of {} Gb/s",
                server.name, bw[s], server.bandwidth_gbps
            ));
        }
    }
    Ok(())
}

/// An error is acceptable only if it says the workload does not fit (or is too large / too slow
/// for the ILP). A violation would mean the algorithm produced a placement that breaks a rule.
fn acceptable(e: &ControlError) -> bool {
    matches!(
        e,
        ControlError::NoFit { .. } | ControlError::TooLarge(_) | ControlError::Solver(_)
    )
}

#[test]
fn every_algorithm_respects_capacity_pinning_and_fault_domains() {
    let (mut placed, mut refused, mut ilp_runs, mut failovers) = (0, 0, 0, 0);
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let cluster = random_cluster(&mut rng);
        let app = random_app(&mut rng);
        // Through the YAML front door: the generated models must be valid files.
        let cluster_yaml = serde_norway::to_string(&cluster).unwrap();
        let app_yaml = serde_norway::to_string(&app).unwrap();
        let ctx = format!("seed {seed}\ncluster:\n{cluster_yaml}\napp:\n{app_yaml}");
        let cluster =
            parse_cluster("random.yaml", &cluster_yaml).unwrap_or_else(|e| panic!("{e}\n{ctx}"));
        let app = parse_app("random.yaml", &app_yaml).unwrap_or_else(|e| panic!("{e}\n{ctx}"));
        let topo = Topology::build(&cluster).unwrap();
        let wl = Workload::from_apps(&[app]).unwrap();
        let small_for_ilp = wl.instances.len() * topo.nodes.len() <= 300;
        let mut algos = vec![Algorithm::Hcm, Algorithm::Anneal];
        if small_for_ilp && seed % 3 == 0 {
            algos.push(Algorithm::Ilp);
            ilp_runs += 1;
        }
        let no_dead = vec![false; topo.nodes.len()];
        for algo in algos {
            match place(&topo, &wl, algo, seed) {
                Ok(p) => {
                    placed += 1;
                    check(&topo, &wl, &p.assign, &no_dead)
                        .unwrap_or_else(|e| panic!("{algo:?}: {e}\n{ctx}"));
                    if algo != Algorithm::Hcm || topo.servers.len() < 2 {
                        continue;
                    }
                    // A random server dies (host and SmartNICs: one fault domain).
                    let mut st = State::new(&topo, &wl);
                    for (i, &n) in p.assign.iter().enumerate() {
                        st.place(i, n);
                    }
                    let victim = rng.random_range(0..topo.servers.len());
                    let mut ring = Ring::new(0..topo.servers.len());
                    ring.remove(victim);
                    let dead_nodes = topo.servers[victim].nodes.clone();
                    match fail_nodes(&mut st, &dead_nodes, &ring) {
                        Ok(moved) => {
                            failovers += 1;
                            let assign = st.complete().unwrap_or_else(|e| panic!("{e}\n{ctx}"));
                            check(&topo, &wl, &assign, &st.dead)
                                .unwrap_or_else(|e| panic!("after failover: {e}\n{ctx}"));
                            // Exactly the dead server's instances moved (plus promoted backups).
                            for m in &moved {
                                assert!(
                                    dead_nodes.contains(&m.from)
                                        || wl.instances[m.instance].replica_of.is_some()
                                        || m.promoted,
                                    "{m:?} moved although it was not on the dead server\n{ctx}"
                                );
                            }
                            for (i, (&before, &after)) in p.assign.iter().zip(&assign).enumerate() {
                                if before != after && !dead_nodes.contains(&before) {
                                    // Only a backup whose primary was promoted onto its node moves.
                                    let promoted_here = wl.replicas[i].is_empty()
                                        && wl.instances[i].replica_of.is_some();
                                    assert!(
                                        promoted_here,
                                        "{} moved from a live node\n{ctx}",
                                        wl.instances[i].id
                                    );
                                }
                            }
                        }
                        Err(e) => assert!(acceptable(&e), "failover: {e}\n{ctx}"),
                    }
                }
                Err(e) => {
                    refused += 1;
                    assert!(acceptable(&e), "{algo:?}: {e}\n{ctx}");
                    assert!(!e.to_string().is_empty());
                }
            }
        }
    }
    // The generator must exercise both outcomes, or the test proves little.
    assert!(placed > 100, "only {placed} placements succeeded");
    assert!(refused > 20, "only {refused} workloads were refused");
    assert!(ilp_runs > 10, "only {ilp_runs} ILP runs");
    assert!(failovers > 20, "only {failovers} failovers");
}

#[test]
fn backups_hold_memory_and_their_share_of_load() {
    let mut app = parse_app(
        "a.yaml",
        "name: a\nrps: 100000\nreplicas: 2\nstages: [{name: s, microservice: KVS, shards: 1}]\n",
    )
    .unwrap();
    for load in [0.0, 0.25, 1.0] {
        app.backup_load = load;
        let wl = Workload::from_apps(&[app.clone()]).unwrap();
        let (p, r) = (&wl.instances[0], &wl.instances[1]);
        assert_eq!(r.replica_of, Some(0));
        assert_eq!(r.memory_mb, p.memory_mb);
        for core in [CoreClass::Beefy, CoreClass::Wimpy] {
            assert!((r.cores_on(core) - load * p.cores_on(core)).abs() < 1e-12);
        }
        assert!((r.bandwidth_gbps - load * p.bandwidth_gbps).abs() < 1e-12);
    }
    let err = parse_app(
        "a.yaml",
        "name: a\nrps: 1\nbackup_load: 1.5\nstages: [{name: s, microservice: KVS, shards: 1}]\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("backup_load must be in [0, 1]"), "{err}");
}
