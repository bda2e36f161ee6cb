//! The large configuration of the xDS scale test (`tests/scale.rs`) and the push benchmark
//! (`examples/push_bench.rs`): `CLUSTERS` clusters `svc-<i>`, and one HTTP listener with a
//! prefix route `/svc-<i>/` to each.

use std::net::SocketAddr;

use flatmesh_config as model;

pub const CLUSTERS: usize = 1_000;
pub const PER_CLUSTER: usize = 10;

/// The listener binds `port`; cluster `i` gets `endpoints(i)`.
pub fn large_config(port: u16, endpoints: impl Fn(usize) -> Vec<SocketAddr>) -> model::Config {
    let mut c = flatmesh_xds::bootstrap::empty_config();
    let mut routes = Vec::new();
    for i in 0..CLUSTERS {
        let name = format!("svc-{i}");
        c.clusters.push(model::Cluster {
            name: name.clone(),
            kind: model::ClusterType::Static,
            allow: Vec::new(),
            max_destinations: None,
            lb: model::LbPolicy::RoundRobin,
            endpoints: endpoints(i).into(),
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
        });
        let mut r: model::Route = serde_json::from_value(serde_json::json!({
            "match": { "path": { "prefix": format!("/svc-{i}/") } }, "cluster": name
        }))
        .unwrap();
        r.name = Some(format!("r{i}"));
        routes.push(r);
    }
    c.listeners.push(model::Listener {
        name: "web".into(),
        address: ([127, 0, 0, 1], port).into(),
        protocol: model::ListenerProtocol::Http,
        routes,
        cluster: None,
        limits: Default::default(),
        normalize_path: None,
        tls: None,
        authorization: None,
        hbone: None,
        rate_limit: None,
        connection_rate_limit: None,
        qnp: None,
        merge_slashes: None,
        path_with_escaped_slashes_action: None,
    });
    c
}

/// `PER_CLUSTER` loopback addresses for cluster `i` that nobody listens on; `net` (the second
/// octet) tells two versions of the config apart.
pub fn unused_endpoints(i: usize, net: u8) -> Vec<SocketAddr> {
    (0..PER_CLUSTER)
        .map(|k| {
            SocketAddr::from((
                [127, net, (i / 250) as u8, (i % 250) as u8 + 1],
                8000 + k as u16,
            ))
        })
        .collect()
}
