//! Helpers shared by the tier-K integration tests: root check, private pin directories,
//! test cgroups, TCP_INFO counters and a child-process runner.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use flatmesh_kernel::KernelConfig;

/// Fails with a clear message unless running as root (tier K needs it; CI runs as root).
pub fn require_root() {
    // SAFETY: no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "tier-K integration tests need root (eBPF, cgroups): run them as root, e.g. `sudo -E cargo test -p flatmesh-kernel`");
}

/// A config with a pin directory private to this test, nothing enabled yet.
pub fn config(test: &str) -> KernelConfig {
    KernelConfig {
        pin_dir: PathBuf::from(format!("/sys/fs/bpf/fm-test-{test}-{}", std::process::id())),
        capture: None,
        redirect: false,
        l7_dispatch: false,
        ..KernelConfig::default()
    }
}

/// A cgroup v2 directory private to this test, removed on drop.
pub struct TestCgroup {
    pub path: PathBuf,
}

impl TestCgroup {
    pub fn new(test: &str) -> TestCgroup {
        let path = flatmesh_kernel::default_cgroup_root()
            .join(format!("fm-test-{test}-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(&path) {
            panic!("cannot create test cgroup {}: {e}", path.display());
        }
        TestCgroup { path }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Children have exited by now; retry briefly while the kernel reaps them.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// (bytes_acked, bytes_received) from TCP_INFO: what really crossed the TCP stack.
pub fn tcp_bytes(s: &TcpStream) -> (u64, u64) {
    let mut buf = [0u8; 256];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buffer and length describe `buf`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    assert_eq!(
        rc,
        0,
        "getsockopt(TCP_INFO): {}",
        std::io::Error::last_os_error()
    );
    assert!(
        len >= 136,
        "TCP_INFO too short ({len} bytes) for tcpi_bytes_received"
    );
    let acked = u64::from_ne_bytes(buf[120..128].try_into().unwrap_or_default());
    let received = u64::from_ne_bytes(buf[128..136].try_into().unwrap_or_default());
    (acked, received)
}

pub fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    let port = l
        .local_addr()
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("local_addr: {e}"));
    (l, port)
}

/// Reads exactly `n` bytes or fails after the deadline.
pub fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut out = vec![0u8; n];
    if let Err(e) = s.read_exact(&mut out) {
        panic!("reading {n} bytes: {e}");
    }
    out
}

pub fn write_all(s: &mut TcpStream, b: &[u8]) {
    if let Err(e) = s.write_all(b) {
        panic!("writing {} bytes: {e}", b.len());
    }
}

/// Polls `f` until it returns Some or two seconds pass.
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs this test binary again as a child executing only the test `name` (a helper that
/// acts on the environment variables in `env`).
pub fn child(name: &str, env: &[(&str, String)]) -> std::process::Child {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let mut cmd = std::process::Command::new(exe);
    cmd.args([
        name,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ])
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn()
        .unwrap_or_else(|e| panic!("spawning child: {e}"))
}

/// Reads the child's stdout until a line containing `prefix`; returns what follows it.
pub fn child_line(out: &mut impl std::io::BufRead, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        match out.read_line(&mut line) {
            Ok(0) => panic!("child exited before printing `{prefix}`"),
            Ok(_) => {
                // libtest may have printed "test name ... " on the same line first.
                if let Some(at) = line.find(prefix) {
                    return line[at + prefix.len()..].trim_end().to_string();
                }
            }
            Err(e) => panic!("reading child output: {e}"),
        }
    }
}
