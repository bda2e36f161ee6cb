//! Resilience of the node toward its clusters: the circuit breaker ([`breaker`]), outlier
//! detection ([`outlier`]) and active health checks ([`health`]). All are per node, shared
//! by every worker, and live in a [`Registry`] that outlives config snapshots, so a reload
//! that leaves a cluster's settings alone keeps its counts, ejections, health and in-flight
//! totals. Outlier ejection and a failed health check take an endpoint out of load
//! balancing the same way: [`Out`].

pub mod breaker;
pub mod budget;
pub mod health;
pub mod outlier;
pub mod rate_limit;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use flatmesh_config::{CircuitBreaker, Cluster, HealthCheck, OutlierDetection};
use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::mpsc;

pub use breaker::{Breaker, Overflow, OverflowCounts, Permit};
pub use health::{ClusterHealth, ProbeCounts, ProbeResult};
pub use outlier::{EjectionCounts, Outcome, Outlier, Reason};

/// A cluster's breaker and outlier detection, as a snapshot's cluster plan holds them.
pub struct ClusterGuard {
    pub breaker: Arc<Breaker>,
    /// `None`: the cluster has no `outlier_detection`.
    pub outlier: Option<Arc<Outlier>>,
    /// `None`: the cluster has no `health_check`.
    pub health: Option<Arc<ClusterHealth>>,
    /// What the cluster's retries have taken of their budget.
    pub budget: Arc<budget::Budget>,
}

impl ClusterGuard {
    /// What takes this cluster's endpoints out of load balancing.
    pub fn out(&self) -> Out {
        Out {
            outlier: self.outlier.clone(),
            health: self.health.clone(),
        }
    }
}

/// What takes a cluster's endpoints out of load balancing, for every LB policy: an outlier
/// ejection or a failed health check, either one.
#[derive(Clone, Default)]
pub struct Out {
    pub outlier: Option<Arc<Outlier>>,
    pub health: Option<Arc<ClusterHealth>>,
}

impl Out {
    /// Whether some endpoint may be out: the pick's fast path looks no further (a load or
    /// two while none is).
    #[inline]
    pub fn any(&self) -> bool {
        self.outlier.as_ref().is_some_and(|o| o.any_out())
            || self.health.as_ref().is_some_and(|h| h.any_down())
    }

    /// The clock `is_out` takes (outlier detection's; 0 without it).
    pub fn now(&self) -> u64 {
        self.outlier.as_ref().map_or(0, |o| o.now())
    }

    /// Whether endpoint `index` is out at `now`.
    pub fn is_out(&self, index: usize, now: u64) -> bool {
        self.health.as_ref().is_some_and(|h| h.is_down(index))
            || self.outlier.as_ref().is_some_and(|o| o.is_out(index, now))
    }
}

/// What one cluster name has in the registry.
struct Entry {
    breaker: (CircuitBreaker, Arc<Breaker>),
    outlier: Option<(OutlierDetection, Vec<SocketAddr>, Arc<Outlier>)>,
    overflows: Arc<OverflowCounts>,
    ejections: Arc<EjectionCounts>,
    health: Option<(HealthCheck, Vec<SocketAddr>, Arc<ClusterHealth>)>,
    probes: Arc<ProbeCounts>,
    /// Counts the routes' retry budgets draw on; no settings of its own, so it is kept.
    budget: Arc<budget::Budget>,
}

/// Every cluster's guard, by name; lives as long as the node.
pub struct Registry {
    clusters: Mutex<HashMap<String, Entry>>,
    /// Each new [`ClusterHealth`] goes to the node's checker ([`health::run`]).
    checks: mpsc::UnboundedSender<Arc<ClusterHealth>>,
    checker: Mutex<Option<mpsc::UnboundedReceiver<Arc<ClusterHealth>>>>,
}

impl Default for Registry {
    fn default() -> Self {
        let (checks, checker) = mpsc::unbounded_channel();
        Registry {
            clusters: Mutex::default(),
            checks,
            checker: Mutex::new(Some(checker)),
        }
    }
}

impl Registry {
    /// What the node's checker probes: the first caller gets it, once.
    pub fn take_checker(&self) -> Option<mpsc::UnboundedReceiver<Arc<ClusterHealth>>> {
        self.checker.lock().take()
    }

    /// The guard of `cluster` for a new snapshot: the one in force when its settings (and,
    /// for outlier detection, its endpoints) did not change, else a new one. Called when a
    /// snapshot is built, never per request.
    pub fn guard(&self, cluster: &Cluster) -> ClusterGuard {
        let breaker_config = cluster.breaker();
        let mut clusters = self.clusters.lock();
        let entry = clusters.entry(cluster.name.clone()).or_insert_with(|| {
            let overflows = Arc::<OverflowCounts>::default();
            Entry {
                breaker: (
                    breaker_config.clone(),
                    Breaker::new(&breaker_config, overflows.clone()),
                ),
                outlier: None,
                overflows,
                ejections: Arc::default(),
                health: None,
                probes: Arc::default(),
                budget: Arc::default(),
            }
        });
        if entry.breaker.0 != breaker_config {
            entry.breaker = (
                breaker_config.clone(),
                Breaker::new(&breaker_config, entry.overflows.clone()),
            );
        }
        entry.outlier = match (&cluster.outlier_detection, entry.outlier.take()) {
            (None, _) => None,
            (Some(config), Some(kept)) if kept.0 == *config && kept.1 == cluster.endpoints => {
                Some(kept)
            }
            (Some(config), _) => Some((
                config.clone(),
                cluster.endpoints.to_vec(),
                Outlier::new(
                    &cluster.name,
                    config,
                    &cluster.endpoints,
                    entry.ejections.clone(),
                ),
            )),
        };
        entry.health = match (&cluster.health_check, entry.health.take()) {
            (Some(config), Some(kept)) if kept.0 == *config && kept.1 == cluster.endpoints => {
                Some(kept)
            }
            (config, old) => {
                if let Some(old) = old {
                    old.2.retire();
                }
                config.as_ref().map(|config| {
                    let health = ClusterHealth::new(
                        &cluster.name,
                        config,
                        &cluster.endpoints,
                        entry.probes.clone(),
                    );
                    // The checker lives as long as the node; after it, nothing probes.
                    let _ = self.checks.send(health.clone());
                    (config.clone(), cluster.endpoints.to_vec(), health)
                })
            }
        };
        ClusterGuard {
            breaker: entry.breaker.1.clone(),
            outlier: entry.outlier.as_ref().map(|o| o.2.clone()),
            health: entry.health.as_ref().map(|h| h.2.clone()),
            budget: entry.budget.clone(),
        }
    }

    /// Drops the clusters a reload removed.
    pub fn retain(&self, names: &HashSet<String>) {
        self.clusters.lock().retain(|name, entry| {
            let keep = names.contains(name);
            if let (false, Some(health)) = (keep, &entry.health) {
                health.2.retire();
            }
            keep
        });
    }

    /// The resilience families of `/metrics`.
    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut overflows = Vec::new();
        let mut open = Vec::new();
        let mut ejections = Vec::new();
        let mut ejected = Vec::new();
        let mut probes = Vec::new();
        let mut unhealthy = Vec::new();
        {
            let clusters = self.clusters.lock();
            let mut names: Vec<&String> = clusters.keys().collect();
            names.sort();
            for name in names {
                let e = &clusters[name];
                for kind in Overflow::ALL {
                    overflows.push((name.clone(), kind.as_str(), e.overflows.get(kind)));
                    open.push((name.clone(), kind.as_str(), e.breaker.1.open(kind)));
                }
                if let Some((_, _, outlier)) = &e.outlier {
                    for reason in Reason::ALL {
                        ejections.push((name.clone(), reason.as_str(), e.ejections.get(reason)));
                    }
                    ejected.push((name.clone(), outlier.ejected()));
                }
                if let Some((_, _, health)) = &e.health {
                    for result in ProbeResult::ALL {
                        probes.push((name.clone(), result.as_str(), e.probes.get(result)));
                    }
                    unhealthy.push((name.clone(), health.down()));
                }
            }
        }
        let rows: Vec<_> = overflows
            .iter()
            .map(|(c, k, v)| ([("cluster", c.as_str()), ("kind", *k)], *v))
            .collect();
        crate::metrics::counter(
            enc,
            "flatmesh_upstream_overflows",
            "Requests refused at once by a cluster's circuit breaker, by the limit they hit (x-flatmesh-overflow)",
            &rows,
        )?;
        let rows: Vec<_> = open
            .iter()
            .map(|(c, k, v)| ([("cluster", c.as_str()), ("kind", *k)], i64::from(*v)))
            .collect();
        crate::metrics::gauge(
            enc,
            "flatmesh_upstream_breaker_open",
            "What is outstanding to a cluster against its circuit breaker's limits: connections, pending connects, requests, retries",
            &rows,
        )?;
        let rows: Vec<_> = ejections
            .iter()
            .map(|(c, r, v)| ([("cluster", c.as_str()), ("reason", *r)], *v))
            .collect();
        crate::metrics::counter(
            enc,
            "flatmesh_outlier_ejections",
            "Endpoints ejected by outlier detection, by cluster and reason",
            &rows,
        )?;
        let rows: Vec<_> = ejected
            .iter()
            .map(|(c, n)| {
                (
                    [("cluster", c.as_str())],
                    i64::try_from(*n).unwrap_or(i64::MAX),
                )
            })
            .collect();
        crate::metrics::gauge(
            enc,
            "flatmesh_outlier_ejected_endpoints",
            "Endpoints of a cluster ejected by outlier detection right now",
            &rows,
        )?;
        let rows: Vec<_> = probes
            .iter()
            .map(|(c, r, v)| ([("cluster", c.as_str()), ("result", *r)], *v))
            .collect();
        crate::metrics::counter(
            enc,
            "flatmesh_health_checks",
            "Active health check probes, by cluster and result (pass, fail, timeout)",
            &rows,
        )?;
        let rows: Vec<_> = unhealthy
            .iter()
            .map(|(c, n)| {
                (
                    [("cluster", c.as_str())],
                    i64::try_from(*n).unwrap_or(i64::MAX),
                )
            })
            .collect();
        crate::metrics::gauge(
            enc,
            "flatmesh_health_unhealthy_endpoints",
            "Endpoints of a cluster out of load balancing because they fail their health check",
            &rows,
        )
    }
}
