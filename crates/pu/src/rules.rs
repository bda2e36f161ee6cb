//! The single-PU nftables rules that make one split namespace look like one (§4.1.1, §4.1.2).
//! All of them live in one table, `ip flatmesh-pu-<ns>`, inside each PU's own network namespace;
//! nothing is ever written to the host namespace.
//!
//! Direct calls (port-based reverse mapping, §4.1.1), on every PU:
//! - `output_nat`: `connect(127.0.0.1:P)` where the table says another PU owns P is DNATed to
//!   that PU's address on the link between them (`remote_ports` maps P to it). The kernel then
//!   re-routes the packet out of the veth; `route_localnet=1` on the veth lets a 127.0.0.1 source
//!   leave and lets replies to 127.0.0.1 come in.
//! - `postrouting_nat`: the 127.0.0.1 source becomes this PU's link address on the way out.
//! - `prerouting_nat`: on the owner, a packet from a link to our link address is DNATed to
//!   127.0.0.1, so a listener bound to 127.0.0.1 gets it.
//! - `input_nat`: ... and its source becomes 127.0.0.1, so the listener sees a local peer.
//!
//! Conntrack on each side undoes both NATs on the replies: the caller sees 127.0.0.1:P answer,
//! the listener sees 127.0.0.1 call. Neither end can tell. A port change touches only one element
//! of `remote_ports`; the rules themselves stay as they are.
//!
//! Interception (partially idempotent rules, §4.1.2). The single-host rule "redirect outbound TCP
//! to the proxy's port" would, on the app's PU, store the original destination in the app PU's
//! conntrack, where a proxy on another PU cannot read it. Instead, with the proxy's port owned by
//! PU Q:
//! 1. on every other PU, `output_route` marks the matching packets and policy routing (`ip rule
//!    fwmark MARK+Q lookup TABLE+Q`, set up with the PU) sends them to Q *unchanged*;
//! 2. on Q, the packet arrives on the link and is routed to local input;
//! 3. on Q, `prerouting_nat` DNATs it to 127.0.0.1:proxy_port. This is the redirect itself, done
//!    where the proxy is, so Q's conntrack holds the original destination and the proxy's
//!    `getsockopt(SO_ORIGINAL_DST)` returns it.
//!
//! Rules 1 and 3 both "move the packet to the proxy's PU": redundant, but without side effects.
//! When the proxy's port moves to another PU, the agents rewrite these rules; while no PU owns it,
//! each PU keeps the plain local redirect, which refuses connections just as a single host would
//! with its sidecar down.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use crate::config::{InterceptConfig, Ipv4Prefix};
use crate::error::Result;
use crate::exec::run_with_input;
use crate::table::TableState;
use crate::topology::{Topology, MARK_BASE};

/// The address plan of the links, never intercepted.
const LINK_NET: &str = "169.254.213.0/24";

/// What the rules of one PU should say, derived from the port table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// Port -> address of its owner PU on the link to it, for ports other PUs own.
    pub remote: BTreeMap<u16, Ipv4Addr>,
    /// For each interception rule, the PU that owns its proxy port.
    pub proxy_owner: Vec<Option<usize>>,
}

impl Desired {
    pub fn from_table(
        topo: &Topology,
        me: usize,
        state: &TableState,
        intercept: &[InterceptConfig],
    ) -> Desired {
        // Peer address per PU, computed once (the table may hold 10,000 ports).
        let peer_addr: Vec<Option<Ipv4Addr>> = (0..topo.pus.len())
            .map(|pu| topo.link_to(me, pu).map(|l| l.peer_addr))
            .collect();
        let remote = state
            .ports
            .iter()
            .filter_map(|(port, owner)| {
                let owner = topo.index(owner)?;
                if owner == me {
                    return None;
                }
                Some((*port, peer_addr[owner]?))
            })
            .collect();
        let proxy_owner = intercept
            .iter()
            .map(|rule| {
                state
                    .ports
                    .get(&rule.proxy_port)
                    .and_then(|o| topo.index(o))
            })
            .collect();
        Desired {
            remote,
            proxy_owner,
        }
    }
}

fn element_list(remote: &BTreeMap<u16, Ipv4Addr>) -> String {
    let mut out = String::new();
    for (i, (port, addr)) in remote.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{port} : {addr}");
    }
    out
}

/// The match part shared by the split interception rules: TCP, not loopback, not the links, not
/// the excluded prefixes, and the listed ports (all if none).
fn intercept_match(rule: &InterceptConfig) -> String {
    let mut m = format!("ip daddr != 127.0.0.0/8 ip daddr != {LINK_NET}");
    for prefix in rule.exclude.iter().filter_map(|c| Ipv4Prefix::parse(c)) {
        let _ = write!(m, " ip daddr != {prefix}");
    }
    m.push_str(" meta l4proto tcp");
    if !rule.ports.is_empty() {
        let ports: Vec<String> = rule.ports.iter().map(u16::to_string).collect();
        let _ = write!(m, " tcp dport {{ {} }}", ports.join(", "));
    }
    m
}

/// The whole table of PU `me`, replacing any previous one atomically (one nft transaction).
pub fn full_script(
    topo: &Topology,
    me: usize,
    intercept: &[InterceptConfig],
    desired: &Desired,
) -> String {
    let table = topo.nft_table();
    let links = topo.links(me);
    let mut output_nat =
        vec!["ip daddr 127.0.0.0/8 dnat to tcp dport map @remote_ports".to_string()];
    let mut postrouting_nat = Vec::new();
    let mut prerouting_nat = Vec::new();
    let mut input_nat = Vec::new();
    let mut output_route = Vec::new();
    for link in &links {
        postrouting_nat.push(format!(
            "oifname \"{}\" ip saddr 127.0.0.0/8 snat to {}",
            link.ifname, link.local_addr
        ));
        prerouting_nat.push(format!(
            "iifname \"{}\" ip daddr {} dnat to 127.0.0.1",
            link.ifname, link.local_addr
        ));
        input_nat.push(format!(
            "iifname \"{}\" ct original ip daddr {} snat to 127.0.0.1",
            link.ifname, link.local_addr
        ));
    }
    for (rule, owner) in intercept.iter().zip(&desired.proxy_owner) {
        let m = intercept_match(rule);
        let port = rule.proxy_port;
        match owner {
            Some(q) if *q == me => {
                // Rules 2+3: traffic from the other PUs, redirected here, where the proxy is.
                for link in &links {
                    prerouting_nat.push(format!(
                        "iifname \"{}\" {m} dnat to 127.0.0.1:{port}",
                        link.ifname
                    ));
                }
                // Apps on the proxy's own PU: the single-host rule, the proxy exempted by uid.
                if let Some(uid) = rule.proxy_uid {
                    output_nat.push(format!("meta skuid != {uid} {m} redirect to :{port}"));
                }
            }
            Some(q) => {
                // Rule 1: route to the proxy's PU, unchanged.
                let mark = MARK_BASE + *q as u32;
                output_route.push(format!("{m} meta mark set {mark:#x}"));
                if let Some(link) = topo.link_to(me, *q) {
                    // The source was picked for the route before the mark; make it this link's.
                    postrouting_nat.push(format!(
                        "oifname \"{}\" meta mark {mark:#x} ip saddr != {} snat to {}",
                        link.ifname, link.local_addr, link.local_addr
                    ));
                }
            }
            None => {
                output_nat.push(format!("{m} redirect to :{port}"));
            }
        }
    }

    let mut s = String::new();
    let _ = writeln!(s, "table ip {table} {{}}");
    let _ = writeln!(s, "delete table ip {table}");
    let _ = writeln!(s, "table ip {table} {{");
    let _ = writeln!(s, "  map remote_ports {{");
    let _ = writeln!(s, "    type inet_service : ipv4_addr");
    if !desired.remote.is_empty() {
        let _ = writeln!(s, "    elements = {{ {} }}", element_list(&desired.remote));
    }
    let _ = writeln!(s, "  }}");
    let chains: [(&str, &str, &str, i32, &Vec<String>); 5] = [
        ("output_route", "route", "output", -150, &output_route),
        ("output_nat", "nat", "output", -100, &output_nat),
        ("prerouting_nat", "nat", "prerouting", -100, &prerouting_nat),
        ("input_nat", "nat", "input", 100, &input_nat),
        (
            "postrouting_nat",
            "nat",
            "postrouting",
            100,
            &postrouting_nat,
        ),
    ];
    for (name, kind, hook, priority, rules) in chains {
        let _ = writeln!(s, "  chain {name} {{");
        let _ = writeln!(
            s,
            "    type {kind} hook {hook} priority {priority}; policy accept;"
        );
        for rule in rules {
            let _ = writeln!(s, "    {rule}");
        }
        let _ = writeln!(s, "  }}");
    }
    let _ = writeln!(s, "}}");
    s
}

/// The element changes that turn `old` into `new` (one nft transaction), or `None` if equal.
pub fn delta_script(
    topo: &Topology,
    old: &BTreeMap<u16, Ipv4Addr>,
    new: &BTreeMap<u16, Ipv4Addr>,
) -> Option<String> {
    let table = topo.nft_table();
    let removed: Vec<u16> = old
        .iter()
        .filter(|(port, addr)| new.get(port) != Some(addr))
        .map(|(port, _)| *port)
        .collect();
    let added: BTreeMap<u16, Ipv4Addr> = new
        .iter()
        .filter(|(port, addr)| old.get(port) != Some(addr))
        .map(|(p, a)| (*p, *a))
        .collect();
    if removed.is_empty() && added.is_empty() {
        return None;
    }
    let mut s = String::new();
    if !removed.is_empty() {
        let ports: Vec<String> = removed.iter().map(u16::to_string).collect();
        let _ = writeln!(
            s,
            "delete element ip {table} remote_ports {{ {} }}",
            ports.join(", ")
        );
    }
    if !added.is_empty() {
        let _ = writeln!(
            s,
            "add element ip {table} remote_ports {{ {} }}",
            element_list(&added)
        );
    }
    Some(s)
}

/// The number of elements in `nft list map ... remote_ports` output (every value is a link
/// address, so count those; the `type ... : ...` line has none).
pub fn count_mapped(listing: &str) -> usize {
    listing.matches(": 169.254.213.").count()
}

/// Applies a script with `nft -f -` in the calling thread's network namespace.
pub fn apply(script: &str) -> Result<()> {
    run_with_input("nft", &["-f", "-"], Some(script)).map(|_| ())
}

/// Removes the table of this split namespace from the calling thread's network namespace.
pub fn remove(topo: &Topology) -> Result<()> {
    let table = topo.nft_table();
    apply(&format!("table ip {table} {{}}\ndelete table ip {table}\n"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn topo() -> Topology {
        Topology {
            namespace: "t".into(),
            pus: vec!["host".into(), "dpu".into()],
            uplink: Some(1),
        }
    }

    fn rule() -> InterceptConfig {
        InterceptConfig {
            proxy_port: 15001,
            ports: vec![80],
            exclude: vec!["10.0.0.0/8".into()],
            proxy_uid: None,
        }
    }

    #[test]
    fn desired_maps_remote_ports_to_the_owner_link() {
        let t = topo();
        let mut state = TableState::empty();
        state.ports.insert(8080, "dpu".into());
        state.ports.insert(9090, "host".into());
        state.ports.insert(15001, "dpu".into());
        let d = Desired::from_table(&t, 0, &state, &[rule()]);
        assert_eq!(d.remote.len(), 2);
        assert_eq!(d.remote[&8080], Ipv4Addr::new(169, 254, 213, 2));
        assert_eq!(d.proxy_owner, vec![Some(1)]);
    }

    #[test]
    fn interception_is_split_by_proxy_owner() {
        let t = topo();
        let d = Desired {
            remote: BTreeMap::new(),
            proxy_owner: vec![Some(1)],
        };
        let app_side = full_script(&t, 0, &[rule()], &d);
        assert!(
            app_side.contains("tcp dport { 80 } meta mark set 0x4d500001"),
            "{app_side}"
        );
        assert!(!app_side.contains("dnat to 127.0.0.1:15001"));
        let proxy_side = full_script(&t, 1, &[rule()], &d);
        assert!(proxy_side.contains("iifname \"pu-host\" ip daddr != 127.0.0.0/8"));
        assert!(proxy_side.contains("ip daddr != 10.0.0.0/8"));
        assert!(
            proxy_side.contains("dnat to 127.0.0.1:15001"),
            "{proxy_side}"
        );
        let nobody = Desired {
            remote: BTreeMap::new(),
            proxy_owner: vec![None],
        };
        assert!(full_script(&t, 0, &[rule()], &nobody).contains("redirect to :15001"));
    }

    #[test]
    fn delta_changes_only_what_moved() {
        let t = topo();
        let a = Ipv4Addr::new(169, 254, 213, 2);
        let old = BTreeMap::from([(1, a), (2, a)]);
        let new = BTreeMap::from([(2, a), (3, a)]);
        let s = delta_script(&t, &old, &new).unwrap();
        assert_eq!(
            s,
            "delete element ip flatmesh-pu-t remote_ports { 1 }\nadd element ip flatmesh-pu-t remote_ports { 3 : 169.254.213.2 }\n"
        );
        assert_eq!(delta_script(&t, &new, &new), None);
        let listing = "table ip x {\n\tmap remote_ports {\n\t\ttype inet_service : ipv4_addr\n\t\telements = { 1 : 169.254.213.2, 3 : 169.254.213.2 }\n\t}\n}\n";
        assert_eq!(count_mapped(listing), 2);
    }
}
