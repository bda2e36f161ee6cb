//! `flatmesh control --metrics HOST:PORT`: the control center's counters as Prometheus text on
//! `GET /metrics` (docs/control.md, "Metrics").
//!
//! Every label set is bounded (a refusal reason, a certificate kind); nothing is labelled by
//! node, so a thousand nodes cost no more series than one. The endpoint is a small HTTP/1.1
//! responder: one request per connection, a request head of at most [`MAX_HEAD`] bytes read
//! within [`READ_TIMEOUT`], at most [`MAX_CONNECTIONS`] connections at once.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::ca::NodeCa;
use flatmesh_xds::server::StreamStats;

/// The longest request head read.
pub const MAX_HEAD: usize = 8 * 1024;
/// A scrape that has not sent its request head by then is dropped.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; more wait in the accept queue.
pub const MAX_CONNECTIONS: usize = 16;

/// What the placement and the orchestrator did.
#[derive(Debug, Default)]
pub struct PlacementStats {
    /// Instances the placement put on nodes.
    pub placed_instances: AtomicU64,
    /// Instances the orchestrator moved off an overloaded node.
    pub migrations: AtomicU64,
    /// Nodes failed over (declared dead, their instances restarted elsewhere).
    pub failovers: AtomicU64,
    /// Migrations the orchestrator wanted and could not make.
    pub not_migrated: AtomicU64,
}

/// Everything `/metrics` reports.
#[derive(Clone)]
pub struct Sources {
    pub ca: Option<Arc<NodeCa>>,
    pub streams: Arc<StreamStats>,
    pub placement: Arc<PlacementStats>,
}

pub(crate) fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// One metric family: its help, type and samples (`labels`, value).
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// The Prometheus text of `sources` now.
pub fn render(sources: &Sources) -> String {
    let mut out = String::new();
    let streams = &sources.streams;
    family(
        &mut out,
        "flatmesh_control_xds_connected_streams",
        "gauge",
        "xDS streams open now (one per connected node or Envoy).",
        &[("", streams.open.load(Relaxed))],
    );
    for (name, help, counter) in [
        (
            "flatmesh_control_xds_pushes_total",
            "xDS responses sent to nodes.",
            &streams.pushes,
        ),
        (
            "flatmesh_control_xds_acks_total",
            "xDS responses nodes acknowledged.",
            &streams.acks,
        ),
        (
            "flatmesh_control_xds_nacks_total",
            "xDS responses nodes refused (NACK).",
            &streams.nacks,
        ),
    ] {
        family(
            &mut out,
            name,
            "counter",
            help,
            &[("", counter.load(Relaxed))],
        );
    }
    if let Some(ca) = &sources.ca {
        let stats = &ca.stats;
        family(
            &mut out,
            "flatmesh_control_ca_issued_total",
            "counter",
            "Certificates the CA issued to nodes.",
            &[("", stats.issued.load(Relaxed))],
        );
        family(
            &mut out,
            "flatmesh_control_ca_refusals_total",
            "counter",
            "Calls and certificate requests the control center refused, by reason.",
            &[
                (
                    "reason=\"unauthenticated\"",
                    stats.unauthenticated.load(Relaxed),
                ),
                ("reason=\"token_revoked\"", stats.revoked.load(Relaxed)),
                ("reason=\"not_placed\"", stats.not_placed.load(Relaxed)),
                ("reason=\"bad_request\"", stats.bad_request.load(Relaxed)),
            ],
        );
        family(
            &mut out,
            "flatmesh_control_xds_streams_revoked_total",
            "counter",
            "xDS streams ended because their node's token was revoked.",
            &[("", stats.streams_cut.load(Relaxed))],
        );
        let (root, control) = ca.expiries();
        let mut samples = vec![("certificate=\"root\"", unix_seconds(root))];
        if let Some(control) = control {
            samples.push(("certificate=\"control\"", unix_seconds(control)));
        }
        family(
            &mut out,
            "flatmesh_control_certificate_expiry_timestamp_seconds",
            "gauge",
            "When the signing root and the control channel's own certificate expire (Unix time).",
            &samples,
        );
    }
    let placement = &sources.placement;
    family(
        &mut out,
        "flatmesh_control_placed_instances",
        "gauge",
        "Instances the placement put on nodes.",
        &[("", placement.placed_instances.load(Relaxed))],
    );
    for (name, help, counter) in [
        (
            "flatmesh_control_migrations_total",
            "Instances the orchestrator moved off an overloaded node.",
            &placement.migrations,
        ),
        (
            "flatmesh_control_failovers_total",
            "Nodes the orchestrator failed over.",
            &placement.failovers,
        ),
        (
            "flatmesh_control_not_migrated_total",
            "Migrations the orchestrator wanted and could not make.",
            &placement.not_migrated,
        ),
    ] {
        family(
            &mut out,
            name,
            "counter",
            help,
            &[("", counter.load(Relaxed))],
        );
    }
    out
}

/// Serves `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, sources: Sources) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (mut stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let sources = sources.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let head = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
                Ok(Some(head)) => head,
                _ => return,
            };
            let (status, body) = match head.split_whitespace().take(2).collect::<Vec<_>>()[..] {
                ["GET", "/metrics"] => ("200 OK", render(&sources)),
                ["GET", _] => ("404 Not Found", "try GET /metrics\n".to_string()),
                _ => (
                    "405 Method Not Allowed",
                    "only GET /metrics is served\n".to_string(),
                ),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

/// The request head, or `None` if the peer closed first or sent more than [`MAX_HEAD`].
/// The console's server reads its requests with it too.
pub(crate) async fn read_head(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 || head.len() + n > MAX_HEAD {
            return None;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_help_type_and_bounded_labels() {
        let sources = Sources {
            ca: None,
            streams: Arc::default(),
            placement: Arc::default(),
        };
        sources.streams.pushes.fetch_add(3, Relaxed);
        let text = render(&sources);
        assert!(
            text.contains("flatmesh_control_xds_pushes_total 3\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE flatmesh_control_xds_connected_streams gauge\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap_or_default();
            assert!(value.parse::<u64>().is_ok(), "{line}");
        }
    }
}
