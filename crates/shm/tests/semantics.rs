//! Socket semantics under the library, with the probe program (`examples/shm_probe.rs`) as
//! both server and client: data integrity with half-close, every I/O style (blocking threads,
//! fork per connection, epoll edge-triggered, epoll_pwait2, poll, select; each mixing kernel
//! fds with shared-memory ones), dup/dup2, fork (also a parent that closes its copy before the
//! child has run), nonblocking I/O, fds closed behind the
//! library's back, peer crash (also with arena records in flight), 1,000 concurrent
//! connections, fallback to TCP when one side lacks the library; the arena (bursts beyond the
//! local record, per-process limit, every record returned); no system call per message on a
//! busy connection and no CPU on idle ones.
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

struct Outcome {
    attached: usize,
    ticks: usize,
    client_output: String,
    client_errors: String,
    /// Exit reports of both processes (`FLATMESH_SHM_STATS`).
    stats: Vec<BTreeMap<String, u64>>,
}

/// Runs `serve MODE N` and `client PORT TEST`, each with or without the library.
fn echo(
    mode: &str,
    connections: usize,
    test: &str,
    server_preload: bool,
    client_preload: bool,
) -> Outcome {
    echo_with(mode, connections, test, server_preload, client_preload, &[])
}

/// As `echo`, with extra environment for the client.
fn echo_with(
    mode: &str,
    connections: usize,
    test: &str,
    server_preload: bool,
    client_preload: bool,
    client_env: &[(&str, &str)],
) -> Outcome {
    echo_with_both(
        mode,
        test,
        (server_preload, &[]),
        (client_preload, client_env),
        connections,
    )
}

/// As `echo`, with extra environment for each side: `(preload, environment)`.
fn echo_with_both(
    mode: &str,
    test: &str,
    (server_preload, server_env): (bool, &[(&str, &str)]),
    (client_preload, client_env): (bool, &[(&str, &str)]),
    connections: usize,
) -> Outcome {
    require_root();
    let stats = stats_path(&format!("{mode}-{}", test.replace([':', '/'], "_")));
    let mut server = command(probe(), server_preload);
    server
        .args(["serve", mode, &connections.to_string()])
        .env("FLATMESH_SHM_STATS", &stats);
    if test == "half-close-full" {
        // No pipe traffic in the server's set: nothing but the library may wake it,
        // and no timeout on its waits, so that a missed wake-up is a hang, not a delay.
        server
            .env("SHM_PROBE_TICK_MS", "0")
            .env("SHM_PROBE_WAIT_MS", "-1");
    }
    if test.starts_with("wake-race:") {
        // Never poll: every wait for data or room is a sleep that needs a wake-up.
        server.env("FLATMESH_SHM_SPIN_US", "0");
    }
    server.envs(server_env.iter().copied());
    let mut server = Running::spawn(server);
    let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .to_string();
    if test.starts_with("wake-race:") {
        // The server on CPU 0, the client pins itself to the last CPU: wake-ups cross CPUs.
        let _ = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", "0", &server.pid().to_string()])
            .stdout(std::process::Stdio::null())
            .status();
    }
    let mut client = command(probe(), client_preload);
    client
        .args(["client", &port, test])
        .env("FLATMESH_SHM_STATS", &stats)
        .envs(client_env.iter().copied());
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
    let reports = read_stats(&stats);
    let _ = std::fs::remove_file(&stats);
    Outcome {
        attached: field("attached"),
        ticks: field("ticks"),
        client_output: stdout,
        client_errors: stderr,
        stats: reports,
    }
}

#[test]
fn half_close_and_integrity_in_every_io_style() {
    for mode in ["thread", "fork", "epoll", "epoll2", "poll", "select"] {
        let outcome = echo(mode, 1, "integrity", true, true);
        assert_eq!(
            outcome.attached, 1,
            "{mode}: the connection did not move to shared memory"
        );
        if matches!(mode, "epoll" | "epoll2" | "poll" | "select") {
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

/// A thread asleep in epoll_wait for EPOLLOUT|EPOLLET while another thread fills the pipe
/// (EAGAIN) and drains the echo with nonblocking reads must be woken (the node proxy's tokio
/// runtime does exactly this).
#[test]
fn epollout_edge_reaches_a_thread_already_asleep_in_epoll_wait() {
    for mode in ["thread", "epoll"] {
        assert_eq!(echo(mode, 1, "epollout-thread", true, true).attached, 1);
    }
}

/// A server asleep on a full pipe must be woken when a client that has shut down its sending
/// side (so its kernel socket can no longer carry a wake-up byte) reads.
#[test]
fn a_writer_on_a_full_pipe_wakes_after_the_reader_half_closed() {
    for mode in ["thread", "epoll", "poll"] {
        assert_eq!(echo(mode, 1, "half-close-full", true, true).attached, 1);
    }
}

/// Both pipes full at once: the client writes 7 MiB without reading (one direction holds
/// about 4 MiB), the blocking echo server blocks on its own write while the client still
/// writes. This used to stall now and then (and, with the client's 10 s read timeout, made the
/// server's write fail with EPIPE once the client gave up): a writer that armed its wake-up
/// flag just after the reader had drained the pipe to its low-water mark looked only at
/// `writable()` and slept for good (`region::tests::a_writer_arming_after_...` has the exact
/// interleaving). Repeated, because the window is narrow.
#[test]
fn a_blocking_writer_with_both_pipes_full_is_woken() {
    for _ in 0..3 {
        assert_eq!(
            echo("thread", 1, "half-close-full:7340032", true, true).attached,
            1
        );
    }
}

/// The sleep/wake-up handshake hammered across CPUs with no polling at all (every wait sleeps):
/// random sizes and pauses on both sides, each read and write bounded by a 5 s timeout, so a
/// lost wake-up fails the test. Blocking threads and an epoll server.
#[test]
fn sleep_and_wake_up_race_across_cpus_loses_nothing() {
    for mode in ["thread", "epoll"] {
        let outcome = echo_with(
            mode,
            1,
            "wake-race:3",
            true,
            true,
            &[("FLATMESH_SHM_SPIN_US", "0")],
        );
        assert_eq!(outcome.attached, 1);
        assert!(
            outcome.client_output.contains("wake-race bytes"),
            "{}",
            outcome.client_output
        );
        // A wake-up is a byte on the socket, or under FLATMESH_SHM_NOTIFY=async a signal.
        let woken = total(&outcome.stats, "wakeups_sent") + total(&outcome.stats, "wake_signals");
        assert!(
            total(&outcome.stats, "sleeps") + woken > 100,
            "the run did not make the sides sleep: {:?}",
            outcome.stats
        );
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

#[test]
fn fds_closed_behind_the_librarys_back_are_forgotten() {
    // close_range() and fclose(fdopen()) close the socket without calling close(); the next
    // fd with that number (a pipe) must behave as a pipe.
    assert_eq!(echo("thread", 2, "stale", true, true).attached, 2);
}

/// Every record a process allocated was freed by someone (reader or last closer).
fn assert_all_records_returned(outcome: &Outcome) {
    let allocated = total(&outcome.stats, "records_allocated");
    let freed = total(&outcome.stats, "records_freed");
    assert_eq!(
        allocated, freed,
        "records leaked: {allocated} allocated, {freed} freed: {:?}",
        outcome.stats
    );
    assert_eq!(
        total(&outcome.stats, "commits_rejected"),
        0,
        "{:?}",
        outcome.stats
    );
}

#[test]
fn a_burst_beyond_the_local_record_goes_through_the_arena() {
    // 3 MiB written before anything is read back: 46 times a 64 KiB local record. The arena
    // holds it (as TCP's socket buffers would); without it, writer and echo would deadlock.
    let outcome = echo("thread", 1, "burst:3", true, true);
    assert_eq!(outcome.attached, 1);
    assert_eq!(
        outcome.stats.len(),
        2,
        "expected two exit reports: {:?}",
        outcome.stats
    );
    for report in &outcome.stats {
        assert!(
            report["records_allocated"] > 0,
            "no arena record used: {report:?}"
        );
        assert!(
            report["records_committed"] > 0,
            "nothing committed: {report:?}"
        );
    }
    assert_all_records_returned(&outcome);
}

#[test]
fn the_per_process_record_limit_holds() {
    // The client reaches its limit only when it writes ahead of the server by more than its local
    // record plus two arena records, which depends on scheduling: on a loaded machine the server
    // may drain every record as soon as it is appended. So up to five runs; in every run the
    // records must come back, and in at least one the limit must have refused an append.
    let mut runs = Vec::new();
    for _ in 0..5 {
        let outcome = echo_with(
            "thread",
            1,
            "integrity",
            true,
            true,
            &[("FLATMESH_SHM_PROCESS_RECORDS", "2")],
        );
        assert_eq!(outcome.attached, 1);
        assert_all_records_returned(&outcome);
        if let Some(client) = outcome.stats.iter().find(|r| r["refused_limit"] > 0) {
            assert!(client["records_allocated"] > 0);
            return;
        }
        runs.push(outcome.stats);
    }
    panic!("the client never hit its limit of 2 in 5 runs: {runs:?}");
}

/// sockperf's 16-byte ping-pong between processes on different CPUs, with every reply checked
/// against the message just sent (a torn, stale or repeated read of the pipe fails it). The
/// reported sockperf failure ("_seqN > m_maxSequenceNo") turned out to be sockperf's own table
/// limit, but the property it suspected is worth holding, at full speed: 20,000 round trips.
/// (A count, not a time: on a busy CI machine a 2-second run once made fewer than asked.)
#[test]
fn ping_pong_across_cpus_returns_every_message_whole() {
    let outcome = echo("thread", 1, "pingpong:20000", true, true);
    assert_eq!(outcome.attached, 1);
    let trips: u64 = outcome
        .client_output
        .split("round-trips ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        trips == 20_000,
        "only {trips} round trips: {}",
        outcome.client_output
    );
}

#[test]
fn busy_connection_makes_no_system_call_per_message() {
    // 200,000 messages of 64 B each way. Every system call on the data path (wake-ups, sleeps,
    // kernel checks) is counted; together they must stay far below one per message.
    let messages = 200_000u64;
    let outcome = echo("thread", 1, &format!("small:{messages}"), true, true);
    assert_eq!(outcome.attached, 1);
    assert_eq!(
        outcome.stats.len(),
        2,
        "expected two exit reports: {:?}",
        outcome.stats
    );
    let calls = total(&outcome.stats, "wakeups_sent")
        + total(&outcome.stats, "sleeps")
        + total(&outcome.stats, "kernel_checks");
    assert!(
        calls * 20 < 2 * messages,
        "{calls} data-path system calls for {} messages: {:?}",
        2 * messages,
        outcome.stats
    );
}

#[test]
fn idle_connections_use_no_cpu() {
    require_root();
    for mode in ["epoll", "thread"] {
        let connections = 200;
        let mut server = command(probe(), true);
        server
            .args(["serve", mode, &connections.to_string()])
            .env("SHM_PROBE_TICK_MS", "0");
        let mut server = Running::spawn(server);
        let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
            .trim()
            .to_string();
        let mut client = command(probe(), true);
        client
            .args(["client", &port, &format!("many:{connections}")])
            .env("SHM_PROBE_HOLD_SECS", "4");
        let mut client = Running::spawn(client);
        let open = client.expect_line("open ", Duration::from_secs(30));
        assert_eq!(
            open,
            format!("open {connections} mapped {connections}"),
            "{mode}: not every connection moved to shared memory"
        );
        // Let the adaptive polling budget run out, then measure 2 s of idleness.
        std::thread::sleep(Duration::from_millis(500));
        let before = cpu_ticks(server.pid()) + cpu_ticks(client.pid());
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs(2));
        let used = cpu_ticks(server.pid()) + cpu_ticks(client.pid()) - before;
        let elapsed = started.elapsed();
        // A polling design burns 100 ticks per second per spinning thread; idle is ~0.
        assert!(
            used <= 10,
            "{mode}: {connections} idle connections used {used} CPU ticks in {elapsed:?}"
        );
        assert!(
            client.wait(Duration::from_secs(30)).success(),
            "{mode}: client failed"
        );
        server.expect_line("served ", Duration::from_secs(30));
        assert!(
            server.wait(Duration::from_secs(30)).success(),
            "{mode}: server failed"
        );
    }
}

#[test]
fn peer_crash_with_arena_records_in_flight_returns_them() {
    require_root();
    let stats = stats_path("crash-hold");
    let mut server = command(probe(), true);
    server.arg("crash-hold");
    let mut server = Running::spawn(server);
    let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .to_string();
    // The client fills 2 MiB of arena records toward a server that stopped reading; the server
    // is SIGKILLed with them in the chain; the client waits until the server process is gone,
    // then closes, and must give every record back.
    let mut client = command(probe(), true);
    client
        .args(["client", &port, &format!("crash-burst:{}", server.pid())])
        .env("FLATMESH_SHM_STATS", &stats);
    let (ok, stdout, stderr) = run(client, Duration::from_secs(60));
    assert!(ok, "client failed:\n{stdout}\n{stderr}");
    let attached = server.expect_line("attached ", Duration::from_secs(10));
    assert!(attached.starts_with("attached 1 "), "{attached}");
    server.wait(Duration::from_secs(10));
    let reports = read_stats(&stats);
    let _ = std::fs::remove_file(&stats);
    assert_eq!(
        reports.len(),
        1,
        "one report (the server was killed): {reports:?}"
    );
    let client = &reports[0];
    assert!(
        client["records_allocated"] >= 16,
        "the burst did not use the arena: {client:?}"
    );
    assert_eq!(
        client["records_freed"], client["records_allocated"],
        "records of the dead peer's inbound chain leaked: {client:?}"
    );
    assert_eq!(client["records_held"], 0, "{client:?}");
}

#[test]
fn a_parent_closing_right_after_fork_leaves_the_child_every_byte() {
    require_root();
    // 1 MiB: the local record and 16 arena records hold it when the server forks.
    let burst = 1 << 20;
    let mut server = command(probe(), true);
    server.args(["fork-close-first", &burst.to_string()]);
    let mut server = Running::spawn(server);
    let port = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .to_string();
    let mut client = command(probe(), true);
    client.args(["client", &port, &format!("fork-close-first:{burst}")]);
    let (ok, stdout, stderr) = run(client, Duration::from_secs(60));
    let child = server.expect_line("child ", Duration::from_secs(30));
    assert_eq!(child, "child ok attached 1", "client:\n{stdout}\n{stderr}");
    assert!(ok, "client failed:\n{stdout}\n{stderr}");
    assert!(server.wait(Duration::from_secs(10)).success());
}

/// 2,000 round trips against a `mode` server, each side with its environment; checks that
/// the connection moved and that every round trip came back.
fn ping_pong_2000(mode: &str, server_env: &[(&str, &str)], client_env: &[(&str, &str)]) -> Outcome {
    let outcome = echo_with_both(
        mode,
        "pingpong:2000",
        (true, server_env),
        (true, client_env),
        1,
    );
    assert_eq!(outcome.attached, 1, "{mode}: not on shared memory");
    assert!(
        outcome.client_output.contains("round-trips 2000 "),
        "{}",
        outcome.client_output
    );
    outcome
}

/// U-NAPI's asynchronous mode (`FLATMESH_SHM_NOTIFY=async`): with no polling, every wait is a
/// sleep, and the peer wakes it with a signal to the sleeping thread, never a wake-up byte;
/// a blocking server and an epoll one (the paper's case for async: an event added to an epoll
/// set). The wake-up race run (random sizes and pauses, 5 s bounds) fails on a lost wake-up.
#[test]
fn async_mode_wakes_sleepers_with_signals_and_loses_none() {
    let env = [
        ("FLATMESH_SHM_NOTIFY", "async"),
        ("FLATMESH_SHM_SPIN_US", "0"),
    ];
    for mode in ["thread", "epoll"] {
        let outcome = echo_with_both(mode, "wake-race:3", (true, &env), (true, &env), 1);
        assert_eq!(outcome.attached, 1);
        assert!(
            outcome.client_output.contains("wake-race bytes"),
            "{}",
            outcome.client_output
        );
        let (signals, bytes) = (
            total(&outcome.stats, "wake_signals"),
            total(&outcome.stats, "wakeups_sent"),
        );
        assert!(
            signals > 100,
            "{mode}: too few signal wake-ups: {:?}",
            outcome.stats
        );
        // A byte only before the acceptor attached (the connector's first wait is a kernel one).
        assert!(
            bytes <= 4,
            "{mode}: {bytes} wake-up bytes: {:?}",
            outcome.stats
        );
    }
}

/// Notify-on-RW (`FLATMESH_SHM_NOTIFY=norw`): a sleeper write-protects the peer's header page
/// through the peer's userfaultfd and is woken by the peer's fault; the wake-up race run loses
/// nothing, and some sleeps end in a fault.
#[test]
fn notify_on_rw_wakes_sleepers_by_the_peers_fault_and_loses_none() {
    let env = [
        ("FLATMESH_SHM_NOTIFY", "norw"),
        ("FLATMESH_SHM_SPIN_US", "0"),
    ];
    let outcome = echo_with_both("thread", "wake-race:3", (true, &env), (true, &env), 1);
    assert_eq!(outcome.attached, 1);
    assert!(
        outcome.client_output.contains("wake-race bytes"),
        "{}",
        outcome.client_output
    );
    let faults = total(&outcome.stats, "wake_faults");
    assert!(faults > 50, "too few fault wake-ups: {:?}", outcome.stats);
    // A forked server: the child, whose stores the parent's userfaultfd does not see, wakes
    // the client with bytes; nothing is lost either.
    ping_pong_2000("fork", &env, &env);
}

/// Each side wakes its peer the way the peer asked, whatever its own mode: an async server
/// with a sync client, and a Notify-on-RW client whose server offers no userfaultfd (it falls
/// back to wake-up bytes), both answer every message.
#[test]
fn mixed_notification_modes_interoperate() {
    let no_spin = ("FLATMESH_SHM_SPIN_US", "0");
    let outcome = ping_pong_2000(
        "thread",
        &[("FLATMESH_SHM_NOTIFY", "async"), no_spin],
        &[("FLATMESH_SHM_NOTIFY", "sync"), no_spin],
    );
    for counter in ["wake_signals", "wakeups_sent"] {
        assert!(
            total(&outcome.stats, counter) > 100,
            "{counter}: {:?}",
            outcome.stats
        );
    }
    let outcome = ping_pong_2000(
        "thread",
        &[("FLATMESH_SHM_NOTIFY", "sync"), no_spin],
        &[("FLATMESH_SHM_NOTIFY", "norw"), no_spin],
    );
    assert_eq!(
        total(&outcome.stats, "wake_faults"),
        0,
        "{:?}",
        outcome.stats
    );
}

/// A bad `FLATMESH_SHM_NOTIFY` is reported (and the default used), not a failed program.
#[test]
fn a_bad_notification_mode_is_reported_and_the_default_used() {
    let outcome = ping_pong_2000("thread", &[], &[("FLATMESH_SHM_NOTIFY", "interrupts")]);
    assert!(
        outcome
            .client_errors
            .contains("FLATMESH_SHM_NOTIFY=\"interrupts\" ignored: must be sync, async or norw"),
        "{}",
        outcome.client_errors
    );
}
