//! Benchmarks for bench/sections/pu.md (`flatmesh pu bench`):
//!
//! 1. What the reverse mapping adds to a cross-PU TCP connection set-up and round trip, against a
//!    plain veth path between the same kind of PUs (a second split namespace with no rules, so no
//!    conntrack or NAT at all), with same-PU loopback for reference. Client on PU a (CPU 0),
//!    server on PU b (CPU 1). Paths are measured interleaved, in rounds, to share the noise.
//! 2. How long a rule update takes as the number of mapped ports grows to 10,000: one whole-table
//!    rebuild (what a restart does), one incremental map change (what a port change does), and
//!    a full agent pass (scan + table + rules) with and without a change.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::pu::echo::{EchoServer, Mode};
use crate::{LabError, Result};
use flatmesh_pu::agent::Agent;
use flatmesh_pu::backend::run_on;
use flatmesh_pu::config::SplitConfig;
use flatmesh_pu::pod::Pod;
use flatmesh_pu::rules::{self, Desired};

/// Latency summary in microseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Summary {
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
    pub n: usize,
}

pub fn summarize(mut samples: Vec<Duration>) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let at = |q: f64| us(samples[((samples.len() - 1) as f64 * q).round() as usize]);
    Summary {
        p50: at(0.5),
        p99: at(0.99),
        mean: samples.iter().map(|d| us(*d)).sum::<f64>() / samples.len() as f64,
        n: samples.len(),
    }
}

#[derive(Debug, Clone)]
pub struct PathResult {
    pub path: String,
    pub connect: Summary,
    pub rtt: Summary,
}

#[derive(Debug, Clone)]
pub struct RuleUpdateResult {
    pub ports: usize,
    pub full_rebuild: Summary,
    pub add_one: Summary,
    pub remove_one: Summary,
    pub agent_pass_idle: Summary,
    pub agent_pass_change: Summary,
}

fn config(ns: &str, state_dir: &std::path::Path) -> Result<SplitConfig> {
    let dpu_cpu = if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        "1"
    } else {
        "0"
    };
    Ok(SplitConfig::parse(
        &format!(
            "namespace: {ns}\nstate_dir: {}\npoll_interval_ms: 20\npus:\n  - {{ name: a, cpus: \"0\" }}\n  - {{ name: b, cpus: \"{dpu_cpu}\" }}\n",
            state_dir.display()
        ),
        "bench config",
    )?)
}

/// Most connections (and round trips) per path in one run: 3 paths x this many TIME_WAIT sockets
/// must fit in the ephemeral port range of one client namespace.
pub const MAX_ITERATIONS: usize = 20_000;
/// Most mapped ports in the rule benchmark: its ports run from 2001 up, and stay below the
/// ephemeral port range.
pub const MAX_PORTS: usize = 15_000;

/// The first CPU of PU `pu`'s cpuset, if it has one.
fn pod_cpu(pod: &Pod, pu: &str) -> Option<usize> {
    let i = pod.config.pu_index(pu)?;
    pod.config.pus[i]
        .cpus
        .as_deref()
        .and_then(flatmesh_pu::config::parse_cpu_list)
        .and_then(|c| c.first().copied())
}

/// Checks the arguments of both benchmarks, before anything is built or timed.
pub fn check_args(iterations: usize, sizes: &[usize]) -> Result<()> {
    if !(1..=MAX_ITERATIONS).contains(&iterations) {
        return Err(bad_arg(format!(
            "--iterations {iterations}: use 1 to {MAX_ITERATIONS} (each connection leaves a TIME_WAIT socket holding an ephemeral port for 60 s)"
        )));
    }
    if sizes.is_empty() {
        return Err(bad_arg(
            "--ports is empty; give port counts such as 10,100,1000,10000".into(),
        ));
    }
    if let Some(bad) = sizes.iter().find(|n| !(1..=MAX_PORTS).contains(*n)) {
        return Err(bad_arg(format!(
            "--ports {bad}: use 1 to {MAX_PORTS} (the benchmark's ports run from 2001 up and must stay below the ephemeral range)"
        )));
    }
    Ok(())
}

fn bad_arg(message: String) -> LabError {
    LabError::InvalidOption(message)
}

fn io(context: &str) -> impl Fn(std::io::Error) -> LabError + '_ {
    move |e| LabError::io(context.to_string(), e)
}

/// `n` connections (connect returns = handshake done) and `n` 64-byte round trips on one
/// connection, against `addr`, from the calling thread.
fn measure(addr: SocketAddr, n: usize) -> std::io::Result<(Vec<Duration>, Vec<Duration>)> {
    let mut connects = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let s = TcpStream::connect(addr)?;
        connects.push(t.elapsed());
        drop(s);
    }
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let msg = [7u8; 64];
    let mut buf = [0u8; 64];
    let mut rtts = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&msg)?;
        s.read_exact(&mut buf)?;
        rtts.push(t.elapsed());
    }
    Ok((connects, rtts))
}

/// Benchmark 1. `iterations` connections and round trips per path, in 5 interleaved rounds.
pub fn mapping_cost(state_dir: &std::path::Path, iterations: usize) -> Result<Vec<PathResult>> {
    check_args(iterations, &[1])?;
    flatmesh_pu::backend::require_root()?;
    let mut mapped = Pod::up(config("bnchmap", state_dir)?)?;
    let plain = Pod::up(config("bnchplain", state_dir)?)?;
    mapped.start_agent("a")?;
    mapped.start_agent("b")?;
    const PORT: u16 = 5201;
    let echo = |l: std::io::Result<TcpListener>| -> Result<EchoServer> {
        EchoServer::start(l.map_err(io("listen"))?, "bench", Mode::Echo).map_err(io("echo"))
    };
    let _mapped_srv = mapped.on("b", || echo(TcpListener::bind(("127.0.0.1", PORT))))??;
    let _plain_srv = plain.on("b", || echo(TcpListener::bind(("0.0.0.0", PORT))))??;
    // Same-PU reference: a server in PU a's network namespace but, like the other servers, on
    // the other CPU (so every path crosses CPUs). Its thread enters only the namespace, not PU
    // a's cpuset, which would confine it to CPU 0.
    let server_cpu = pod_cpu(&mapped, "b");
    let netns_a = mapped.backend.topology().netns(mapped.pu("a")?);
    let _local_srv = std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<EchoServer> {
                flatmesh_pu::netns::enter(&netns_a)?;
                if let Some(cpu) = server_cpu {
                    flatmesh_pu::cpuset::set_affinity(&[cpu])
                        .map_err(io("pin the reference server"))?;
                }
                echo(TcpListener::bind(("127.0.0.1", PORT + 1)))
            })
            .join()
            .unwrap_or_else(|_| Err(LabError::io("bench", std::io::Error::other("panicked"))))
    })?;
    if !mapped.wait_for_table(Duration::from_secs(10), |s| s.ports.contains_key(&PORT)) {
        return Err(LabError::io(
            "bench",
            std::io::Error::other("port table never filled"),
        ));
    }
    // The agents have written the rules; stop them, so their polling (which reads every socket
    // of the PU, TIME_WAIT included, each poll interval) does not share the client's CPU while
    // it is timed. The rules stay in force without them: they are control plane only.
    mapped.stop_agent("a")?;
    mapped.stop_agent("b")?;
    let plain_b = plain
        .backend
        .topology()
        .link_to(0, 1)
        .map(|l| l.peer_addr)
        .ok_or_else(|| LabError::io("bench", std::io::Error::other("no link")))?;
    let paths: Vec<(String, &Pod, SocketAddr)> = vec![
        (
            "same PU, loopback (reference)".into(),
            &mapped,
            SocketAddr::from(([127, 0, 0, 1], PORT + 1)),
        ),
        (
            "cross-PU, plain veth, no rules".into(),
            &plain,
            SocketAddr::from((plain_b, PORT)),
        ),
        (
            "cross-PU, localhost via reverse mapping".into(),
            &mapped,
            SocketAddr::from(([127, 0, 0, 1], PORT)),
        ),
    ];
    let rounds = 5;
    let per_round = iterations.div_ceil(rounds).max(1);
    let mut samples: Vec<(Vec<Duration>, Vec<Duration>)> =
        vec![(Vec::new(), Vec::new()); paths.len()];
    for _ in 0..rounds {
        for (i, (_, pod, addr)) in paths.iter().enumerate() {
            let (c, r) = pod
                .on("a", || measure(*addr, per_round))?
                .map_err(io("bench traffic"))?;
            samples[i].0.extend(c);
            samples[i].1.extend(r);
        }
    }
    drop((_mapped_srv, _plain_srv, _local_srv));
    wait_for_fds_to_settle();
    Ok(paths
        .into_iter()
        .zip(samples)
        .map(|((path, _, _), (c, r))| PathResult {
            path,
            connect: summarize(c),
            rtt: summarize(r),
        })
        .collect())
}

/// Waits (at most 20 s) until the echo servers' connection threads have seen their clients go,
/// so that the next benchmark starts with few open descriptors.
fn wait_for_fds_to_settle() {
    for _ in 0..200 {
        let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
        if open < 256 {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Benchmark 2, for each port count in `sizes`.
pub fn rule_updates(
    state_dir: &std::path::Path,
    sizes: &[usize],
    repeats: usize,
) -> Result<Vec<RuleUpdateResult>> {
    check_args(1, sizes)?;
    if repeats == 0 {
        return Err(bad_arg("repeats must be at least 1".into()));
    }
    flatmesh_pu::backend::require_root()?;
    let pod = Pod::up(config("bnchrule", state_dir)?)?;
    let topo = pod.backend.topology().clone();
    let mut results = Vec::new();
    for &n in sizes {
        let ports: Vec<u16> = (1..=n as u16).map(|i| 2000 + i).collect();
        // PU b's ports, claimed in the table as b's binds claim them (b has no agent, which
        // would release them: nothing listens on them).
        let table = pod.table();
        for p in table.read()?.ports.keys() {
            table.release(*p, "b")?;
        }
        for p in &ports {
            table.claim(*p, "b")?;
        }
        let config_a = pod.config.clone();
        let table = pod.table();
        let topo = topo.clone();
        let backend = pod.backend.as_ref();
        let result = run_on(
            pod.backend.as_ref(),
            0,
            move || -> Result<RuleUpdateResult> {
                let mut agent = Agent::new(&config_a, "a")?;
                agent.start(backend)?;
                let state = table.read()?;
                let desired = Desired::from_table(&topo, 0, &state, &[]);
                let script = rules::full_script(&topo, 0, &[], &desired);
                let mut full = Vec::new();
                let mut add = Vec::new();
                let mut remove = Vec::new();
                let mut idle = Vec::new();
                let mut change = Vec::new();
                let extra: u16 = 1000;
                let peer = topo
                    .link_to(0, 1)
                    .map(|l| l.peer_addr)
                    .unwrap_or(std::net::Ipv4Addr::LOCALHOST);
                let mut with_extra = desired.remote.clone();
                with_extra.insert(extra, peer);
                let add_script =
                    rules::delta_script(&topo, &desired.remote, &with_extra).unwrap_or_default();
                let remove_script =
                    rules::delta_script(&topo, &with_extra, &desired.remote).unwrap_or_default();
                for _ in 0..repeats {
                    let t = Instant::now();
                    rules::apply(&script)?;
                    full.push(t.elapsed());
                    let t = Instant::now();
                    rules::apply(&add_script)?;
                    add.push(t.elapsed());
                    let t = Instant::now();
                    rules::apply(&remove_script)?;
                    remove.push(t.elapsed());
                }
                // Resynchronise the agent with what is applied, then time its passes.
                agent.start(backend)?;
                for _ in 0..repeats {
                    let t = Instant::now();
                    agent.tick()?;
                    idle.push(t.elapsed());
                    // One port appears on b (as its agent claims it), then a's pass maps it;
                    // then it goes away again and a's pass unmaps it.
                    for _ in 0..2 {
                        if !table.release(extra, "b")? {
                            table.claim(extra, "b")?;
                        }
                        let t = Instant::now();
                        let report = agent.tick()?;
                        change.push(t.elapsed());
                        if !report.rules_changed {
                            return Err(LabError::io(
                                "bench",
                                std::io::Error::other("the agent saw no change"),
                            ));
                        }
                    }
                }
                Ok(RuleUpdateResult {
                    ports: n,
                    full_rebuild: summarize(full),
                    add_one: summarize(add),
                    remove_one: summarize(remove),
                    agent_pass_idle: summarize(idle),
                    agent_pass_change: summarize(change),
                })
            },
        )??;
        results.push(result);
    }
    pod.down()?;
    Ok(results)
}
