//! Access log: one JSON object per line. Lines are formatted on the worker and handed to a
//! writer thread through a bounded channel; if the writer falls behind, lines are dropped
//! (and counted) rather than ever blocking a worker.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

#[derive(Serialize)]
pub struct AccessRecord {
    pub listener: String,
    pub route: String,
    pub cluster: String,
    pub method: String,
    pub path: String,
    pub status: u16,
    #[serde(serialize_with = "millis")]
    pub duration: Duration,
    pub upstream: Option<SocketAddr>,
    pub peer: SocketAddr,
}

fn millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

#[derive(Serialize)]
struct Line {
    ts: f64,
    #[serde(flatten)]
    record: AccessRecord,
}

/// Cheap to clone; `None` inside means access logging is off.
#[derive(Clone, Default)]
pub struct AccessLog {
    sink: Option<(SyncSender<String>, Arc<AtomicU64>)>,
}

impl AccessLog {
    pub fn disabled() -> AccessLog {
        AccessLog::default()
    }

    /// Start the writer thread for `path` (`stdout`, `stderr` or a file, appended).
    pub fn open(path: &str) -> std::io::Result<AccessLog> {
        let mut out: Box<dyn Write + Send> = match path {
            "stdout" => Box::new(std::io::stdout()),
            "stderr" => Box::new(std::io::stderr()),
            file => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(file)?,
            ),
        };
        let (tx, rx) = sync_channel::<String>(65_536);
        std::thread::Builder::new()
            .name("flatmesh-access-log".into())
            .spawn(move || {
                let mut buf = std::io::BufWriter::new(&mut out);
                while let Ok(line) = rx.recv() {
                    let _ = buf.write_all(line.as_bytes());
                    // Write what else is already queued, then flush once.
                    while let Ok(more) = rx.try_recv() {
                        let _ = buf.write_all(more.as_bytes());
                    }
                    let _ = buf.flush();
                }
            })?;
        Ok(AccessLog {
            sink: Some((tx, Arc::new(AtomicU64::new(0)))),
        })
    }

    pub fn enabled(&self) -> bool {
        self.sink.is_some()
    }

    /// Log one request; `record` is only called when logging is on.
    pub fn write(&self, record: impl FnOnce() -> AccessRecord) {
        let Some((tx, dropped)) = &self.sink else {
            return;
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let line = Line {
            ts,
            record: record(),
        };
        let Ok(mut line) = serde_json::to_string(&line) else {
            return;
        };
        line.push('\n');
        if let Err(TrySendError::Full(_)) = tx.try_send(line) {
            dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}
