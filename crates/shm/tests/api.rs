//! The intercepted libc surface, from C: `tests/c/api_client.c` is compiled here with
//! `-O2 -D_FORTIFY_SOURCE=2` (so `read`, `recv`, `recvfrom` and `poll` become `__read_chk`,
//! `__recv_chk`, `__recvfrom_chk` and `__poll_chk`) and runs preloaded against the probe's echo
//! server: read/write, send/recv, sendto/recvfrom, readv/writev, sendmsg/recvmsg, MSG_PEEK,
//! MSG_WAITALL, MSG_DONTWAIT, FIONREAD, FIONBIO, O_NONBLOCK, poll/select/epoll over a socket
//! and a pipe (epoll through a dup of its fd), dup/dup2/dup3/F_DUPFD, fork, getsockopt,
//! getpeername, half-close.
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// Compiles the C client into the target directory.
fn build_client() -> PathBuf {
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/api_client.c");
    let output = std::env::temp_dir().join(format!("fm-shm-api-client-{}", std::process::id()));
    require("cc", "gcc");
    let status = Command::new("cc")
        .args(["-O2", "-D_FORTIFY_SOURCE=2", "-Wall", "-Werror", "-o"])
        .arg(&output)
        .arg(&source)
        .status()
        .expect("cannot run cc");
    assert!(status.success(), "cc failed on {}", source.display());
    output
}

/// The symbols the binary imports (to prove it really calls the FORTIFY variants).
fn imports(binary: &PathBuf) -> String {
    require("nm", "binutils");
    let output = Command::new("nm").arg("-D").arg(binary).output().unwrap();
    assert!(output.status.success());
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn c_program_uses_every_intercepted_call_correctly() {
    require_root();
    let client = build_client();
    let symbols = imports(&client);
    for name in ["__read_chk", "__recv_chk", "__recvfrom_chk", "__poll_chk"] {
        assert!(
            symbols.contains(name),
            "the fortified build does not call {name}; the test would not cover it:\n{symbols}"
        );
    }
    for preload in [true, false] {
        let mut server = command(probe(), true);
        server.args(["serve", "thread", "1"]);
        let mut server = Running::spawn(server);
        let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
            .trim()
            .to_string();
        let mut run_client = command(&client, preload);
        run_client.arg(&port);
        let (ok, stdout, stderr) = run(run_client, Duration::from_secs(60));
        assert!(
            ok,
            "C client (preload {preload}) failed:\n{stdout}\n{stderr}"
        );
        let summary = server.expect_line("served ", Duration::from_secs(30));
        assert!(server.wait(Duration::from_secs(30)).success());
        if preload {
            assert_eq!(
                stdout.trim(),
                "ok api mapped 1",
                "connection not accelerated"
            );
            assert!(summary.contains("attached 1"), "{summary}");
        } else {
            // The same program against a preloaded server, itself without the library:
            // plain TCP on both ends, same results.
            assert_eq!(stdout.trim(), "ok api mapped 0");
            assert!(summary.contains("attached 0"), "{summary}");
        }
    }
    let _ = std::fs::remove_file(client);
}
