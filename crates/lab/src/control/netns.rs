//! The demo's network: one Linux bridge in the root namespace (the rack's ToR switch) and one
//! network namespace per compute node, each joined to the bridge by a veth pair. The controller
//! and the load generator stay in the root namespace and reach every node over the bridge.
//!
//! Every name carries the demo's tag (`fmd<pid>`), so parallel runs do not collide and a run that
//! was killed can be recognised and swept by the next one.

use std::net::Ipv4Addr;
use std::process::Command;

use crate::{LabError, Result};

/// Runs `ip ARGS`, turning a failure into an error that shows the command and its stderr.
pub fn ip(args: &[&str]) -> Result<String> {
    run("ip", args)
}

pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| LabError::Demo {
            what: format!("{program} {}", args.join(" ")),
            message: format!("cannot run it: {e}; install iproute2 and run as root"),
        })?;
    if !out.status.success() {
        return Err(LabError::Demo {
            what: format!("{program} {}", args.join(" ")),
            message: format!(
                "{}; the demo needs root (CAP_NET_ADMIN)",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The bridge and the node namespaces of one demo run. Dropping it removes them all.
#[derive(Debug)]
pub struct Fabric {
    pub tag: String,
    pub bridge: String,
    /// The first three octets of the /24 the demo uses.
    pub prefix: [u8; 3],
    pub namespaces: Vec<String>,
}

impl Fabric {
    /// The bridge's (the controller's) address.
    pub fn gateway_ip(&self) -> Ipv4Addr {
        let [a, b, c] = self.prefix;
        Ipv4Addr::new(a, b, c, 1)
    }

    pub fn node_ip(&self, k: usize) -> Ipv4Addr {
        let [a, b, c] = self.prefix;
        Ipv4Addr::new(a, b, c, 10 + k as u8)
    }

    /// Creates the bridge on the first free 10.213.x.0/24.
    pub fn create(tag: &str) -> Result<Fabric> {
        let routes = ip(&["-4", "route", "show"])?;
        let start = std::process::id() as usize % 200;
        let third = (0..200)
            .map(|k| ((start + k) % 200 + 20) as u8)
            .find(|x| !routes.contains(&format!("10.213.{x}.")))
            .ok_or_else(|| LabError::Demo {
                what: "demo network".into(),
                message: "every 10.213.x.0/24 is in use; remove stale demo bridges (`ip link show type bridge`)".into(),
            })?;
        let fabric = Fabric {
            tag: tag.to_string(),
            bridge: format!("{tag}br"),
            prefix: [10, 213, third],
            namespaces: Vec::new(),
        };
        ip(&["link", "add", &fabric.bridge, "type", "bridge"])?;
        let cidr = format!("{}/24", fabric.gateway_ip());
        ip(&["addr", "add", &cidr, "dev", &fabric.bridge])?;
        ip(&["link", "set", &fabric.bridge, "up"])?;
        Ok(fabric)
    }

    /// Adds node `k`: a namespace with `eth0` on the bridge and loopback up. Returns its name.
    pub fn add_node(&mut self, k: usize) -> Result<String> {
        let ns = format!("{}-n{k}", self.tag);
        ip(&["netns", "add", &ns])?;
        self.namespaces.push(ns.clone());
        let veth = format!("{}v{k}", self.tag);
        ip(&[
            "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ])?;
        ip(&["link", "set", &veth, "master", &self.bridge])?;
        ip(&["link", "set", &veth, "up"])?;
        let cidr = format!("{}/24", self.node_ip(k));
        ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Kills what still runs in the namespaces, deletes them and the bridge. Idempotent.
    pub fn teardown(&mut self) {
        for ns in self.namespaces.drain(..) {
            kill_namespace(&ns);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// SIGKILLs every process in `ns` and deletes it (veths inside go with it).
pub fn kill_namespace(ns: &str) {
    if let Ok(pids) = ip(&["netns", "pids", ns]) {
        for pid in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: kill(2) with a pid read from the kernel and a constant signal has no memory
            // effects; at worst the process is already gone (ESRCH).
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    let _ = ip(&["netns", "del", ns]);
}

/// Removes namespaces and bridges left by demo runs whose process no longer exists (a run killed
/// with SIGKILL cannot clean up after itself).
pub fn sweep_stale() -> Vec<String> {
    let alive = |tag: &str| {
        tag.strip_prefix("fmd")
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
    };
    let mut swept = Vec::new();
    if let Ok(list) = ip(&["netns", "list"]) {
        for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if let Some((tag, _)) = ns.split_once('-') {
                if tag.starts_with("fmd") && !alive(tag) {
                    kill_namespace(ns);
                    swept.push(ns.to_string());
                }
            }
        }
    }
    if let Ok(links) = ip(&["-o", "link", "show", "type", "bridge"]) {
        for name in links.lines().filter_map(|l| l.split(": ").nth(1)) {
            if let Some(tag) = name.strip_suffix("br") {
                if tag.starts_with("fmd") && !alive(tag) {
                    let _ = ip(&["link", "del", name]);
                    swept.push(name.to_string());
                }
            }
        }
    }
    swept
}
