//! The two speed targets: `cargo bench -p flatmesh-control --bench control`.
//!
//! - `hcm_place/1000_servers_10k_deployed`: HCM deploys one more application (IOT-TS, 108
//!   microservice instances) on 1,000 Type2-SmartNIC servers (FatTree, 40 per rack) on which
//!   ~10,000 instances are already deployed. Criterion's throughput is instances per second; its
//!   inverse is the per-microservice deployment time, which must be at most 26 ms (E3 Table 6:
//!   263 ms). `anneal_place/...` is the same deployment by simulated annealing, for comparison.
//! - `orchestrator_round/50000_servers`: one decision round of the orchestrator: decode and judge
//!   the 16-byte heartbeats of all 200,000 SmartNICs of 50,000 Type2 servers, then sweep for silent
//!   nodes. Must take under 10 ms (E3 Fig. 11).
//!
//! FLATMESH_BENCH_SERVERS, FLATMESH_BENCH_DEPLOYED and FLATMESH_BENCH_HB_SERVERS shrink the
//! set-up for a smoke test.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use flatmesh_control::model::load_app;
use flatmesh_control::placement::{anneal, hcm, State};
use flatmesh_control::simulate::{background_apps, fat_tree, HeartbeatRound};
use flatmesh_control::workload::Workload;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn placement(c: &mut Criterion) {
    let servers: u32 = env_or("FLATMESH_BENCH_SERVERS", 1000);
    let deployed: usize = env_or("FLATMESH_BENCH_DEPLOYED", 10_000);
    let topo = fat_tree(servers).expect("topology");
    let mut apps = background_apps(deployed).expect("background apps");
    let mut probe = load_app("preset:IOT-TS").expect("IOT-TS preset");
    probe.name = "probe".into();
    apps.push(probe);
    let wl = Workload::from_apps(&apps).expect("workload");
    let probe = wl.apps.last().expect("probe app").clone();
    let mut base = State::new(&topo, &wl);
    hcm::run_range(&mut base, 0..probe.first_instance).expect("background fits");
    let n = (probe.end_instance - probe.first_instance) as u64;
    let name = format!("{servers}_servers_{}_deployed", probe.first_instance);

    let mut g = c.benchmark_group("hcm_place");
    g.throughput(Throughput::Elements(n));
    g.bench_function(&name, |b| {
        b.iter_batched_ref(
            || base.clone(),
            |st| hcm::run_range(st, probe.first_instance..probe.end_instance).expect("fits"),
            BatchSize::LargeInput,
        )
    });
    g.finish();

    let movable: Vec<usize> = (probe.first_instance..probe.end_instance).collect();
    let params = anneal::Params::for_size(movable.len(), 1);
    let mut g = c.benchmark_group("anneal_place");
    g.throughput(Throughput::Elements(n));
    g.sample_size(10);
    g.bench_function(&name, |b| {
        b.iter_batched_ref(
            || base.clone(),
            |st| anneal::run(st, &movable, &params).expect("fits"),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn orchestrator(c: &mut Criterion) {
    let servers: u32 = env_or("FLATMESH_BENCH_HB_SERVERS", 50_000);
    let mut round = HeartbeatRound::new(servers, 6).expect("heartbeat round");
    let mut g = c.benchmark_group("orchestrator_round");
    g.throughput(Throughput::Elements(round.heartbeats() as u64));
    g.bench_function(format!("{servers}_servers"), |b| b.iter(|| round.judge()));
    g.finish();
}

criterion_group!(benches, placement, orchestrator);
criterion_main!(benches);
