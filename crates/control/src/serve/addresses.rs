//! Where placed instances serve. The placement says on which *node* an instance runs, not on
//! which socket: the `--addresses` file of `flatmesh control` gives each node's IP and each
//! service's port (shard `k` of a service serves on its port + `k`), the convention
//! `flatmesh control demo` uses too.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use serde::Deserialize;

use crate::endpoints::{service_of, Endpoint};
use crate::error::{ControlError, Result};
use crate::model::did_you_mean;
use crate::topology::Topology;
use crate::workload::Workload;

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
        let text = std::fs::read_to_string(path).map_err(|e| ControlError::Addresses {
            origin: path.display().to_string(),
            why: format!("cannot read it: {e}; check the path (--addresses FILE)"),
        })?;
        Addresses::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<Addresses> {
        serde_norway::from_str(text).map_err(|e| ControlError::Addresses {
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
            Err(ControlError::Addresses {
                origin: origin.to_string(),
                why,
            })
        };
        topo.check_node_names(
            self.nodes.keys(),
            |id| format!("node `{id}` has no address; add `{id}: IP` under `nodes:` (an instance may move to any node)"),
            "nodes: ",
        )
        .or_else(fail)?;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::model::{parse_app, parse_cluster};

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
}
