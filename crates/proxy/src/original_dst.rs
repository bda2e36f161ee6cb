//! `type: original_dst` clusters: where an accepted connection was going before it was sent
//! to the node, and whether the node may send it there.
//!
//! The address the client first dialled comes, in this order, from tier K's capture map
//! (the connection's socket cookie, when the node's `kernel.capture` redirected it), from
//! `SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST` (conntrack's record of an iptables/nftables
//! `REDIRECT` or DNAT), and else from the accepted socket's own local address (TPROXY, which
//! leaves the destination on the socket). It is read once, at accept, and only while some
//! cluster of the config is an `original_dst` one.
//!
//! A destination is refused unless it is in the cluster's `allow` list, and always when it
//! is the node itself: the accepted socket's own address (a connection that was dialled
//! straight to the node, not redirected) or one of the node's listener addresses. Forwarding
//! those would bring the connection back to the node, again and again.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use flatmesh_config::{Cidr, Cluster, Config};
use tokio::net::TcpStream;

use crate::kernel::KernelBinding;
use crate::workload::proc_net::canonical;

/// Where an accepted connection was going, and the address it reached the node on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dialled {
    pub to: SocketAddr,
    /// The accepted socket's local address.
    pub local: SocketAddr,
}

/// Reads where `stream` was going (see the module's comment for the order). `None` only
/// when the socket has no local address (it is gone already).
pub fn lookup(stream: &TcpStream, kernel: Option<&KernelBinding>) -> Option<Dialled> {
    let local = stream.local_addr().ok()?;
    let captured = kernel.and_then(|k| k.original_dst(stream));
    let to = captured
        .or_else(|| {
            let ipv6 = matches!(local.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none());
            flatmesh_kernel::original_dst_sockopt(stream, ipv6).ok()
        })
        .unwrap_or(local);
    Some(Dialled {
        to: canonical(to),
        local: canonical(local),
    })
}

/// Why an `original_dst` cluster does not forward a connection or request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The node did not read a destination for the connection (it was accepted while no
    /// cluster was an `original_dst` one).
    Unknown,
    /// The destination is outside the cluster's `allow` list.
    NotAllowed { to: SocketAddr, allow: String },
    /// The destination is the node itself.
    Loop { to: SocketAddr },
}

impl Refused {
    /// The HTTP status an L7 client gets: 403 for a destination the cluster may not reach,
    /// 502 when the node does not know where the request was going.
    pub fn status(&self) -> u16 {
        match self {
            Refused::Unknown => 502,
            Refused::NotAllowed { .. } | Refused::Loop { .. } => 403,
        }
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Unknown => write!(
                f,
                "the node does not know where this connection was going (it was accepted before the cluster became original_dst); reconnect"
            ),
            Refused::NotAllowed { to, allow } => write!(
                f,
                "original destination {to} is outside the cluster's allow-list [{allow}]; add a prefix that holds it to `allow` if it should be reached"
            ),
            Refused::Loop { to } => write!(
                f,
                "original destination {to} is this node's own listener (the connection was dialled to the node, not redirected to it); forwarding it would loop"
            ),
        }
    }
}

/// An `original_dst` cluster as the data plane reads it.
#[derive(Debug)]
pub struct OriginalDstPlan {
    allow: Vec<Cidr>,
    /// The node's listener addresses (as configured), which are never a destination.
    listeners: Vec<SocketAddr>,
    /// The most destinations a worker keeps idle connections to.
    pub max_destinations: usize,
}

impl OriginalDstPlan {
    /// The plan of `cluster` (an `original_dst` one) in `config`.
    pub fn new(cluster: &Cluster, config: &Config) -> OriginalDstPlan {
        OriginalDstPlan {
            allow: cluster.allow.clone(),
            listeners: config.listeners.iter().map(|l| l.address).collect(),
            max_destinations: cluster.destinations_bound() as usize,
        }
    }

    /// Where the connection may go: its original destination, when the allow-list has it
    /// and it is not the node itself.
    pub fn check(&self, dialled: Option<Dialled>) -> Result<SocketAddr, Refused> {
        let Dialled { to, local } = dialled.ok_or(Refused::Unknown)?;
        if to == local || self.listeners.iter().any(|l| is_listener(*l, to, local)) {
            return Err(Refused::Loop { to });
        }
        if !self.allow.iter().any(|c| c.contains(to.ip())) {
            let allow = self
                .allow
                .iter()
                .map(Cidr::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Refused::NotAllowed { to, allow });
        }
        Ok(to)
    }
}

/// Whether a connection to `to` would reach the listener bound to `listener`, from a node
/// one of whose addresses is `local`: the same address, or the listener's port on a
/// listener bound to every address (`0.0.0.0`, `::`) and `to` on this host.
fn is_listener(listener: SocketAddr, to: SocketAddr, local: SocketAddr) -> bool {
    listener.port() == to.port()
        && (listener.ip() == to.ip()
            || (listener.ip().is_unspecified() && (to.ip().is_loopback() || to.ip() == local.ip())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn plan() -> OriginalDstPlan {
        let config = flatmesh_config::parse(
            "listeners:\n  - { name: capture, address: 127.0.0.1:15001, protocol: tcp, cluster: out }\n  - { name: any, address: 0.0.0.0:15006, protocol: tcp, cluster: out }\nclusters:\n  - { name: out, type: original_dst, allow: [ 10.0.0.0/8, 127.0.0.0/8 ] }\n",
            "t.yaml",
        )
        .unwrap();
        OriginalDstPlan::new(&config.clusters[0], &config)
    }

    fn dialled(to: &str) -> Option<Dialled> {
        Some(Dialled {
            to: to.parse().unwrap(),
            local: "127.0.0.1:15001".parse().unwrap(),
        })
    }

    #[test]
    fn a_destination_in_the_allow_list_is_reached() {
        let p = plan();
        assert_eq!(
            p.check(dialled("10.1.2.3:80")),
            Ok("10.1.2.3:80".parse().unwrap())
        );
        assert_eq!(
            p.check(dialled("127.0.0.5:9000")),
            Ok("127.0.0.5:9000".parse().unwrap())
        );
    }

    #[test]
    fn a_destination_outside_it_is_refused_with_the_list_named() {
        let err = plan().check(dialled("192.168.0.1:80")).unwrap_err();
        assert_eq!(err.status(), 403);
        let text = err.to_string();
        assert!(
            text.contains("192.168.0.1:80") && text.contains("[10.0.0.0/8, 127.0.0.0/8]"),
            "{text}"
        );
    }

    #[test]
    fn the_node_itself_is_never_a_destination() {
        let p = plan();
        // Not redirected: the destination is the socket's own address.
        assert!(matches!(
            p.check(dialled("127.0.0.1:15001")),
            Err(Refused::Loop { .. })
        ));
        // Redirected to another of the node's listeners, one bound to every address.
        assert!(matches!(
            p.check(dialled("127.0.0.9:15006")),
            Err(Refused::Loop { .. })
        ));
        // That port elsewhere is not the node.
        assert!(p.check(dialled("10.0.0.9:15006")).is_ok());
        assert_eq!(p.check(None), Err(Refused::Unknown));
    }

    #[test]
    fn a_dual_stack_view_of_an_ipv4_address_is_that_address() {
        assert_eq!(
            canonical("[::ffff:10.0.0.1]:80".parse().unwrap()),
            "10.0.0.1:80".parse::<SocketAddr>().unwrap()
        );
    }
}
