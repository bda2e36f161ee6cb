//! The YAML models: cluster topology, microservice profiles and application DAGs, plus the
//! presets that reproduce E3's Tables 1-4. Loading validates every cross reference and turns
//! unknown keys into errors with a "did you mean" hint.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{ControlError, Result};

const SERVERS_YAML: &str = include_str!("../presets/servers.yaml");
const MICROSERVICES_YAML: &str = include_str!("../presets/microservices.yaml");
const APPS_YAML: &str = include_str!("../presets/apps.yaml");

/// The class of a processor core. Beefy = Xeon host cores; wimpy = cnMIPS SmartNIC (or Wimpy server) cores.
/// Per-request cost and power come from the matching column of Table 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CoreClass {
    Beefy,
    Wimpy,
}

/// Hardware figures of one compute node (a host processor or one SmartNIC).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub core: CoreClass,
    pub cores: f64,
    pub memory_mb: u64,
    pub idle_watts: f64,
    pub peak_watts: f64,
    pub cost_usd: f64,
    /// Network bandwidth of this node's own ports. A SmartNIC server's host has 0: ECMP reaches it
    /// over the SmartNIC ports, which the whole server shares (§3.2).
    pub bandwidth_gbps: f64,
}

/// A server model: one host node plus `smartnic_count` identical SmartNIC nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerType {
    #[serde(default)]
    pub description: Option<String>,
    pub host: NodeSpec,
    #[serde(default)]
    pub smartnic: Option<NodeSpec>,
    #[serde(default)]
    pub smartnic_count: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerGroup {
    #[serde(rename = "type")]
    pub server_type: String,
    #[serde(default = "one")]
    pub count: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RackSpec {
    pub name: String,
    pub servers: Vec<ServerGroup>,
}

/// A cluster file. Table 4's server types are always available by name; `server_types` may add
/// or override types.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub name: String,
    #[serde(default)]
    pub server_types: BTreeMap<String, ServerType>,
    pub racks: Vec<RackSpec>,
}

/// One column of Table 1: peak throughput, active power and active cores.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Perf {
    pub rps: f64,
    pub watts: f64,
    pub cores: f64,
}

impl Perf {
    /// Core-seconds one request costs.
    pub fn core_seconds_per_request(&self) -> f64 {
        self.cores / self.rps
    }
    /// Joules of active energy one request costs.
    pub fn joules_per_request(&self) -> f64 {
        self.watts / self.rps
    }
    /// Requests per joule (the RPJ column of Table 1).
    pub fn rpj(&self) -> f64 {
        self.rps / self.watts
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pin {
    #[default]
    Any,
    /// Only on host processors (§4: SQL's state cannot be migrated off the host).
    Host,
}

/// A microservice profile (Tables 1 and 2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Microservice {
    #[serde(default)]
    pub description: Option<String>,
    pub stateful: bool,
    pub request_bytes: u32,
    pub memory_mb: u64,
    #[serde(default)]
    pub pin: Pin,
    pub beefy: Perf,
    pub wimpy: Perf,
}

impl Microservice {
    pub fn perf(&self, core: CoreClass) -> &Perf {
        match core {
            CoreClass::Beefy => &self.beefy,
            CoreClass::Wimpy => &self.wimpy,
        }
    }
    /// HeteroK8s' offload rule (papers/004 §5) in E3's terms: move work to the SmartNIC only when
    /// the SmartNIC runs it at least as energy-efficiently as the host (Table 1's × column ≥ 1).
    pub fn offloadable(&self) -> bool {
        self.pin == Pin::Any && self.wimpy.rpj() >= self.beefy.rpj()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilesSpec {
    pub microservices: BTreeMap<String, Microservice>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSpec {
    pub name: String,
    pub microservice: String,
    pub shards: u32,
    /// Upstream stages: the DAG edges point from each of these to this stage.
    #[serde(default)]
    pub after: Vec<String>,
    /// Share of the app's entry requests that reach this stage (default 1). Analytics stages that
    /// fire only past a threshold (Fig. 1's spike detection, recommendation) see a fraction.
    #[serde(default = "one_f64")]
    pub fraction: f64,
}

/// An application: a DAG of sharded, replicated microservice stages.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppSpec {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    /// Design entry rate (requests/s); every request visits every stage once.
    pub rps: f64,
    /// Backup replicas per shard (Service Fabric secondaries); they never share a server with their primary.
    #[serde(default = "one")]
    pub replicas: u32,
    /// Share of its primary's CPU and bandwidth that each backup reserves, in [0, 1]. A backup
    /// always holds its memory (the replicated state). 0 (the default) is a passive secondary, as
    /// E3 measured at peak: backups serve no requests. 1 is a hot standby sized so that promoting
    /// it can never overload its node.
    #[serde(default)]
    pub backup_load: f64,
    /// Extra or overriding microservice profiles; Table 1's profiles are always available.
    #[serde(default)]
    pub microservices: BTreeMap<String, Microservice>,
    pub stages: Vec<StageSpec>,
}

impl AppSpec {
    /// DAG node count as Table 3 counts it: shards times (1 + replicas).
    pub fn dag_nodes(&self) -> u64 {
        self.stages
            .iter()
            .map(|s| u64::from(s.shards) * (1 + u64::from(self.replicas)))
            .sum()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServersFile {
    server_types: BTreeMap<String, ServerType>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AppsFile {
    apps: Vec<AppSpec>,
}

fn one() -> u32 {
    1
}

fn one_f64() -> f64 {
    1.0
}

/// Cluster presets: (name, [(server type, count)]) in one rack. Table 4's clusters plus the single
/// servers and §5.1's three-server clusters.
const CLUSTER_PRESETS: &[(&str, &[(&str, u32)])] = &[
    ("Beefy", &[("Beefy", 1)]),
    ("Wimpy", &[("Wimpy", 1)]),
    ("Type1-SmartNIC", &[("Type1-SmartNIC", 1)]),
    ("Type2-SmartNIC", &[("Type2-SmartNIC", 1)]),
    ("SuperBeefy", &[("SuperBeefy", 1)]),
    ("3xBeefy", &[("Beefy", 3)]),
    ("3xType1-SmartNIC", &[("Type1-SmartNIC", 3)]),
    ("4xBeefy", &[("Beefy", 4)]),
    ("4xWimpy", &[("Wimpy", 4)]),
    ("2xBeefy+2xWimpy", &[("Beefy", 2), ("Wimpy", 2)]),
    ("2xType2-SmartNIC", &[("Type2-SmartNIC", 2)]),
    ("1xSuperBeefy", &[("SuperBeefy", 1)]),
];

/// Table 5's five clusters, in the paper's row order.
pub const TABLE5_CLUSTERS: &[&str] = &[
    "4xBeefy",
    "4xWimpy",
    "2xBeefy+2xWimpy",
    "2xType2-SmartNIC",
    "1xSuperBeefy",
];

pub fn cluster_preset_names() -> Vec<&'static str> {
    CLUSTER_PRESETS.iter().map(|(n, _)| *n).collect()
}

pub fn app_preset_names() -> Result<Vec<String>> {
    Ok(preset_apps()?.into_iter().map(|a| a.name).collect())
}

/// Table 4's server types.
pub fn builtin_server_types() -> Result<BTreeMap<String, ServerType>> {
    let f: ServersFile = parse_yaml("preset", "servers.yaml", SERVERS_YAML)?;
    Ok(f.server_types)
}

/// Tables 1 and 2's microservice profiles.
pub fn builtin_microservices() -> Result<BTreeMap<String, Microservice>> {
    let f: ProfilesSpec = parse_yaml("preset", "microservices.yaml", MICROSERVICES_YAML)?;
    Ok(f.microservices)
}

fn preset_apps() -> Result<Vec<AppSpec>> {
    let f: AppsFile = parse_yaml("preset", "apps.yaml", APPS_YAML)?;
    Ok(f.apps)
}

/// A cluster made of `count` servers of one type, `per_rack` per rack (the simulator's FatTree racks).
pub fn uniform_cluster(name: &str, server_type: &str, count: u32, per_rack: u32) -> ClusterSpec {
    let per_rack = per_rack.max(1);
    let mut racks = Vec::new();
    let mut left = count;
    while left > 0 {
        let n = left.min(per_rack);
        racks.push(RackSpec {
            name: format!("rack{}", racks.len()),
            servers: vec![ServerGroup {
                server_type: server_type.to_string(),
                count: n,
            }],
        });
        left -= n;
    }
    ClusterSpec {
        name: name.to_string(),
        server_types: BTreeMap::new(),
        racks,
    }
}

/// Loads a cluster from `preset:NAME` or a YAML file path.
pub fn load_cluster(source: &str) -> Result<ClusterSpec> {
    let spec = if let Some(name) = source.strip_prefix("preset:") {
        let Some((_, groups)) = CLUSTER_PRESETS.iter().find(|(n, _)| *n == name) else {
            return Err(unknown_preset(name, &cluster_preset_names()));
        };
        ClusterSpec {
            name: name.to_string(),
            server_types: BTreeMap::new(),
            racks: vec![RackSpec {
                name: "rack0".into(),
                servers: groups
                    .iter()
                    .map(|(t, c)| ServerGroup {
                        server_type: (*t).to_string(),
                        count: *c,
                    })
                    .collect(),
            }],
        }
    } else {
        let text = read(source)?;
        parse_yaml("cluster", source, &text)?
    };
    validate_cluster(&spec)?;
    Ok(spec)
}

/// Loads an application from `preset:NAME` or a YAML file path.
pub fn load_app(source: &str) -> Result<AppSpec> {
    let spec = if let Some(name) = source.strip_prefix("preset:") {
        let apps = preset_apps()?;
        let names: Vec<String> = apps.iter().map(|a| a.name.clone()).collect();
        match apps.into_iter().find(|a| a.name == name) {
            Some(a) => a,
            None => {
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                return Err(unknown_preset(name, &refs));
            }
        }
    } else {
        let text = read(source)?;
        parse_yaml("app", source, &text)?
    };
    validate_app(&spec)?;
    Ok(spec)
}

/// Parses a cluster from YAML text (used by the fuzzer and tests).
pub fn parse_cluster(path: &str, text: &str) -> Result<ClusterSpec> {
    let spec: ClusterSpec = parse_yaml("cluster", path, text)?;
    validate_cluster(&spec)?;
    Ok(spec)
}

/// Parses an application from YAML text (used by the fuzzer and tests).
pub fn parse_app(path: &str, text: &str) -> Result<AppSpec> {
    let spec: AppSpec = parse_yaml("app", path, text)?;
    validate_app(&spec)?;
    Ok(spec)
}

/// The profile table an app sees: the built-in profiles overridden by the app's own.
pub fn app_profiles(app: &AppSpec) -> Result<BTreeMap<String, Microservice>> {
    let mut all = builtin_microservices()?;
    for (k, v) in &app.microservices {
        all.insert(k.clone(), v.clone());
    }
    Ok(all)
}

/// The server types a cluster sees: Table 4's overridden by the file's own.
pub fn cluster_server_types(spec: &ClusterSpec) -> Result<BTreeMap<String, ServerType>> {
    let mut all = builtin_server_types()?;
    for (k, v) in &spec.server_types {
        all.insert(k.clone(), v.clone());
    }
    Ok(all)
}

fn invalid(what: &'static str, message: String) -> ControlError {
    ControlError::Invalid { what, message }
}

fn check_node(where_: &str, n: &NodeSpec) -> Result<()> {
    let finite = [
        n.cores,
        n.idle_watts,
        n.peak_watts,
        n.cost_usd,
        n.bandwidth_gbps,
    ]
    .iter()
    .all(|v| v.is_finite() && *v >= 0.0);
    if !finite {
        return Err(invalid(
            "cluster",
            format!("{where_}: cores, watts, cost and bandwidth must be finite and non-negative"),
        ));
    }
    if n.cores <= 0.0 || n.memory_mb == 0 {
        return Err(invalid(
            "cluster",
            format!("{where_}: a compute node needs cores > 0 and memory_mb > 0"),
        ));
    }
    if n.peak_watts < n.idle_watts {
        return Err(invalid(
            "cluster",
            format!(
                "{where_}: peak_watts {} is below idle_watts {}; peak power includes idle power",
                n.peak_watts, n.idle_watts
            ),
        ));
    }
    Ok(())
}

/// Upper bound on servers, so a typo like `count: 4000000000` fails fast instead of eating memory.
pub const MAX_SERVERS: u64 = 100_000;

fn validate_cluster(spec: &ClusterSpec) -> Result<()> {
    let types = cluster_server_types(spec)?;
    for (name, t) in &types {
        check_node(&format!("server type {name} host"), &t.host)?;
        match (&t.smartnic, t.smartnic_count) {
            (Some(nic), _) => check_node(&format!("server type {name} smartnic"), nic)?,
            (None, 0) => {}
            (None, n) => {
                return Err(invalid(
                    "cluster",
                    format!("server type {name}: smartnic_count is {n} but no `smartnic:` node is described; add one or set smartnic_count: 0"),
                ))
            }
        }
        if t.smartnic_count > 64 {
            return Err(invalid(
                "cluster",
                format!(
                    "server type {name}: {} SmartNICs per server is not plausible (max 64)",
                    t.smartnic_count
                ),
            ));
        }
    }
    if spec.racks.is_empty() {
        return Err(invalid(
            "cluster",
            format!(
                "cluster {} has no racks; add at least one rack with servers",
                spec.name
            ),
        ));
    }
    let mut total: u64 = 0;
    let mut rack_names = std::collections::BTreeSet::new();
    for rack in &spec.racks {
        if !rack_names.insert(rack.name.as_str()) {
            return Err(invalid(
                "cluster",
                format!(
                    "rack name {:?} is used twice; rack names must be unique",
                    rack.name
                ),
            ));
        }
        for g in &rack.servers {
            if !types.contains_key(&g.server_type) {
                let known: Vec<&str> = types.keys().map(String::as_str).collect();
                return Err(invalid(
                    "cluster",
                    format!(
                        "rack {}: unknown server type {:?}{}; known types: {}",
                        rack.name,
                        g.server_type,
                        did_you_mean(&g.server_type, &known),
                        known.join(", ")
                    ),
                ));
            }
            total += u64::from(g.count);
        }
    }
    if total == 0 {
        return Err(invalid(
            "cluster",
            format!(
                "cluster {} has no servers; give a rack a server group with count >= 1",
                spec.name
            ),
        ));
    }
    if total > MAX_SERVERS {
        return Err(invalid(
            "cluster",
            format!(
                "cluster {} has {total} servers, above the limit of {MAX_SERVERS}",
                spec.name
            ),
        ));
    }
    Ok(())
}

/// Upper bound on DAG nodes per application.
pub const MAX_APP_INSTANCES: u64 = 1_000_000;

fn validate_app(app: &AppSpec) -> Result<()> {
    let profiles = app_profiles(app)?;
    if !(app.rps.is_finite() && app.rps > 0.0) {
        return Err(invalid(
            "app",
            format!(
                "app {}: rps must be a positive number, got {}",
                app.name, app.rps
            ),
        ));
    }
    for (name, m) in &app.microservices {
        for (col, p) in [("beefy", &m.beefy), ("wimpy", &m.wimpy)] {
            let ok = [p.rps, p.watts, p.cores]
                .iter()
                .all(|v| v.is_finite() && *v > 0.0);
            if !ok {
                return Err(invalid(
                    "app",
                    format!("microservice {name}: {col} rps, watts and cores must all be positive numbers"),
                ));
            }
        }
    }
    if app.stages.is_empty() {
        return Err(invalid(
            "app",
            format!("app {} has no stages; list at least one stage", app.name),
        ));
    }
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, s) in app.stages.iter().enumerate() {
        if seen.insert(s.name.as_str(), i).is_some() {
            return Err(invalid(
                "app",
                format!("app {}: stage name {:?} is used twice", app.name, s.name),
            ));
        }
        if !(s.fraction.is_finite() && s.fraction > 0.0 && s.fraction <= 1.0) {
            return Err(invalid(
                "app",
                format!(
                    "app {} stage {}: fraction must be in (0, 1], got {}",
                    app.name, s.name, s.fraction
                ),
            ));
        }
        if s.shards == 0 {
            return Err(invalid(
                "app",
                format!(
                    "app {} stage {}: shards must be at least 1",
                    app.name, s.name
                ),
            ));
        }
        if !profiles.contains_key(&s.microservice) {
            let known: Vec<&str> = profiles.keys().map(String::as_str).collect();
            return Err(invalid(
                "app",
                format!(
                    "app {} stage {}: unknown microservice {:?}{}; known: {}",
                    app.name,
                    s.name,
                    s.microservice,
                    did_you_mean(&s.microservice, &known),
                    known.join(", ")
                ),
            ));
        }
    }
    // `after` may only name earlier stages: that makes the graph acyclic by construction.
    for (i, s) in app.stages.iter().enumerate() {
        for up in &s.after {
            match seen.get(up.as_str()) {
                Some(j) if *j < i => {}
                Some(_) => {
                    return Err(invalid(
                        "app",
                        format!("app {} stage {}: `after: {up}` names a later stage (or itself); list stages upstream first so the graph stays a DAG", app.name, s.name),
                    ))
                }
                None => {
                    let known: Vec<&str> = seen.keys().copied().collect();
                    return Err(invalid(
                        "app",
                        format!(
                            "app {} stage {}: `after` names unknown stage {up:?}{}",
                            app.name,
                            s.name,
                            did_you_mean(up, &known)
                        ),
                    ));
                }
            }
        }
    }
    if !(app.backup_load.is_finite() && (0.0..=1.0).contains(&app.backup_load)) {
        return Err(invalid(
            "app",
            format!(
                "app {}: backup_load must be in [0, 1] (share of a primary's CPU a backup reserves), got {}",
                app.name, app.backup_load
            ),
        ));
    }
    if app.replicas > 16 {
        return Err(invalid(
            "app",
            format!(
                "app {}: {} replicas per shard is not plausible (max 16)",
                app.name, app.replicas
            ),
        ));
    }
    if app.dag_nodes() > MAX_APP_INSTANCES {
        return Err(invalid(
            "app",
            format!(
                "app {} has {} DAG nodes, above the limit of {MAX_APP_INSTANCES}",
                app.name,
                app.dag_nodes()
            ),
        ));
    }
    Ok(())
}

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|cause| ControlError::Read {
        path: path.to_string(),
        cause,
    })
}

fn unknown_preset(name: &str, known: &[&str]) -> ControlError {
    ControlError::UnknownPreset {
        name: format!("preset:{name}{}", did_you_mean(name, known)),
        known: known.join(", "),
    }
}

/// Parses YAML into `T`, turning serde's "unknown field `x`, expected one of ..." into a hint.
pub(crate) fn parse_yaml<T: serde::de::DeserializeOwned>(
    what: &'static str,
    path: &str,
    text: &str,
) -> Result<T> {
    serde_norway::from_str(text).map_err(|e| {
        let mut message = e.to_string();
        if let Some(hint) = unknown_field_hint(&message) {
            message.push_str(&hint);
        }
        ControlError::Yaml {
            what,
            path: path.to_string(),
            message,
        }
    })
}

fn unknown_field_hint(message: &str) -> Option<String> {
    let rest = message.split("unknown field `").nth(1)?;
    let field = rest.split('`').next()?;
    let expected = rest.split("expected one of ").nth(1)?;
    let known: Vec<&str> = expected
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect();
    let hint = did_you_mean(field, &known);
    (!hint.is_empty()).then_some(hint)
}

/// ` (did you mean "x"?)` when a known name is within edit distance 3, else "".
pub fn did_you_mean(input: &str, known: &[&str]) -> String {
    let best = known
        .iter()
        .map(|k| (edit_distance(&input.to_lowercase(), &k.to_lowercase()), *k))
        .min();
    match best {
        Some((d, k)) if d <= 3 && d < input.len().max(1) => format!(" (did you mean {k:?}?)"),
        _ => String::new(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Table 4 rows: (cluster, cost, beefy cores, wimpy cores, memory GB, idle W, peak W, bandwidth Gb/s).
    type Row = (&'static str, f64, f64, f64, u64, f64, f64, f64);
    const TABLE4: &[Row] = &[
        ("Beefy", 4500.0, 12.0, 0.0, 64, 83.0, 201.0, 20.0),
        ("Wimpy", 2209.0, 0.0, 32.0, 2, 79.0, 95.0, 20.0),
        ("Type1-SmartNIC", 4650.0, 12.0, 12.0, 68, 98.0, 222.0, 20.0),
        (
            "Type2-SmartNIC",
            6750.0,
            16.0,
            48.0,
            144,
            145.0,
            252.0,
            40.0,
        ),
        ("SuperBeefy", 12550.0, 24.0, 0.0, 192, 77.0, 256.0, 80.0),
        ("4xBeefy", 18000.0, 48.0, 0.0, 256, 332.0, 804.0, 80.0),
        ("4xWimpy", 8836.0, 0.0, 128.0, 8, 316.0, 380.0, 80.0),
        // The paper prints $13,018 for 2xB.+2xW., but its own rows sum to 2*4500+2*2209 = $13,418;
        // we keep the consistent sum (docs/control.md notes the misprint).
        (
            "2xBeefy+2xWimpy",
            13418.0,
            24.0,
            64.0,
            132,
            324.0,
            592.0,
            80.0,
        ),
        (
            "2xType2-SmartNIC",
            13500.0,
            32.0,
            96.0,
            288,
            290.0,
            504.0,
            80.0,
        ),
        ("1xSuperBeefy", 12550.0, 24.0, 0.0, 192, 77.0, 256.0, 80.0),
    ];

    #[test]
    fn cluster_presets_reproduce_table4() {
        for &(name, cost, bc, wc, mem_gb, idle, peak, bw) in TABLE4 {
            let spec = load_cluster(&format!("preset:{name}")).unwrap();
            let types = cluster_server_types(&spec).unwrap();
            let (mut c, mut b, mut w, mut m, mut i, mut p, mut n) =
                (0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0);
            for g in &spec.racks[0].servers {
                let t = &types[&g.server_type];
                let mut nodes = vec![&t.host];
                for _ in 0..t.smartnic_count {
                    nodes.push(t.smartnic.as_ref().unwrap());
                }
                for _ in 0..g.count {
                    for node in &nodes {
                        c += node.cost_usd;
                        match node.core {
                            CoreClass::Beefy => b += node.cores,
                            CoreClass::Wimpy => w += node.cores,
                        }
                        m += node.memory_mb;
                        i += node.idle_watts;
                        p += node.peak_watts;
                        n += node.bandwidth_gbps;
                    }
                }
            }
            assert_eq!(
                (c, b, w, m / 1024, i, p, n),
                (cost, bc, wc, mem_gb, idle, peak, bw),
                "{name}"
            );
        }
    }

    /// Table 1's RPJ columns (K requests/J) and the × column, from the DPDK host and SmartNIC columns.
    const TABLE1_RPJ: &[(&str, f64, f64, f64)] = &[
        ("IPsec", 8.1, 79.0, 9.7),
        ("BM25", 0.9, 20.6, 22.8),
        ("NIDS", 17.2, 84.8, 4.9),
        ("Recommend", 0.04, 0.7, 18.4),
        ("NATv4", 36.8, 86.9, 2.4),
        ("Count", 40.3, 96.1, 2.4),
        ("EMA", 38.6, 93.5, 2.4),
        ("KVS", 59.6, 97.1, 1.6),
        ("Flow mon.", 40.4, 83.6, 2.1),
        ("DDoS", 17.4, 80.4, 4.6),
        ("KNN", 0.4, 1.5, 3.9),
        ("Spike", 0.9, 3.1, 3.4),
        ("Bayes", 0.1, 0.08, 0.7),
        ("API gw", 14.3, 5.0, 0.4),
        ("Top Ranker", 7.1, 0.7, 0.1),
        ("SQL", 4.7, 2.1, 0.4),
    ];

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-9)
    }

    #[test]
    fn microservice_presets_reproduce_table1_and_table2() {
        let ms = builtin_microservices().unwrap();
        assert_eq!(ms.len(), 16, "Table 2 lists 16 microservices");
        for &(name, host_k, nic_k, times) in TABLE1_RPJ {
            let m = &ms[name];
            let (h, n) = (m.beefy.rpj() / 1000.0, m.wimpy.rpj() / 1000.0);
            // The paper rounds RPJ to 2 significant digits; Recommend's 0.04K is 1 digit.
            // Values under 1K are printed with one decimal: allow half a unit of the last digit.
            let ok = |v: f64, t: f64| close(v, t, 0.13) || (v - t).abs() <= 0.05;
            assert!(ok(h, host_k), "{name} host RPJ {h} vs {host_k}");
            assert!(ok(n, nic_k), "{name} NIC RPJ {n} vs {nic_k}");
            assert!(close(n / h, times, 0.25), "{name} x {} vs {times}", n / h);
        }
        // Table 2's S column.
        let stateless = ["IPsec", "BM25", "NATv4", "NIDS", "KNN", "Bayes"];
        for (name, m) in &ms {
            assert_eq!(m.stateful, !stateless.contains(&name.as_str()), "{name}");
        }
        // §2.3: the host wins for Top ranker, Bayes, SQL and API gateway; everything else offloads.
        let host_only: Vec<&str> = ms
            .iter()
            .filter(|(_, m)| !m.offloadable())
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(host_only, vec!["API gw", "Bayes", "SQL", "Top Ranker"]);
        assert_eq!(ms["SQL"].pin, Pin::Host);
    }

    #[test]
    fn app_presets_reproduce_table3() {
        let expect = [
            ("NFV-FIN", 72, vec!["Flow mon.", "IPsec", "NIDS"]),
            ("NFV-DIN", 60, vec!["DDoS", "NATv4", "NIDS"]),
            ("NFV-IFID", 84, vec!["NATv4", "Flow mon.", "IPsec", "DDoS"]),
            ("RTA-PTC", 60, vec!["Count", "Top Ranker", "KNN"]),
            ("RTA-SF", 96, vec!["Spike", "Count", "KVS", "Bayes"]),
            ("RTA-SHM", 84, vec!["Count", "EMA", "SQL", "BM25"]),
            ("IOT-DH", 108, vec!["API gw", "Count", "KNN", "KVS", "SQL"]),
            (
                "IOT-TS",
                108,
                vec!["API gw", "SQL", "EMA", "Spike", "Recommend"],
            ),
        ];
        assert_eq!(app_preset_names().unwrap().len(), expect.len());
        for (name, n, types) in expect {
            let app = load_app(&format!("preset:{name}")).unwrap();
            assert_eq!(app.dag_nodes(), n, "{name}");
            let got: Vec<&str> = app.stages.iter().map(|s| s.microservice.as_str()).collect();
            assert_eq!(got, types, "{name}");
        }
        // §4 spells out IOT-TS: 6 API, 12 SQL, 12 EMA, 12 Spike, 12 Recommend, one backup each.
        let ts = load_app("preset:IOT-TS").unwrap();
        let shards: Vec<u32> = ts.stages.iter().map(|s| s.shards).collect();
        assert_eq!(shards, vec![6, 12, 12, 12, 12]);
        assert_eq!(ts.replicas, 1);
    }

    #[test]
    fn unknown_keys_and_names_get_hints() {
        let err = parse_app("a.yaml", "name: x\nrps: 1\nstagess: []\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("did you mean \"stages\""), "{err}");
        let err = parse_app(
            "a.yaml",
            "name: x\nrps: 1\nstages:\n  - {name: a, microservice: Cout, shards: 1}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("did you mean \"Count\""), "{err}");
        let err = load_cluster("preset:3xType1-SmartNlC")
            .unwrap_err()
            .to_string();
        assert!(err.contains("did you mean \"3xType1-SmartNIC\""), "{err}");
        let err = parse_cluster(
            "c.yaml",
            "name: c\nracks:\n  - {name: r, servers: [{type: Type3-SmartNIC}]}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("did you mean \"Type1-SmartNIC\"") || err.contains("Type2-SmartNIC"),
            "{err}"
        );
    }

    #[test]
    fn app_graph_must_be_a_dag_in_order() {
        let err = parse_app(
            "a.yaml",
            "name: x\nrps: 1\nstages:\n  - {name: a, microservice: Count, shards: 1, after: [b]}\n  - {name: b, microservice: EMA, shards: 1}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("later stage"), "{err}");
        let err = parse_app(
            "a.yaml",
            "name: x\nrps: -5\nstages:\n  - {name: a, microservice: Count, shards: 1}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("rps must be a positive"), "{err}");
    }

    #[test]
    fn cluster_file_with_own_server_type() {
        let text = "name: lab\nserver_types:\n  BlueField2:\n    host: {core: beefy, cores: 8, memory_mb: 32768, idle_watts: 60, peak_watts: 150, cost_usd: 3000, bandwidth_gbps: 0}\n    smartnic: {core: wimpy, cores: 8, memory_mb: 16384, idle_watts: 20, peak_watts: 35, cost_usd: 1500, bandwidth_gbps: 100}\n    smartnic_count: 1\nracks:\n  - {name: r0, servers: [{type: BlueField2, count: 2}]}\n";
        let spec = parse_cluster("lab.yaml", text).unwrap();
        assert_eq!(spec.racks[0].servers[0].count, 2);
        let bad = text.replace("peak_watts: 150", "peak_watts: 10");
        assert!(parse_cluster("lab.yaml", &bad)
            .unwrap_err()
            .to_string()
            .contains("below idle_watts"));
        let bad = text.replace(
            "smartnic_count: 1",
            "smartnic_count: 1\n    smartnic_cnt: 2",
        );
        assert!(parse_cluster("lab.yaml", &bad)
            .unwrap_err()
            .to_string()
            .contains("did you mean"));
    }
}
