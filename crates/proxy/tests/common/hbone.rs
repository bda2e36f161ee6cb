//! The receiving side of HBONE tests: a node whose `hbone` listener accepts tunnels from
//! other nodes over mutual TLS.

use std::net::SocketAddr;

use super::pki::{Pki, NODE};
use super::{free_addr, TestNode};

/// Node B: an hbone listener `tunnel` on `listen`, presenting [`NODE`], that admits nodes with
/// `allow` (SPIFFE patterns), with `extra` YAML under the listener (its `hbone:` or
/// `authorization:`).
pub fn node_b(pki: &Pki, listen: SocketAddr, allow: &str, extra: &str) -> TestNode {
    let id = pki.issue("node-b", NODE);
    let ca = pki.ca_file();
    TestNode::start(&format!(
        r#"
admin: {admin}
workers: 2
limits: {{ header_read_timeout: 2s, connect_timeout: 1s }}
listeners:
  - name: tunnel
    address: {listen}
    protocol: hbone
    tls: {{ cert: {id}.pem, key: {id}.key, client_ca: {ca}, allow: [ {allow} ] }}
{extra}
"#,
        admin = free_addr()
    ))
}
