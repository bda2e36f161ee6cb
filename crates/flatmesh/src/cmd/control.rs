//! `flatmesh control`: the control center. With no subcommand it serves xDS (the work is in
//! `flatmesh_control::serve`; this file parses arguments and waits for SIGINT/SIGTERM);
//! `flatmesh control demo` is the placement/orchestration demo (cmd/control_demo.rs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use flatmesh_config::AdminAddress;
use flatmesh_control::serve::{
    CaOptions, ControlCenter, Options, OrchestratorOptions, PlacementOptions,
};

use crate::cmd::console_feed;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<ControlCommand>,
    /// Where to serve xDS (ADS over gRPC: plaintext, or TLS with --ca-dir), HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:18000")]
    listen: SocketAddr,
    /// The state to serve: a flatmesh config (YAML/JSON, docs/config.md) whose listeners, routes
    /// and clusters become LDS/RDS/CDS/EDS. Edits are pushed to every node within a second.
    /// Clusters may list no endpoints (they answer 503 until endpoints arrive).
    /// One of --state, --cluster, --kubeconfig or --in-cluster is needed (in a pod,
    /// --in-cluster is implied).
    #[arg(long, value_name = "FILE")]
    state: Option<PathBuf>,
    /// Serve the mesh of a Kubernetes cluster (docs/kubernetes.md): watch its Services,
    /// EndpointSlices, Pods and mesh routes through the API server of this kubeconfig, and
    /// serve each node (by its node id, the Kubernetes node name) what its pods need.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["state", "cluster", "in_cluster"])]
    kubeconfig: Option<PathBuf>,
    /// As --kubeconfig, with the API server of the cluster this runs in (a pod's service
    /// account). Implied when KUBERNETES_SERVICE_HOST is set and no --state or --cluster is given.
    #[arg(long, conflicts_with_all = ["state", "cluster"])]
    in_cluster: bool,
    /// With --kubeconfig or --in-cluster: also schedule the pods of `schedulerName: flatmesh`
    /// with E3's HCM placement and bind them through the Binding API (docs/kubernetes.md,
    /// "Scheduler").
    #[arg(long, conflicts_with_all = ["state", "cluster"])]
    schedule: bool,
    /// The trust domain of the pods' SPIFFE IDs (spiffe://TD/ns/NS/sa/SA) with --kubeconfig or
    /// --in-cluster. Default: the CA's with --ca-dir (it must match it), else cluster.local.
    #[arg(long, value_name = "TD")]
    trust_domain: Option<String>,
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
    /// Run the orchestrator on the node heartbeats received on this UDP address
    /// (docs/control.md): overload migrates, silence fails over, and the endpoints follow.
    /// With --cluster; or with --kubeconfig/--in-cluster and --schedule, where a move
    /// re-creates the pod on its new node (docs/kubernetes.md, "Orchestrator").
    #[arg(long, value_name = "HOST:PORT", requires = "heartbeat_keys")]
    heartbeats: Option<SocketAddr>,
    /// Each node's heartbeat key (YAML, mode 0600): node id (on Kubernetes, the node name) ->
    /// 64 hex digits (`openssl rand -hex 32`), the key that node's agent seals its heartbeats
    /// with. A heartbeat must also come from the node's IP in --addresses (on Kubernetes, its
    /// InternalIP); others are dropped.
    #[arg(long, value_name = "FILE", requires = "heartbeats")]
    heartbeat_keys: Option<PathBuf>,
    /// On Kubernetes with --schedule: run the orchestrator on the node proxies' load reports
    /// (LRS), asked for every PERIOD (like `1s`): each pod's execution time is the time it
    /// takes to answer the proxies that call it. Overload migrates (by re-creating the pod);
    /// node failures are left to Kubernetes (docs/kubernetes.md, "The orchestrator, live").
    #[arg(long, value_name = "PERIOD", conflicts_with = "heartbeats", value_parser = parse_period)]
    load_reports: Option<std::time::Duration>,
    /// Run PROGRAM STEP INSTANCE FROM TO for each step of a migration or failover restart
    /// (STEP: push-binary, remove, cleanup, migrate-state, restart); a non-zero exit fails the
    /// step. Without it the steps are only logged (instances are managed elsewhere).
    #[arg(long, value_name = "PROGRAM", requires = "heartbeats")]
    step_command: Option<PathBuf>,
    /// Be the nodes' CA with the CA of `flatmesh ca init --dir DIR`: serve over TLS (the
    /// control center presents spiffe://TD/flatmesh/control), require each node's bootstrap
    /// token, and sign nodes' CSRs for the identities placed on (or granted to) them.
    #[arg(long, value_name = "DIR", requires = "node_tokens")]
    ca_dir: Option<PathBuf>,
    /// Each node's bootstrap token and outright identity grants (YAML, mode 0600):
    /// `NODE: { token_sha256: HEX, identities: [...] }`; `flatmesh ca token --node NODE`
    /// prints an entry and its token. See docs/security.md, "The control center as CA".
    #[arg(long, value_name = "FILE", requires = "ca_dir")]
    node_tokens: Option<PathBuf>,
    /// The longest lifetime of a node's certificate, like `24h` or `30m` (nodes renew at half).
    #[arg(long, default_value = "24h", requires = "ca_dir")]
    cert_ttl: String,
    /// Serve the control center's metrics (Prometheus text, GET /metrics) on HOST:PORT: xDS
    /// streams, pushes, ACKs and NACKs, CA issuance and refusals by reason, certificate expiry,
    /// placements and migrations (docs/control.md, "Metrics").
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<SocketAddr>,
    /// Serve the web console on HOST:PORT (open http://HOST:PORT/ui): the service graph from
    /// the nodes' live traffic, each route's tier, the placement with migrations on a timeline,
    /// node health and certificate expiry (docs/console.md).
    #[arg(long, value_name = "HOST:PORT")]
    ui: Option<SocketAddr>,
    /// The port of every node proxy's admin endpoint, at the node's IP from --addresses: the
    /// console reads each node's GET /stats/routes there once a second (without it the console
    /// has no traffic, only placement and health).
    #[arg(long, value_name = "PORT", requires_all = ["ui", "cluster"])]
    node_admin_port: Option<u16>,
    /// The nodes' admin token (their admin.token_file), read from FILE.
    #[arg(long, value_name = "FILE", requires = "node_admin_port")]
    node_admin_token_file: Option<PathBuf>,
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

/// A load report period: 100 ms to 5 minutes.
fn parse_period(text: &str) -> Result<std::time::Duration, String> {
    let period = flatmesh_config::duration::parse(text)?;
    if !(std::time::Duration::from_millis(100)..=std::time::Duration::from_secs(300))
        .contains(&period)
    {
        return Err(format!(
            "{text} is out of range: give a period from 100ms to 5m (1s is usual)"
        ));
    }
    Ok(period)
}

fn serve(args: Args) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    let kubernetes = args.kubeconfig.is_some()
        || args.in_cluster
        || (args.state.is_none()
            && args.cluster.is_none()
            && std::env::var_os("KUBERNETES_SERVICE_HOST").is_some());
    if args.heartbeats.is_some() && args.cluster.is_none() && !(kubernetes && args.schedule) {
        anyhow::bail!(
            "--heartbeats runs the orchestrator on a placement: give --cluster (with --app and --addresses), or --kubeconfig with --schedule"
        );
    }
    if args.load_reports.is_some() && !(kubernetes && args.schedule) {
        anyhow::bail!(
            "--load-reports runs Kubernetes' orchestrator on the nodes' load reports: give --kubeconfig (or run in a pod) with --schedule"
        );
    }
    if args.step_command.is_some() && args.cluster.is_none() {
        anyhow::bail!(
            "--step-command drives the instances of --cluster; on Kubernetes a migration re-creates the pod on its new node and needs no command"
        );
    }
    // On Kubernetes: the orchestrator's socket and keys, read before anything starts.
    let k8s_beats = match (&args.heartbeats, &args.heartbeat_keys) {
        (Some(at), Some(keys)) if args.cluster.is_none() => {
            Some(flatmesh_k8s::schedule::orchestrate::Beats::Sealed {
                socket: std::net::UdpSocket::bind(at).with_context(|| {
                    format!(
                        "cannot receive heartbeats on {at}; pick a free address with --heartbeats"
                    )
                })?,
                keys: flatmesh_control::serve::heartbeat_keys::HeartbeatKeys::load(keys)?,
            })
        }
        _ => None,
    };
    if args.state.is_none() && args.cluster.is_none() && !kubernetes {
        anyhow::bail!(
            "nothing to serve: give --state FILE (a flatmesh config), --cluster with --app and --addresses (a placement), or --kubeconfig FILE (a Kubernetes cluster; in a pod its own is used)"
        );
    }
    let placement = match args.cluster {
        Some(cluster) => Some(PlacementOptions {
            cluster,
            apps: args.app,
            algorithm: args.algo.parse()?,
            seed: args.seed,
            addresses: args
                .addresses
                .context("--cluster needs --addresses FILE: where each node's instances serve")?,
            orchestrator: match (args.heartbeats, args.heartbeat_keys) {
                (Some(heartbeats), Some(heartbeat_keys)) => Some(OrchestratorOptions {
                    heartbeats,
                    heartbeat_keys,
                    step_command: args.step_command,
                }),
                (None, _) => None,
                (Some(_), None) => anyhow::bail!(
                    "--heartbeats needs --heartbeat-keys FILE: each node's key (docs/control.md)"
                ),
            },
        }),
        None => None,
    };
    let ca = match (args.ca_dir, args.node_tokens) {
        (Some(dir), Some(node_tokens)) => Some(CaOptions {
            dir,
            node_tokens,
            ttl: flatmesh_config::duration::parse(&args.cert_ttl)
                .map_err(anyhow::Error::msg)
                .context("--cert-ttl")?,
        }),
        _ => None,
    };
    let options = Options {
        listen: args.listen,
        state: args.state,
        placement,
        ca,
        metrics: args.metrics,
        ui: args.ui,
    };
    let token = args
        .node_admin_token_file
        .as_deref()
        .map(|path| flatmesh_config::admin::read_token_file(path).map_err(anyhow::Error::msg))
        .transpose()
        .context("--node-admin-token-file")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the xDS server runtime")?;
    rt.block_on(async {
        let mut center = ControlCenter::new(&options)?;
        let k8s_beats = match (k8s_beats, args.load_reports) {
            (Some(beats), _) => Some((beats, flatmesh_k8s::schedule::orchestrate::detector())),
            (None, Some(period)) => Some((
                flatmesh_k8s::schedule::orchestrate::Beats::LoadReports {
                    reports: center.read_load_reports(period),
                    period,
                },
                flatmesh_k8s::schedule::orchestrate::load_report_detector(period),
            )),
            (None, None) => None,
        };
        let stop_polling = Arc::new(AtomicBool::new(false));
        if let (Some(console), Some(at)) = (center.console(), center.ui_addr()) {
            tracing::info!("web console: http://{at}/ui");
            if let Some(port) = args.node_admin_port {
                let admins = center
                    .node_addresses()
                    .into_iter()
                    .map(|(node, ip)| (node, AdminAddress::Tcp(SocketAddr::new(ip, port))))
                    .collect();
                console_feed::poll_routes(&console, admins, token, stop_polling.clone());
            }
        }
        // The cluster's objects, published to every node's own state in the center's store.
        // With a CA, each node may hold (and is given over SDS) its own pods' identities.
        let _kubernetes = match kubernetes {
            true => {
                let pods = center.pod_identities();
                let options = flatmesh_k8s::Options {
                    trust_domain: pod_trust_domain(args.trust_domain, center.trust_domain())?,
                    identities: Some(Arc::new(move |by_node| pods.replace(by_node))),
                    ..Default::default()
                };
                Some(flatmesh_k8s::Controller::spawn(
                    flatmesh_k8s::connect(args.kubeconfig.as_deref()).await?,
                    center.feed().store().clone(),
                    options,
                ))
            }
            false => None,
        };
        // E3 as the scheduler of the pods of `schedulerName: flatmesh`, and with heartbeats,
        // its orchestrator.
        let _scheduler = match kubernetes && args.schedule {
            true => {
                let client = flatmesh_k8s::connect(args.kubeconfig.as_deref()).await?;
                let scheduler = flatmesh_k8s::schedule::Scheduler::spawn(
                    client.clone(),
                    flatmesh_k8s::schedule::Options::default(),
                );
                let orchestrator = match k8s_beats {
                    Some((beats, detector)) => Some(flatmesh_k8s::schedule::Orchestrator::spawn(
                        client,
                        scheduler.subscribe(),
                        flatmesh_k8s::schedule::OrchestratorOptions {
                            beats,
                            detector,
                            observer: None,
                        },
                    )?),
                    None => None,
                };
                Some((scheduler, orchestrator))
            }
            false => None,
        };
        let result = center.run(stop_signal(), None).await;
        stop_polling.store(true, Ordering::Relaxed);
        result?;
        Ok(())
    })
}

/// The trust domain of the pods' identities: `--trust-domain`, or the CA's (which signs its
/// own trust domain only), or Kubernetes' usual `cluster.local`.
fn pod_trust_domain(given: Option<String>, ca: Option<String>) -> anyhow::Result<String> {
    match (given, ca) {
        (Some(given), Some(ca)) if given != ca => anyhow::bail!(
            "--trust-domain {given} is not the trust domain of the CA of --ca-dir ({ca}): the CA could not issue the pods' identities; drop --trust-domain, or use a CA of {given} (flatmesh ca init --trust-domain {given})"
        ),
        (Some(given), _) => {
            flatmesh_identity::SpiffeId::parse(&format!("spiffe://{given}/ns/x/sa/y"))
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("--trust-domain {given}"))?;
            Ok(given)
        }
        (None, Some(ca)) => Ok(ca),
        (None, None) => Ok(flatmesh_k8s::controller::DEFAULT_TRUST_DOMAIN.to_string()),
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn stop_signal() {
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
}
