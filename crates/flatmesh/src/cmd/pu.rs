//! `flatmesh pu ...`: split network namespace across processing units (crates/pu, issue 7).

use std::path::PathBuf;

use anyhow::Context as _;
use comfy_table::Table;
use flatmesh_lab::pu::{demo, mesh};
use flatmesh_pu::backend::{for_config, run_on};
use flatmesh_pu::{cleanup, SplitConfig};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Create the PUs of a split namespace (network namespaces, cpusets, veth links).
    Up(ConfigArg),
    /// Run the agent of one PU: keeps the global port table and this PU's rules up to date.
    Agent {
        /// The PU this agent runs on.
        #[arg(long)]
        pu: String,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Run a command on a PU (its network namespace and CPUs), e.g. an app or a proxy.
    Run {
        #[arg(long)]
        pu: String,
        #[command(flatten)]
        config: ConfigArg,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Show the port table, the agents and each PU's rules.
    Status(ConfigArg),
    /// Remove the PUs, links, rules and port table of a split namespace.
    Down(ConfigArg),
    /// Remove leftovers of split namespaces (after a crash): all, or one with --namespace.
    Cleanup {
        #[arg(long)]
        namespace: Option<String>,
        #[arg(long, default_value = "/run/flatmesh/pu")]
        state_dir: PathBuf,
    },
    /// Two PUs, an app on one, the flatmesh node proxy on the other: direct calls, a port
    /// conflict, and intercepted calls through the proxy with their original destinations, as a
    /// table. Cleans up after itself (and after a killed earlier run).
    Demo {
        #[arg(long, default_value = "fmdemo")]
        namespace: String,
        #[arg(long, default_value = "/run/flatmesh/pu")]
        state_dir: PathBuf,
        /// Do not start `flatmesh node` on the dpu PU (skips the rows through it).
        #[arg(long)]
        no_node_proxy: bool,
        /// HeteroK8s-Mesh-All instead (papers/004 Fig. 8): client and server on the host PU, the
        /// node proxy on the host, on the DPU over veth, and on the DPU over shared memory,
        /// measured side by side (latency and CPU per request, a table and two SVG charts).
        #[arg(long)]
        mesh: bool,
        /// --mesh: interleaved rounds per placement.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// --mesh: seconds of load per round.
        #[arg(long, default_value_t = 3)]
        seconds: u64,
        /// --mesh: client connections (one request in flight on each).
        #[arg(long, default_value_t = 1)]
        connections: usize,
        /// --mesh: where the charts go (pu-mesh-latency.svg, pu-mesh-cpu.svg).
        #[arg(long, default_value = ".")]
        plots: PathBuf,
        /// --mesh: hold the CPUs out of idle states for the run (/dev/cpu_dma_latency = 0), so
        /// that a wake-up on the other CPU does not measure a VM's halted vCPU.
        #[arg(long)]
        cpus_awake: bool,
    },
    /// The microservices of `demo --mesh` (run on a PU by the demo itself).
    #[command(hide = true)]
    App {
        #[command(subcommand)]
        app: App,
    },
    /// Benchmarks: mapping cost vs a plain veth path, and rule update time vs port count.
    Bench(BenchArgs),
}

#[derive(clap::Subcommand)]
enum App {
    /// An HTTP/1.1 service answering every request.
    Serve {
        #[arg(long)]
        listen: std::net::SocketAddr,
    },
    /// Closed-loop HTTP/1.1 load; prints one JSON line.
    Load {
        #[arg(long)]
        target: std::net::SocketAddr,
        #[arg(long, default_value_t = 1)]
        connections: usize,
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
}

#[derive(clap::Args)]
struct ConfigArg {
    /// The split-namespace config (YAML); see docs/pu.md.
    #[arg(long, short)]
    config: PathBuf,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Round trips (and connections) per path.
    #[arg(long, default_value_t = 5000)]
    iterations: usize,
    /// Port counts for the rule-update benchmark.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    ports: Vec<usize>,
    #[arg(long, default_value = "/run/flatmesh/pu")]
    state_dir: PathBuf,
}

fn load(arg: &ConfigArg) -> anyhow::Result<SplitConfig> {
    Ok(SplitConfig::load(&arg.config)?)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    match args.command {
        Sub::Up(c) => {
            let config = load(&c)?;
            for_config(&config).up()?;
            println!(
                "split namespace `{}` is up: PUs {}; start one agent per PU with `flatmesh pu agent --pu NAME --config {}`",
                config.namespace,
                config.pu_names().join(", "),
                c.config.display()
            );
            Ok(())
        }
        Sub::Agent { pu, config } => {
            let config = load(&config)?;
            let backend = for_config(&config);
            let stop = flatmesh_pu::agent::stop_on_signals();
            flatmesh_pu::Agent::run(&config, &pu, backend.as_ref(), stop)?;
            Ok(())
        }
        Sub::Run {
            pu,
            config,
            command,
        } => {
            let config = load(&config)?;
            let index = config.pu_index(&pu).with_context(|| {
                format!("no PU `{pu}`; the PUs are {}", config.pu_names().join(", "))
            })?;
            let backend = for_config(&config);
            let (program, rest) = command.split_first().context("no command given")?;
            let status = backend
                .command(index, program.as_ref())?
                .args(rest)
                .status()
                .with_context(|| format!("cannot run {program}"))?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Sub::Status(c) => status(&load(&c)?),
        Sub::Down(c) => {
            let config = load(&c)?;
            for_config(&config).down()?;
            let _ = std::fs::remove_dir_all(config.table_dir());
            println!("split namespace `{}` removed", config.namespace);
            Ok(())
        }
        Sub::Cleanup {
            namespace,
            state_dir,
        } => {
            let report = cleanup::cleanup(namespace.as_deref(), &state_dir)?;
            if report.is_empty() {
                println!("nothing to clean up");
            }
            for ns in &report.netns {
                println!("removed network namespace {ns}");
            }
            for cg in &report.cgroups {
                println!("removed cgroup {}", cg.display());
            }
            for d in &report.port_tables {
                println!("removed port table and bind hook {}", d.display());
            }
            for d in &report.state_dirs {
                println!("removed state {}", d.display());
            }
            for t in &report.host_tables {
                println!(
                    "removed nftables table {t} from the HOST namespace (it should never be there)"
                );
            }
            Ok(())
        }
        Sub::Demo {
            namespace,
            state_dir,
            mesh: true,
            rounds,
            seconds,
            connections,
            plots,
            cpus_awake,
            ..
        } => run_mesh(
            mesh::MeshOptions {
                namespace,
                state_dir,
                flatmesh: std::env::current_exe().context("cannot find the flatmesh binary")?,
                library: crate::cmd::shm::find_library()?,
                rounds,
                seconds,
                connections,
                cpus_awake,
            },
            &plots,
        ),
        Sub::Demo {
            namespace,
            state_dir,
            no_node_proxy,
            ..
        } => run_demo(namespace, state_dir, no_node_proxy),
        Sub::App { app } => match app {
            App::Serve { listen } => Ok(mesh::serve(listen)?),
            App::Load {
                target,
                connections,
                seconds,
            } => {
                let line = mesh::load(target, connections, seconds)?;
                println!("{}", serde_json::to_string(&line)?);
                Ok(())
            }
        },
        Sub::Bench(b) => bench(b),
    }
}

fn run_demo(namespace: String, state_dir: PathBuf, no_node_proxy: bool) -> anyhow::Result<()> {
    let node_proxy = if no_node_proxy {
        None
    } else {
        Some(std::env::current_exe().context("cannot find the flatmesh binary")?)
    };
    println!("building split namespace `{namespace}`: PU host (CPU 0, the app) and PU dpu (CPU 1, the flatmesh node proxy, the uplink) ...");
    let report = demo::run_demo(&demo::DemoOptions {
        namespace,
        state_dir,
        node_proxy,
    })?;
    let mut table = Table::new();
    table.set_header([
        "call",
        "from PU",
        "dialed",
        "handled by",
        "what the receiver saw",
        "ok",
    ]);
    for r in &report.rows {
        table.add_row([
            r.call.as_str(),
            r.from.as_str(),
            r.dialed.as_str(),
            r.handled_by.as_str(),
            r.seen.as_str(),
            if r.ok { "yes" } else { "NO" },
        ]);
    }
    println!("{table}");
    let ports: Vec<String> = report
        .port_table
        .iter()
        .map(|(p, o)| format!("{p}->{o}"))
        .collect();
    println!("global port table: {}", ports.join(", "));
    for n in &report.notes {
        println!("note: {n}");
    }
    let failed = report.rows.iter().filter(|r| !r.ok).count();
    if failed > 0 {
        anyhow::bail!("{failed} demo row(s) failed");
    }
    Ok(())
}

fn run_mesh(opts: mesh::MeshOptions, plots: &std::path::Path) -> anyhow::Result<()> {
    println!(
        "HeteroK8s-Mesh-All in split namespace `{}`: client and server on PU host (CPU 0), the flatmesh node proxy on host or on PU dpu (CPU 1); {} round(s) of {} s per placement, {} connection(s){} ...",
        opts.namespace,
        opts.rounds,
        opts.seconds,
        opts.connections,
        if opts.cpus_awake { ", CPUs held out of idle states" } else { "" }
    );
    let steps = (opts.rounds * mesh::Placement::ALL.len()) as u64;
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(steps),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // `pos` counts the steps started: the one running is shown with its number.
    let results = mesh::run_mesh(&opts, &|step| {
        bar.inc(1);
        bar.set_message(step.to_string());
    })?;
    bar.finish_and_clear();
    let mut table = Table::new();
    table.set_header([
        "placement",
        "p50 (µs)",
        "p99 (µs)",
        "requests/s",
        "host CPU per request (µs)",
        "DPU CPU per request (µs)",
        "on shared memory (client, node proxy)",
        "errors",
    ]);
    for r in &results {
        table.add_row([
            r.placement.label().to_string(),
            format!("{:.0}", r.p50_us),
            format!("{:.0}", r.p99_us),
            format!("{:.0}", r.requests_per_second()),
            format!("{:.1}", r.host_cpu_us),
            format!("{:.1}", r.dpu_cpu_us),
            format!("{}, {}", r.shm_connections, r.shm_node_connections),
            r.errors.to_string(),
        ]);
    }
    println!("{table}");
    let by = |p: mesh::Placement| results.iter().find(|r| r.placement == p);
    if let (Some(host), Some(veth), Some(shm)) = (
        by(mesh::Placement::Host),
        by(mesh::Placement::DpuVeth),
        by(mesh::Placement::DpuShm),
    ) {
        println!(
            "p50, proxy on the DPU over shared memory vs on the host CPU: {:.2}x (target <= 1.2x); over veth: {:.2}x",
            shm.p50_us / host.p50_us,
            veth.p50_us / host.p50_us
        );
        println!(
            "host CPU per request, proxy on the DPU over shared memory vs on the host CPU: {:.2}x",
            shm.host_cpu_us / host.host_cpu_us
        );
    }
    std::fs::create_dir_all(plots).with_context(|| format!("cannot create {}", plots.display()))?;
    let (latency, cpu) = mesh::charts(&results);
    for (name, svg) in [("pu-mesh-latency.svg", latency), ("pu-mesh-cpu.svg", cpu)] {
        let path = plots.join(name);
        std::fs::write(&path, svg).with_context(|| format!("cannot write {}", path.display()))?;
        println!("chart: {}", path.display());
    }
    let failed: u64 = results.iter().map(|r| r.errors).sum();
    let shm = by(mesh::Placement::DpuShm).map_or(0, |r| r.shm_connections);
    if shm == 0 {
        anyhow::bail!("placement (c) never moved a connection to shared memory; see the node log under the state directory");
    }
    if failed > 0 {
        anyhow::bail!("{failed} request(s) failed");
    }
    Ok(())
}

fn status(config: &SplitConfig) -> anyhow::Result<()> {
    let backend = for_config(config);
    let topo = backend.topology().clone();
    let port_table = flatmesh_pu::PortTable::new(config);
    let state = port_table.read()?;
    let mut table = Table::new();
    table.set_header([
        "PU",
        "network namespace",
        "agent",
        "ports owned",
        "rules (remote ports mapped)",
    ]);
    for (i, pu) in topo.pus.iter().enumerate() {
        let agent = match state.agents.get(pu) {
            Some(pid) if std::path::Path::new(&format!("/proc/{pid}")).exists() => {
                format!("pid {pid}")
            }
            Some(pid) => format!("pid {pid} (gone; restart it with `flatmesh pu agent`)"),
            None => "not running".into(),
        };
        let owned = state.ports.values().filter(|o| *o == pu).count();
        let rules = if backend.exists(i) {
            let nft_table = topo.nft_table();
            let out = run_on(backend.as_ref(), i, || {
                flatmesh_pu::exec::run("nft", &["list", "map", "ip", &nft_table, "remote_ports"])
            })?;
            match out {
                Ok(text) => flatmesh_pu::rules::count_mapped(&text).to_string(),
                Err(_) => "no table (no agent has run)".into(),
            }
        } else {
            "PU missing (run `flatmesh pu up`)".into()
        };
        table.add_row([pu.clone(), topo.netns(i), agent, owned.to_string(), rules]);
    }
    println!("{table}");
    let ports: Vec<String> = state
        .ports
        .iter()
        .map(|(p, o)| format!("{p}->{o}"))
        .collect();
    println!("port table ({} ports): {}", ports.len(), ports.join(", "));
    let hook = flatmesh_kernel::PuPorts::stats(port_table.path())?;
    println!(
        "bind hook ({}): {} binds claimed a port, {} refused with EADDRINUSE",
        port_table.path().display(),
        hook.claimed,
        hook.refused
    );
    Ok(())
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    use flatmesh_lab::pu::bench;
    bench::check_args(args.iterations, &args.ports)?;
    println!("## Mapping cost: cross-PU connection set-up and 64-byte round trip (client PU a on CPU 0, server PU b on CPU 1)\n");
    println!(
        "{} connections and {} round trips per path, 5 interleaved rounds.\n",
        args.iterations, args.iterations
    );
    println!("| path | connect p50 (µs) | connect p99 (µs) | connect mean (µs) | RTT p50 (µs) | RTT p99 (µs) | RTT mean (µs) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let paths = bench::mapping_cost(&args.state_dir, args.iterations)?;
    for p in &paths {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            p.path, p.connect.p50, p.connect.p99, p.connect.mean, p.rtt.p50, p.rtt.p99, p.rtt.mean
        );
    }
    if let (Some(plain), Some(mapped)) = (paths.get(1), paths.get(2)) {
        println!(
            "\nmapping vs plain veth: connect p50 x{:.2} (+{:.1} µs), RTT p50 x{:.2} (+{:.1} µs)",
            mapped.connect.p50 / plain.connect.p50,
            mapped.connect.p50 - plain.connect.p50,
            mapped.rtt.p50 / plain.rtt.p50,
            mapped.rtt.p50 - plain.rtt.p50
        );
    }
    println!("\n## Rule update time vs mapped port count\n");
    println!("| ports | full rebuild p50 (ms) | add one port p50 (ms) | remove one port p50 (ms) | agent pass, no change p50 (ms) | agent pass, one change p50 (ms) |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for r in bench::rule_updates(&args.state_dir, &args.ports, 10)? {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.ports,
            r.full_rebuild.p50 / 1000.0,
            r.add_one.p50 / 1000.0,
            r.remove_one.p50 / 1000.0,
            r.agent_pass_idle.p50 / 1000.0,
            r.agent_pass_change.p50 / 1000.0
        );
    }
    Ok(())
}
