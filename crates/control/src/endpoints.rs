//! Where traffic should go: a placement turned into endpoint lists per service, and the sinks that
//! carry them to the node proxies. This is the seam for the xDS server (issue 9):
//! `flatmesh_xds::feed::XdsSink` implements [`EndpointSink`] and turns each snapshot into
//! ClusterLoadAssignments (`flatmesh control --cluster ... --heartbeats ...`). The
//! [`FileSink`] writes a watched JSON file, and the [`ProxyConfigSink`] rewrites the node proxies'
//! own YAML config files (which `flatmesh node --config FILE` reloads on change without dropping
//! requests); both replace files atomically, so a reader never sees half of one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{ControlError, Result};
use crate::placement::State;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub instance: String,
    pub node: String,
    pub server: String,
}

/// One version of the routing state: service (`APP/STAGE`) -> serving endpoints (primaries only;
/// backups take no traffic until promoted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSnapshot {
    pub version: u64,
    pub services: BTreeMap<String, Vec<Endpoint>>,
}

/// The service an instance belongs to: its id without the shard and replica suffix.
pub fn service_of(instance_id: &str) -> &str {
    match instance_id.rfind('-') {
        Some(pos) if instance_id[pos + 1..].chars().all(|c| c.is_ascii_digit()) => {
            &instance_id[..pos]
        }
        _ => instance_id,
    }
}

pub fn snapshot(st: &State, version: u64) -> EndpointSnapshot {
    let mut services: BTreeMap<String, Vec<Endpoint>> = BTreeMap::new();
    for (i, inst) in st.wl.instances.iter().enumerate() {
        if !inst.is_primary() {
            continue;
        }
        let Some(n) = st.assign[i] else { continue };
        let node = &st.topo.nodes[n];
        services
            .entry(service_of(&inst.id).to_string())
            .or_default()
            .push(Endpoint {
                instance: inst.id.clone(),
                node: node.id.clone(),
                server: st.topo.servers[node.server].name.clone(),
            });
    }
    EndpointSnapshot { version, services }
}

/// Receives every new routing state. Implemented by the watched file below and by the xDS server.
pub trait EndpointSink {
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> Result<()>;
}

/// Keeps every snapshot in memory (tests, and the simulator's log).
#[derive(Debug, Default)]
pub struct MemorySink {
    pub published: Vec<EndpointSnapshot>,
}

impl EndpointSink for MemorySink {
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> Result<()> {
        self.published.push(snapshot.clone());
        Ok(())
    }
}

/// Writes the snapshot as JSON to `path` via a temporary file and rename (atomic on one filesystem).
#[derive(Debug)]
pub struct FileSink {
    pub path: std::path::PathBuf,
}

impl EndpointSink for FileSink {
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> Result<()> {
        let text = serde_json::to_vec_pretty(snapshot).map_err(|e| ControlError::Write {
            path: self.path.display().to_string(),
            cause: std::io::Error::other(e),
        })?;
        replace_file(&self.path, &text)
    }
}

/// Writes `text` to `path` through a temporary file and a rename (atomic on one filesystem).
fn replace_file(path: &std::path::Path, text: &[u8]) -> Result<()> {
    let err = |cause| ControlError::Write {
        path: path.display().to_string(),
        cause,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Renders each snapshot into node proxy config files, `(path, YAML)` per node, and replaces them.
/// The node proxies notice the change and reload. The rendering (addresses, routes) belongs to
/// whoever runs the nodes; the demo supplies it.
pub struct ProxyConfigSink<F> {
    render: F,
}

impl<F> ProxyConfigSink<F>
where
    F: FnMut(&EndpointSnapshot) -> Vec<(std::path::PathBuf, String)>,
{
    pub fn new(render: F) -> Self {
        ProxyConfigSink { render }
    }
}

impl<F> EndpointSink for ProxyConfigSink<F>
where
    F: FnMut(&EndpointSnapshot) -> Vec<(std::path::PathBuf, String)>,
{
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> Result<()> {
        for (path, text) in (self.render)(snapshot) {
            replace_file(&path, text.as_bytes())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::hcm;
    use crate::placement::tests::setup;

    #[test]
    fn services_list_primaries_only() {
        assert_eq!(service_of("IOT-TS/api-3"), "IOT-TS/api");
        assert_eq!(service_of("IOT-TS/api-3-r1"), "IOT-TS/api-3-r1");
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:IOT-TS");
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let snap = snapshot(&st, 3);
        assert_eq!(snap.services.len(), 5);
        assert_eq!(snap.services["IOT-TS/api"].len(), 6);
        assert_eq!(snap.services["IOT-TS/sql"].len(), 12);
    }

    #[test]
    fn file_sink_replaces_atomically() {
        let dir = std::env::temp_dir().join(format!("flatmesh-control-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut sink = FileSink {
            path: dir.join("endpoints.json"),
        };
        let snap = EndpointSnapshot {
            version: 1,
            services: BTreeMap::new(),
        };
        sink.publish(&snap).unwrap();
        let back: EndpointSnapshot =
            serde_json::from_slice(&std::fs::read(&sink.path).unwrap()).unwrap();
        assert_eq!(back, snap);
        let mut bad = FileSink {
            path: dir.join("missing/endpoints.json"),
        };
        assert!(bad
            .publish(&snap)
            .unwrap_err()
            .to_string()
            .contains("writable"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
