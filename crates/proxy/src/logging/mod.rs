//! Where the node's logs go, without ever making a worker wait: the process log (`tracing`)
//! and the access log both write through a [`LogQueue`], bounded in bytes and drained by a
//! writer thread; repeated warnings are rate-limited ([`RateLimit`]). The binary builds its
//! `tracing` subscriber from [`ProcessLog`]; `/metrics` reads [`dropped`].

mod queue;
mod rate_limit;

use std::io::Write;
use std::sync::OnceLock;
use std::time::Duration;

pub use queue::{LogQueue, REPORT_EVERY};
pub use rate_limit::{RateLimit, BURST, WINDOW};

/// Bytes the process log may hold while its reader (stderr) lags.
pub const PROCESS_LOG_QUEUE_BYTES: usize = 4 * 1024 * 1024;
/// A process log line longer than this is cut, marked `...`.
pub const MAX_LINE_BYTES: usize = 16 * 1024;

/// The rate limiter of the process log, once the binary has set it up.
static PROCESS_RATE_LIMIT: OnceLock<RateLimit> = OnceLock::new();

/// The process log's pieces: the queue its lines go through and the rate limiter of
/// repeated warnings. The binary layers them into its `tracing` subscriber.
pub struct ProcessLog {
    queue: LogQueue,
    rate_limit: RateLimit,
}

impl ProcessLog {
    /// Start the writer thread of the process log, writing to `out` (stderr in the binary).
    pub fn start(out: Box<dyn Write + Send>, capacity: usize) -> std::io::Result<ProcessLog> {
        let rate_limit = PROCESS_RATE_LIMIT.get_or_init(RateLimit::default).clone();
        let reporter = rate_limit.clone();
        let queue = LogQueue::spawn(
            "process",
            out,
            capacity,
            REPORT_EVERY,
            Some(Box::new(move || reporter.report_ended())),
        )?;
        Ok(ProcessLog { queue, rate_limit })
    }

    /// The `tracing` layer that leaves out repeats of a warning.
    pub fn rate_limit(&self) -> RateLimit {
        self.rate_limit.clone()
    }

    /// The writer for `tracing_subscriber::fmt`: each line goes into the queue.
    pub fn writer(&self) -> ProcessLogWriter {
        ProcessLogWriter(self.queue.clone())
    }

    /// Wait (bounded) until every line logged so far is written; at exit.
    pub fn flush(&self, limit: Duration) {
        self.queue.flush(limit)
    }
}

/// `tracing_subscriber::fmt`'s writer: hands each formatted line to the queue, cut to
/// [`MAX_LINE_BYTES`].
#[derive(Clone)]
pub struct ProcessLogWriter(LogQueue);

impl Write for &ProcessLogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() <= MAX_LINE_BYTES {
            self.0.push(buf);
        } else {
            let mut line = Vec::with_capacity(MAX_LINE_BYTES + 4);
            line.extend_from_slice(&buf[..MAX_LINE_BYTES]);
            line.extend_from_slice(b"...\n");
            self.0.push(&line);
        }
        // A dropped line is counted, not an error: the caller must not retry or stall.
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ProcessLogWriter {
    type Writer = &'a ProcessLogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

/// Log lines left out, by log (`process`, `access`) and reason (`queue_full`: the reader
/// lagged; `repeated`: a rate-limited warning).
pub struct Dropped {
    pub log: &'static str,
    pub reason: &'static str,
    pub lines: u64,
}

/// Every count of lines left out in this process, for `/metrics`.
pub fn dropped() -> Vec<Dropped> {
    let mut out: Vec<Dropped> = queue::stats()
        .into_iter()
        .map(|q| Dropped {
            log: q.log,
            reason: "queue_full",
            lines: q.dropped_lines,
        })
        .collect();
    if let Some(limit) = PROCESS_RATE_LIMIT.get() {
        out.push(Dropped {
            log: "process",
            reason: "repeated",
            lines: limit.suppressed(),
        });
    }
    out
}
