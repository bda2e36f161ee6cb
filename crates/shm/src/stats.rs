//! Process-wide counters of the slow events: system calls on the data path (wake-ups, sleeps,
//! kernel checks) and record traffic. Nothing is counted per message, so the counters cost
//! nothing on a busy connection; they prove that it makes no system call per message.
//!
//! Read them with `FLATMESH_SHM_STATS=1` (one report on stderr at exit) or, from a program
//! that has the library loaded, through the exported `flatmesh_shm_stats` function.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Counters {
    /// Connections whose data path moved to shared memory (connect or accept side).
    pub accelerated: AtomicU64,
    /// Wake-up bytes sent to a sleeping peer.
    pub wakeups_sent: AtomicU64,
    /// Signals sent to a sleeping peer thread (`FLATMESH_SHM_NOTIFY=async`).
    pub wake_signals: AtomicU64,
    /// Sleeps ended by the peer's fault on a protected page (`FLATMESH_SHM_NOTIFY=norw`).
    pub wake_faults: AtomicU64,
    /// Times a waiter went to sleep in the kernel (poll/epoll/futex) after polling.
    pub sleeps: AtomicU64,
    /// Non-blocking looks at the kernel socket for wake-ups, EOF or reset.
    pub kernel_checks: AtomicU64,
    pub records_allocated: AtomicU64,
    pub records_committed: AtomicU64,
    pub records_freed: AtomicU64,
    pub refused_limit: AtomicU64,
    pub refused_exhausted: AtomicU64,
    pub commits_rejected: AtomicU64,
    /// Accepted connections that found a rendezvous region made for another connection (the
    /// kernel named another connector socket): they stayed TCP.
    pub unproven: AtomicU64,
}

static COUNTERS: Counters = Counters {
    accelerated: AtomicU64::new(0),
    wakeups_sent: AtomicU64::new(0),
    wake_signals: AtomicU64::new(0),
    wake_faults: AtomicU64::new(0),
    sleeps: AtomicU64::new(0),
    kernel_checks: AtomicU64::new(0),
    records_allocated: AtomicU64::new(0),
    records_committed: AtomicU64::new(0),
    records_freed: AtomicU64::new(0),
    refused_limit: AtomicU64::new(0),
    refused_exhausted: AtomicU64::new(0),
    commits_rejected: AtomicU64::new(0),
    unproven: AtomicU64::new(0),
};

pub fn get() -> &'static Counters {
    &COUNTERS
}

pub fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The report: one `key value` line of counters, then one line per mapped arena.
pub fn report() -> String {
    let c = get();
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let mut out = format!(
        "flatmesh-shm pid {} accelerated {} wakeups_sent {} wake_signals {} wake_faults {} sleeps {} kernel_checks {} records_allocated {} records_committed {} records_freed {} records_held {} refused_limit {} refused_exhausted {} commits_rejected {} unproven {}\n",
        crate::process::pid(),
        load(&c.accelerated),
        load(&c.wakeups_sent),
        load(&c.wake_signals),
        load(&c.wake_faults),
        load(&c.sleeps),
        load(&c.kernel_checks),
        load(&c.records_allocated),
        load(&c.records_committed),
        load(&c.records_freed),
        crate::arena::process_usage(),
        load(&c.refused_limit),
        load(&c.refused_exhausted),
        load(&c.commits_rejected),
        load(&c.unproven),
    );
    out.push_str(&crate::arena::report());
    out
}

/// Copies the report into `buffer` (NUL-terminated, truncated to fit). Returns the report's
/// full length, like snprintf.
///
/// # Safety
/// `buffer` must be valid for `len` bytes (or null with `len` 0).
#[cfg(not(test))]
#[no_mangle]
pub unsafe extern "C" fn flatmesh_shm_stats(buffer: *mut libc::c_char, len: usize) -> isize {
    // SAFETY: this function's own contract, passed on.
    unsafe { copy_out(&report(), buffer, len) }
}

/// # Safety
/// As [`flatmesh_shm_stats`]: `buffer` is valid for writes of `len` bytes, or null.
unsafe fn copy_out(text: &str, buffer: *mut libc::c_char, len: usize) -> isize {
    if !buffer.is_null() && len > 0 {
        let take = text.len().min(len - 1);
        // SAFETY: `buffer` is valid for `len` bytes (the contract), and `take + 1 <= len`
        // bytes are written: `take` of text, then the NUL at offset `take`. A String never
        // overlaps the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), take);
            *buffer.add(take) = 0;
        }
    }
    text.len() as isize
}

/// Every arena of this user (mapped for the occasion) with its usage and the processes that
/// hold records: what `flatmesh shm status` prints.
///
/// # Safety
/// As [`flatmesh_shm_stats`].
#[cfg(not(test))]
#[no_mangle]
pub unsafe extern "C" fn flatmesh_shm_status(buffer: *mut libc::c_char, len: usize) -> isize {
    // SAFETY: this function's own contract, passed on.
    unsafe { copy_out(&status(), buffer, len) }
}

/// Arenas, then the connection region files still in /dev/shm. A connector's file lives only
/// until the peer accepts (it is unlinked then); files that stay belong to connections never
/// accepted, or to connectors that crashed before the accept.
#[cfg(not(test))]
fn status() -> String {
    let mut out = crate::arena::status();
    let (mut files, mut bytes) = (0u64, 0u64);
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("flatmesh-shm-") && !name.starts_with("flatmesh-shm-arena-") {
                files += 1;
                bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
    }
    out.push_str(&format!(
        "pending connection regions {files} ({} KiB) in /dev/shm (unlinked once accepted)\n",
        bytes / 1024
    ));
    out
}

/// The problems with the `FLATMESH_SHM_*` environment variables, one per line (empty: none).
/// `flatmesh shm run` calls it before starting a program.
///
/// # Safety
/// As [`flatmesh_shm_stats`].
#[cfg(not(test))]
#[no_mangle]
pub unsafe extern "C" fn flatmesh_shm_check_env(buffer: *mut libc::c_char, len: usize) -> isize {
    let mut text = crate::settings::problems().join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    // SAFETY: this function's own contract, passed on.
    unsafe { copy_out(&text, buffer, len) }
}

/// At exit with `FLATMESH_SHM_STATS=1`.
pub fn print_at_exit() {
    let Some(target) = crate::settings::stats_target() else {
        return;
    };
    let text = report();
    // SAFETY: SYS_write reads `text.len()` bytes of a live String (the raw system call, as
    // `write` is interposed); `path` is a CString, so NUL-terminated; the fd `open` returns is
    // ours and is closed here once.
    unsafe {
        match target {
            None => {
                libc::syscall(libc::SYS_write, 2, text.as_ptr(), text.len());
            }
            Some(path) => {
                let fd = libc::open(
                    path.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                    0o600,
                );
                if fd >= 0 {
                    // One write with O_APPEND: reports of concurrent processes do not interleave.
                    libc::syscall(libc::SYS_write, fd, text.as_ptr(), text.len());
                    crate::real::close(fd);
                }
            }
        }
    }
}
