//! `flatmesh control demo`: E3's orchestrator on a small cluster of network namespaces (see
//! `flatmesh_lab::control`). This file is the command line and the terminal view; the hidden
//! `service` and `agent` subcommands are the demo's own processes (the binary re-executes itself).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use comfy_table::{Cell, Table};
use flatmesh_config::AdminAddress;
use flatmesh_control::console::{Console, NodeInfo, TimelineEntry};
use flatmesh_control::orchestrator::LogEntry;
use flatmesh_lab::control::services::{self, ServiceConfig};
use flatmesh_lab::control::{self as demo, DemoConfig, DemoEvent, Summary};

use crate::cmd::console_feed;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    opts: DemoOpts,
}

#[derive(clap::Args)]
struct DemoOpts {
    /// How long the load runs, in seconds.
    #[arg(long, default_value_t = 30)]
    duration: u64,
    /// When the load steps up, as a share of the duration.
    #[arg(long, default_value_t = 0.3)]
    step_at: f64,
    /// Requests/s before the step.
    #[arg(long, default_value_t = 60)]
    low_rps: u32,
    /// Requests/s after the step: enough to overload one emulated SmartNIC (with the greedy
    /// client's allowed share, past its CPU quota).
    #[arg(long, default_value_t = 300)]
    high_rps: u32,
    /// One extra client that sends this many requests/s, above its rate limit.
    #[arg(long, default_value_t = 60)]
    greedy_rps: u32,
    /// The API gateway's rate limit per client, requests/s.
    #[arg(long, default_value_t = 40.0)]
    rate_limit: f64,
    /// CPU of one emulated SmartNIC, in host cores (cgroup CPU bandwidth limit).
    #[arg(long, default_value_t = 0.2)]
    nic_cpu: f64,
    /// CPU work per KVS/Count/EMA request on a host core, µs (the gateway does a third of it).
    #[arg(long, default_value_t = 220)]
    work_us: u64,
    /// End this many seconds after the last migration (the recovery shown), not at --duration,
    /// which stays the limit.
    #[arg(long)]
    end_after_move: Option<u64>,
    /// Keep the working directory (configs, logs, checkpoints) in /tmp after the run.
    #[arg(long)]
    keep: bool,
    /// Print the summary as JSON on stdout (the log still goes to stderr).
    #[arg(long)]
    json: bool,
    /// Serve the web console on HOST:PORT (open http://HOST:PORT/ui): the service graph from
    /// the node proxies' live traffic, the placement, the migration on a timeline, node health
    /// (docs/console.md).
    #[arg(long, value_name = "HOST:PORT")]
    ui: Option<SocketAddr>,
}

#[derive(clap::Subcommand)]
enum Role {
    /// One microservice instance (started by the demo inside a node's namespace).
    #[command(hide = true)]
    Service(ServiceArgs),
    /// One node's heartbeat agent (started by the demo inside a node's namespace).
    #[command(hide = true)]
    Agent(AgentArgs),
}

#[derive(clap::Args)]
struct ServiceArgs {
    #[arg(long)]
    kind: String,
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    stats_listen: Option<SocketAddr>,
    #[arg(long)]
    state: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    work_iterations: u64,
    #[arg(long)]
    upstream: Option<SocketAddr>,
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    #[arg(long, default_value_t = 20.0)]
    burst: f64,
}

#[derive(clap::Args)]
struct AgentArgs {
    #[arg(long)]
    node: u32,
    #[arg(long)]
    orchestrator: SocketAddr,
    #[arg(long)]
    instances: PathBuf,
    /// The node's heartbeat key (64 hex digits, mode 0600), written by the demo.
    #[arg(long)]
    key_file: PathBuf,
    /// The node's nominal link rate, for the heartbeat's bandwidth utilisation.
    #[arg(long, default_value_t = 1000)]
    link_mbps: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.role {
        Some(Role::Service(s)) => service(s),
        Some(Role::Agent(a)) => agent(a),
        None => demo_main(args.opts),
    }
}

/// A microservice instance is one "core": a single-threaded runtime.
fn service(a: ServiceArgs) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    let cfg = ServiceConfig {
        kind: a.kind.parse()?,
        listen: a.listen,
        stats_listen: a.stats_listen,
        state_file: a.state,
        work_iterations: a.work_iterations,
        upstream: a.upstream,
        rate: a.rate,
        burst: a.burst,
        idle_exit: Duration::from_secs(1),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(services::serve(cfg))?;
    Ok(())
}

fn agent(a: AgentArgs) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(demo::node_agent::run(demo::node_agent::AgentConfig {
        node: a.node,
        orchestrator: a.orchestrator,
        instances: a.instances,
        key: flatmesh_control::heartbeat::HeartbeatKey::load(&a.key_file)?,
        link_bits_per_sec: a.link_mbps * 1_000_000,
        period: Duration::from_millis(50),
    }))?;
    Ok(())
}

fn demo_main(o: DemoOpts) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&o.step_at) {
        anyhow::bail!(
            "--step-at {} must be in [0, 1): a share of the duration",
            o.step_at
        );
    }
    if !(0.05..=1.0).contains(&o.nic_cpu) {
        anyhow::bail!(
            "--nic-cpu {} must be between 0.05 and 1 (cores of CPU per emulated SmartNIC)",
            o.nic_cpu
        );
    }
    if o.duration == 0 || o.duration > 600 {
        anyhow::bail!("--duration {} must be 1 to 600 seconds", o.duration);
    }
    if o.rate_limit <= 0.0 || !o.rate_limit.is_finite() {
        anyhow::bail!("--rate-limit must be a positive number of requests/s");
    }
    if o.work_us > 100_000 {
        anyhow::bail!(
            "--work-us {} is over 100 ms per request; use at most 100000",
            o.work_us
        );
    }
    let program =
        std::env::current_exe().context("cannot find the flatmesh binary to re-execute")?;
    let cfg = DemoConfig {
        launcher: demo::runtime::Launcher {
            program,
            service_args: vec!["control".into(), "demo".into(), "service".into()],
            agent_args: vec!["control".into(), "demo".into(), "agent".into()],
        },
        duration: Duration::from_secs(o.duration),
        step_at: o.step_at,
        low_rps: o.low_rps,
        high_rps: o.high_rps,
        greedy_rps: o.greedy_rps,
        rate_limit: o.rate_limit,
        nic_cpu: o.nic_cpu,
        work_us: o.work_us,
        keep: o.keep,
        end_after_move: o.end_after_move.map(Duration::from_secs),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let json = o.json;
    // Bound before anything starts, so a taken port fails the run at once.
    let ui =
        o.ui.map(|at| {
            let listener = std::net::TcpListener::bind(at).with_context(|| {
                format!("cannot serve the console on {at}; pick a free address with --ui")
            })?;
            listener.set_nonblocking(true)?;
            Ok::<_, anyhow::Error>(listener)
        })
        .transpose()?;
    let console = ui.as_ref().map(|_| Console::default());
    let stop_polling = Arc::new(AtomicBool::new(false));
    let summary = rt.block_on(async {
        let server = match (ui, &console) {
            (Some(listener), Some(console)) => {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                eprintln!("[setup] web console: http://{}/ui", listener.local_addr()?);
                Some(tokio::spawn(flatmesh_control::console::server::serve(
                    listener,
                    console.clone(),
                )))
            }
            _ => None,
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let feed = console.clone().map(|c| (c, stop_polling.clone()));
        let view = tokio::spawn(async move {
            let mut v = View::new(cfg.duration, feed);
            while let Some(e) = rx.recv().await {
                v.show(e);
            }
            v.finish();
        });
        let result = tokio::select! {
            r = demo::run(cfg, tx) => r.map_err(anyhow::Error::from),
            _ = tokio::signal::ctrl_c() => {
                // Dropping the demo's future tears everything down (its clean-up runs on drop).
                Err(anyhow::anyhow!("interrupted; namespaces, cgroups and processes were removed"))
            }
        };
        let _ = view.await;
        stop_polling.store(true, Ordering::Relaxed);
        if let Some(server) = server {
            server.abort();
        }
        result
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(&summary);
    }
    if summary.failed > 0 {
        anyhow::bail!(
            "{} requests failed (examples: {})",
            summary.failed,
            summary.failures.join("; ")
        );
    }
    Ok(())
}

/// The live view: a progress bar with the current numbers, and the log above it; with `--ui`,
/// the web console is fed from the same events.
struct View {
    bar: indicatif::ProgressBar,
    console: Option<(Console, Arc<AtomicBool>)>,
    /// Node ids by index (the orchestrator's signals name nodes by index).
    node_ids: Vec<String>,
}

impl View {
    fn new(duration: Duration, console: Option<(Console, Arc<AtomicBool>)>) -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(duration.as_secs()),
            indicatif::ProgressDrawTarget::stderr(),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len}s {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        View {
            bar,
            console,
            node_ids: Vec::new(),
        }
    }

    /// Feeds the web console: the model and the node pollers at the start, then heartbeat
    /// ages, the placement each second, and the orchestrator's log and steps.
    fn feed_console(&mut self, e: &DemoEvent) {
        let Some((console, stop)) = &self.console else {
            return;
        };
        match e {
            DemoEvent::Info(_) => {}
            DemoEvent::Started(start) => {
                self.node_ids = start.nodes.iter().map(|n| n.id.clone()).collect();
                let callers = start
                    .calls
                    .iter()
                    .map(|(caller, callee)| (callee.clone(), caller.clone()))
                    .collect();
                console.set_model(start.services.iter().cloned(), callers);
                console.set_nodes(
                    start
                        .nodes
                        .iter()
                        .map(|n| NodeInfo {
                            id: n.id.clone(),
                            kind: if n.smartnic { "smartnic" } else { "host" }.into(),
                            admin: Some(n.admin.to_string()),
                        })
                        .collect(),
                );
                console.set_placement(start.placement.clone());
                let admins = start
                    .nodes
                    .iter()
                    .map(|n| (n.id.clone(), AdminAddress::Tcp(n.admin)))
                    .collect();
                console_feed::poll_routes(console, admins, None, stop.clone());
            }
            DemoEvent::Tick(row) => {
                let now = Instant::now();
                let mut placement = BTreeMap::new();
                for n in &row.nodes {
                    if let Some(age) = n.heartbeat_age_ms {
                        let at = now.checked_sub(Duration::from_millis(age)).unwrap_or(now);
                        console.heartbeat(&n.node, at);
                    }
                    for i in &n.instances {
                        placement.insert(i.clone(), n.node.clone());
                    }
                }
                console.set_placement(placement);
            }
            DemoEvent::Controller { entry, .. } => {
                let ids = &self.node_ids;
                let node = |n: usize| ids.get(n).cloned().unwrap_or_else(|| format!("node {n}"));
                console.record(entry, &node, &|i| format!("instance {i}"))
            }
            DemoEvent::Step(s) => {
                let mut entry = TimelineEntry::now(
                    "step",
                    format!(
                        "step {} {} ({} → {}): {}",
                        s.step, s.instance, s.from, s.to, s.detail
                    ),
                );
                entry.instance = Some(s.instance.clone());
                console.push(entry);
            }
        }
    }

    fn line(&self, s: String) {
        if self.bar.is_hidden() {
            eprintln!("{s}");
        } else {
            self.bar.println(s);
        }
    }

    fn show(&mut self, e: DemoEvent) {
        self.feed_console(&e);
        match e {
            DemoEvent::Info(m) => self.line(format!("[setup] {m}")),
            DemoEvent::Started(start) => self.line(format!(
                "[setup] {} nodes, {} services up; HCM's placement is live",
                start.nodes.len(),
                start.services.len()
            )),
            DemoEvent::Tick(row) => {
                self.bar.set_position(row.t_s.round() as u64);
                let nics: Vec<String> = row
                    .nodes
                    .iter()
                    .filter(|n| n.smartnic)
                    .map(|n| {
                        format!(
                            "{} exec {} q {}",
                            n.node,
                            n.exec_us.map_or("-".into(), |e| format!("{e}µs")),
                            n.queue
                        )
                    })
                    .collect();
                self.bar.set_message(format!(
                    "{} req/s ok, {} failed | {}",
                    row.ok_rps,
                    row.failed,
                    nics.join(" | ")
                ));
            }
            DemoEvent::Controller { at, entry } => {
                let t = at.as_secs_f64();
                let msg = match entry {
                    LogEntry::Detected(s) => {
                        format!("DETECTED   {}", describe_signal(&s))
                    }
                    LogEntry::Migrated {
                        instance, from, to, ..
                    } => {
                        format!("MIGRATED   {instance}: {from} -> {to}; traffic follows the new endpoints")
                    }
                    LogEntry::NotMigrated { node, reason } => {
                        format!("no move     {node}: {reason}")
                    }
                    LogEntry::FailedOver { node, moved, .. } => {
                        format!("FAILOVER   {node}: {} instances re-placed", moved.len())
                    }
                    LogEntry::Error(e) => format!("error      {e}"),
                };
                self.line(format!("[{t:6.2}s] {msg}"));
            }
            DemoEvent::Step(s) => self.line(format!(
                "[{:6.2}s]   step {:<28} {} ({} -> {}): {}",
                s.at.as_secs_f64(),
                s.step,
                s.instance,
                s.from,
                s.to,
                s.detail
            )),
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn describe_signal(s: &flatmesh_control::orchestrator::Signal) -> String {
    use flatmesh_control::orchestrator::Signal;
    match s {
        Signal::Overload { node, slot, exec_us, ema_us } => format!(
            "overload on node {node}: slot {slot} took {exec_us} µs vs EMA {ema_us:.0} µs (more than 20% above)"
        ),
        Signal::HostStarvation { node, queue_len, bw_util_pct } => format!(
            "host starvation on node {node}: standing queue {queue_len} while links are {bw_util_pct}% used"
        ),
        Signal::NodeDead { node } => format!("node {node} silent: dead"),
    }
}

fn print_summary(s: &Summary) {
    println!();
    println!(
        "SmartNIC nodes are emulated wimpy cores: {} CPU each, via {}.",
        s.nic_cpu, s.throttle
    );
    let mut t = Table::new();

    let nic_names: Vec<String> = s
        .timeline
        .first()
        .map(|r| {
            r.nodes
                .iter()
                .filter(|n| n.smartnic)
                .map(|n| n.node.clone())
                .collect()
        })
        .unwrap_or_default();
    let mut header = vec![
        "t (s)".to_string(),
        "offered req/s".into(),
        "ok req/s".into(),
        "p50 ms".into(),
        "p99 ms".into(),
        "429 (total)".into(),
        "failed (total)".into(),
    ];
    for n in &nic_names {
        header.push(format!("{n} exec µs / queue"));
        header.push(format!("on {n}"));
    }
    t.set_header(header);
    for row in &s.timeline {
        let mut cells = vec![
            Cell::new(format!("{:.0}", row.t_s)),
            Cell::new(row.target_rps),
            Cell::new(row.ok_rps),
            Cell::new(row.p50_ms.map_or("-".into(), |v| format!("{v:.1}"))),
            Cell::new(row.p99_ms.map_or("-".into(), |v| format!("{v:.1}"))),
            Cell::new(row.limited),
            Cell::new(row.failed),
        ];
        for n in row.nodes.iter().filter(|n| n.smartnic) {
            cells.push(Cell::new(format!(
                "{} / {}",
                n.exec_us.map_or("-".into(), |e| e.to_string()),
                n.queue
            )));
            let short: Vec<&str> = n
                .instances
                .iter()
                .map(|i| i.rsplit('/').next().unwrap_or(i))
                .collect();
            cells.push(Cell::new(short.join(",")));
        }
        t.add_row(cells);
    }
    println!("{t}");

    let mut p = Table::new();

    p.set_header(vec!["instance", "placed by HCM on", "runs at the end on"]);
    for (inst, node) in &s.placement_before {
        let after = s.placement_after.get(inst).map_or("-", String::as_str);
        let moved = if after != node { " (migrated)" } else { "" };
        p.add_row(vec![inst.clone(), node.clone(), format!("{after}{moved}")]);
    }
    println!("{p}");

    for d in &s.detections {
        println!("detected  at {:5.2}s  {}: {}", d.at_s, d.node, d.signal);
    }
    for m in &s.migrations {
        println!(
            "migrated  at {:5.2}s  {}: {} -> {}",
            m.at_s, m.instance, m.from, m.to
        );
    }
    for (n, (times, secs)) in &s.throttled {
        println!("throttled {n}: {times} periods, {secs:.2} s in total (cgroup cpu.stat)");
    }
    println!(
        "requests: {} sent, {} ok, {} rate-limited (429, by design), {} failed, {} shed by the load generator; {} heartbeats; {} endpoint versions published",
        s.sent, s.ok, s.limited, s.failed, s.shed, s.heartbeats, s.endpoint_versions
    );
    if s.cleanup_left.is_empty() {
        println!(
            "cleaned up: namespaces, bridge, cgroups, processes and working directory removed"
        );
    } else {
        println!("could not remove: {}", s.cleanup_left.join(", "));
    }
}
