//! What the control center's integration tests share: a two-server lab cluster, a one-stage
//! app (HCM puts its KVS on the first SmartNIC), the addresses of its nodes, and a scratch
//! directory.
#![allow(dead_code)]

use std::path::PathBuf;

pub const CLUSTER: &str = r#"
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

pub const APP: &str = r#"
name: shop
rps: 1000
replicas: 0
stages: [{name: kvs, microservice: KVS, shards: 1}]
"#;

/// Topology order: per server its host, then its SmartNIC; the index is the heartbeat's node.
pub const ADDRESSES: &str = "nodes: { r0-s0/host: 127.0.0.1, r0-s0/nic0: 127.0.0.2, r0-s1/host: 127.0.0.3, r0-s1/nic0: 127.0.0.4 }\nservices: { shop/kvs: 9100 }\n";

/// A scratch directory of this test's own, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("fm-control-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The console's `GET /ui/state`.
pub fn console_state(ui: std::net::SocketAddr) -> serde_json::Value {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(ui).unwrap();
    s.write_all(b"GET /ui/state HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let body = answer.split_once("\r\n\r\n").unwrap().1;
    serde_json::from_str(body).unwrap()
}
