//! Applications expanded into the instances the placer places: one instance per shard plus its
//! backup replicas, with the DAG edges between shard instances and each instance's resource demand.

use crate::error::{ControlError, Result};
use crate::model::{app_profiles, AppSpec, CoreClass, Microservice, Pin};

#[derive(Debug, Clone)]
pub struct Instance {
    /// `APP/STAGE-SHARD`, or `APP/STAGE-SHARD-rK` for backup replica K.
    pub id: String,
    pub app: usize,
    pub microservice: String,
    /// Requests/s this shard carries (a backup: the rate of its primary, served only once promoted).
    pub rps: f64,
    /// Share of `rps` whose CPU and bandwidth this instance reserves: 1 for a primary, the app's
    /// `backup_load` for a backup.
    pub load: f64,
    pub replica_of: Option<usize>,
    /// Fault-domain group: a primary and its replicas. No two members share a server (§3.5).
    pub group: usize,
    /// Reserved by primaries and backups alike: a backup holds the replicated state.
    pub memory_mb: u64,
    pub pin: Pin,
    pub offloadable: bool,
    /// Cores reserved on each core class (`rps x load x` Table 1's cores/RPS).
    pub cores_beefy: f64,
    pub cores_wimpy: f64,
    /// Active joules per request on each core class (Table 1's W / RPS).
    pub joules_beefy: f64,
    pub joules_wimpy: f64,
    /// Bandwidth of the server's shared ports reserved (`rps x load x` request size).
    pub bandwidth_gbps: f64,
}

impl Instance {
    pub fn cores_on(&self, core: CoreClass) -> f64 {
        match core {
            CoreClass::Beefy => self.cores_beefy,
            CoreClass::Wimpy => self.cores_wimpy,
        }
    }
    pub fn joules_on(&self, core: CoreClass) -> f64 {
        match core {
            CoreClass::Beefy => self.joules_beefy,
            CoreClass::Wimpy => self.joules_wimpy,
        }
    }
    pub fn is_primary(&self) -> bool {
        self.replica_of.is_none()
    }
}

#[derive(Debug, Clone)]
pub struct AppInfo {
    pub name: String,
    pub rps: f64,
    pub first_instance: usize,
    pub end_instance: usize,
}

/// Everything to place: instances, DAG edges between primaries, and the replica lists.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    pub instances: Vec<Instance>,
    /// Direct descendants of each instance in the DAG (primaries only; replicas have none).
    pub children: Vec<Vec<usize>>,
    /// Backup replicas of each primary.
    pub replicas: Vec<Vec<usize>>,
    /// Primaries with no parent: the DAG sources V_src.
    pub sources: Vec<usize>,
    pub apps: Vec<AppInfo>,
}

impl Workload {
    pub fn from_apps(apps: &[AppSpec]) -> Result<Self> {
        let mut wl = Workload::default();
        for app in apps {
            wl.add_app(app, 1.0)?;
        }
        Ok(wl)
    }

    /// Adds one application whose design rate is scaled by `scale` (the simulator searches for the
    /// peak rate this way). Returns its index.
    pub fn add_app(&mut self, app: &AppSpec, scale: f64) -> Result<usize> {
        if self.apps.iter().any(|a| a.name == app.name) {
            return Err(ControlError::Invalid {
                what: "app",
                message: format!(
                    "two apps are named {:?}; instance ids would clash, rename one of them",
                    app.name
                ),
            });
        }
        let profiles = app_profiles(app)?;
        let app_idx = self.apps.len();
        let rps = app.rps * scale;
        let first = self.instances.len();
        // Primary instance ids per stage, for wiring the edges.
        let mut stage_shards: Vec<Vec<usize>> = Vec::with_capacity(app.stages.len());
        for stage in &app.stages {
            let profile: &Microservice =
                profiles
                    .get(&stage.microservice)
                    .ok_or_else(|| ControlError::Invalid {
                        what: "app",
                        message: format!(
                            "stage {} names unknown microservice {:?}",
                            stage.name, stage.microservice
                        ),
                    })?;
            let shard_rps = rps * stage.fraction / f64::from(stage.shards);
            let mut shards = Vec::new();
            for shard in 0..stage.shards {
                let group = self.instances.len();
                let primary = self.push(
                    format!("{}/{}-{shard}", app.name, stage.name),
                    app_idx,
                    &stage.microservice,
                    profile,
                    (shard_rps, 1.0),
                    None,
                    group,
                );
                shards.push(primary);
                for r in 1..=app.replicas {
                    let rep = self.push(
                        format!("{}/{}-{shard}-r{r}", app.name, stage.name),
                        app_idx,
                        &stage.microservice,
                        profile,
                        (shard_rps, app.backup_load),
                        Some(primary),
                        group,
                    );
                    self.replicas[primary].push(rep);
                }
            }
            stage_shards.push(shards);
        }
        let index: std::collections::HashMap<&str, usize> = app
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        for (b, stage) in app.stages.iter().enumerate() {
            if stage.after.is_empty() {
                self.sources.extend(&stage_shards[b]);
            }
            for up in &stage.after {
                let Some(&a) = index.get(up.as_str()) else {
                    continue;
                };
                for (i, j) in shard_edges(stage_shards[a].len(), stage_shards[b].len()) {
                    let (from, to) = (stage_shards[a][i], stage_shards[b][j]);
                    self.children[from].push(to);
                }
            }
        }
        self.apps.push(AppInfo {
            name: app.name.clone(),
            rps,
            first_instance: first,
            end_instance: self.instances.len(),
        });
        Ok(app_idx)
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        id: String,
        app: usize,
        name: &str,
        m: &Microservice,
        (rps, load): (f64, f64),
        replica_of: Option<usize>,
        group: usize,
    ) -> usize {
        let idx = self.instances.len();
        let reserved = rps * load;
        self.instances.push(Instance {
            id,
            app,
            microservice: name.to_string(),
            rps,
            load,
            replica_of,
            group,
            memory_mb: m.memory_mb,
            pin: m.pin,
            offloadable: m.offloadable(),
            cores_beefy: reserved * m.beefy.core_seconds_per_request(),
            cores_wimpy: reserved * m.wimpy.core_seconds_per_request(),
            joules_beefy: m.beefy.joules_per_request(),
            joules_wimpy: m.wimpy.joules_per_request(),
            bandwidth_gbps: reserved * f64::from(m.request_bytes) * 8.0 / 1e9,
        });
        self.children.push(Vec::new());
        self.replicas.push(Vec::new());
        idx
    }

    /// All DAG edges (parent, child) between primaries.
    pub fn edges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.children
            .iter()
            .enumerate()
            .flat_map(|(p, cs)| cs.iter().map(move |&c| (p, c)))
    }
}

/// Shard-aligned wiring between a stage of `na` shards and its successor of `nb` shards: when the
/// successor is wider, shard i feeds every successor shard j with j % na == i (a fan-out of nb/na);
/// when narrower, shard i feeds shard i % nb. Every shard gets at least one edge each way that exists.
pub fn shard_edges(na: usize, nb: usize) -> Vec<(usize, usize)> {
    if na == 0 || nb == 0 {
        return Vec::new();
    }
    if na <= nb {
        (0..nb).map(|j| (j % na, j)).collect()
    } else {
        (0..na).map(|i| (i, i % nb)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::load_app;

    #[test]
    fn iot_ts_expands_to_108_instances() {
        let app = load_app("preset:IOT-TS").unwrap();
        let wl = Workload::from_apps(&[app]).unwrap();
        assert_eq!(wl.instances.len(), 108);
        assert_eq!(wl.sources.len(), 6);
        assert_eq!(wl.instances[0].id, "IOT-TS/api-0");
        assert_eq!(wl.instances[1].id, "IOT-TS/api-0-r1");
        assert_eq!(wl.instances[1].replica_of, Some(0));
        // API(6) -> SQL(12): fan-out 2; SQL -> EMA, Spike, Recommend: fan-out 3.
        assert_eq!(wl.children[0].len(), 2);
        let sql0 = wl.children[0][0];
        assert_eq!(wl.instances[sql0].microservice, "SQL");
        assert_eq!(wl.children[sql0].len(), 3);
        assert_eq!(wl.edges().count(), 12 + 36);
        // SQL is pinned and not offloadable; EMA is offloadable.
        assert!(!wl.instances[sql0].offloadable);
    }

    #[test]
    fn duplicate_app_names_are_rejected() {
        let app = load_app("preset:NFV-FIN").unwrap();
        let err = Workload::from_apps(&[app.clone(), app])
            .unwrap_err()
            .to_string();
        assert!(err.contains("rename one"), "{err}");
    }

    #[test]
    fn fraction_scales_a_stage_load() {
        let app = load_app("preset:IOT-TS").unwrap();
        let wl = Workload::from_apps(&[app]).unwrap();
        let rate = |ms: &str| {
            wl.instances
                .iter()
                .find(|i| i.microservice == ms)
                .unwrap()
                .rps
        };
        // 2,000 req/s over 12 shards; Recommend sees 0.2% of them.
        assert!((rate("SQL") - 2000.0 / 12.0).abs() < 1e-9);
        assert!((rate("Recommend") - 4.0 / 12.0).abs() < 1e-9);
    }

    #[test]
    fn shard_edges_cover_both_sides() {
        for (na, nb) in [(1, 1), (6, 12), (12, 6), (5, 3), (3, 5)] {
            let e = shard_edges(na, nb);
            for i in 0..na {
                assert!(e.iter().any(|&(a, _)| a == i));
            }
            for j in 0..nb {
                assert!(e.iter().any(|&(_, b)| b == j));
            }
        }
    }
}
