#![no_main]
//! Any text as a cluster file and as an app file: parsing never panics; a valid small pair is
//! placed with HCM, and whatever HCM returns passes the independent verifier.
use flatmesh_control::model::{parse_app, parse_cluster};
use flatmesh_control::placement::{place, verify, Algorithm};
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;
use flatmesh_control::ControlError;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // One input feeds both parsers: the part before a "---" line is the cluster, after it the app.
    let (c, a) = text.split_once("\n---\n").unwrap_or((text, text));
    let cluster = parse_cluster("fuzz-cluster.yaml", c);
    let app = parse_app("fuzz-app.yaml", a);
    let (Ok(cluster), Ok(app)) = (cluster, app) else {
        return;
    };
    // Keep each run fast: skip huge instances (they are valid, just slow).
    let servers: u64 = cluster
        .racks
        .iter()
        .flat_map(|r| &r.servers)
        .map(|g| u64::from(g.count))
        .sum();
    if servers > 200 || app.dag_nodes() > 2_000 {
        return;
    }
    let Ok(topo) = Topology::build(&cluster) else {
        return;
    };
    let Ok(wl) = Workload::from_apps(&[app]) else {
        return;
    };
    match place(&topo, &wl, Algorithm::Hcm, 0) {
        Ok(p) => assert!(verify(&topo, &wl, &p.assign).is_ok()),
        // HCM produced a placement the verifier rejects: a bug in HCM's constraint checks.
        Err(ControlError::Violation(v)) => panic!("{v}"),
        Err(_) => {}
    }
});
