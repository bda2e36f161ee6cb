//! Socket semantics under the library, with the probe program (`examples/shm_probe.rs`) as
//! both server and client: data integrity with half-close, every I/O style (blocking threads,
//! fork per connection, epoll edge-triggered, poll, select; each mixing kernel fds with
//! shared-memory ones), dup/dup2, fork, nonblocking I/O, peer crash, 1,000 concurrent
//! connections, and fallback to TCP when one side lacks the library.
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::time::Duration;

struct Outcome {
    attached: usize,
    ticks: usize,
    client_output: String,
}

/// Runs `serve MODE N` and `client PORT TEST`, each with or without the library.
fn echo(
    mode: &str,
    connections: usize,
    test: &str,
    server_preload: bool,
    client_preload: bool,
) -> Outcome {
    require_root();
    let mut server = command(probe(), server_preload);
    server.args(["serve", mode, &connections.to_string()]);
    let mut server = Running::spawn(server);
    let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .to_string();
    let mut client = command(probe(), client_preload);
    client.args(["client", &port, test]);
    let (ok, stdout, stderr) = run(client, Duration::from_secs(90));
    assert!(
        ok,
        "client `{test}` against `{mode}` server failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("ok {test}")),
        "client did not finish: {stdout}"
    );
    let summary = server.expect_line("served ", Duration::from_secs(30));
    assert!(
        server.wait(Duration::from_secs(30)).success(),
        "server failed after: {summary}"
    );
    let field = |name: &str| -> usize {
        let words: Vec<&str> = summary.split_whitespace().collect();
        words
            .iter()
            .position(|w| *w == name)
            .and_then(|i| words.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    Outcome {
        attached: field("attached"),
        ticks: field("ticks"),
        client_output: stdout,
    }
}

#[test]
fn half_close_and_integrity_in_every_io_style() {
    for mode in ["thread", "fork", "epoll", "poll", "select"] {
        let outcome = echo(mode, 1, "integrity", true, true);
        assert_eq!(
            outcome.attached, 1,
            "{mode}: the connection did not move to shared memory"
        );
        if matches!(mode, "epoll" | "poll" | "select") {
            assert!(
                outcome.ticks > 0,
                "{mode}: the kernel pipe in the same set never fired"
            );
        }
    }
}

#[test]
fn dup_and_dup2_share_the_connection() {
    for mode in ["thread", "epoll"] {
        assert_eq!(echo(mode, 1, "dup", true, true).attached, 1);
    }
}

#[test]
fn forked_child_and_parent_both_use_the_connection() {
    for mode in ["thread", "poll"] {
        assert_eq!(echo(mode, 1, "fork", true, true).attached, 1);
    }
}

#[test]
fn nonblocking_io_eagain_fionread_and_poll() {
    for mode in ["epoll", "select"] {
        assert_eq!(echo(mode, 1, "nonblocking", true, true).attached, 1);
    }
}

#[test]
fn thousand_concurrent_connections() {
    let outcome = echo("epoll", 1000, "many:1000", true, true);
    assert_eq!(
        outcome.attached, 1000,
        "not every connection moved to shared memory"
    );
    assert!(
        outcome.client_output.contains("open 1000 mapped 1000"),
        "{}",
        outcome.client_output
    );
}

#[test]
fn falls_back_to_tcp_when_one_side_lacks_the_library() {
    assert_eq!(echo("epoll", 1, "integrity", false, true).attached, 0);
    assert_eq!(echo("thread", 1, "integrity", true, false).attached, 0);
    assert_eq!(echo("poll", 1, "nonblocking", false, true).attached, 0);
}

#[test]
fn peer_crash_gives_eof_or_reset_never_a_hang() {
    require_root();
    let mut server = command(probe(), true);
    server.arg("crash-serve");
    let mut server = Running::spawn(server);
    let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .to_string();
    let mut client = command(probe(), true);
    client.args(["client", &port, "crash"]);
    let (ok, stdout, stderr) = run(client, Duration::from_secs(60));
    assert!(ok, "client failed:\n{stdout}\n{stderr}");
    let attached = server.expect_line("attached ", Duration::from_secs(10));
    assert_eq!(
        attached, "attached 1",
        "the connection did not move to shared memory"
    );
    server.wait(Duration::from_secs(10));
}
