//! Names and addresses of everything a split namespace creates, derived from the config alone, so
//! that every agent, the clean-up and `status` agree without talking to each other.
//!
//! Every resource carries a recognisable prefix, which is how `flatmesh pu cleanup` finds leftovers
//! after a crash: network namespaces `fmpu-<ns>-<pu>`, cpuset cgroups `flatmesh-pu-<ns>-<pu>`, the
//! nftables table `flatmesh-pu-<ns>` (inside the PU namespaces only), and `<state_dir>/<ns>/`.

use std::net::Ipv4Addr;

use crate::config::SplitConfig;

/// Prefix of every network namespace a split namespace creates.
pub const NETNS_PREFIX: &str = "fmpu-";
/// Prefix of every cgroup and nftables table.
pub const RESOURCE_PREFIX: &str = "flatmesh-pu-";
/// Firewall marks for "route this packet to PU n unchanged" (§4.1.2 rule 1) are MARK_BASE + n.
/// Where split namespaces pin their port tables and bind hooks: `<PIN_ROOT>/flatmesh-pu-<ns>`.
pub const PIN_ROOT: &str = "/sys/fs/bpf";
pub const MARK_BASE: u32 = 0x4d50_0000;
/// Routing table ids for those marks are TABLE_BASE + n.
pub const TABLE_BASE: u32 = 4000;

/// One PU as seen from another: the veth between them and both ends' addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Index of the PU at the far end.
    pub peer: usize,
    pub peer_name: String,
    /// Interface name on this side (`pu-<peer>`).
    pub ifname: String,
    pub local_addr: Ipv4Addr,
    pub peer_addr: Ipv4Addr,
}

#[derive(Debug, Clone)]
pub struct Topology {
    pub namespace: String,
    pub pus: Vec<String>,
    pub uplink: Option<usize>,
}

impl Topology {
    pub fn new(config: &SplitConfig) -> Topology {
        Topology {
            namespace: config.namespace.clone(),
            pus: config.pus.iter().map(|p| p.name.clone()).collect(),
            uplink: config.uplink.as_deref().and_then(|u| config.pu_index(u)),
        }
    }

    pub fn netns(&self, pu: usize) -> String {
        format!("{NETNS_PREFIX}{}-{}", self.namespace, self.pus[pu])
    }

    pub fn cgroup(&self, pu: usize) -> String {
        format!("{RESOURCE_PREFIX}{}-{}", self.namespace, self.pus[pu])
    }

    pub fn nft_table(&self) -> String {
        format!("{RESOURCE_PREFIX}{}", self.namespace)
    }

    /// The bpffs directory of the port table and its bind hook.
    pub fn pin_dir(&self) -> std::path::PathBuf {
        pin_dir(&self.namespace)
    }

    /// The /30 of the link between PUs `a` and `b` is number k in pair order (0,1), (0,2), ..;
    /// the lower-numbered PU gets .1 of it, the other .2.
    fn link_addrs(&self, a: usize, b: usize) -> (Ipv4Addr, Ipv4Addr) {
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        let n = self.pus.len();
        let k = (0..lo).map(|i| n - 1 - i).sum::<usize>() + (hi - lo - 1);
        let base = 4 * k as u8;
        let lo_addr = Ipv4Addr::new(169, 254, 213, base + 1);
        let hi_addr = Ipv4Addr::new(169, 254, 213, base + 2);
        if a < b {
            (lo_addr, hi_addr)
        } else {
            (hi_addr, lo_addr)
        }
    }

    /// The links of PU `me`, one per other PU, in PU order.
    pub fn links(&self, me: usize) -> Vec<Link> {
        (0..self.pus.len())
            .filter(|&p| p != me)
            .map(|peer| {
                let (local_addr, peer_addr) = self.link_addrs(me, peer);
                Link {
                    peer,
                    peer_name: self.pus[peer].clone(),
                    ifname: format!("pu-{}", self.pus[peer]),
                    local_addr,
                    peer_addr,
                }
            })
            .collect()
    }

    pub fn link_to(&self, me: usize, peer: usize) -> Option<Link> {
        self.links(me).into_iter().find(|l| l.peer == peer)
    }

    pub fn index(&self, pu: &str) -> Option<usize> {
        self.pus.iter().position(|p| p == pu)
    }
}

/// The bpffs directory of split namespace `namespace`'s port table.
pub fn pin_dir(namespace: &str) -> std::path::PathBuf {
    std::path::Path::new(PIN_ROOT).join(format!("{RESOURCE_PREFIX}{namespace}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn topo(n: usize) -> Topology {
        Topology {
            namespace: "t".into(),
            pus: (0..n).map(|i| format!("p{i}")).collect(),
            uplink: None,
        }
    }

    #[test]
    fn link_addresses_are_unique_and_symmetric() {
        let t = topo(crate::config::MAX_PUS);
        let mut seen = std::collections::HashSet::new();
        for a in 0..t.pus.len() {
            for l in t.links(a) {
                assert!(seen.insert(l.local_addr), "{} reused", l.local_addr);
                let back = t.link_to(l.peer, a).unwrap();
                assert_eq!(back.local_addr, l.peer_addr);
                assert_eq!(back.peer_addr, l.local_addr);
                // Both ends are in the same /30.
                assert_eq!(u32::from(l.local_addr) & !3, u32::from(l.peer_addr) & !3);
            }
        }
    }
}
