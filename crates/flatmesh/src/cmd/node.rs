//! `flatmesh node`: run the node proxy until SIGINT/SIGTERM. Its config comes from a YAML file
//! (`--config`), from a control plane over xDS (`--xds`, with `--config` optional for node
//! settings and static resources), or from an Envoy v3 bootstrap (`--envoy-config`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use flatmesh_proxy::{ConfigSource, Draining, Node};
use flatmesh_xds::apply::StartThenReload;
use flatmesh_xds::client::{Apply as _, Client, Options, Protocol};
use flatmesh_xds::identities::IdentityOptions;
use flatmesh_xds::secure::ChannelSecurity;

#[derive(clap::Args)]
pub struct Args {
    /// The node's YAML config. Changes to it (or SIGHUP) reload it without dropping requests.
    /// With --xds it is optional and gives node settings plus any static listeners/clusters.
    #[arg(long, short, required_unless_present_any = ["xds", "envoy_config"])]
    config: Option<PathBuf>,
    /// Take listeners, routes, clusters and endpoints from this xDS (ADS) server, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT", requires = "node_id")]
    xds: Option<String>,
    /// The node id sent to the xDS server.
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// Speak incremental (delta) xDS instead of state-of-the-world.
    #[arg(long, requires = "xds")]
    xds_delta: bool,
    /// Run the static_resources of an Envoy v3 bootstrap file (YAML or JSON), within the
    /// subset flatmesh supports (docs/xds.md).
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    envoy_config: Option<PathBuf>,
    /// Speak TLS to the xDS server and trust this bundle (PEM: the `ca.pem` of its CA); the
    /// server must present spiffe://TD/flatmesh/control of that trust domain. The file is
    /// re-read when it changes (checked at each connection), so a root rotation's new ca.pem
    /// is taken up without a restart.
    #[arg(long, value_name = "FILE", requires = "xds")]
    xds_ca: Option<PathBuf>,
    /// A file holding this node's bootstrap token, sent on every call to the control center.
    #[arg(long, value_name = "FILE", requires = "xds")]
    bootstrap_token: Option<PathBuf>,
    /// A workload identity this node presents (repeatable): its certificate comes from the
    /// control center, which gives it only if the identity is placed on this node, and is kept
    /// in --identity-dir as ns.NS.sa.SA.pem/.key, renewed at half its lifetime.
    #[arg(long, value_name = "SPIFFE_ID", requires_all = ["xds_ca", "bootstrap_token", "identity_dir"])]
    identity: Vec<String>,
    /// Also hold the node's own identity, spiffe://TD/ns/flatmesh-system/sa/node/NODE_ID
    /// (TD: --xds-ca's trust domain), which only this node's token obtains; kept in
    /// --identity-dir as ns.flatmesh-system.sa.node.NODE_ID.pem/.key (a `/` in the node id
    /// becomes `.`) and renewed like the others, for the hbone listener and tunnel clusters.
    #[arg(long, requires_all = ["xds_ca", "bootstrap_token", "identity_dir"])]
    node_identity: bool,
    /// Where workload certificates and the trust bundle (bundle.pem) are written.
    #[arg(long, value_name = "DIR")]
    identity_dir: Option<PathBuf>,
    /// The certificate lifetime to ask for (the control center may give less).
    #[arg(long, default_value = "24h")]
    identity_ttl: String,
    /// Where SDS secrets pushed over xDS are written (certificates, keys mode 0600, trust
    /// bundles); listeners and clusters that name a secret read it from there.
    #[arg(long, value_name = "DIR", requires = "xds")]
    sds_dir: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    match (&args.xds, &args.envoy_config, &args.config) {
        (Some(server), _, _) => run_xds(&args, server.clone()),
        (None, Some(envoy), _) => {
            let config = flatmesh_xds::bootstrap::load(envoy)?;
            let stop = StopSignals::register()?;
            let node = Node::start(config, ConfigSource::Inline)?;
            tracing::info!(admin = %node.admin_addr(), envoy_config = %envoy.display(), "flatmesh node is ready (Envoy bootstrap imported)");
            wait_and_stop(node, stop)
        }
        (None, None, Some(path)) => {
            let config = flatmesh_config::load(path).map_err(|e| anyhow::anyhow!("{e}"))?;
            let stop = StopSignals::register()?;
            let node = Node::start(config, ConfigSource::File(path.clone()))?;
            tracing::info!(admin = %node.admin_addr(), config = %path.display(), "flatmesh node is ready");
            wait_and_stop(node, stop)
        }
        (None, None, None) => {
            anyhow::bail!("give --config FILE, --envoy-config FILE or --xds HOST:PORT --node-id ID")
        }
    }
}

fn run_xds(args: &Args, server: String) -> anyhow::Result<()> {
    let base = match (&args.config, &args.envoy_config) {
        (Some(path), _) => flatmesh_xds::load_base(path)?,
        (None, Some(envoy)) => flatmesh_xds::bootstrap::load(envoy)?,
        (None, None) => flatmesh_xds::bootstrap::empty_config(),
    };
    let node_id = args.node_id.clone().context("--xds needs --node-id ID")?;
    let security = channel_security(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("flatmesh-xds")
        .enable_all()
        .build()
        .context("cannot start the xDS client runtime")?;
    // Certificates first: the static config may name their files.
    let identities = match &args.identity_dir {
        Some(dir) => {
            let options = identity_options(args, &server, security.clone(), dir.clone())?;
            let held = rt.block_on(flatmesh_xds::identities::fetch_all(
                &options,
                IDENTITY_PATIENCE,
            ))?;
            Some((options, held))
        }
        None => None,
    };
    let stop = StopSignals::register()?;
    let (mut apply, node) = StartThenReload::new(
        |config| Node::start(config, ConfigSource::Inline).map_err(|e| e.to_string()),
        |node: &Node, config| node.reload(config).map_err(|e| e.to_string()),
    );
    // Start at once with the static part, so the admin endpoint is up before the control plane answers.
    apply
        .apply(base.clone())
        .map_err(|e| anyhow::anyhow!("cannot start the node: {e}"))?;
    if let Some(n) = node.lock().as_ref() {
        tracing::info!(admin = %n.admin_addr(), xds = %server, node_id = %node_id, "flatmesh node is ready; waiting for xDS");
    }
    if let Some((options, held)) = identities {
        let node = node.clone();
        rt.spawn(flatmesh_xds::identities::keep_renewed(options, held, move || {
            if let Some(n) = node.lock().as_ref() {
                if let Err(e) = n.reload_files() {
                    tracing::error!(error = %e, "renewed certificates not taken up; the node keeps the previous ones until the next renewal");
                }
            }
        }));
    }
    let options = Options {
        server,
        node_cluster: node_id.clone(),
        node_id,
        protocol: if args.xds_delta {
            Protocol::Delta
        } else {
            Protocol::Sotw
        },
        security,
        sds_dir: args.sds_dir.clone(),
        // Every node reports its endpoints' load over LRS; a control plane without LRS
        // refuses the stream and the node asks again only now and then.
        load_reports: Some(flatmesh_xds::lrs::LoadSource(Arc::new({
            let node = node.clone();
            move || {
                node.lock()
                    .as_ref()
                    .map(Node::take_load_reports)
                    .unwrap_or_default()
            }
        }))),
    };
    let client = rt.block_on(async { Client::spawn(options, base, apply) });
    // The client runs on `rt`'s own worker thread while this one waits for a signal.
    let draining = node.lock().as_ref().map(Node::draining);
    stop.wait(draining);
    rt.block_on(client.stop());
    let running = node.lock().take();
    if let Some(n) = running {
        tracing::info!("stopping: draining in-flight connections");
        n.shutdown();
    }
    Ok(())
}

/// TLS (trusting --xds-ca, expecting the control center's SPIFFE ID) and the bootstrap token.
fn channel_security(args: &Args) -> anyhow::Result<ChannelSecurity> {
    let token = args
        .bootstrap_token
        .as_ref()
        .map(|path| {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the bootstrap token {}", path.display()))?;
            let token = text.trim().to_string();
            anyhow::ensure!(
                !token.is_empty(),
                "{} is empty; put the node's bootstrap token in it (`flatmesh ca token` prints one)",
                path.display()
            );
            Ok(token)
        })
        .transpose()?;
    let tls = args
        .xds_ca
        .as_ref()
        .map(|path| {
            let control = flatmesh_identity::IdPattern::parse(&format!(
                "spiffe://{}/flatmesh/control",
                trust_domain_of(path)?
            ))?;
            // Re-read when it changes: a rotation's new ca.pem needs no restart.
            Ok::<_, anyhow::Error>(flatmesh_identity::tls::client_config_following(
                path,
                vec![control],
                &[b"h2"],
            )?)
        })
        .transpose()?;
    Ok(ChannelSecurity { tls, token })
}

/// The trust domain of a CA bundle file: its first root's SPIFFE ID (`spiffe://TD`).
fn trust_domain_of(path: &std::path::Path) -> anyhow::Result<String> {
    let roots = flatmesh_identity::ca::load_certificates(path)?;
    let domain = roots
        .first()
        .and_then(|root| flatmesh_identity::svid::spiffe_id_of(root).ok())
        .with_context(|| {
            format!(
                "{}: its first certificate carries no trust domain (spiffe://TD); give the ca.pem of `flatmesh ca init`",
                path.display()
            )
        })?;
    Ok(domain.trust_domain().to_string())
}

/// How long a starting node waits for an unreachable control center before it gives up.
const IDENTITY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

fn identity_options(
    args: &Args,
    server: &str,
    security: ChannelSecurity,
    dir: PathBuf,
) -> anyhow::Result<IdentityOptions> {
    let mut ids = args
        .identity
        .iter()
        .map(|id| {
            flatmesh_identity::SpiffeId::parse(id).with_context(|| format!("--identity {id}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.node_identity {
        let node_id = args
            .node_id
            .as_deref()
            .context("--xds needs --node-id ID")?;
        let ca = args
            .xds_ca
            .as_deref()
            .context("--node-identity needs --xds-ca FILE")?;
        let own = flatmesh_identity::SpiffeId::node(&trust_domain_of(ca)?, node_id).with_context(
            || format!("--node-identity: the node id `{node_id}` cannot be part of a SPIFFE ID"),
        )?;
        ids.push(own);
    }
    anyhow::ensure!(
        !ids.is_empty(),
        "--identity-dir is given but no identity to keep there: add --identity SPIFFE_ID or --node-identity"
    );
    Ok(IdentityOptions {
        server: server.to_string(),
        security,
        ids,
        dir,
        ttl: flatmesh_config::duration::parse(&args.identity_ttl)
            .map_err(anyhow::Error::msg)
            .context("--identity-ttl")?,
    })
}

/// SIGTERM/SIGINT handlers registered before the node starts: a signal that arrives right
/// after "ready" must stop the node cleanly (draining, detaching tier K), not kill it by the
/// default action with its pins left behind.
struct StopSignals {
    rt: tokio::runtime::Runtime,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn register() -> anyhow::Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start a runtime to wait for signals")?;
        let (term, int) = {
            let _in_rt = rt.enter();
            (
                signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
                signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            )
        };
        Ok(StopSignals { rt, term, int })
    }

    /// Blocks until SIGTERM or SIGINT, or until the node's drain begins (`POST /drain`).
    fn wait(self, draining: Option<Draining>) {
        let StopSignals {
            rt,
            mut term,
            mut int,
        } = self;
        rt.block_on(async {
            let drain_asked = async {
                match draining {
                    Some(mut d) => d.begun().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
                () = drain_asked => {}
            }
        });
    }
}

fn wait_and_stop(node: Node, stop: StopSignals) -> anyhow::Result<()> {
    stop.wait(Some(node.draining()));
    tracing::info!("stopping: draining in-flight connections");
    node.shutdown();
    Ok(())
}
