//! `flatmesh control`: the control center. With no subcommand it serves xDS (issue 9);
//! `flatmesh control demo` is the placement/orchestration demo (cmd/control_demo.rs, issue 8).
//!
//! The xDS server serves the control center's state (`flatmesh_xds::feed`): a state file in
//! flatmesh's config model (listeners, routes, clusters; watched, reloaded on change) and, with
//! `--cluster`/`--app`, the endpoints of the placed instances. With `--heartbeats` the E3
//! orchestrator runs too: overloaded SmartNICs shed their hottest instance to a host and dead
//! nodes fail over, and every move is an EDS push to the nodes and Envoy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use flatmesh_control::endpoints::{snapshot, EndpointSink as _};
use flatmesh_control::model::{load_app, load_cluster};
use flatmesh_control::orchestrator::{Controller, DetectorConfig, LogEntry, Runtime, Step};
use flatmesh_control::placement::{place, Algorithm, State};
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;
use flatmesh_xds::feed::{Addresses, Feed, XdsSink};
use flatmesh_xds::server::Store;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<ControlCommand>,
    /// Where to serve xDS (ADS over plaintext gRPC), HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:18000")]
    listen: SocketAddr,
    /// The state to serve: a flatmesh config (YAML/JSON, docs/config.md) whose listeners, routes
    /// and clusters become LDS/RDS/CDS/EDS. Edits are pushed to every node within a second.
    /// Clusters may list no endpoints (they answer 503 until endpoints arrive).
    #[arg(long, value_name = "FILE", required_unless_present = "cluster")]
    state: Option<PathBuf>,
    /// Place applications on this cluster (a YAML file or preset:NAME, as in `flatmesh place`)
    /// and serve each placed service APP/STAGE as the EDS cluster of that name.
    #[arg(long, value_name = "SOURCE", requires_all = ["app", "addresses"])]
    cluster: Option<String>,
    /// An application to place (a YAML file or preset:NAME); repeat for several.
    #[arg(long, value_name = "SOURCE", requires = "cluster")]
    app: Vec<String>,
    /// Placement algorithm: hcm, anneal or ilp.
    #[arg(long, default_value = "hcm", requires = "cluster")]
    algo: String,
    /// Seed for annealing.
    #[arg(long, default_value_t = 1, requires = "cluster")]
    seed: u64,
    /// Where placed instances serve (YAML): `nodes:` node id -> IP, `services:` APP/STAGE ->
    /// port of shard 0 (shard k serves on port + k). See docs/xds.md.
    #[arg(long, value_name = "FILE", requires = "cluster")]
    addresses: Option<PathBuf>,
    /// Run the orchestrator on the 16-byte node heartbeats received on this UDP address
    /// (docs/control.md): overload migrates, silence fails over, and the endpoints follow.
    #[arg(long, value_name = "HOST:PORT", requires = "cluster")]
    heartbeats: Option<SocketAddr>,
    /// Run PROGRAM STEP INSTANCE FROM TO for each step of a migration or failover restart
    /// (STEP: push-binary, remove, cleanup, migrate-state, restart); a non-zero exit fails the
    /// step. Without it the steps are only logged (instances are managed elsewhere).
    #[arg(long, value_name = "PROGRAM", requires = "heartbeats")]
    step_command: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
enum ControlCommand {
    /// Nodes in network namespaces, emulated SmartNIC cores, real services; overload moves them.
    Demo(crate::cmd::control_demo::Args),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Some(ControlCommand::Demo(demo)) => crate::cmd::control_demo::run(demo),
        None => serve(args),
    }
}

fn serve(args: Args) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    let (config, mut loaded) = match &args.state {
        Some(path) => {
            let stamp = modified(path);
            (load(path)?, stamp)
        }
        None => (flatmesh_xds::bootstrap::empty_config(), None),
    };
    let feed = Feed::new(Store::new(), config);

    // The placement, if asked for: its model lives as long as the server.
    let placed = match &args.cluster {
        Some(cluster) => Some(Placed::new(&args, cluster)?),
        None => None,
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the xDS server runtime")?;
    rt.block_on(async {
        let watcher = args.state.clone().map(|state| {
            let feed = feed.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    let now = modified(&state);
                    if now != loaded {
                        loaded = now;
                        match load(&state) {
                            Ok(config) => feed.set_config(config),
                            Err(e) => {
                                tracing::error!(error = %format!("{e:#}"), "state file refused; still serving the previous state")
                            }
                        }
                    }
                }
            })
        });
        let shutdown = async {
            use tokio::signal::unix::{signal, SignalKind};
            if let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
        };
        let server = flatmesh_xds::server::serve(args.listen, feed.store().clone(), None, shutdown);
        let result = match &placed {
            Some(placed) => placed.run(&args, feed.clone(), server).await,
            None => server.await.map_err(anyhow::Error::from),
        };
        if let Some(w) = watcher {
            w.abort();
        }
        result
    })
}

fn modified(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Read and validate the state file.
fn load(path: &std::path::Path) -> anyhow::Result<flatmesh_config::Config> {
    let config = flatmesh_xds::load_base(path)?;
    tracing::info!(
        state = %path.display(),
        listeners = config.listeners.len(),
        clusters = config.clusters.len(),
        "serving state"
    );
    Ok(config)
}

/// The placed applications: the cluster and workload models, where HCM (or the chosen
/// algorithm) put every instance, and where each instance serves.
struct Placed {
    topo: Topology,
    wl: Workload,
    assign: Vec<usize>,
    addresses: Addresses,
}

impl Placed {
    fn new(args: &Args, cluster: &str) -> anyhow::Result<Placed> {
        let algo: Algorithm = args.algo.parse()?;
        let topo = Topology::build(&load_cluster(cluster)?)?;
        let apps = args
            .app
            .iter()
            .map(|a| load_app(a))
            .collect::<Result<Vec<_>, _>>()?;
        let wl = Workload::from_apps(&apps)?;
        let path = args
            .addresses
            .as_ref()
            .context("--cluster needs --addresses FILE: where each node's instances serve")?;
        let addresses = Addresses::load(path)?;
        addresses.check(&topo, &wl, &path.display().to_string())?;
        let p = place(&topo, &wl, algo, args.seed)
            .with_context(|| format!("placing on {} with {}", topo.name, algo.name()))?;
        tracing::info!(
            cluster = %topo.name,
            instances = wl.instances.len(),
            algorithm = algo.name(),
            "placed"
        );
        Ok(Placed {
            topo,
            wl,
            assign: p.assign,
            addresses,
        })
    }

    /// Publish the placement's endpoints and serve; with `--heartbeats`, run the orchestrator
    /// alongside the server until either stops.
    async fn run(
        &self,
        args: &Args,
        feed: Feed,
        server: impl std::future::Future<Output = flatmesh_xds::Result<()>>,
    ) -> anyhow::Result<()> {
        let mut state = State::new(&self.topo, &self.wl);
        for (i, &n) in self.assign.iter().enumerate() {
            state.place(i, n);
        }
        for (i, inst) in self.wl.instances.iter().enumerate() {
            if let Some(n) = state.assign[i] {
                tracing::info!(instance = %inst.id, node = %self.topo.nodes[n].id, "placement");
            }
        }
        let mut sink = XdsSink {
            feed,
            addresses: self.addresses.clone(),
        };
        let Some(listen) = args.heartbeats else {
            sink.publish(&snapshot(&state, 1))?;
            return server.await.map_err(anyhow::Error::from);
        };
        let socket = tokio::net::UdpSocket::bind(listen).await.with_context(|| {
            format!("cannot receive heartbeats on {listen}; pick a free address with --heartbeats")
        })?;
        tracing::info!(address = %listen, nodes = self.topo.nodes.len(), "orchestrator: receiving heartbeats (node index = position in `flatmesh place --json` nodes)");
        let runtime = StepCommand {
            program: args.step_command.clone(),
        };
        let mut controller = Controller::new(state, DetectorConfig::default(), runtime, sink)?;
        let (log_tx, mut log_rx) = tokio::sync::mpsc::unbounded_channel();
        controller.observer = Some(log_tx);
        tokio::spawn(async move {
            while let Some(entry) = log_rx.recv().await {
                log_entry(&entry);
            }
        });
        let (beats_tx, beats_rx) = tokio::sync::mpsc::channel(1024);
        let receiver = tokio::spawn(async move {
            if let Err(e) = flatmesh_control::agent::receive(&socket, beats_tx).await {
                tracing::error!(error = %e, "heartbeat socket failed; the orchestrator stops");
            }
        });
        let result = tokio::select! {
            result = server => result.map_err(anyhow::Error::from),
            result = controller.run(beats_rx) => result.map_err(anyhow::Error::from),
        };
        receiver.abort();
        result
    }
}

fn log_entry(entry: &LogEntry) {
    match entry {
        LogEntry::Detected(signal) => tracing::warn!(?signal, "orchestrator: detected"),
        LogEntry::Migrated {
            instance, from, to, ..
        } => {
            tracing::info!(%instance, %from, %to, "orchestrator: migrated; endpoints pushed over EDS")
        }
        LogEntry::NotMigrated { node, reason } => {
            tracing::warn!(%node, %reason, "orchestrator: not migrated")
        }
        LogEntry::FailedOver { node, moved, .. } => {
            tracing::warn!(%node, moved = moved.len(), "orchestrator: failed over; endpoints pushed over EDS")
        }
        LogEntry::Error(e) => tracing::error!(error = %e, "orchestrator"),
    }
}

/// The orchestrator's migration steps: `PROGRAM STEP INSTANCE FROM TO` per step, or only a log
/// line when no program is given (the instances are started and stopped by something else).
struct StepCommand {
    program: Option<PathBuf>,
}

/// Longest a step program may run before the step counts as failed.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

fn step_slug(step: Step) -> &'static str {
    match step {
        Step::PushBinary => "push-binary",
        Step::Remove => "remove",
        Step::Cleanup => "cleanup",
        Step::MigrateState => "migrate-state",
        Step::Restart => "restart",
    }
}

impl Runtime for StepCommand {
    fn step(
        &self,
        step: Step,
        instance: &str,
        from: &str,
        to: &str,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send {
        let program = self.program.clone();
        let args: Vec<String> = vec![
            step_slug(step).to_string(),
            instance.to_string(),
            from.to_string(),
            to.to_string(),
        ];
        async move {
            let Some(program) = program else {
                tracing::info!(step = %args[0], instance = %args[1], from = %args[2], to = %args[3], "orchestrator step (no --step-command: logged only)");
                return Ok(());
            };
            tokio::task::spawn_blocking(move || run_step(&program, &args))
                .await
                .map_err(|e| format!("the step runner failed: {e}"))?
        }
    }
}

/// Run one step program to completion (or kill it at [`STEP_TIMEOUT`]). Its stdout and stderr
/// go to this process's, so whatever it says lands in the control center's log.
fn run_step(program: &std::path::Path, args: &[String]) -> Result<(), String> {
    let shown = format!("{} {}", program.display(), args.join(" "));
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run `{shown}`: {e}; check --step-command"))?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("`{shown}` failed ({status})")),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "`{shown}` did not finish within {} s and was killed",
                    STEP_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("cannot wait for `{shown}`: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn step_programs_run_and_failures_are_reported() {
        let dir = std::env::temp_dir().join(format!("flatmesh-step-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("steps.log");
        let script = dir.join("step.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"$@\" >> {}\n[ \"$1\" != fail-me ] || exit 3\n",
                log.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let args = |step: &str| -> Vec<String> {
            [step, "app/s-0", "a", "b"]
                .iter()
                .map(|s| s.to_string())
                .collect()
        };
        run_step(&script, &args("push-binary")).unwrap();
        let e = run_step(&script, &args("fail-me")).unwrap_err();
        assert!(e.contains("fail-me app/s-0 a b") && e.contains("3"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "push-binary app/s-0 a b\nfail-me app/s-0 a b\n"
        );
        let e = run_step(&dir.join("missing"), &args("restart")).unwrap_err();
        assert!(
            e.contains("cannot run") && e.contains("--step-command"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
