//! What `flatmesh control` serves: a config (its state file's listeners, routes and clusters)
//! with the endpoints of placed services filled in. The control center (crates/control, its
//! `serve` module) places the services and moves them; it hands each new placement to
//! [`Feed::set_endpoints`] as service name -> addresses.
//!
//! A placed service `APP/STAGE` is served as the cluster of that name. If the state file declares
//! it (to route to it, or to set its load balancer, protocol or connect timeout), its endpoints
//! are the placement's, whatever the file lists; otherwise it is served as a round-robin cluster
//! of its own. Every cluster is an EDS cluster on the wire, so a migration or a failover that
//! moves an instance is one small EDS push to every node and to Envoy.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use flatmesh_config as model;
use parking_lot::Mutex;

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
            Some(c) => c.endpoints = endpoints.clone().into(),
            None => out.clusters.push(model::Cluster {
                name: service.clone(),
                kind: model::ClusterType::Static,
                allow: Vec::new(),
                max_destinations: None,
                lb: model::LbPolicy::RoundRobin,
                endpoints: endpoints.clone().into(),
                protocol: model::UpstreamProtocol::Http1,
                hash_on: None,
                connect_timeout: None,
                tls: None,
                tunnel: None,
                tunnel_port: None,
                circuit_breaker: None,
                outlier_detection: None,
                health_check: None,
                slow_start: None,
                overprovisioning_factor: None,
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn placed_endpoints_fill_declared_clusters_and_add_the_others() {
        let state = flatmesh_config::parse(
            "listeners: [ { name: web, address: 127.0.0.1:8080, protocol: http, routes: [ { cluster: shop/kvs } ] } ]\nclusters: [ { name: shop/kvs, lb: least_request, endpoints: [ 127.0.0.1:1 ] } ]\n",
            "state.yaml",
        )
        .unwrap();
        let store = Store::new();
        let feed = Feed::new(store.clone(), state);
        let mut placed = BTreeMap::new();
        placed.insert(
            "shop/kvs".to_string(),
            vec![
                "127.0.0.2:9100".parse().unwrap(),
                "127.0.0.3:9101".parse().unwrap(),
            ],
        );
        placed.insert("shop/other".to_string(), vec![]);
        feed.set_endpoints(placed);
        let served = feed.served();
        let kvs = served.cluster("shop/kvs").unwrap();
        assert_eq!(
            kvs.lb,
            model::LbPolicy::LeastRequest,
            "the file's settings stay"
        );
        assert_eq!(
            kvs.endpoints.len(),
            2,
            "the placement's endpoints replace the file's"
        );
        assert!(
            served.cluster("shop/other").unwrap().endpoints.is_empty(),
            "a placed service with no address is served, with no endpoints (503)"
        );
        assert_eq!(
            store.resources().endpoints["shop/kvs"].endpoints[0]
                .lb_endpoints
                .len(),
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
