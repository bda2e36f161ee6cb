//! The control center's endpoint feed into the xDS server: each service of a placement snapshot
//! becomes the endpoints of the cluster of that name ([`flatmesh_xds::feed::Feed`]), pushed to
//! every node and Envoy at once.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use flatmesh_xds::feed::Feed;

use super::addresses::Addresses;
use crate::endpoints::{EndpointSink, EndpointSnapshot};

/// The control center's endpoint feed into the xDS server: each service of a snapshot becomes
/// the endpoints of the cluster of that name, pushed to every node and Envoy at once.
pub struct XdsSink {
    pub feed: Feed,
    pub addresses: Addresses,
    /// With the control center as CA: its trust domain, and where placed identities are
    /// recorded (a node may get a certificate only for the services placed on it).
    pub grants: Option<(String, super::ca::Placements)>,
}

impl EndpointSink for XdsSink {
    fn publish(&mut self, snapshot: &EndpointSnapshot) -> crate::Result<()> {
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
        // Identities move with the instances: record the new placement before the nodes hear
        // of it, so a node that just received an instance can get its certificate at once.
        if let Some((trust_domain, placements)) = &self.grants {
            placements.update(trust_domain, snapshot);
        }
        self.feed.set_endpoints(placed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::Endpoint;
    use flatmesh_config as model;
    use flatmesh_xds::server::Store;

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
            addresses: Addresses::parse(
                "nodes: { r0-s0/host: 127.0.0.1, r0-s0/nic0: 127.0.0.2, r0-s1/host: 127.0.0.3, r0-s1/nic0: 127.0.0.4 }\nservices: { shop/kvs: 9100 }\n",
                "a.yaml",
            )
            .unwrap(),
            grants: None,
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
            *kvs.endpoints,
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
    }
}
