//! Helpers for tests that run real programs with the library preloaded.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// target/<profile>/ (tests run from target/<profile>/deps/).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .to_path_buf()
}

/// Newest modification time of the files an artifact of this crate is built from.
fn newest_source() -> std::time::SystemTime {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("Cargo.toml"), root.join("build.rs")];
    for dir in ["src", "examples"] {
        if let Ok(entries) = std::fs::read_dir(root.join(dir)) {
            files.extend(entries.map_while(Result::ok).map(|e| e.path()));
        }
    }
    files
        .iter()
        .filter_map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
        .max()
        .unwrap_or(std::time::UNIX_EPOCH)
}

/// Fails when `artifact` is older than the crate's sources: `cargo test --test NAME` rebuilds
/// only the test, not the examples it runs, and a stale library or probe makes failures that
/// have nothing to do with the code under test.
fn require_fresh(artifact: &std::path::Path) {
    let built = std::fs::metadata(artifact)
        .and_then(|m| m.modified())
        .unwrap();
    assert!(
        built >= newest_source(),
        "{} is older than the sources of crates/shm: rebuild it with `cargo build --release -p flatmesh-shm --lib --examples` (or run `cargo test --release -p flatmesh-shm` without --test, which builds the examples too)",
        artifact.display()
    );
}

/// The preload library built from this crate, the newer of two copies: `cargo test` builds the
/// one in examples/ (see Cargo.toml); a plain `cargo build` builds libflatmesh_shm.so.
pub fn library() -> PathBuf {
    let dir = profile_dir();
    let newest = [
        dir.join("examples/libflatmesh_shm_preload.so"),
        dir.join("libflatmesh_shm.so"),
    ]
    .into_iter()
    .filter_map(|c| Some((std::fs::metadata(&c).and_then(|m| m.modified()).ok()?, c)))
    .max();
    if let Some((_, candidate)) = newest {
        require_fresh(&candidate);
        return candidate;
    }
    panic!("libflatmesh_shm.so not found next to {}: build it with `cargo build --release -p flatmesh-shm --lib`", dir.display());
}

/// The probe program (crates/shm/examples/shm_probe.rs).
pub fn probe() -> PathBuf {
    let path = profile_dir().join("examples/shm_probe");
    assert!(
        path.exists(),
        "{} not found: build it with `cargo build --release -p flatmesh-shm --examples`",
        path.display()
    );
    require_fresh(&path);
    path
}

/// Fails with the Debian package to install when a program is missing.
pub fn require(program: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false);
    assert!(found, "`{program}` is not installed: install the Debian package `{package}` (apt-get install -y {package}); CI installs it in scripts/setup");
}

pub fn require_root() {
    // SAFETY: geteuid takes no arguments and cannot fail; the declaration below matches its C
    // prototype (`uid_t geteuid(void)`, uid_t being u32 on Linux).
    let euid = unsafe { libc_geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (it writes /dev/shm and may raise fd limits); CI runs as root"
    );
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

/// A command with the library preloaded (or not).
pub fn command(program: impl AsRef<std::ffi::OsStr>, preload: bool) -> Command {
    let mut command = Command::new(program);
    if preload {
        command.env("LD_PRELOAD", library());
    } else {
        command.env_remove("LD_PRELOAD");
    }
    command
}

/// A child process killed on drop, with its stdout lines on a channel.
pub struct Running {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
}

impl Running {
    pub fn spawn(mut command: Command) -> Running {
        command.stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Running { child, lines }
    }

    /// Waits for a line starting with `prefix` and returns it.
    pub fn expect_line(&self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => continue,
                Err(_) => panic!("no line starting with {prefix:?} within {within:?} (a hang?)"),
            }
        }
    }

    /// Waits for the exit status, killing the process if it takes longer than `within`.
    pub fn wait(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!("process did not finish within {within:?} (a hang?)");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every line still to come, up to the end of the output (call after the process exited:
    /// the reader thread may not have passed on its last lines yet; `try_iter` would miss them).
    pub fn remaining_lines(&self, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => return lines,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("the output did not end within {within:?} (a hang?)")
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Running {
    /// SIGTERM first, so that a server with worker processes (nginx's master) stops them too;
    /// SIGKILL if it has not exited within 2 s.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own child, which has not been reaped yet.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(2);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a command to completion with a time limit; returns (success, stdout, stderr).
pub fn run(mut command: Command, within: Duration) -> (bool, String, String) {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).ok();
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).ok();
        s
    });
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} did not finish within {within:?} (a hang?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.success(), out.join().unwrap(), err.join().unwrap())
}

/// Connection regions mapped by a process (arenas not counted): >0 means the library moved a
/// connection.
pub fn shm_mappings(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/dev/shm/flatmesh-shm-") && !l.contains("-arena-"))
        .count()
}

/// Shared-memory mappings of a process and all its descendants.
/// The shared-memory regions `pid` maps, looked at until there are `at_least` or `within` has
/// passed: a server maps a region once it has accepted the connection, and on a loaded machine
/// the client may take a while to start.
pub fn mappings_within(pid: u32, at_least: usize, within: Duration) -> usize {
    let looking = Instant::now();
    loop {
        let mapped = shm_mappings(pid);
        if mapped >= at_least || looking.elapsed() >= within {
            return mapped;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn shm_mappings_tree(pid: u32) -> usize {
    let mut total = shm_mappings(pid);
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    for child in children
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
    {
        total += shm_mappings_tree(child);
    }
    total
}

// Never the same port twice in one test process (two tests of one binary asking at once could
// otherwise be handed the same one): the proxy tests' helper.
#[path = "../../../proxy/tests/common/ports.rs"]
mod ports;
#[allow(unused_imports)] // not every test binary asks for a port
pub use ports::free_port;

/// Waits until something listens on the port (connecting without the library).
pub fn wait_listening(port: u16, within: Duration) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("nothing listens on 127.0.0.1:{port} after {within:?}");
}

/// A fresh path for the library's exit reports (`FLATMESH_SHM_STATS=<path>`).
pub fn stats_path(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "flatmesh-shm-stats-{name}-{}.txt",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&path);
    path
}

/// The counters of every process that wrote an exit report to `path`, keyed by name.
pub fn read_stats(path: &std::path::Path) -> Vec<std::collections::BTreeMap<String, u64>> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("flatmesh-shm pid "))
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().skip(1).collect();
            words
                .chunks(2)
                .filter_map(|pair| Some((pair[0].to_string(), pair.get(1)?.parse().ok()?)))
                .collect()
        })
        .collect()
}

/// Sum of one counter over all reports.
pub fn total(reports: &[std::collections::BTreeMap<String, u64>], key: &str) -> u64 {
    reports
        .iter()
        .map(|r| r.get(key).copied().unwrap_or(0))
        .sum()
}

/// CPU time (user + system, all threads) a process has used, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // After "pid (comm)": state is field 3, utime 14, stime 15 (1-based).
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}
