//! Compares the dispatch modes under closed-loop load, in a release build of this crate only:
//! `cargo run --release -p flatmesh-lab --example rsd_compare -- [kv|pingpong] [workers] [clients] [seconds]`
//! (`kv` needs `--features kv`). The same comparison as `flatmesh qnp demo`.

use flatmesh_lab::qnp::load::{compare_modes, demo_table, DemoApp, Generator, RunSpec};
use flatmesh_qnp::dispatch::Mode;
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let default = if flatmesh_lab::qnp::KV_BUILT {
        "kv"
    } else {
        "pingpong"
    };
    let workload = args.first().map_or(default, String::as_str);
    let app: DemoApp = workload.parse()?;
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (workers, clients, seconds) = (num(1, 2), num(2, 8), num(3, 3));
    let modes = [
        Mode::Reuseport,
        Mode::Kernel,
        Mode::SoftwareQueue,
        Mode::SoftwareUds,
    ];
    let spec = RunSpec {
        generator: Generator::Endpoint,
        workers,
        dispatchers: 1,
        clients,
        duration: Duration::from_secs(seconds as u64),
        pinning: Default::default(),
    };
    let results = compare_modes(&modes, app, &spec)?;
    println!("workload {workload}, {workers} workers, 1 dispatcher, {clients} clients, {seconds} s per mode");
    print!("{}", demo_table(&results));
    Ok(())
}
