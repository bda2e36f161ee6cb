//! The `--heartbeat-keys` file of `flatmesh control`: each node's heartbeat key, which that node's
//! agent holds too (docs/control.md, "Heartbeat transport").
//!
//! ```yaml
//! # node id -> 32-byte key as 64 hex digits (`openssl rand -hex 32`); chmod 600
//! r0-s0/host: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! r0-s0/nic0: 60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use crate::agent::{Gate, GateConfig, NodeCredentials};
use crate::error::{ControlError, Result};
use crate::heartbeat::{read_secret, HeartbeatKey};
use crate::serve::addresses::Addresses;
use crate::topology::Topology;

/// Node id -> heartbeat key.
#[derive(Debug, Clone, PartialEq)]
pub struct HeartbeatKeys {
    keys: BTreeMap<String, HeartbeatKey>,
}

impl HeartbeatKeys {
    /// Reads the file; it must be readable by its owner only.
    pub fn load(path: &Path) -> Result<HeartbeatKeys> {
        let text = read_secret(path)?;
        HeartbeatKeys::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<HeartbeatKeys> {
        let fail = |why: String| ControlError::HeartbeatKeys {
            origin: origin.to_string(),
            why,
        };
        let raw: BTreeMap<String, String> = serde_norway::from_str(text).map_err(|e| {
            // The YAML error quotes the line, which may hold a key: say where, not what.
            let at = e
                .location()
                .map(|l| format!(" at line {}", l.line()))
                .unwrap_or_default();
            fail(format!(
                "not a map of node id -> key{at}; write one `NODE: 64 hex digits` per line"
            ))
        })?;
        let keys = raw
            .into_iter()
            .map(|(node, hex)| {
                let key =
                    HeartbeatKey::from_hex(&hex).map_err(|m| fail(format!("`{node}`: {m}")))?;
                Ok((node, key))
            })
            .collect::<Result<_>>()?;
        Ok(HeartbeatKeys { keys })
    }

    /// Every node of `topo` needs a key (a node without one could never report, so it would
    /// never be failed over either), and every name must be a node.
    pub fn check(&self, topo: &Topology, origin: &str) -> Result<()> {
        let fail = |why: String| {
            Err(ControlError::HeartbeatKeys {
                origin: origin.to_string(),
                why,
            })
        };
        topo.check_node_names(
            self.keys.keys(),
            |id| format!("node `{id}` has no key; add `{id}: KEY` (`openssl rand -hex 32`) and give the same key to its agent"),
            "",
        )
        .or_else(fail)
    }

    /// The node ids, in the order of [`HeartbeatKeys::gate_by_name`]'s indices (sorted).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// A gate for nodes that are numbered by this file rather than by a topology (Kubernetes,
    /// where nodes come and go): node `i` is the `i`th name in [`HeartbeatKeys::names`].
    /// Their addresses are set as they become known ([`Gate::set_address`]); until then a
    /// node's heartbeats are refused.
    pub fn gate_by_name(&self, cfg: GateConfig) -> Gate {
        let nodes = self
            .keys
            .values()
            .map(|key| {
                Some(NodeCredentials {
                    key: key.clone(),
                    address: None,
                })
            })
            .collect();
        let mut gate = Gate::new(nodes, cfg);
        gate.require_address();
        gate
    }

    /// The receiver's gate: node `i` (its position in the topology, the heartbeat's node field)
    /// with its key and, as its only source address, its IP from the addresses file.
    pub fn gate(&self, topo: &Topology, addresses: &Addresses, cfg: GateConfig) -> Gate {
        let nodes = topo
            .nodes
            .iter()
            .map(|n| {
                Some(NodeCredentials {
                    key: self.keys.get(&n.id)?.clone(),
                    address: addresses.nodes.get(&n.id).copied(),
                })
            })
            .collect();
        Gate::new(nodes, cfg)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::model::parse_cluster;

    const CLUSTER: &str = r#"
name: lab
server_types:
  Small:
    host:     {core: beefy, cores: 2, memory_mb: 4096, idle_watts: 83, peak_watts: 201, cost_usd: 4500, bandwidth_gbps: 0}
    smartnic: {core: wimpy, cores: 1, memory_mb: 1024, idle_watts: 15, peak_watts: 21, cost_usd: 150, bandwidth_gbps: 0}
    smartnic_count: 1
racks:
  - name: r0
    servers: [{type: Small, count: 1}]
"#;

    fn topo() -> Topology {
        Topology::build(&parse_cluster("c.yaml", CLUSTER).unwrap()).unwrap()
    }

    #[test]
    fn every_node_has_a_key_and_every_key_a_node() {
        let (a, b) = ("1".repeat(64), "2".repeat(64));
        let keys =
            HeartbeatKeys::parse(&format!("r0-s0/host: {a}\nr0-s0/nic0: \"{b}\"\n"), "k").unwrap();
        keys.check(&topo(), "k").unwrap();
        let e = HeartbeatKeys::parse(&format!("r0-s0/host: {a}\n"), "k")
            .unwrap()
            .check(&topo(), "k")
            .unwrap_err()
            .to_string();
        assert!(e.contains("node `r0-s0/nic0` has no key"), "{e}");
        let e = HeartbeatKeys::parse(
            &format!("r0-s0/host: {a}\nr0-s0/nic0: {b}\nr0-s0/nic1: {b}\n"),
            "k",
        )
        .unwrap()
        .check(&topo(), "k")
        .unwrap_err()
        .to_string();
        assert!(e.contains("did you mean \"r0-s0/nic0\""), "{e}");
    }

    #[test]
    fn bad_files_say_what_to_write_without_echoing_keys() {
        let e = HeartbeatKeys::parse("r0-s0/host: abc\n", "k.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("k.yaml: `r0-s0/host`: "), "{e}");
        assert!(e.contains("openssl rand -hex 32"), "{e}");
        let secret = "5".repeat(64);
        let e = HeartbeatKeys::parse(&format!("- {secret}\n"), "k.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("NODE: 64 hex digits"), "{e}");
        assert!(!e.contains(&secret), "{e}");
    }
}
