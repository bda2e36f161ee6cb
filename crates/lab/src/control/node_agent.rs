//! The orchestrator agent of one demo node (a process in the node's namespace): every 50 ms it
//! reads the execution statistics of the instances its node runs and sends one heartbeat, sealed
//! with the node's key, over UDP to the orchestrator.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::UdpSocket;

use super::runtime::AgentSlot;
use crate::control::services::Stats;
use crate::{LabError, Result};
use flatmesh_control::agent::{send_loop, HeartbeatBuilder, NodeSample};
use flatmesh_control::heartbeat::HeartbeatKey;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node: u32,
    pub orchestrator: SocketAddr,
    /// The runtime's list of instances on this node, in slot order.
    pub instances: PathBuf,
    /// The node's heartbeat key, which the orchestrator holds too.
    pub key: HeartbeatKey,
    pub link_bits_per_sec: u64,
    pub period: Duration,
}

/// Runs until killed (the demo kills its agents at shutdown).
pub async fn run(cfg: AgentConfig) -> Result<()> {
    let bind: SocketAddr = if cfg.orchestrator.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .map_err(|e| LabError::Demo {
        what: "agent".into(),
        message: format!("{e}"),
    })?;
    let socket = UdpSocket::bind(bind).await.map_err(|e| LabError::Demo {
        what: "agent".into(),
        message: format!("cannot open a UDP socket: {e}"),
    })?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let builder = HeartbeatBuilder::new(cfg.node, cfg.link_bits_per_sec, cfg.period);
    let list = cfg.instances.clone();
    // Half a period per instance at most: a heartbeat must not wait for a stuck instance.
    let budget = cfg.period / 2;
    send_loop(&socket, cfg.orchestrator, builder, &cfg.key, || {
        let client = client.clone();
        let list = list.clone();
        async move {
            let slots: Vec<AgentSlot> = std::fs::read(&list)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            let mut sample = NodeSample::default();
            for slot in slots {
                let stats = read_stats(&client, slot.stats, budget).await;
                sample.queue_len += stats.as_ref().map_or(0, |s| s.queue);
                sample.bytes += stats.as_ref().map_or(0, |s| s.bytes);
                sample.exec_us.push(stats.and_then(|s| s.exec_us));
            }
            Some(sample)
        }
    })
    .await
    .map_err(|e| LabError::Demo {
        what: format!("agent of node {}", cfg.node),
        message: format!("cannot send heartbeats to {}: {e}", cfg.orchestrator),
    })
}

async fn read_stats(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    budget: Duration,
) -> Option<Stats> {
    let req = http::Request::get(format!("http://{addr}/_stats"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let resp = tokio::time::timeout(budget, client.request(req))
        .await
        .ok()?
        .ok()?;
    let body = tokio::time::timeout(budget, resp.into_body().collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    serde_json::from_slice(&body).ok()
}
