//! What `flatmesh control` serves: the state file's listeners, routes and clusters, with the
//! endpoints of every placed service filled in by the control center. E3's placement and
//! orchestrator (crates/control) publish them through the control crate's [`EndpointSink`]
//! seam, which [`XdsSink`] implements.
//!
//! A placed service `APP/STAGE` is served as the cluster of that name. If the state file declares
//! it (to route to it, or to set its load balancer, protocol or connect timeout), its endpoints
//! are the placement's, whatever the file lists; otherwise it is served as a round-robin cluster
//! of its own. Every cluster is an EDS cluster on the wire, so a migration or a failover that
//! moves an instance is one small EDS push to every node and to Envoy.
//!
//! The placement says on which *node* an instance runs, not on which socket: an [`Addresses`]
//! file gives each node's IP and each service's port (shard `k` of a service serves on its
//! port + `k`), the convention `flatmesh control demo` uses too.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use flatmesh_config as model;
use flatmesh_control::endpoints::{service_of, Endpoint, EndpointSink, EndpointSnapshot};
use flatmesh_control::model::did_you_mean;
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;
use parking_lot::Mutex;
use serde::Deserialize;

use crate::error::{Result, XdsError};
use crate::server::Store;

/// The served state: a flatmesh config (the `--state` file) plus the placed services' endpoints.
/// Cheap to clone; every clone publishes to the same [`Store`].
#[derive(Clone)]
pub struct Feed {
    store: Store,
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    config: model::Config,
    placed: BTreeMap<String, Vec<SocketAddr>>,
}

impl Feed {
    /// Serve `config` (validated by the caller) through `store`, with nothing placed yet.
    pub fn new(store: Store, config: model::Config) -> Feed {
        let feed = Feed {
            store,
            inner: Arc::new(Mutex::new(Inner {
                config,
                placed: BTreeMap::new(),
            })),
        };
        feed.publish(&feed.inner.lock());
        feed
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// A new state file: its listeners, routes and clusters, with the placed endpoints kept.
    pub fn set_config(&self, config: model::Config) {
        let mut inner = self.inner.lock();
        inner.config = config;
        self.publish(&inner);
    }

    /// A new placement: service (`APP/STAGE`) -> the addresses of its serving instances.
    pub fn set_endpoints(&self, placed: BTreeMap<String, Vec<SocketAddr>>) {
        let mut inner = self.inner.lock();
        inner.placed = placed;
        self.publish(&inner);
    }

    /// The config being served (state file and placement merged).
    pub fn served(&self) -> model::Config {
        let inner = self.inner.lock();
        merge(&inner.config, &inner.placed)
    }

    fn publish(&self, inner: &Inner) {
        self.store
            .publish_config(&merge(&inner.config, &inner.placed));
    }
}

/// `config` with each placed service's cluster holding the placement's endpoints (added as a
/// round-robin cluster when the config does not declare it).
pub fn merge(config: &model::Config, placed: &BTreeMap<String, Vec<SocketAddr>>) -> model::Config {
    let mut out = config.clone();
    for (service, endpoints) in placed {
        match out.clusters.iter_mut().find(|c| &c.name == service) {
            Some(c) => c.endpoints = endpoints.clone(),
            None => out.clusters.push(model::Cluster {
                name: service.clone(),
                lb: model::LbPolicy::RoundRobin,
                endpoints: endpoints.clone(),
                protocol: model::UpstreamProtocol::Http1,
                hash_on: None,
                connect_timeout: None,
            }),
        }
    }
    out
}

/// Where placed instances serve: node id -> IP, service -> port of shard 0.
///
/// ```yaml
/// nodes:                    # every node of the cluster (flatmesh place lists them)
///   r0-s0/host: 10.0.0.1
///   r0-s0/nic0: 10.0.0.2
/// services:                 # every service (APP/STAGE); shard k serves on port + k
///   IOT-TS/api: 9100
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Addresses {
    pub nodes: BTreeMap<String, IpAddr>,
    pub services: BTreeMap<String, u16>,
}

impl Addresses {
    pub fn load(path: &Path) -> Result<Addresses> {
        let text = std::fs::read_to_string(path).map_err(|source| XdsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Addresses::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<Addresses> {
        serde_norway::from_str(text).map_err(|e| XdsError::Addresses {
            origin: origin.to_string(),
            why: format!(
                "{e}; the file maps `nodes:` (node id -> IP) and `services:` (APP/STAGE -> port)"
            ),
        })
    }

    /// Every node of `topo` and every service of `wl` must have an address, and every name in
    /// the file must be one of them: an instance may land on any node after a migration or a
    /// failover, and a typo would otherwise silently take a service out of EDS.
    pub fn check(&self, topo: &Topology, wl: &Workload, origin: &str) -> Result<()> {
        let fail = |why: String| {
            Err(XdsError::Addresses {
                origin: origin.to_string(),
                why,
            })
        };
        let node_ids: Vec<&str> = topo.nodes.iter().map(|n| n.id.as_str()).collect();
        for id in &node_ids {
            if !self.nodes.contains_key(*id) {
                return fail(format!(
                    "node `{id}` has no address; add `{id}: IP` under `nodes:` (an instance may move to any node)"
                ));
            }
        }
        for id in self.nodes.keys() {
            if !node_ids.contains(&id.as_str()) {
                return fail(format!(
                    "nodes: `{id}` is not a node of cluster `{}`{}",
                    topo.name,
                    did_you_mean(id, &node_ids)
                ));
            }
        }
        let mut services: Vec<&str> = wl
            .instances
            .iter()
            .filter(|i| i.is_primary())
            .map(|i| service_of(&i.id))
            .collect();
        services.sort_unstable();
        services.dedup();
        for service in &services {
            if !self.services.contains_key(*service) {
                return fail(format!(
                    "service `{service}` has no port; add `{service}: PORT` under `services:`"
                ));
            }
        }
        for service in self.services.keys() {
            if !services.contains(&service.as_str()) {
                return fail(format!(
                    "services: `{service}` is not a service of the placed apps{}",
                    did_you_mean(service, &services)
                ));
            }
        }
        for inst in wl.instances.iter().filter(|i| i.is_primary()) {
            if self.port(&inst.id).is_none() {
                return fail(format!(
                    "instance `{}` would serve past port 65535; give `{}` a lower port",
                    inst.id,
                    service_of(&inst.id)
                ));
            }
        }
        Ok(())
    }

    /// The port of an instance `APP/STAGE-SHARD`: its service's port + SHARD.
    fn port(&self, instance: &str) -> Option<u16> {
        let service = service_of(instance);
        let base = *self.services.get(service)?;
        let shard: u16 = match instance.strip_prefix(service) {
            Some("") => 0,
            Some(rest) => rest.strip_prefix('-')?.parse().ok()?,
            None => return None,
        };
        base.checked_add(shard)
    }

    /// Where `endpoint` serves, if the file says.
    pub fn resolve(&self, endpoint: &Endpoint) -> Option<SocketAddr> {
        Some(SocketAddr::new(
            *self.nodes.get(&endpoint.node)?,
            self.port(&endpoint.instance)?,
        ))
    }
}

/// The control center's endpoint feed into the xDS server: each service of a snapshot becomes
/// the endpoints of the cluster of that name, pushed to every node and Envoy at once.
pub struct XdsSink {
    pub feed: Feed,
    pub addresses: Addresses,
}

impl EndpointSink for XdsSink {
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> flatmesh_control::Result<()> {
        let mut placed = BTreeMap::new();
        for (service, endpoints) in &snapshot.services {
            let addresses: Vec<SocketAddr> = endpoints
                .iter()
                .filter_map(|e| {
                    let address = self.addresses.resolve(e);
                    if address.is_none() {
                        tracing::warn!(instance = %e.instance, node = %e.node, "no address for this endpoint; left out of EDS (check the addresses file)");
                    }
                    address
                })
                .collect();
            placed.insert(service.clone(), addresses);
        }
        tracing::info!(
            version = snapshot.version,
            services = placed.len(),
            "publishing the placement's endpoints over EDS"
        );
        self.feed.set_endpoints(placed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use flatmesh_control::model::{parse_app, parse_cluster};

    const CLUSTER: &str = r#"
name: lab
server_types:
  Small:
    host:     {core: beefy, cores: 2, memory_mb: 4096, idle_watts: 83, peak_watts: 201, cost_usd: 4500, bandwidth_gbps: 0}
    smartnic: {core: wimpy, cores: 1, memory_mb: 1024, idle_watts: 15, peak_watts: 21, cost_usd: 150, bandwidth_gbps: 10}
    smartnic_count: 1
racks:
  - name: r0
    servers: [{type: Small, count: 2}]
"#;
    const APP: &str = r#"
name: shop
rps: 1000
replicas: 0
stages: [{name: kvs, microservice: KVS, shards: 2}]
"#;

    fn model() -> (Topology, Workload) {
        let topo = Topology::build(&parse_cluster("c.yaml", CLUSTER).unwrap()).unwrap();
        let wl = Workload::from_apps(&[parse_app("a.yaml", APP).unwrap()]).unwrap();
        (topo, wl)
    }

    const ADDRESSES: &str = "nodes: { r0-s0/host: 127.0.0.1, r0-s0/nic0: 127.0.0.2, r0-s1/host: 127.0.0.3, r0-s1/nic0: 127.0.0.4 }\nservices: { shop/kvs: 9100 }\n";

    #[test]
    fn addresses_resolve_node_ip_and_shard_port() {
        let (topo, wl) = model();
        let a = Addresses::parse(ADDRESSES, "a.yaml").unwrap();
        a.check(&topo, &wl, "a.yaml").unwrap();
        let e = |instance: &str, node: &str| Endpoint {
            instance: instance.into(),
            node: node.into(),
            server: "r0-s0".into(),
        };
        assert_eq!(
            a.resolve(&e("shop/kvs-1", "r0-s0/nic0")),
            Some("127.0.0.2:9101".parse().unwrap())
        );
        assert_eq!(a.resolve(&e("shop/kvs-0", "r9-s9/host")), None);
        assert_eq!(a.resolve(&e("other/x-0", "r0-s0/host")), None);
    }

    #[test]
    fn addresses_name_what_is_missing_or_misspelt() {
        let (topo, wl) = model();
        let check = |text: &str| {
            Addresses::parse(text, "a.yaml")
                .and_then(|a| a.check(&topo, &wl, "a.yaml"))
                .unwrap_err()
                .to_string()
        };
        let e = check(&ADDRESSES.replace(", r0-s1/nic0: 127.0.0.4", ""));
        assert!(
            e.starts_with("a.yaml: node `r0-s1/nic0` has no address"),
            "{e}"
        );
        let e = check(&ADDRESSES.replace("r0-s1/nic0", "r0-s1/nic9"));
        assert!(e.contains("`r0-s1/nic0` has no address"), "{e}");
        let e = check(&format!("{ADDRESSES}extra: 1\n"));
        assert!(e.contains("unknown field `extra`"), "{e}");
        let e = check(&ADDRESSES.replace("shop/kvs", "shop/kv"));
        assert!(e.contains("service `shop/kvs` has no port"), "{e}");
        let e = check(&ADDRESSES.replace("{ shop/kvs: 9100 }", "{ shop/kvs: 9100, shop/kvz: 1 }"));
        assert!(e.contains("did you mean \"shop/kvs\""), "{e}");
        let e = check(&ADDRESSES.replace("9100", "65535"));
        assert!(e.contains("shop/kvs-1") && e.contains("65535"), "{e}");
        let e = check(&ADDRESSES.replace("127.0.0.2", "not-an-ip"));
        assert!(e.starts_with("a.yaml: "), "{e}");
    }

    #[test]
    fn sink_fills_declared_clusters_and_adds_the_others() {
        let state = flatmesh_config::parse(
            "listeners: [ { name: web, address: 127.0.0.1:8080, protocol: http, routes: [ { cluster: shop/kvs } ] } ]\nclusters: [ { name: shop/kvs, lb: least_request, endpoints: [ 127.0.0.1:1 ] } ]\n",
            "state.yaml",
        )
        .unwrap();
        let store = Store::new();
        let feed = Feed::new(store.clone(), state);
        let mut sink = XdsSink {
            feed: feed.clone(),
            addresses: Addresses::parse(ADDRESSES, "a.yaml").unwrap(),
        };
        let endpoint = |instance: &str, node: &str| Endpoint {
            instance: instance.into(),
            node: node.into(),
            server: "r0-s0".into(),
        };
        let mut services = BTreeMap::new();
        services.insert(
            "shop/kvs".to_string(),
            vec![
                endpoint("shop/kvs-0", "r0-s0/nic0"),
                endpoint("shop/kvs-1", "r0-s1/host"),
                endpoint("shop/kvs-2", "unknown-node"),
            ],
        );
        services.insert(
            "shop/other".to_string(),
            vec![endpoint("shop/other-0", "r0-s0/host")],
        );
        sink.publish(&EndpointSnapshot {
            version: 1,
            services,
        })
        .unwrap();
        let served = feed.served();
        let kvs = served.cluster("shop/kvs").unwrap();
        assert_eq!(
            kvs.lb,
            model::LbPolicy::LeastRequest,
            "the file's settings stay"
        );
        assert_eq!(
            kvs.endpoints,
            [
                "127.0.0.2:9100".parse().unwrap(),
                "127.0.0.3:9101".parse().unwrap()
            ],
            "the placement's endpoints replace the file's; the unresolvable one is left out"
        );
        assert!(
            served.cluster("shop/other").unwrap().endpoints.is_empty(),
            "a placed service without a port is served, with no endpoints (503)"
        );
        let cla = &store.resources().endpoints["shop/kvs"];
        assert_eq!(
            cla.endpoints[0].lb_endpoints.len(),
            2,
            "and it is what EDS serves"
        );

        // A new state file keeps the placement's endpoints.
        feed.set_config(
            flatmesh_config::parse(
                "listeners: [ { name: web, address: 127.0.0.1:8081, protocol: http, routes: [ { cluster: x } ] } ]\nclusters: [ { name: x, endpoints: [ 127.0.0.1:1 ] } ]\n",
                "state.yaml",
            )
            .unwrap(),
        );
        let served = feed.served();
        assert_eq!(served.cluster("shop/kvs").unwrap().endpoints.len(), 2);
        assert_eq!(
            served.cluster("shop/kvs").unwrap().lb,
            model::LbPolicy::RoundRobin
        );
        assert!(served.cluster("x").is_some());
    }
}
