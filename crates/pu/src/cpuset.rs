//! A PU's CPUs. The emulated PU gets its own cpuset cgroup, so that everything started in it
//! (agent, apps, proxy) runs only on that PU's cores, as it would on a DPU's ARM cores.
//!
//! Which hierarchy has the cpuset controller differs between machines: a pure cgroup v2 host has
//! it at /sys/fs/cgroup, a hybrid host (like these) keeps v2 at /sys/fs/cgroup/unified with no
//! controllers and cpuset on v1 at /sys/fs/cgroup/cpuset. We use whichever offers it, and fall back
//! to plain CPU affinity when none does.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::config::parse_cpu_list;
use crate::error::{PuError, Result};

/// Where a PU's cpuset lives, if a cpuset hierarchy exists.
#[derive(Debug, Clone)]
pub struct Cpuset {
    pub pu: String,
    pub dir: Option<PathBuf>,
    v1: bool,
    pub cpus: Option<Vec<usize>>,
}

/// The root of the hierarchy that has the cpuset controller, and whether it is v1.
fn hierarchy() -> Option<(PathBuf, bool)> {
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let controllers = std::fs::read_to_string(Path::new(root).join("cgroup.subtree_control"))
            .unwrap_or_default();
        if controllers.split_whitespace().any(|c| c == "cpuset") {
            return Some((PathBuf::from(root), false));
        }
    }
    let v1 = PathBuf::from("/sys/fs/cgroup/cpuset");
    if v1.join("cpuset.cpus").exists() {
        return Some((v1, true));
    }
    None
}

fn write(path: &Path, value: &str, pu: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|e| PuError::Cpuset {
        pu: pu.to_string(),
        message: format!("cannot write `{value}` to {}: {e}", path.display()),
    })
}

impl Cpuset {
    /// The cpuset of cgroup `name` (not created).
    pub fn new(pu: &str, name: &str, cpus: Option<&str>) -> Cpuset {
        let hierarchy = hierarchy();
        Cpuset {
            pu: pu.to_string(),
            dir: hierarchy.as_ref().map(|(root, _)| root.join(name)),
            v1: hierarchy.is_some_and(|(_, v1)| v1),
            cpus: cpus.and_then(parse_cpu_list),
        }
    }

    /// Creates the cgroup and gives it the PU's CPUs (and the parent's memory nodes).
    pub fn create(&self, cpus_text: Option<&str>) -> Result<()> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        if !dir.exists() {
            std::fs::create_dir(dir).map_err(|e| PuError::Cpuset {
                pu: self.pu.clone(),
                message: format!("cannot create {}: {e}", dir.display()),
            })?;
        }
        let parent = dir.parent().unwrap_or(Path::new("/"));
        let read_parent = |file: &str| {
            std::fs::read_to_string(parent.join(file))
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        let cpus = match cpus_text {
            Some(c) => c.to_string(),
            None => read_parent(if self.v1 {
                "cpuset.cpus"
            } else {
                "cpuset.cpus.effective"
            }),
        };
        write(&dir.join("cpuset.cpus"), &cpus, &self.pu).map_err(|e| PuError::Cpuset {
            pu: self.pu.clone(),
            message: format!("{e}; is CPU list `{cpus}` within this machine's CPUs?"),
        })?;
        let mems = read_parent(if self.v1 {
            "cpuset.mems"
        } else {
            "cpuset.mems.effective"
        });
        if !mems.is_empty() {
            write(&dir.join("cpuset.mems"), &mems, &self.pu)?;
        }
        Ok(())
    }

    /// Opens the file through which a process moves itself in (write "0" to it, e.g. between
    /// fork and exec). `None` when there is no cpuset hierarchy.
    pub fn procs_file(&self) -> Result<Option<File>> {
        let Some(dir) = &self.dir else {
            return Ok(None);
        };
        let path = dir.join("cgroup.procs");
        OpenOptions::new()
            .write(true)
            .open(&path)
            .map(Some)
            .map_err(|e| PuError::Cpuset {
                pu: self.pu.clone(),
                message: format!(
                    "cannot open {}: {e}; run `flatmesh pu up` first",
                    path.display()
                ),
            })
    }

    /// Moves the calling thread onto the PU's CPUs: into the v1 cpuset (v1 moves single threads
    /// through `tasks`), and in any case by CPU affinity.
    pub fn enter_thread(&self) -> Result<()> {
        if let (Some(dir), true) = (&self.dir, self.v1) {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            write(&dir.join("tasks"), &tid.to_string(), &self.pu)?;
        }
        if let Some(cpus) = &self.cpus {
            set_affinity(cpus).map_err(|e| PuError::Cpuset {
                pu: self.pu.clone(),
                message: format!("cannot pin to CPUs {cpus:?}: {e}"),
            })?;
        }
        Ok(())
    }

    /// Process ids still in the cgroup.
    pub fn pids(&self) -> Vec<i32> {
        let Some(dir) = &self.dir else {
            return Vec::new();
        };
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Removes the cgroup. Processes still in it were started in the PU by us; they are stopped.
    pub fn destroy(&self) -> Result<()> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        remove_cgroup(dir, &self.pu)
    }
}

/// Stops what is left in a cgroup directory and removes it.
pub fn remove_cgroup(dir: &Path, pu: &str) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let own = std::process::id() as i32;
    for _ in 0..50 {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<i32> = procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        // Our own threads may sit in the cpuset (tests, demo); move them back to the root.
        let tasks = std::fs::read_to_string(dir.join("tasks")).unwrap_or_default();
        let root_tasks = dir.parent().map(|p| p.join("tasks"));
        for tid in tasks.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            if std::path::Path::new(&format!("/proc/{own}/task/{tid}")).exists() {
                if let Some(root) = &root_tasks {
                    let _ = std::fs::write(root, tid.to_string());
                }
            }
        }
        let others: Vec<i32> = pids.into_iter().filter(|&p| p != own).collect();
        if others.is_empty() && std::fs::remove_dir(dir).is_ok() {
            return Ok(());
        }
        for pid in others {
            // SAFETY: kill with a pid read from the cgroup and a valid signal number.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::fs::remove_dir(dir).map_err(|e| PuError::Cpuset {
        pu: pu.to_string(),
        message: format!(
            "cannot remove {}: {e}; some process is still in it (cat {}/cgroup.procs)",
            dir.display(),
            dir.display()
        ),
    })
}

/// `sched_setaffinity` for the calling thread.
pub fn set_affinity(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET only write inside it, and CPU_SET ignores
    // numbers beyond its size (parse_cpu_list bounds them anyway).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Writes "0" (= "me") into a `cgroup.procs` file. Async-signal-safe, for use in `pre_exec`.
pub fn join_self(procs: &mut File) -> std::io::Result<()> {
    procs.write_all(b"0")
}

/// Lists cgroups whose name starts with `prefix` in the cpuset hierarchy.
pub fn list(prefix: &str) -> Vec<PathBuf> {
    let Some((root, _)) = hierarchy() else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir(&root) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = dir
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}
