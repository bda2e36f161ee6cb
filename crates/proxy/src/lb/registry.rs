//! Every cluster's load-balancing tables of the snapshot in force, by name, for the node's
//! lifetime: slow start carries over reloads from here, and `/metrics` reads each priority
//! level's health and load from here (never per request).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use flatmesh_config::Cluster;
use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;

use super::slow_start::SlowStart;
use super::Tables;
use crate::resilience::Out;

struct Entry {
    /// The slow start in force, with the settings and endpoints it was made for.
    slow_start: Option<(flatmesh_config::SlowStart, Vec<SocketAddr>, Arc<SlowStart>)>,
    tables: Arc<Tables>,
    out: Out,
}

#[derive(Default)]
pub struct Registry {
    clusters: Mutex<HashMap<String, Entry>>,
}

impl Registry {
    /// The tables of `cluster` for a new snapshot. Called when a snapshot is built.
    pub fn tables(&self, cluster: &Cluster, node_locality: Option<&str>, out: Out) -> Arc<Tables> {
        let mut clusters = self.clusters.lock();
        let previous = clusters.remove(&cluster.name);
        let slow_start = match (&cluster.slow_start, previous.and_then(|p| p.slow_start)) {
            (None, _) => None,
            (Some(config), Some(kept)) if kept.0 == *config && kept.1 == cluster.endpoints => {
                Some(kept)
            }
            (Some(config), kept) => {
                let state = match kept {
                    // Endpoints new in this update ramp; the others keep their state.
                    Some((_, endpoints, old)) => {
                        SlowStart::carried(config, &cluster.endpoints, &old, &endpoints)
                    }
                    // A new cluster (or slow start just turned on): nothing ramps yet, as
                    // Envoy does not slow-start the hosts a cluster is created with.
                    None => SlowStart::new(config, cluster.endpoints.len()),
                };
                Some((config.clone(), cluster.endpoints.to_vec(), Arc::new(state)))
            }
        };
        let tables = Arc::new(Tables::build(
            cluster,
            node_locality,
            slow_start.as_ref().map(|s| s.2.clone()),
        ));
        clusters.insert(
            cluster.name.clone(),
            Entry {
                slow_start,
                tables: tables.clone(),
                out,
            },
        );
        tables
    }

    /// Drops the clusters a reload removed.
    pub fn retain(&self, names: &HashSet<String>) {
        self.clusters.lock().retain(|name, _| names.contains(name));
    }

    /// The load-balancing families of `/metrics`: per priority level, endpoints in and in
    /// all, and the share of traffic the level takes.
    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        type Row = ([(&'static str, String); 3], i64);
        let mut healthy: Vec<Row> = Vec::new();
        let mut total: Vec<Row> = Vec::new();
        let mut load: Vec<Row> = Vec::new();
        let mut ramping: Vec<([(&'static str, String); 1], i64)> = Vec::new();
        {
            let clusters = self.clusters.lock();
            let mut names: Vec<&String> = clusters.keys().collect();
            names.sort();
            for name in names {
                let e = &clusters[name];
                let health = e.tables.health(&e.out, e.out.now(), |_, _| {});
                let loads = e.tables.loads(&health);
                for ((level, (up, all)), share) in e.tables.levels.iter().zip(&health).zip(&loads) {
                    let labels = [
                        ("cluster", name.clone()),
                        ("priority", level.priority.to_string()),
                        ("locality", level.proximity.as_str().to_owned()),
                    ];
                    healthy.push((labels.clone(), i64::from(*up)));
                    total.push((labels.clone(), i64::from(*all)));
                    load.push((labels, i64::from(*share)));
                }
                if let Some(s) = &e.tables.slow_start {
                    let n = s.ramping(s.now());
                    ramping.push(([("cluster", name.clone())], n as i64));
                }
            }
        }
        crate::metrics::gauge(
            enc,
            "flatmesh_lb_level_healthy_endpoints",
            "Endpoints of a cluster's priority level (priority, and locality relative to the node) that are in: not ejected, not failing their health check",
            &healthy,
        )?;
        crate::metrics::gauge(
            enc,
            "flatmesh_lb_level_endpoints",
            "Endpoints of a cluster's priority level",
            &total,
        )?;
        crate::metrics::gauge(
            enc,
            "flatmesh_lb_level_load_percent",
            "The share of a cluster's traffic its priority level takes now, in percent (Envoy's priority load with the overprovisioning factor); all 0: every endpoint is out (panic routing)",
            &load,
        )?;
        crate::metrics::gauge(
            enc,
            "flatmesh_lb_slow_start_endpoints",
            "Endpoints of a cluster in their slow-start window",
            &ramping,
        )
    }
}
