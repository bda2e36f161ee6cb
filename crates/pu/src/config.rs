//! The split-namespace config file: which PUs share one network namespace, their CPUs, and the
//! sidecar-style interception rules to split across them.
//!
//! ```yaml
//! namespace: pod1          # [a-z0-9], 1 to 12 characters
//! pus:
//!   - { name: host, cpus: "0" }
//!   - { name: dpu,  cpus: "1" }
//! uplink: dpu              # optional: the PU that holds the pod's way out; the others route via it
//! intercept:               # optional: "redirect outbound TCP to the proxy's port"
//!   - { proxy_port: 15001, ports: [80, 443], exclude: [10.0.0.0/8] }
//! ```

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{PuError, Result};

/// Most PUs a split namespace can have: the link address plan (one /30 per pair of PUs inside
/// 169.254.213.0/24) has room for 64 links, and 8 PUs need 28.
pub const MAX_PUS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitConfig {
    /// Name of the split namespace; prefixes every resource the PUs create.
    pub namespace: String,
    /// Where the global port table lives (a directory shared by all agents of this host).
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// How often an agent looks for new or closed listening sockets, in milliseconds.
    #[serde(default = "default_poll_ms")]
    pub poll_interval_ms: u64,
    pub pus: Vec<PuConfig>,
    #[serde(default)]
    pub uplink: Option<String>,
    #[serde(default)]
    pub intercept: Vec<InterceptConfig>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PuConfig {
    pub name: String,
    /// A cpuset list such as `0`, `0-3` or `0,2`; default: all CPUs.
    #[serde(default)]
    pub cpus: Option<String>,
}

/// One sidecar-style interception rule as it would be written for a single host:
/// "redirect outbound TCP to `ports` (all ports if empty), except to `exclude`, to `proxy_port`".
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterceptConfig {
    pub proxy_port: u16,
    #[serde(default)]
    pub ports: Vec<u16>,
    #[serde(default)]
    pub exclude: Vec<String>,
    /// The proxy's user id. If set, apps on the proxy's own PU are intercepted too, with the
    /// proxy's own connections exempted by owner (as Istio does with uid 1337).
    #[serde(default)]
    pub proxy_uid: Option<u32>,
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/run/flatmesh/pu")
}

fn default_poll_ms() -> u64 {
    50
}

/// An IPv4 prefix such as `10.0.0.0/8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Prefix {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl std::fmt::Display for Ipv4Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl Ipv4Prefix {
    pub fn parse(text: &str) -> Option<Ipv4Prefix> {
        let (addr, len) = match text.split_once('/') {
            Some((a, l)) => (a, l.parse::<u8>().ok()?),
            None => (text, 32),
        };
        let addr: Ipv4Addr = addr.parse().ok()?;
        if len > 32 {
            return None;
        }
        // nft refuses a prefix with host bits set; keep the network address only.
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        Some(Ipv4Prefix {
            addr: Ipv4Addr::from(u32::from(addr) & mask),
            len,
        })
    }
}

impl SplitConfig {
    pub fn load(path: &Path) -> Result<SplitConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| PuError::ReadFile {
            path: path.to_path_buf(),
            source,
        })?;
        SplitConfig::parse(&text, &path.display().to_string())
    }

    /// Parses and validates; `origin` names the text in error messages.
    pub fn parse(text: &str, origin: &str) -> Result<SplitConfig> {
        let err = |message: String| PuError::Config {
            path: origin.to_string(),
            message,
        };
        let config: SplitConfig = serde_norway::from_str(text).map_err(|e| err(e.to_string()))?;
        let problems = config.problems();
        if !problems.is_empty() {
            return Err(err(problems.join("; ")));
        }
        Ok(config)
    }

    /// Every problem in the config, each with what to do about it.
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(p) = name_problem(&self.namespace, 12) {
            out.push(format!("namespace `{}`: {p}", self.namespace));
        } else if self.namespace.contains('-') {
            // Resource names are `fmpu-<ns>-<pu>`; a `-` in <ns> would make them ambiguous.
            out.push(format!(
                "namespace `{}`: use only a-z and 0-9 (no `-`)",
                self.namespace
            ));
        }
        if !(1..=10_000).contains(&self.poll_interval_ms) {
            out.push(format!(
                "poll_interval_ms is {}; use 1 to 10000",
                self.poll_interval_ms
            ));
        }
        if self.pus.len() < 2 || self.pus.len() > MAX_PUS {
            out.push(format!(
                "{} PUs listed; a split namespace needs 2 to {MAX_PUS}",
                self.pus.len()
            ));
        }
        for (i, pu) in self.pus.iter().enumerate() {
            // The link toward a PU is named `pu-<name>` and interface names stop at 15 bytes.
            if let Some(p) = name_problem(&pu.name, 12) {
                out.push(format!("PU `{}`: {p}", pu.name));
            }
            if self.pus[..i].iter().any(|other| other.name == pu.name) {
                out.push(format!(
                    "PU `{}` is listed twice; PU names must be unique",
                    pu.name
                ));
            }
            if let Some(cpus) = &pu.cpus {
                if parse_cpu_list(cpus).is_none() {
                    out.push(format!(
                        "PU `{}`: cpus `{cpus}` is not a CPU list; write e.g. \"0\", \"0-3\" or \"0,2\"",
                        pu.name
                    ));
                }
            }
        }
        if let Some(uplink) = &self.uplink {
            if !self.pus.iter().any(|pu| &pu.name == uplink) {
                out.push(format!(
                    "uplink `{uplink}` is not one of the PUs ({})",
                    self.pu_names().join(", ")
                ));
            }
        }
        for (i, rule) in self.intercept.iter().enumerate() {
            if rule.proxy_port == 0 {
                out.push(format!("intercept[{i}]: proxy_port must be 1 to 65535"));
            }
            if rule.ports.contains(&0) {
                out.push(format!(
                    "intercept[{i}]: port 0 cannot be intercepted; remove it"
                ));
            }
            for cidr in &rule.exclude {
                if Ipv4Prefix::parse(cidr).is_none() {
                    out.push(format!(
                        "intercept[{i}]: exclude `{cidr}` is not an IPv4 prefix; write e.g. 10.0.0.0/8"
                    ));
                }
            }
        }
        out
    }

    pub fn pu_names(&self) -> Vec<&str> {
        self.pus.iter().map(|p| p.name.as_str()).collect()
    }

    pub fn pu_index(&self, name: &str) -> Option<usize> {
        self.pus.iter().position(|p| p.name == name)
    }

    /// Where this namespace's port table and lock live.
    pub fn table_dir(&self) -> PathBuf {
        self.state_dir.join(&self.namespace)
    }
}

fn name_problem(name: &str, max: usize) -> Option<String> {
    if name.is_empty() || name.len() > max {
        return Some(format!("use 1 to {max} characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Some("use only a-z, 0-9 and -".to_string());
    }
    None
}

/// Parses a cpuset list (`0-3,6`) into CPU numbers; `None` if it is not one.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<usize>().ok()?, hi.parse::<usize>().ok()?),
            None => {
                let cpu = part.parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        // 4096 is the kernel's largest NR_CPUS; it also bounds the work here.
        if lo > hi || hi >= 4096 {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    if cpus.is_empty() {
        None
    } else {
        Some(cpus)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const GOOD: &str = "namespace: pod1\npus:\n  - { name: host, cpus: \"0\" }\n  - { name: dpu, cpus: \"1\" }\nuplink: dpu\nintercept:\n  - { proxy_port: 15001, ports: [80], exclude: [10.1.2.3/8] }\n";

    #[test]
    fn parses_a_good_config() {
        let c = SplitConfig::parse(GOOD, "t.yaml").unwrap();
        assert_eq!(c.pu_names(), vec!["host", "dpu"]);
        assert_eq!(c.poll_interval_ms, 50);
        assert_eq!(c.intercept[0].proxy_port, 15001);
        assert_eq!(
            Ipv4Prefix::parse(&c.intercept[0].exclude[0])
                .unwrap()
                .to_string(),
            "10.0.0.0/8"
        );
    }

    #[test]
    fn reports_every_problem_with_a_hint() {
        let text = "namespace: Pod_1\npus:\n  - { name: a, cpus: \"3-1\" }\n  - { name: a }\nuplink: b\nintercept:\n  - { proxy_port: 0, exclude: [nope] }\n";
        let e = SplitConfig::parse(text, "t.yaml").unwrap_err().to_string();
        for needle in [
            "t.yaml",
            "namespace `Pod_1`",
            "not a CPU list",
            "listed twice",
            "uplink `b`",
            "proxy_port",
            "exclude `nope`",
        ] {
            assert!(e.contains(needle), "missing {needle:?} in {e}");
        }
    }

    #[test]
    fn unknown_keys_are_errors() {
        let e = SplitConfig::parse("namespace: a\npus: []\nfoo: 1\n", "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("foo"), "{e}");
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-2,5"), Some(vec![0, 1, 2, 5]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("2-1"), None);
        assert_eq!(parse_cpu_list("99999"), None);
    }
}
