//! Wimpy cores from ordinary ones: every emulated SmartNIC gets a CPU cgroup with a CFS bandwidth
//! limit, so its microservices get only a fraction of one core (the demo says so in its output).
//!
//! cgroup v2's `cpu.max` is the interface when the v2 hierarchy owns the cpu controller. In a
//! hybrid layout (v2 at /sys/fs/cgroup/unified, as on these machines) the cpu controller usually
//! stays bound to the v1 hierarchy and v2 cannot enable it; then the same CFS bandwidth limit is set
//! through v1's `cpu.cfs_period_us` / `cpu.cfs_quota_us`. Both throttle identically.

use std::path::{Path, PathBuf};

use crate::{LabError, Result};

/// CFS period: short, so a throttled group stalls for a few ms at a time, not 100 ms.
pub const PERIOD_US: u64 = 20_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interface {
    /// cgroup v2 with the cpu controller; `cpu.max` under this root.
    V2(PathBuf),
    /// cgroup v1 cpu controller; `cpu.cfs_quota_us` under this root.
    V1(PathBuf),
}

impl Interface {
    /// Finds a hierarchy that can limit CPU bandwidth.
    pub fn detect() -> Result<Interface> {
        for root in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
            let root = Path::new(root);
            if let Ok(c) = std::fs::read_to_string(root.join("cgroup.controllers")) {
                if c.split_whitespace().any(|x| x == "cpu") {
                    return Ok(Interface::V2(root.to_path_buf()));
                }
            }
        }
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        if v1.join("cpu.cfs_quota_us").exists() {
            return Ok(Interface::V1(v1.to_path_buf()));
        }
        Err(LabError::Demo {
            what: "CPU cgroups".into(),
            message: "no cgroup hierarchy with the cpu controller (looked for cpu in /sys/fs/cgroup[/unified]/cgroup.controllers and for /sys/fs/cgroup/cpu); mount cgroup v2 or the v1 cpu controller".into(),
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Interface::V2(root) => format!("cgroup v2 cpu.max under {}", root.display()),
            Interface::V1(root) => format!(
                "cgroup v1 cpu.cfs_quota_us under {} (cgroup v2 at /sys/fs/cgroup/unified has no cpu controller in this hybrid layout)",
                root.display()
            ),
        }
    }
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|cause| LabError::Write {
        path: path.display().to_string(),
        cause,
    })
}

/// The demo's cgroup directory with one child per throttled node. Dropping it removes them (the
/// processes inside must be gone by then; the demo kills them first).
#[derive(Debug)]
pub struct CpuGroups {
    pub interface: Interface,
    pub dir: PathBuf,
    children: Vec<PathBuf>,
}

impl CpuGroups {
    pub fn create(interface: Interface, name: &str) -> Result<CpuGroups> {
        let root = match &interface {
            Interface::V2(r) | Interface::V1(r) => r.clone(),
        };
        let dir = root.join(name);
        if let Interface::V2(_) = interface {
            // The parent must delegate the cpu controller to its children.
            write(&root.join("cgroup.subtree_control"), "+cpu")?;
        }
        std::fs::create_dir_all(&dir).map_err(|cause| LabError::Write {
            path: dir.display().to_string(),
            cause,
        })?;
        if let Interface::V2(_) = interface {
            write(&dir.join("cgroup.subtree_control"), "+cpu")?;
        }
        Ok(CpuGroups {
            interface,
            dir,
            children: Vec::new(),
        })
    }

    /// Creates `name` limited to `cores` of CPU (0.25 = a quarter of one core). Returns the file a
    /// process writes its pid to in order to join.
    pub fn limit(&mut self, name: &str, cores: f64) -> Result<PathBuf> {
        let dir = self.dir.join(name);
        std::fs::create_dir_all(&dir).map_err(|cause| LabError::Write {
            path: dir.display().to_string(),
            cause,
        })?;
        self.children.push(dir.clone());
        let quota = ((cores * PERIOD_US as f64).round() as u64).max(1_000);
        match &self.interface {
            Interface::V2(_) => write(&dir.join("cpu.max"), &format!("{quota} {PERIOD_US}"))?,
            Interface::V1(_) => {
                write(&dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
        }
        Ok(dir.join("cgroup.procs"))
    }

    /// Times the group was throttled and for how long in total (from `cpu.stat`).
    pub fn throttled(&self, name: &str) -> Option<(u64, f64)> {
        let stat = std::fs::read_to_string(self.dir.join(name).join("cpu.stat")).ok()?;
        let field = |k: &str| {
            stat.lines()
                .find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok())
        };
        let periods = field("nr_throttled ")?;
        let secs = match &self.interface {
            Interface::V2(_) => field("throttled_usec ")? as f64 / 1e6,
            Interface::V1(_) => field("throttled_time ")? as f64 / 1e9,
        };
        Some((periods, secs))
    }

    /// Removes the groups. A group with processes left in it cannot be removed; say which.
    pub fn remove(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        for d in self
            .children
            .drain(..)
            .chain(std::iter::once(self.dir.clone()))
        {
            // A just-killed process may take a moment to leave its group.
            let mut ok = false;
            for _ in 0..50 {
                if !d.exists() || std::fs::remove_dir(&d).is_ok() {
                    ok = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if !ok {
                left.push(d.display().to_string());
            }
        }
        left
    }
}

impl Drop for CpuGroups {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Removes cgroups of demo runs whose process is gone.
pub fn sweep_stale(interface: &Interface) -> Vec<String> {
    let root = match interface {
        Interface::V2(r) | Interface::V1(r) => r,
    };
    let mut swept = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return swept;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("flatmesh-demo-") else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if let Ok(children) = std::fs::read_dir(e.path()) {
            for c in children.flatten() {
                if c.path().is_dir() {
                    let _ = std::fs::remove_dir(c.path());
                }
            }
        }
        if std::fs::remove_dir(e.path()).is_ok() {
            swept.push(e.path().display().to_string());
        }
    }
    swept
}
