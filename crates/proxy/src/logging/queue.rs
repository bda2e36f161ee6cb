//! A bounded, non-blocking queue of log lines, drained by a writer thread of its own.
//!
//! A worker that logs must never wait for the log's reader: a stalled pipe on stderr once
//! froze a worker that warned on every failed upstream connect. So producers only copy their
//! line into a shared buffer (under a lock held for that copy alone) and go on. The buffer,
//! together with the batch the writer is busy writing, holds at most `capacity` bytes: a
//! line that does not fit is dropped and counted, and the writer says so in the process log
//! (at most once per report interval) once it can write again. The `flatmesh_log_lines_dropped`
//! metric reads the counts.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How often the writer wakes up with nothing to write, to report drops and run its tick.
const TICK: Duration = Duration::from_millis(500);
/// Drops are reported in the process log at most this often.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// Counts of one queue, for `/metrics`.
pub struct QueueStats {
    /// `process` (tracing) or `access`.
    pub log: &'static str,
    pub dropped_lines: u64,
}

/// Every queue alive in the process, for the metrics scrape.
static QUEUES: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

/// The counts of every queue alive in the process, summed by log name.
pub fn stats() -> Vec<QueueStats> {
    let mut out: Vec<QueueStats> = Vec::new();
    let mut queues = QUEUES.lock();
    queues.retain(|q| q.strong_count() > 0);
    for q in queues.iter().filter_map(Weak::upgrade) {
        let dropped = q.dropped.load(Ordering::Relaxed);
        match out.iter_mut().find(|s| s.log == q.log) {
            Some(s) => s.dropped_lines += dropped,
            None => out.push(QueueStats {
                log: q.log,
                dropped_lines: dropped,
            }),
        }
    }
    out
}

/// Something the writer thread runs on every wake-up (after writing), outside the queue's
/// lock: the process log uses it to report suppressed repeats.
pub type Tick = Box<dyn FnMut() + Send>;

struct Buffered {
    /// Lines waiting, back to back.
    waiting: Vec<u8>,
    /// Bytes of the batch the writer has taken and not finished writing.
    writing: usize,
    /// No producer is left: write what is waiting and stop.
    closed: bool,
}

struct Inner {
    log: &'static str,
    capacity: usize,
    state: Mutex<Buffered>,
    ready: Condvar,
    /// The writer finished a batch (for `flush`).
    written: Condvar,
    dropped: AtomicU64,
}

/// A handle producers push lines into; cheap to clone. The writer stops once every handle
/// is gone and the queue is written out.
pub struct LogQueue {
    inner: Arc<Inner>,
    /// Shared by the handles; the last one to go closes the queue.
    _producers: Arc<Producers>,
}

impl Clone for LogQueue {
    fn clone(&self) -> Self {
        LogQueue {
            inner: self.inner.clone(),
            _producers: self._producers.clone(),
        }
    }
}

struct Producers(Arc<Inner>);

impl Drop for Producers {
    fn drop(&mut self) {
        self.0.state.lock().closed = true;
        self.0.ready.notify_one();
    }
}

impl LogQueue {
    /// Start the writer thread `flatmesh-log-NAME` draining into `out`, with room for
    /// `capacity` bytes of lines. `report_every` spaces the "lines dropped" reports.
    pub fn spawn(
        log: &'static str,
        out: Box<dyn Write + Send>,
        capacity: usize,
        report_every: Duration,
        tick: Option<Tick>,
    ) -> std::io::Result<LogQueue> {
        let inner = Arc::new(Inner {
            log,
            capacity,
            state: Mutex::new(Buffered {
                waiting: Vec::new(),
                writing: 0,
                closed: false,
            }),
            ready: Condvar::new(),
            written: Condvar::new(),
            dropped: AtomicU64::new(0),
        });
        let writer = inner.clone();
        std::thread::Builder::new()
            .name(format!("flatmesh-log-{log}"))
            .spawn(move || drain(&writer, out, report_every, tick))?;
        QUEUES.lock().push(Arc::downgrade(&inner));
        Ok(LogQueue {
            _producers: Arc::new(Producers(inner.clone())),
            inner,
        })
    }

    /// Queue `line` (which ends in a newline) unless it does not fit; never waits for the
    /// writer. Returns whether it was queued.
    pub fn push(&self, line: &[u8]) -> bool {
        let inner = &*self.inner;
        let mut state = inner.state.lock();
        if state.waiting.len() + state.writing + line.len() > inner.capacity {
            drop(state);
            inner.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let was_empty = state.waiting.is_empty();
        state.waiting.extend_from_slice(line);
        drop(state);
        if was_empty {
            inner.ready.notify_one();
        }
        true
    }

    /// Lines dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Ordering::Relaxed)
    }

    /// Bytes queued or being written right now.
    pub fn pending_bytes(&self) -> usize {
        let state = self.inner.state.lock();
        state.waiting.len() + state.writing
    }

    /// Wait (at most `limit`) until everything queued so far is written: at exit, so the
    /// last lines are not lost.
    pub fn flush(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut state = self.inner.state.lock();
        while state.waiting.len() + state.writing > 0 {
            if self
                .inner
                .written
                .wait_until(&mut state, deadline)
                .timed_out()
            {
                return;
            }
        }
    }
}

/// The writer thread: take what is waiting, write it without holding the lock, repeat.
fn drain(
    inner: &Inner,
    mut out: Box<dyn Write + Send>,
    report_every: Duration,
    mut tick: Option<Tick>,
) {
    let mut batch = Vec::new();
    let mut reported = 0u64;
    let mut last_report: Option<Instant> = None;
    loop {
        let closed = {
            let mut state = inner.state.lock();
            if state.waiting.is_empty() && !state.closed {
                inner.ready.wait_for(&mut state, TICK);
            }
            std::mem::swap(&mut batch, &mut state.waiting);
            state.writing = batch.len();
            state.closed && batch.is_empty()
        };
        if !batch.is_empty() {
            // A failed write loses this batch, like a dropped line; the next one tries again.
            let _ = out.write_all(&batch).and_then(|()| out.flush());
            batch.clear();
            // Keep the memory of a burst from staying for good.
            batch.shrink_to(64 * 1024);
            inner.state.lock().writing = 0;
            inner.written.notify_all();
        }
        let dropped = inner.dropped.load(Ordering::Relaxed);
        if dropped > reported && last_report.is_none_or(|t| t.elapsed() >= report_every) {
            // Said through the process log, which may be this very queue: the writer is
            // free now, so there is room for the line unless the queue filled up again.
            tracing::warn!(
                log = inner.log,
                dropped = dropped - reported,
                total = dropped,
                "log lines dropped: the log's reader is slower than the node writes; nothing waited for it"
            );
            reported = dropped;
            last_report = Some(Instant::now());
        }
        if let Some(tick) = tick.as_mut() {
            tick();
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A sink whose writes block until the test lets them through; it reports what it got.
    struct Gate {
        open: mpsc::Receiver<()>,
        got: mpsc::Sender<Vec<u8>>,
    }

    impl Write for Gate {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.open.recv();
            let _ = self.got.send(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stalled_sink_never_blocks_a_producer_and_memory_stays_bounded() {
        let (open_tx, open) = mpsc::channel();
        let (got, got_rx) = mpsc::channel();
        let queue = LogQueue::spawn(
            "test-stalled",
            Box::new(Gate { open, got }),
            4096,
            Duration::ZERO,
            None,
        )
        .unwrap();
        let line = [b'x'; 99]
            .iter()
            .copied()
            .chain([b'\n'])
            .collect::<Vec<u8>>();
        let started = Instant::now();
        let mut queued = 0;
        for _ in 0..10_000 {
            queued += usize::from(queue.push(&line));
        }
        // 10,000 pushes against a sink that takes nothing: no wait, at most 4 KiB held.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "pushing took {:?}",
            started.elapsed()
        );
        assert!(queue.pending_bytes() <= 4096, "{}", queue.pending_bytes());
        assert!(queued <= 4096 / line.len(), "{queued} lines queued");
        assert_eq!(queue.dropped(), 10_000 - queued as u64);
        // Unblock the sink: what was queued arrives whole, in order.
        for _ in 0..16 {
            let _ = open_tx.send(());
        }
        let mut written = Vec::new();
        while written.len() < queued * line.len() {
            written.extend(
                got_rx
                    .recv_timeout(Duration::from_secs(5))
                    .expect("the writer writes once the sink moves"),
            );
        }
        assert!(written.chunks(line.len()).all(|l| l == line.as_slice()));
    }

    #[test]
    fn flush_waits_for_the_writer_and_the_thread_ends_with_the_last_handle() {
        let (open_tx, open) = mpsc::channel();
        let (got, got_rx) = mpsc::channel();
        for _ in 0..4 {
            open_tx.send(()).unwrap();
        }
        let queue = LogQueue::spawn(
            "test-flush",
            Box::new(Gate { open, got }),
            1024,
            REPORT_EVERY,
            None,
        )
        .unwrap();
        assert!(queue.push(b"one\n"));
        queue.flush(Duration::from_secs(5));
        assert_eq!(queue.pending_bytes(), 0);
        assert_eq!(
            got_rx.recv_timeout(Duration::from_secs(1)).unwrap(),
            b"one\n"
        );
        let weak = Arc::downgrade(&queue.inner);
        drop(queue);
        let deadline = Instant::now() + Duration::from_secs(5);
        while weak.strong_count() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(weak.strong_count(), 0, "the writer thread did not end");
    }
}
