//! `flatmesh control`: the control center. With no subcommand it serves xDS (issue 9);
//! `flatmesh control demo` is the placement/orchestration demo (cmd/control_demo.rs, issue 8).
//!
//! The xDS server serves the control center's state: a state file in flatmesh's config model
//! (listeners, routes, clusters, endpoints; watched, reloaded on change) and whatever the
//! orchestrator publishes through [`XdsSink`], the control crate's `EndpointSink` seam.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use flatmesh_control::endpoints::{Endpoint, EndpointSink, EndpointSnapshot};
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
    #[arg(long, value_name = "FILE")]
    state: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
enum ControlCommand {
    /// Nodes in network namespaces, emulated SmartNIC cores, real services; overload moves them.
    Demo(crate::cmd::control_demo::Args),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Some(ControlCommand::Demo(demo)) => crate::cmd::control_demo::run(demo),
        None => serve(args.listen, args.state),
    }
}

fn serve(listen: SocketAddr, state: Option<PathBuf>) -> anyhow::Result<()> {
    crate::cmd::init_logging();
    let state = state.context(
        "`flatmesh control` needs --state FILE: the listeners, routes and clusters to serve (a flatmesh config file)",
    )?;
    let store = Store::new();
    let mut loaded = load(&state, &store)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the xDS server runtime")?;
    rt.block_on(async {
        let watcher = {
            let store = store.clone();
            let state = state.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    let modified = modified(&state);
                    if modified != loaded {
                        loaded = modified;
                        if let Err(e) = load(&state, &store) {
                            tracing::error!(error = %format!("{e:#}"), "state file refused; still serving the previous state");
                        }
                    }
                }
            })
        };
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
        let result = flatmesh_xds::server::serve(listen, store, None, shutdown).await;
        watcher.abort();
        result
    })?;
    Ok(())
}

fn modified(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Read, validate and publish the state file; returns its modification time.
fn load(path: &std::path::Path, store: &Store) -> anyhow::Result<Option<SystemTime>> {
    let stamp = modified(path);
    let config = flatmesh_xds::load_base(path)?;
    store.publish_config(&config);
    tracing::info!(
        state = %path.display(),
        listeners = config.listeners.len(),
        clusters = config.clusters.len(),
        "serving state"
    );
    Ok(stamp)
}

/// The orchestrator's endpoint feed into the xDS server: each service (`APP/STAGE`) of a
/// snapshot becomes the endpoints of the cluster of that name. The placement names where an
/// instance runs, not its socket, so `resolve` maps an endpoint to the address it serves on;
/// endpoints it cannot resolve are left out (and logged).
pub struct XdsSink<F: Fn(&Endpoint) -> Option<SocketAddr>> {
    pub store: Store,
    pub resolve: F,
}

impl<F: Fn(&Endpoint) -> Option<SocketAddr>> EndpointSink for XdsSink<F> {
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> flatmesh_control::Result<()> {
        let mut resources = self.store.resources();
        for (service, endpoints) in &snapshot.services {
            let addresses: Vec<SocketAddr> = endpoints
                .iter()
                .filter_map(|e| {
                    let address = (self.resolve)(e);
                    if address.is_none() {
                        tracing::warn!(instance = %e.instance, node = %e.node, "no address for this endpoint; left out of EDS");
                    }
                    address
                })
                .collect();
            resources.endpoints.insert(
                service.clone(),
                flatmesh_xds::from_model::assignment(service, &addresses),
            );
        }
        self.store.publish(resources);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn sink_turns_a_snapshot_into_assignments() {
        let store = Store::new();
        let mut sink = XdsSink {
            store: store.clone(),
            resolve: |e: &Endpoint| match e.instance.as_str() {
                "IOT/api-0" => Some("10.0.0.1:8080".parse().unwrap()),
                "IOT/api-1" => Some("10.0.0.2:8080".parse().unwrap()),
                _ => None,
            },
        };
        let endpoint = |instance: &str| Endpoint {
            instance: instance.into(),
            node: "n1".into(),
            server: "s1".into(),
        };
        let mut services = BTreeMap::new();
        services.insert(
            "IOT/api".to_string(),
            vec![
                endpoint("IOT/api-0"),
                endpoint("IOT/api-1"),
                endpoint("IOT/api-9"),
            ],
        );
        sink.publish(&EndpointSnapshot {
            version: 1,
            services,
        })
        .unwrap();
        let cla = &store.resources().endpoints["IOT/api"];
        assert_eq!(
            cla.endpoints[0].lb_endpoints.len(),
            2,
            "the unresolvable one is left out"
        );
    }
}
