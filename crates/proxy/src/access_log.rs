//! Access log: one JSON object per line. Lines are formatted on the worker and handed to a
//! writer thread through a [`LogQueue`] bounded in bytes (`access_log.queue_bytes`): if the
//! sink falls behind, lines are dropped and counted rather than ever blocking a worker.
//! Request fields longer than `access_log.max_field_bytes` are cut and marked `...`, so one
//! line stays small whatever the client sent (a request target can be 1 MiB).

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::logging::{LogQueue, REPORT_EVERY};

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
    /// The client's verified SPIFFE ID (TLS listeners with `client_ca`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
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
    sink: Option<Sink>,
}

#[derive(Clone)]
struct Sink {
    queue: LogQueue,
    max_field_bytes: usize,
}

impl AccessLog {
    pub fn disabled() -> AccessLog {
        AccessLog::default()
    }

    /// Start the writer thread for `config.path` (`stdout`, `stderr` or a file, appended).
    pub fn open(config: &flatmesh_config::AccessLog) -> std::io::Result<AccessLog> {
        let out: Box<dyn Write + Send> = match config.path.as_str() {
            "stdout" => Box::new(std::io::stdout()),
            "stderr" => Box::new(std::io::stderr()),
            file => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(file)?,
            ),
        };
        AccessLog::to(out, config)
    }

    /// Start the writer thread for `out`, with `config`'s sizes.
    fn to(
        out: Box<dyn Write + Send>,
        config: &flatmesh_config::AccessLog,
    ) -> std::io::Result<AccessLog> {
        let queue = LogQueue::spawn("access", out, config.queue_bytes, REPORT_EVERY, None)?;
        Ok(AccessLog {
            sink: Some(Sink {
                queue,
                max_field_bytes: config.max_field_bytes,
            }),
        })
    }

    pub fn enabled(&self) -> bool {
        self.sink.is_some()
    }

    /// Log one request; `record` is only called when logging is on.
    pub fn write(&self, record: impl FnOnce() -> AccessRecord) {
        let Some(sink) = &self.sink else {
            return;
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let mut record = record();
        for field in [
            &mut record.listener,
            &mut record.route,
            &mut record.cluster,
            &mut record.method,
            &mut record.path,
        ] {
            cut(field, sink.max_field_bytes);
        }
        let Ok(mut line) = serde_json::to_vec(&Line { ts, record }) else {
            return;
        };
        line.push(b'\n');
        sink.queue.push(&line);
    }

    /// Lines dropped because the sink lagged.
    #[cfg(test)]
    fn dropped(&self) -> u64 {
        self.sink.as_ref().map_or(0, |s| s.queue.dropped())
    }
}

/// Cut `text` to at most `max` bytes (on a character boundary) and mark it with `...`.
fn cut(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str("...");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(path: String) -> AccessRecord {
        AccessRecord {
            listener: "web".into(),
            route: "r".into(),
            cluster: "c".into(),
            method: "GET".into(),
            path,
            status: 200,
            duration: Duration::from_millis(1),
            upstream: None,
            peer: SocketAddr::from(([127, 0, 0, 1], 1)),
            principal: None,
        }
    }

    /// A sink that blocks on its first write until the test ends.
    struct Stalled(std::sync::mpsc::Receiver<()>);

    impl Write for Stalled {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.recv();
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn long_fields_are_cut_and_a_stalled_sink_holds_at_most_the_queue_bytes() {
        let (release, stalled) = std::sync::mpsc::channel();
        let config = flatmesh_config::AccessLog {
            path: "unused".into(),
            queue_bytes: 256 * 1024,
            max_field_bytes: 2048,
        };
        let log = AccessLog::to(Box::new(Stalled(stalled)), &config).unwrap();
        let queue = log.sink.as_ref().unwrap().queue.clone();
        // 60 KB request targets, 5,000 of them (300 MB if kept): each line is cut to ~2 KiB
        // and the queue never holds more than its 256 KiB while the sink takes nothing.
        let long = "/".to_string() + &"a".repeat(60_000);
        let started = std::time::Instant::now();
        for _ in 0..5_000 {
            log.write(|| record(long.clone()));
            assert!(queue.pending_bytes() <= config.queue_bytes);
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        let kept = 5_000 - log.dropped();
        assert!(kept <= 256 * 1024 / 2048, "kept {kept} lines");
        drop(release);
    }

    #[test]
    fn one_line_is_json_with_its_fields_cut() {
        let mut path = "/x".to_string() + &"é".repeat(3000);
        cut(&mut path, 2048);
        assert!(path.len() <= 2048 + 3 && path.ends_with("..."));
        let line = serde_json::to_string(&Line {
            ts: 1.0,
            record: record(path),
        })
        .unwrap();
        let back: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert!(back["path"].as_str().unwrap().ends_with("..."));
    }
}
