//! `flatmesh node --config FILE`: run the node proxy until SIGINT/SIGTERM.

use std::path::PathBuf;

use anyhow::Context as _;
use flatmesh_proxy::{ConfigSource, Node};

#[derive(clap::Args)]
pub struct Args {
    /// The node's YAML config. Changes to it (or SIGHUP) reload it without dropping requests.
    #[arg(long, short)]
    config: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    let config = flatmesh_config::load(&args.config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let node = Node::start(config, ConfigSource::File(args.config.clone()))?;
    tracing::info!(admin = %node.admin_addr(), config = %args.config.display(), "flatmesh node is ready");
    wait_for_stop().context("cannot wait for SIGINT/SIGTERM")?;
    tracing::info!("stopping: draining in-flight connections");
    node.shutdown();
    Ok(())
}

fn wait_for_stop() -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok(())
    })
}
