//! Who this process is, and whether another one still lives.
//!
//! Locks and records in shared memory name their holder by pid, so that a survivor can tell a
//! holder that is merely slow from one that crashed. Pids are only comparable inside one pid
//! namespace; callers check [`pid_namespace`] before they trust [`alive`] to say "dead".

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

static PID: AtomicU32 = AtomicU32::new(0);
static PID_NAMESPACE: AtomicU64 = AtomicU64::new(0);

/// This process's pid, without a system call after the first (glibc no longer caches it).
pub fn pid() -> u32 {
    let cached = PID.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    PID.store(pid, Ordering::Relaxed);
    pid
}

/// In a forked child: the cached pid is the parent's.
pub fn after_fork_in_child() {
    PID.store(0, Ordering::Relaxed);
}

/// The inode of this process's pid namespace (1 if it cannot be read).
pub fn pid_namespace() -> u64 {
    namespace_id("pid", &PID_NAMESPACE)
}

/// The inode of this process's namespace of `kind` (`/proc/self/ns/<kind>`), read once into
/// `cache`; 1 if it cannot be read.
pub fn namespace_id(kind: &str, cache: &AtomicU64) -> u64 {
    let cached = cache.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    let id = std::fs::metadata(format!("/proc/self/ns/{kind}"))
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(1);
    cache.store(id, Ordering::Relaxed);
    id
}

/// Whether a process with this pid exists and has not exited (a zombie, which only waits for
/// its parent to reap it, counts as dead). Never "dead" for pid 0 (unknown).
pub fn alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return true;
    }
    let saved = crate::real::errno();
    // SAFETY: kill with signal 0 delivers nothing: it only checks existence and permission,
    // and takes no pointer (pid is in 1..=i32::MAX, so never a group or "every process").
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    let exists = rc == 0 || crate::real::errno() == libc::EPERM;
    crate::real::set_errno(saved);
    exists && !zombie(pid)
}

/// The process's state in /proc is Z (zombie) or X (dead).
fn zombie(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": comm may contain spaces and parentheses; the state follows the last ')'.
    matches!(
        stat.rsplit(')')
            .next()
            .and_then(|rest| rest.trim_start().chars().next()),
        Some('Z' | 'X')
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_pid_is_alive_and_cached() {
        assert_eq!(pid(), std::process::id());
        assert!(alive(pid()));
        assert!(alive(0), "pid 0 means unknown, never dead");
        assert_ne!(pid_namespace(), 0);
    }

    #[test]
    fn a_zombie_is_dead() {
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !zombie(pid) {
            assert!(std::time::Instant::now() < deadline, "child never exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!alive(pid), "an unreaped child that exited is not alive");
        drop(child);
    }

    #[test]
    fn a_reaped_child_is_dead() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!alive(pid));
    }
}
