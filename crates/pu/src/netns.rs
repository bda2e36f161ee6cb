//! Entering a named network namespace. `setns(CLONE_NEWNET)` moves only the calling thread, so an
//! agent, a test app or a benchmark thread can each live in its own PU inside one process; the
//! processes such a thread spawns inherit its namespace.

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::path::PathBuf;

use crate::error::{PuError, Result};

pub fn path(netns: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(netns)
}

pub fn exists(netns: &str) -> bool {
    path(netns).exists()
}

/// Opens the namespace handle (kept open across `fork` for `pre_exec`).
pub fn open(netns: &str) -> Result<File> {
    File::open(path(netns)).map_err(|source| PuError::EnterNetns {
        netns: netns.to_string(),
        source,
    })
}

/// Moves the calling thread into `netns`.
pub fn enter(netns: &str) -> Result<()> {
    let file = open(netns)?;
    set(&file).map_err(|source| PuError::EnterNetns {
        netns: netns.to_string(),
        source,
    })
}

/// `setns(fd, CLONE_NEWNET)`; async-signal-safe, so usable between fork and exec.
pub fn set(file: &File) -> std::io::Result<()> {
    // SAFETY: setns takes a valid open descriptor (the File keeps it open) and a flag; it
    // touches no memory of ours.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Identity (device, inode) of a network namespace file, e.g. `/run/netns/NAME` or
/// `/proc/thread-self/ns/net`: two paths name the same namespace iff these are equal.
pub fn id_of(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// Identity of the calling thread's network namespace.
pub fn current_id() -> std::io::Result<(u64, u64)> {
    id_of(std::path::Path::new("/proc/thread-self/ns/net"))
}

/// The cookie of the calling thread's network namespace (SO_NETNS_COOKIE): what eBPF
/// programs see of it (`bpf_get_netns_cookie`).
pub fn cookie() -> std::io::Result<u64> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    cookie_of(std::os::fd::AsFd::as_fd(&socket))
}

/// The cookie of the network namespace socket `socket` belongs to.
pub fn cookie_of(socket: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u64> {
    /// SO_NETNS_COOKIE (Linux 5.14); not in every libc crate version.
    const SO_NETNS_COOKIE: libc::c_int = 71;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `cookie`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Lists the named network namespaces whose name starts with `prefix`.
pub fn list(prefix: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}
