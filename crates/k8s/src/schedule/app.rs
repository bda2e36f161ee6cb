//! The pods of `schedulerName: flatmesh` as E3 applications (`flatmesh_control::model::AppSpec`):
//! the app, stage, microservice profile and DAG edges come from the pods' annotations. A pure
//! function.
//!
//! Each pod is one E3 instance. A stage's pods, in order (the StatefulSet pod index label, then
//! the name), are shard 0's primary, its backups, shard 1's primary, ...: with `replicas: R`
//! (backups per shard) a stage of N pods has N / (R + 1) shards, and N must be a multiple of
//! R + 1. The instance of pod k is `APP/STAGE-SHARD` or `APP/STAGE-SHARD-rK`, E3's ids
//! (`flatmesh_control::workload`), so [`App::yaml`] given to `flatmesh place --app` names the
//! same instances.

use std::collections::{BTreeMap, BTreeSet};

use flatmesh_control::model::{AppSpec, Microservice, StageSpec};
use k8s_openapi::api::core::v1::Pod;

/// The scheduler name of the pods flatmesh places.
pub const SCHEDULER_NAME: &str = "flatmesh";
/// Annotation: the application a pod belongs to (required).
pub const APP_ANNOTATION: &str = "flatmesh.io/app";
/// Annotation: the pod's stage in its app. Default: the pod's `app` label.
pub const STAGE_ANNOTATION: &str = "flatmesh.io/stage";
/// Annotation: the stage's microservice profile, a name of E3's Table 1 (`Count`, `KVS`,
/// `API gw`, ...) or of a profile given in [`PROFILE_ANNOTATION`] (required).
pub const MICROSERVICE_ANNOTATION: &str = "flatmesh.io/microservice";
/// Annotation: a microservice profile of its own (JSON or YAML, the fields of a profile in
/// `flatmesh place --app` files), named by [`MICROSERVICE_ANNOTATION`].
pub const PROFILE_ANNOTATION: &str = "flatmesh.io/profile";
/// Annotation: the stages of the same app this stage calls, comma-separated (the DAG's edges).
pub const CALLS_ANNOTATION: &str = "flatmesh.io/calls";
/// Annotation: the share of the app's requests that reach this stage, in (0, 1]; default 1.
pub const FRACTION_ANNOTATION: &str = "flatmesh.io/fraction";
/// Annotation: the app's entry rate in requests/s (required on at least one of its pods).
pub const RPS_ANNOTATION: &str = "flatmesh.io/rps";
/// Annotation: backup replicas per shard; default 0.
pub const REPLICAS_ANNOTATION: &str = "flatmesh.io/replicas";
/// Annotation: the share of its primary's load a backup reserves, in [0, 1]; default 0.
pub const BACKUP_LOAD_ANNOTATION: &str = "flatmesh.io/backup-load";
/// The StatefulSet controller's label of a pod's ordinal.
const POD_INDEX_LABEL: &str = "apps.kubernetes.io/pod-index";

/// A pod, by namespace and name (and uid, so a re-created pod is a new one).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodKey {
    pub fn of(pod: &Pod) -> PodKey {
        PodKey {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One application and which pod each of its instances is.
#[derive(Debug, Clone)]
pub struct App {
    pub spec: AppSpec,
    /// E3 instance id -> pod.
    pub pods: BTreeMap<String, PodKey>,
}

impl App {
    /// The app as a `flatmesh place --app FILE` file.
    pub fn yaml(&self) -> String {
        // An AppSpec is plain data (strings, numbers, maps): serializing cannot fail.
        serde_norway::to_string(&self.spec).unwrap_or_default()
    }
}

/// The apps, and the pods that are in none (with why).
#[derive(Debug, Clone, Default)]
pub struct Apps {
    pub apps: Vec<App>,
    pub errors: Vec<(PodKey, String)>,
}

/// Whether the scheduler should care about `pod`: `schedulerName: flatmesh`, not finished, not
/// being deleted.
pub fn is_ours(pod: &Pod) -> bool {
    let spec = pod.spec.as_ref();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    spec.and_then(|s| s.scheduler_name.as_deref()) == Some(SCHEDULER_NAME)
        && !matches!(phase, Some("Succeeded" | "Failed"))
        && pod.metadata.deletion_timestamp.is_none()
}

/// The apps of the pods that [`is_ours`], bound or not (a bound pod keeps its node; its app
/// still needs it for the DAG). An app named `A` in namespace `N` is `N/A`.
pub fn apps_from_pods(pods: &[Pod]) -> Apps {
    let mut out = Apps::default();
    let mut by_app: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| is_ours(p)) {
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        match annotations.get(APP_ANNOTATION) {
            Some(app) if !app.trim().is_empty() => by_app
                .entry(format!(
                    "{}/{}",
                    pod.metadata.namespace.as_deref().unwrap_or_default(),
                    app.trim()
                ))
                .or_default()
                .push(pod),
            _ => out.errors.push((
                PodKey::of(pod),
                format!("it has schedulerName {SCHEDULER_NAME} but no annotation {APP_ANNOTATION}: APP (docs/kubernetes.md, \"Scheduler\")"),
            )),
        }
    }
    for (name, pods) in by_app {
        match app_of(&name, &pods) {
            Ok(app) => out.apps.push(app),
            Err(why) => {
                let why = format!("app {name}: {why}");
                out.errors
                    .extend(pods.iter().map(|p| (PodKey::of(p), why.clone())));
            }
        }
    }
    out
}

/// What one stage's pods say.
struct Stage<'a> {
    microservice: String,
    calls: BTreeSet<String>,
    fraction: f64,
    pods: Vec<&'a Pod>,
}

fn app_of(name: &str, pods: &[&Pod]) -> Result<App, String> {
    let mut rps: Option<f64> = None;
    let mut replicas: Option<u32> = None;
    let mut backup_load: Option<f64> = None;
    let mut profiles: BTreeMap<String, Microservice> = BTreeMap::new();
    let mut stages: BTreeMap<String, Stage> = BTreeMap::new();
    for pod in pods {
        let key = PodKey::of(pod);
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        let get = |k: &str| annotations.get(k).map(|v| v.trim());
        let number = |k: &str| -> Result<Option<f64>, String> {
            get(k)
                .map(|v| {
                    v.parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite())
                        .ok_or_else(|| format!("pod {key}: annotation {k}={v:?} is not a number"))
                })
                .transpose()
        };
        // App-wide values: every pod that gives one must agree.
        agree(&mut rps, number(RPS_ANNOTATION)?, RPS_ANNOTATION, &key)?;
        agree(
            &mut backup_load,
            number(BACKUP_LOAD_ANNOTATION)?,
            BACKUP_LOAD_ANNOTATION,
            &key,
        )?;
        let r = get(REPLICAS_ANNOTATION)
            .map(|v| {
                v.parse::<u32>().map_err(|_| {
                    format!(
                        "pod {key}: annotation {REPLICAS_ANNOTATION}={v:?} is not a whole number"
                    )
                })
            })
            .transpose()?;
        agree(&mut replicas, r, REPLICAS_ANNOTATION, &key)?;
        let stage_name = get(STAGE_ANNOTATION)
            .map(str::to_string)
            .or_else(|| pod.metadata.labels.as_ref().and_then(|l| l.get("app")).cloned())
            .ok_or_else(|| format!("pod {key} has no annotation {STAGE_ANNOTATION} and no `app` label to name its stage"))?;
        let microservice = get(MICROSERVICE_ANNOTATION)
            .ok_or_else(|| format!("pod {key} has no annotation {MICROSERVICE_ANNOTATION}: a profile of E3's Table 1 (e.g. Count, KVS, NIDS) or one of {PROFILE_ANNOTATION}"))?
            .to_string();
        if let Some(text) = get(PROFILE_ANNOTATION) {
            let profile: Microservice = serde_norway::from_str(text).map_err(|e| {
                format!(
                    "pod {key}: annotation {PROFILE_ANNOTATION} is not a microservice profile: {e}"
                )
            })?;
            let mut known = profiles.get(&microservice).cloned();
            agree(&mut known, Some(profile), PROFILE_ANNOTATION, &key)?;
            if let Some(p) = known {
                profiles.insert(microservice.clone(), p);
            }
        }
        let calls: BTreeSet<String> = get(CALLS_ANNOTATION)
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        let fraction = number(FRACTION_ANNOTATION)?.unwrap_or(1.0);
        let stage = stages.entry(stage_name.clone()).or_insert_with(|| Stage {
            microservice: microservice.clone(),
            calls: calls.clone(),
            fraction,
            pods: Vec::new(),
        });
        if stage.microservice != microservice || stage.calls != calls || stage.fraction != fraction
        {
            return Err(format!(
                "the pods of stage {stage_name} disagree on {MICROSERVICE_ANNOTATION}, {CALLS_ANNOTATION} or {FRACTION_ANNOTATION} (pod {key}); give every pod of a stage the same"
            ));
        }
        stage.pods.push(*pod);
    }
    let rps = rps.ok_or_else(|| {
        format!("no pod gives the app's entry rate: add the annotation {RPS_ANNOTATION}: REQUESTS_PER_SECOND")
    })?;
    let replicas = replicas.unwrap_or(0);
    let order = stage_order(&stages)?;
    let mut spec = AppSpec {
        name: name.to_string(),
        description: None,
        rps,
        replicas,
        backup_load: backup_load.unwrap_or(0.0),
        microservices: profiles,
        stages: Vec::new(),
    };
    let mut by_instance = BTreeMap::new();
    for stage_name in order {
        let stage = &stages[&stage_name];
        let per_shard = replicas as usize + 1;
        if !stage.pods.len().is_multiple_of(per_shard) {
            return Err(format!(
                "stage {stage_name} has {} pods, not a multiple of {per_shard} (a primary and {replicas} backups per shard, {REPLICAS_ANNOTATION})",
                stage.pods.len()
            ));
        }
        let mut pods = stage.pods.clone();
        pods.sort_by_key(|p| (pod_index(p), p.metadata.name.clone()));
        for (k, pod) in pods.iter().enumerate() {
            let (shard, replica) = (k / per_shard, k % per_shard);
            let id = match replica {
                0 => format!("{name}/{stage_name}-{shard}"),
                r => format!("{name}/{stage_name}-{shard}-r{r}"),
            };
            by_instance.insert(id, PodKey::of(pod));
        }
        spec.stages.push(StageSpec {
            name: stage_name.clone(),
            microservice: stage.microservice.clone(),
            shards: (pods.len() / per_shard) as u32,
            after: stages
                .iter()
                .filter(|(_, s)| s.calls.contains(&stage_name))
                .map(|(n, _)| n.clone())
                .collect(),
            fraction: stage.fraction,
        });
    }
    // E3's own checks (profiles exist, fractions and rates in range, a DAG): through the same
    // parser as `flatmesh place --app`.
    let spec = flatmesh_control::model::parse_app(
        name,
        &serde_norway::to_string(&spec).unwrap_or_default(),
    )
    .map_err(|e| e.to_string())?;
    Ok(App {
        spec,
        pods: by_instance,
    })
}

/// Keeps the first value given; a different one is an error naming `key` and the pod.
fn agree<T: PartialEq + std::fmt::Debug>(
    known: &mut Option<T>,
    given: Option<T>,
    key: &str,
    pod: &PodKey,
) -> Result<(), String> {
    match (known.as_ref(), given) {
        (_, None) => Ok(()),
        (None, Some(v)) => {
            *known = Some(v);
            Ok(())
        }
        (Some(k), Some(v)) if *k == v => Ok(()),
        (Some(k), Some(v)) => Err(format!(
            "pod {pod} says {key}={v:?} but another pod of the app says {k:?}; give every pod the same"
        )),
    }
}

fn pod_index(pod: &Pod) -> u64 {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(POD_INDEX_LABEL))
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The stages callers first (E3's `after` may only name earlier stages), ties by name; an
/// error on a call to an unknown stage or a cycle.
fn stage_order(stages: &BTreeMap<String, Stage>) -> Result<Vec<String>, String> {
    for (name, stage) in stages {
        if let Some(unknown) = stage.calls.iter().find(|c| !stages.contains_key(*c)) {
            let known: Vec<&str> = stages.keys().map(String::as_str).collect();
            return Err(format!(
                "stage {name} calls {unknown:?}{}, which no pod of the app is a stage of (stages: {})",
                flatmesh_control::model::did_you_mean(unknown, &known),
                known.join(", ")
            ));
        }
    }
    let mut callers: BTreeMap<&str, usize> = stages.keys().map(|n| (n.as_str(), 0)).collect();
    for stage in stages.values() {
        for callee in &stage.calls {
            *callers.entry(callee.as_str()).or_default() += 1;
        }
    }
    let mut ready: BTreeSet<&str> = callers
        .iter()
        .filter(|(_, c)| **c == 0)
        .map(|(n, _)| *n)
        .collect();
    let mut order = Vec::new();
    while let Some(next) = ready.pop_first() {
        order.push(next.to_string());
        for callee in &stages[next].calls {
            if let Some(c) = callers.get_mut(callee.as_str()) {
                *c -= 1;
                if *c == 0 {
                    ready.insert(callee.as_str());
                }
            }
        }
    }
    if order.len() < stages.len() {
        let cycle: Vec<&str> = callers
            .iter()
            .filter(|(_, c)| **c > 0)
            .map(|(n, _)| *n)
            .collect();
        return Err(format!(
            "the calls between stages {} form a cycle; E3 places a DAG ({CALLS_ANNOTATION})",
            cycle.join(", ")
        ));
    }
    Ok(order)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A pending pod of `schedulerName: flatmesh` with these annotations.
    pub(crate) fn pod(namespace: &str, name: &str, annotations: &[(&str, &str)]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "namespace": namespace,
                "name": name,
                "uid": format!("uid-{name}"),
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            },
            "spec": {"schedulerName": SCHEDULER_NAME, "containers": [{"name": "c", "image": "i"}]},
        }))
        .unwrap()
    }

    /// The shop: gw (API gw, 1 pod) calls count (2 pods) and kvs (2 pods); count calls kvs.
    pub(crate) fn shop() -> Vec<Pod> {
        let gw = [
            (APP_ANNOTATION, "shop"),
            (STAGE_ANNOTATION, "gw"),
            (MICROSERVICE_ANNOTATION, "API gw"),
            (CALLS_ANNOTATION, "count, kvs"),
            (RPS_ANNOTATION, "1000"),
        ];
        let count = [
            (APP_ANNOTATION, "shop"),
            (STAGE_ANNOTATION, "count"),
            (MICROSERVICE_ANNOTATION, "Count"),
            (CALLS_ANNOTATION, "kvs"),
        ];
        let kvs = [
            (APP_ANNOTATION, "shop"),
            (STAGE_ANNOTATION, "kvs"),
            (MICROSERVICE_ANNOTATION, "KVS"),
            (FRACTION_ANNOTATION, "0.5"),
        ];
        vec![
            pod("web", "kvs-1", &kvs),
            pod("web", "gw-0", &gw),
            pod("web", "count-0", &count),
            pod("web", "kvs-0", &kvs),
            pod("web", "count-1", &count),
        ]
    }

    #[test]
    fn pods_become_an_e3_app() {
        let apps = apps_from_pods(&shop());
        assert!(apps.errors.is_empty(), "{:?}", apps.errors);
        let app = &apps.apps[0];
        assert_eq!(app.spec.name, "web/shop");
        let stages: Vec<(&str, &str, u32, Vec<&str>, f64)> = app
            .spec
            .stages
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.microservice.as_str(),
                    s.shards,
                    s.after.iter().map(String::as_str).collect(),
                    s.fraction,
                )
            })
            .collect();
        assert_eq!(
            stages,
            vec![
                ("gw", "API gw", 1, vec![], 1.0),
                ("count", "Count", 2, vec!["gw"], 1.0),
                ("kvs", "KVS", 2, vec!["count", "gw"], 0.5),
            ]
        );
        assert_eq!((app.spec.rps, app.spec.replicas), (1000.0, 0));
        assert_eq!(app.pods["web/shop/kvs-1"].name, "kvs-1");
        assert_eq!(app.pods["web/shop/gw-0"].name, "gw-0");
        // The YAML `flatmesh place` reads gives the same instances.
        let again = flatmesh_control::model::parse_app("shop.yaml", &app.yaml()).unwrap();
        let wl = flatmesh_control::workload::Workload::from_apps(&[again]).unwrap();
        let ids: BTreeSet<&str> = wl.instances.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, app.pods.keys().map(String::as_str).collect());
    }

    #[test]
    fn backups_follow_their_primary_in_pod_order() {
        let a = [
            (APP_ANNOTATION, "db"),
            (STAGE_ANNOTATION, "kvs"),
            (MICROSERVICE_ANNOTATION, "KVS"),
            (RPS_ANNOTATION, "10"),
            (REPLICAS_ANNOTATION, "1"),
        ];
        let mut pods: Vec<Pod> = (0..4).map(|i| pod("ns", &format!("kvs-{i}"), &a)).collect();
        // StatefulSet ordinals order the pods, not their names.
        for (i, p) in pods.iter_mut().enumerate() {
            p.metadata.labels = Some(BTreeMap::from([(
                POD_INDEX_LABEL.into(),
                (3 - i).to_string(),
            )]));
        }
        let apps = apps_from_pods(&pods);
        let app = &apps.apps[0];
        let names: Vec<(&str, &str)> = app
            .pods
            .iter()
            .map(|(i, p)| (i.as_str(), p.name.as_str()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("ns/db/kvs-0", "kvs-3"),
                ("ns/db/kvs-0-r1", "kvs-2"),
                ("ns/db/kvs-1", "kvs-1"),
                ("ns/db/kvs-1-r1", "kvs-0"),
            ]
        );
        // Three pods cannot be shards of a primary and a backup each.
        let apps = apps_from_pods(&pods[..3]);
        assert_eq!(apps.errors.len(), 3);
        assert!(
            apps.errors[0].1.contains("not a multiple of 2"),
            "{:?}",
            apps.errors
        );
    }

    #[test]
    fn own_profiles_and_bad_annotations() {
        let profile = r#"{stateful: false, request_bytes: 100, memory_mb: 64, beefy: {rps: 1000, watts: 10, cores: 1}, wimpy: {rps: 500, watts: 2, cores: 1}}"#;
        let ok = [
            (APP_ANNOTATION, "x"),
            (STAGE_ANNOTATION, "s"),
            (MICROSERVICE_ANNOTATION, "mine"),
            (PROFILE_ANNOTATION, profile),
            (RPS_ANNOTATION, "10"),
        ];
        let apps = apps_from_pods(&[pod("ns", "s-0", &ok)]);
        assert!(apps.errors.is_empty(), "{:?}", apps.errors);
        assert_eq!(apps.apps[0].spec.microservices["mine"].memory_mb, 64);

        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![(STAGE_ANNOTATION, "s")], APP_ANNOTATION),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (RPS_ANNOTATION, "1"),
                ],
                MICROSERVICE_ANNOTATION,
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (MICROSERVICE_ANNOTATION, "Count"),
                ],
                RPS_ANNOTATION,
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (MICROSERVICE_ANNOTATION, "Cuont"),
                    (RPS_ANNOTATION, "1"),
                ],
                "did you mean \"Count\"",
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (MICROSERVICE_ANNOTATION, "Count"),
                    (RPS_ANNOTATION, "fast"),
                ],
                "not a number",
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (MICROSERVICE_ANNOTATION, "Count"),
                    (RPS_ANNOTATION, "1"),
                    (CALLS_ANNOTATION, "t"),
                ],
                "calls \"t\"",
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (MICROSERVICE_ANNOTATION, "Count"),
                    (RPS_ANNOTATION, "1"),
                    (CALLS_ANNOTATION, "s"),
                ],
                "cycle",
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (MICROSERVICE_ANNOTATION, "Count"),
                    (RPS_ANNOTATION, "1"),
                ],
                "no annotation flatmesh.io/stage",
            ),
            (
                vec![
                    (APP_ANNOTATION, "x"),
                    (STAGE_ANNOTATION, "s"),
                    (MICROSERVICE_ANNOTATION, "mine"),
                    (PROFILE_ANNOTATION, "{memory_mb: lots}"),
                    (RPS_ANNOTATION, "1"),
                ],
                PROFILE_ANNOTATION,
            ),
        ];
        for (annotations, expect) in cases {
            let apps = apps_from_pods(&[pod("ns", "p", &annotations)]);
            assert!(apps.apps.is_empty());
            assert!(
                apps.errors[0].1.contains(expect),
                "{expect}: {:?}",
                apps.errors
            );
        }
        // Pods of one app that disagree on its rate.
        let a = [
            (APP_ANNOTATION, "x"),
            (STAGE_ANNOTATION, "s"),
            (MICROSERVICE_ANNOTATION, "Count"),
            (RPS_ANNOTATION, "1"),
        ];
        let b = [
            (APP_ANNOTATION, "x"),
            (STAGE_ANNOTATION, "s"),
            (MICROSERVICE_ANNOTATION, "Count"),
            (RPS_ANNOTATION, "2"),
        ];
        let apps = apps_from_pods(&[pod("ns", "a", &a), pod("ns", "b", &b)]);
        assert!(
            apps.errors[0].1.contains("give every pod the same"),
            "{:?}",
            apps.errors
        );
        // Other schedulers' pods are not ours.
        let mut other = pod("ns", "o", &a);
        other.spec.as_mut().unwrap().scheduler_name = Some("default-scheduler".into());
        assert!(apps_from_pods(&[other]).apps.is_empty());
    }
}
