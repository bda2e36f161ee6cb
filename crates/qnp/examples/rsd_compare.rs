//! Compares the dispatch modes under closed-loop load, in a release build of this crate only:
//! `cargo run --release -p flatmesh-qnp --example rsd_compare -- [kv|pingpong] [workers] [clients] [seconds]`.
//! The same comparison as `flatmesh qnp demo`.

use flatmesh_qnp::dispatch::Mode;
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let workload = args.first().map_or("kv", String::as_str);
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (workers, clients, seconds) = (num(1, 2), num(2, 8), num(3, 3));
    let modes = [
        Mode::Reuseport,
        Mode::Kernel,
        Mode::SoftwareQueue,
        Mode::SoftwareUds,
    ];
    let spec = flatmesh_qnp::load::RunSpec {
        generator: flatmesh_qnp::load::Generator::Endpoint,
        workers,
        dispatchers: 1,
        clients,
        duration: Duration::from_secs(seconds as u64),
        pinning: Default::default(),
    };
    let results = flatmesh_qnp::load::compare_modes(&modes, workload, &spec)?;
    println!("workload {workload}, {workers} workers, 1 dispatcher, {clients} clients, {seconds} s per mode");
    println!(
        "{:<14} {:>9} {:>8} {:>8} {:>8} {:>18} {:>6}",
        "mode", "req/s", "p50 µs", "p99 µs", "timeouts", "per worker", "drops"
    );
    for r in results {
        println!(
            "{:<14} {:>9.0} {:>8.1} {:>8.1} {:>8} {:>18} {:>6}",
            format!("{:?}", r.mode),
            r.report.rps(),
            r.report.p50_us,
            r.report.p99_us,
            r.report.errors,
            format!("{:?}", r.per_worker),
            r.dropped
        );
    }
    Ok(())
}
