//! Resilience of the node toward its clusters: the circuit breaker ([`breaker`]) and outlier
//! detection ([`outlier`]). Both are per node, shared by every worker, and live in a
//! [`Registry`] that outlives config snapshots, so a reload that leaves a cluster's settings
//! alone keeps its counts, ejections and in-flight totals.

pub mod breaker;
pub mod outlier;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use flatmesh_config::{CircuitBreaker, Cluster, OutlierDetection};
use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;

pub use breaker::{Breaker, Overflow, OverflowCounts, Overflowed, Permit};
pub use outlier::{EjectionCounts, Outcome, Outlier, Reason};

/// A cluster's breaker and outlier detection, as a snapshot's cluster plan holds them.
pub struct ClusterGuard {
    pub breaker: Arc<Breaker>,
    /// `None`: the cluster has no `outlier_detection`.
    pub outlier: Option<Arc<Outlier>>,
}

/// What one cluster name has in the registry.
struct Entry {
    breaker: (CircuitBreaker, Arc<Breaker>),
    outlier: Option<(OutlierDetection, Vec<SocketAddr>, Arc<Outlier>)>,
    overflows: Arc<OverflowCounts>,
    ejections: Arc<EjectionCounts>,
}

/// Every cluster's guard, by name; lives as long as the node.
#[derive(Default)]
pub struct Registry {
    clusters: Mutex<HashMap<String, Entry>>,
}

impl Registry {
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
                cluster.endpoints.clone(),
                Outlier::new(
                    &cluster.name,
                    config,
                    &cluster.endpoints,
                    entry.ejections.clone(),
                ),
            )),
        };
        ClusterGuard {
            breaker: entry.breaker.1.clone(),
            outlier: entry.outlier.as_ref().map(|o| o.2.clone()),
        }
    }

    /// Drops the clusters a reload removed.
    pub fn retain(&self, names: &HashSet<String>) {
        self.clusters.lock().retain(|name, _| names.contains(name));
    }

    /// The resilience families of `/metrics`.
    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut overflows = Vec::new();
        let mut open = Vec::new();
        let mut ejections = Vec::new();
        let mut ejected = Vec::new();
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
        )
    }
}
