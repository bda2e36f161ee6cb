//! Per-endpoint load, as Envoy's load reporting (LRS, `envoy.service.load_stats.v3`) reports
//! it: for every endpoint of every cluster, the tries issued, the answered ones that succeeded
//! or failed (5xx, or no answer), and the time to the answer's head. The xDS client sends the
//! counts of each period to the control plane (`flatmesh_xds::lrs`), which is how E3's
//! orchestrator learns each pod's execution time on Kubernetes.
//!
//! The counters outlive reloads: they are kept by (cluster, endpoint) in the node's registry,
//! and a snapshot's cluster takes its endpoints' counters from it. Each worker writes its own
//! cache line of an endpoint's counters, so the request path never contends; a report reads
//! them all and subtracts what it reported last.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use flatmesh_config::load_report::EndpointReport;
use parking_lot::Mutex;

/// One worker's counters of one endpoint. Only that worker writes them.
#[repr(align(64))]
#[derive(Default)]
struct WorkerLoad {
    issued: AtomicU64,
    /// Answered below 500.
    succeeded: AtomicU64,
    answered_5xx: AtomicU64,
    /// Ended without an answer: connect failure, reset, timeout.
    unanswered: AtomicU64,
    /// Ended by nobody's fault that is the endpoint's (see [`TryEnd::Uncounted`]).
    uncounted: AtomicU64,
    /// Microseconds from a try's start to its answer's head, summed over answered tries.
    answer_us: AtomicU64,
}

/// Adds `n` to a counter that only the calling worker writes (no locked read-modify-write).
#[inline]
fn bump(counter: &AtomicU64, n: u64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// How a try ended, for the load report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryEnd {
    /// Answered with this status, after this long (to the answer's head).
    Answered(u16, Duration),
    /// No answer: connect failure, reset, timeout.
    Unanswered,
    /// Not the endpoint's doing (a pooled connection it had closed while idle, a client that
    /// went away, the proxy's own refusal): neither a success nor an error.
    Uncounted,
}

/// The counters of one endpoint of one cluster, one block per worker.
pub struct EndpointLoad {
    workers: Box<[WorkerLoad]>,
}

impl EndpointLoad {
    fn new(workers: usize) -> EndpointLoad {
        EndpointLoad {
            workers: (0..workers.max(1)).map(|_| WorkerLoad::default()).collect(),
        }
    }

    /// A try starts on `worker`.
    #[inline]
    pub fn begin(&self, worker: usize) {
        if let Some(w) = self.workers.get(worker) {
            bump(&w.issued, 1);
        }
    }

    /// The try `worker` began has ended.
    #[inline]
    pub fn end(&self, worker: usize, end: TryEnd) {
        let Some(w) = self.workers.get(worker) else {
            return;
        };
        match end {
            TryEnd::Answered(status, took) => {
                bump(
                    if status < 500 {
                        &w.succeeded
                    } else {
                        &w.answered_5xx
                    },
                    1,
                );
                bump(
                    &w.answer_us,
                    u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                );
            }
            TryEnd::Unanswered => bump(&w.unanswered, 1),
            TryEnd::Uncounted => bump(&w.uncounted, 1),
        }
    }

    fn totals(&self) -> Totals {
        let mut t = Totals::default();
        let add = |sum: &mut u64, c: &AtomicU64| *sum = sum.wrapping_add(c.load(Ordering::Relaxed));
        for w in self.workers.iter() {
            add(&mut t.issued, &w.issued);
            add(&mut t.succeeded, &w.succeeded);
            add(&mut t.answered_5xx, &w.answered_5xx);
            add(&mut t.unanswered, &w.unanswered);
            add(&mut t.uncounted, &w.uncounted);
            add(&mut t.answer_us, &w.answer_us);
        }
        t
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Totals {
    issued: u64,
    succeeded: u64,
    answered_5xx: u64,
    unanswered: u64,
    uncounted: u64,
    answer_us: u64,
}

impl Totals {
    fn ended(&self) -> u64 {
        self.succeeded
            .wrapping_add(self.answered_5xx)
            .wrapping_add(self.unanswered)
            .wrapping_add(self.uncounted)
    }

    /// Each counter's growth since `was`.
    fn since(&self, was: &Totals) -> Totals {
        Totals {
            issued: self.issued.wrapping_sub(was.issued),
            succeeded: self.succeeded.wrapping_sub(was.succeeded),
            answered_5xx: self.answered_5xx.wrapping_sub(was.answered_5xx),
            unanswered: self.unanswered.wrapping_sub(was.unanswered),
            uncounted: self.uncounted.wrapping_sub(was.uncounted),
            answer_us: self.answer_us.wrapping_sub(was.answer_us),
        }
    }
}

/// Every endpoint's counters, by (cluster, endpoint), for the node's whole life.
pub struct LoadReports {
    workers: usize,
    inner: Mutex<HashMap<(String, SocketAddr), Entry>>,
}

struct Entry {
    load: Arc<EndpointLoad>,
    /// What the last report counted up to.
    reported: Totals,
}

impl LoadReports {
    pub fn new(workers: usize) -> LoadReports {
        LoadReports {
            workers,
            inner: Mutex::default(),
        }
    }

    /// The counters of `endpoints` of `cluster`, in their order. Called when a snapshot is
    /// built, never per request.
    pub fn cluster(&self, cluster: &str, endpoints: &[SocketAddr]) -> Arc<[Arc<EndpointLoad>]> {
        let mut inner = self.inner.lock();
        endpoints
            .iter()
            .map(|e| {
                inner
                    .entry((cluster.to_owned(), *e))
                    .or_insert_with(|| Entry {
                        load: Arc::new(EndpointLoad::new(self.workers)),
                        reported: Totals::default(),
                    })
                    .load
                    .clone()
            })
            .collect()
    }

    /// The load of every endpoint since the last call; endpoints with nothing to say are left
    /// out. Forgets an endpoint once no snapshot holds it and nothing of it is outstanding.
    pub fn take(&self) -> Vec<EndpointReport> {
        let mut inner = self.inner.lock();
        let mut out = Vec::new();
        inner.retain(|(cluster, endpoint), entry| {
            let now = entry.load.totals();
            let d = now.since(&entry.reported);
            entry.reported = now;
            let in_progress = now.issued.saturating_sub(now.ended());
            if d.issued > 0 || d.ended() > 0 || in_progress > 0 {
                out.push(EndpointReport {
                    cluster: cluster.clone(),
                    endpoint: *endpoint,
                    issued: d.issued,
                    succeeded: d.succeeded,
                    failed: d.answered_5xx.wrapping_add(d.unanswered),
                    in_progress,
                    answered: d.succeeded.wrapping_add(d.answered_5xx),
                    answer_us: d.answer_us,
                });
            }
            Arc::strong_count(&entry.load) > 1 || in_progress > 0
        });
        out.sort_by(|a, b| (&a.cluster, a.endpoint).cmp(&(&b.cluster, b.endpoint)));
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    #[test]
    fn a_report_counts_the_period_since_the_last_one() {
        let reports = LoadReports::new(2);
        let loads = reports.cluster("web", &[at(1), at(2)]);
        loads[0].begin(0);
        loads[0].end(0, TryEnd::Answered(200, Duration::from_micros(300)));
        loads[0].begin(1);
        loads[0].end(1, TryEnd::Answered(503, Duration::from_micros(100)));
        loads[0].begin(1);
        loads[0].end(1, TryEnd::Unanswered);
        loads[0].begin(0);
        loads[0].end(0, TryEnd::Uncounted);
        loads[1].begin(0); // still outstanding
        let first = reports.take();
        assert_eq!(
            first,
            [
                EndpointReport {
                    cluster: "web".into(),
                    endpoint: at(1),
                    issued: 4,
                    succeeded: 1,
                    failed: 2,
                    in_progress: 0,
                    answered: 2,
                    answer_us: 400,
                },
                EndpointReport {
                    cluster: "web".into(),
                    endpoint: at(2),
                    issued: 1,
                    succeeded: 0,
                    failed: 0,
                    in_progress: 1,
                    answered: 0,
                    answer_us: 0,
                },
            ]
        );
        loads[1].end(0, TryEnd::Answered(200, Duration::from_micros(50)));
        let second = reports.take();
        assert_eq!(second.len(), 1, "{second:?}");
        assert_eq!(
            (
                second[0].endpoint,
                second[0].issued,
                second[0].answered,
                second[0].answer_us
            ),
            (at(2), 0, 1, 50)
        );
        assert!(reports.take().is_empty(), "nothing new, nothing said");
    }

    #[test]
    fn counters_outlive_a_reload_and_are_forgotten_once_unheld() {
        let reports = LoadReports::new(1);
        let old = reports.cluster("web", &[at(1)]);
        old[0].begin(0);
        // A reload: the new snapshot takes the same counters.
        let new = reports.cluster("web", &[at(1)]);
        assert!(Arc::ptr_eq(&old[0], &new[0]));
        drop(old);
        new[0].end(0, TryEnd::Answered(200, Duration::from_micros(7)));
        assert_eq!(reports.take()[0].answer_us, 7);
        drop(new);
        assert!(reports.take().is_empty());
        assert!(
            reports.inner.lock().is_empty(),
            "an endpoint no snapshot holds is forgotten"
        );
    }
}
