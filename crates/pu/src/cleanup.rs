//! Finding and removing what split namespaces left behind: after a clean exit there is nothing,
//! after a crash (`kill -9` of a demo, a test or `pu up` without `pu down`) there are network
//! namespaces `fmpu-*`, cpuset cgroups `flatmesh-pu-*`, port tables with their bind hooks
//! (`/sys/fs/bpf/flatmesh-pu-*`) and state directories. Removing a PU's
//! network namespace removes its veths and its nftables table with it.
//!
//! It also checks the host namespace for a `flatmesh-pu-*` nftables table. None is ever written
//! there; if one is found (by a bug or by hand), it is removed and reported.

use std::path::{Path, PathBuf};

use crate::backend::remove_netns;
use crate::cpuset;
use crate::error::Result;
use crate::exec::run;
use crate::netns;
use crate::topology::{pin_dir, NETNS_PREFIX, PIN_ROOT, RESOURCE_PREFIX};

#[derive(Debug, Default, Clone)]
pub struct CleanupReport {
    pub netns: Vec<String>,
    pub cgroups: Vec<PathBuf>,
    /// Port tables and bind hooks (bpffs directories).
    pub port_tables: Vec<PathBuf>,
    pub state_dirs: Vec<PathBuf>,
    pub host_tables: Vec<String>,
}

impl CleanupReport {
    pub fn is_empty(&self) -> bool {
        self.netns.is_empty()
            && self.cgroups.is_empty()
            && self.port_tables.is_empty()
            && self.state_dirs.is_empty()
            && self.host_tables.is_empty()
    }
}

/// Removes leftovers of split namespace `namespace` (all of them if `None`). Call it from a
/// thread in the host network namespace.
pub fn cleanup(namespace: Option<&str>, state_dir: &Path) -> Result<CleanupReport> {
    let mut report = CleanupReport::default();
    let netns_prefix = match namespace {
        Some(ns) => format!("{NETNS_PREFIX}{ns}-"),
        None => NETNS_PREFIX.to_string(),
    };
    for ns in netns::list(&netns_prefix) {
        remove_netns(&ns)?;
        report.netns.push(ns);
    }
    let cg_prefix = match namespace {
        Some(ns) => format!("{RESOURCE_PREFIX}{ns}-"),
        None => RESOURCE_PREFIX.to_string(),
    };
    for dir in cpuset::list(&cg_prefix) {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        cpuset::remove_cgroup(&dir, &name)?;
        report.cgroups.push(dir);
    }
    for dir in port_tables(namespace) {
        flatmesh_kernel::PuPorts::detach(&dir).map_err(|e| crate::PuError::PortTable {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        report.port_tables.push(dir);
    }
    let state_dirs: Vec<PathBuf> = match namespace {
        Some(ns) => vec![state_dir.join(ns)],
        None => std::fs::read_dir(state_dir)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default(),
    };
    for dir in state_dirs.into_iter().filter(|d| d.is_dir()) {
        std::fs::remove_dir_all(&dir)
            .map_err(|e| crate::PuError::io(format!("cannot remove {}", dir.display()), e))?;
        report.state_dirs.push(dir);
    }
    for table in host_tables()? {
        let matches = match namespace {
            Some(ns) => table == format!("{RESOURCE_PREFIX}{ns}"),
            None => true,
        };
        if matches {
            run("nft", &["delete", "table", "ip", &table])?;
            report.host_tables.push(table);
        }
    }
    Ok(report)
}

/// `flatmesh-pu-*` nftables tables (family ip) in the calling thread's network namespace.
pub fn host_tables() -> Result<Vec<String>> {
    let out = run("nft", &["list", "tables", "ip"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table ip "))
        .filter(|t| t.starts_with(RESOURCE_PREFIX))
        .map(str::to_string)
        .collect())
}

/// What of split namespace `namespace` still exists: network namespaces (their veths and rules
/// live in them), cpuset cgroups, the state directory, a host-namespace table.
/// The bpffs directories of the port tables of `namespace` (of all namespaces if `None`).
fn port_tables(namespace: Option<&str>) -> Vec<PathBuf> {
    match namespace {
        Some(ns) => vec![pin_dir(ns)]
            .into_iter()
            .filter(|d| d.exists())
            .collect(),
        None => std::fs::read_dir(PIN_ROOT)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with(RESOURCE_PREFIX))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default(),
    }
}

pub fn leftovers(namespace: &str, table_dir: &std::path::Path) -> Vec<String> {
    let mut left = netns::list(&format!("{NETNS_PREFIX}{namespace}-"));
    left.extend(
        cpuset::list(&format!("{RESOURCE_PREFIX}{namespace}-"))
            .into_iter()
            .map(|p| p.display().to_string()),
    );
    if table_dir.exists() {
        left.push(table_dir.display().to_string());
    }
    left.extend(
        port_tables(Some(namespace))
            .into_iter()
            .map(|p| p.display().to_string()),
    );
    let table = format!("{RESOURCE_PREFIX}{namespace}");
    left.extend(
        host_tables()
            .unwrap_or_default()
            .into_iter()
            .filter(|t| *t == table)
            .map(|t| format!("host nft table {t}")),
    );
    left
}
