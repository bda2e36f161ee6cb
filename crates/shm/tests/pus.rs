//! hetero-socket between the PUs of a split namespace (issue "HeteroK8s-Mesh end to end", item 1),
//! as root, in real network namespaces with their agents: a connection from one PU to a
//! listener on another (over localhost, which the split namespace's rules carry across the PUs'
//! link, with NAT on both sides) moves its data to shared memory with every byte intact; a
//! connection from another address with the same port is never handed the region; with no
//! agent to prove the connection it stays TCP; and the allow-list keeps other ports on TCP.
//! The probe program (`examples/shm_probe.rs`) is both ends.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "../../pu/tests/common/mod.rs"]
mod pu_common;

use common::{library, probe, read_stats, stats_path, total, Running};
use flatmesh_pu::pod::Pod;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::Command;
use std::time::Duration;

/// The probe on PU `pu` with the library preloaded (and the PUs' shared directory, which the
/// backend sets for every command it runs on a PU).
fn probe_on(pod: &Pod, pu: &str) -> Command {
    let mut command = pod
        .backend
        .command(pod.pu(pu).unwrap(), probe().as_os_str())
        .unwrap();
    command.env("LD_PRELOAD", library());
    command
}

/// Starts `serve thread N` on PU b and waits until PU a's rules carry its port there.
fn server_on_b(pod: &Pod, connections: usize, extra: &[(&str, &str)]) -> (Running, u16) {
    let mut server = probe_on(pod, "b");
    server
        .args(["serve", "thread", &connections.to_string()])
        .envs(extra.iter().copied());
    let server = Running::spawn(server);
    let port: u16 = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .parse()
        .unwrap();
    pu_common::wait_owner(pod, port, Some("b"));
    pu_common::eventually("PU a maps the server's port to PU b", || {
        pu_common::rules_text(pod, "a").contains(&format!("{port} : "))
    });
    (server, port)
}

/// Runs `client PORT TEST` on PU a and returns the server's `attached` count.
fn client_on_a(
    pod: &Pod,
    server: &mut Running,
    port: u16,
    test: &str,
    env: &[(&str, &str)],
) -> usize {
    let mut client = probe_on(pod, "a");
    client
        .args(["client", &port.to_string(), test])
        .envs(env.iter().copied());
    let (ok, stdout, stderr) = common::run(client, Duration::from_secs(90));
    assert!(ok, "client `{test}` failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("ok {test}")), "{stdout}");
    let summary = server.expect_line("served ", Duration::from_secs(30));
    assert!(server.wait(Duration::from_secs(30)).success(), "{summary}");
    let words: Vec<&str> = summary.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "attached").unwrap();
    words[at + 1].parse().unwrap()
}

#[test]
fn data_between_pus_moves_through_shared_memory() {
    let mut pod = pu_common::pod("smx", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let stats = stats_path("pus-integrity");
    let (mut server, port) =
        server_on_b(&pod, 1, &[("FLATMESH_SHM_STATS", stats.to_str().unwrap())]);
    // 8 MiB each way in odd-sized chunks, half-close, every byte checked by the client.
    let attached = client_on_a(
        &pod,
        &mut server,
        port,
        "integrity",
        &[("FLATMESH_SHM_STATS", stats.to_str().unwrap())],
    );
    let reports = read_stats(&stats);
    let _ = std::fs::remove_file(&stats);
    assert_eq!(
        attached, 1,
        "the connection between the PUs stayed on TCP: {reports:?}"
    );
    // Counted by both ends.
    assert_eq!(total(&reports, "accelerated"), 2, "{reports:?}");
    assert_eq!(total(&reports, "unproven"), 0, "{reports:?}");
    // Nothing is left in the shared directory but the agents' services.
    let group = flatmesh_pu::shm_proof::group_dir(&pod.config);
    let adverts: Vec<_> = std::fs::read_dir(group.join("l")).unwrap().collect();
    assert!(adverts.is_empty(), "{adverts:?}");
}

#[test]
fn a_call_intercepted_to_a_proxy_on_another_pu_moves_to_shared_memory() {
    // Outbound calls to port 80 go to the proxy port 15106, wherever it is (PU b here): the
    // split rules route them there unchanged and redirect them on arrival.
    let mut pod = pu_common::pod(
        "smc",
        "intercept:\n  - { proxy_port: 15106, ports: [80] }\n",
    );
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    // The "proxy": the probe's echo server on port 15106 of PU b.
    let stats = stats_path("pus-intercepted");
    let stats_env = ("FLATMESH_SHM_STATS", stats.to_str().unwrap());
    let (mut server, port) = server_on_b(&pod, 1, &[("SHM_PROBE_PORT", "15106"), stats_env]);
    assert_eq!(port, 15106);
    // The app on PU a dials a service address; it never names the proxy.
    let env = [("SHM_PROBE_SERVER_IP", "10.96.7.10"), stats_env];
    let attached = client_on_a(&pod, &mut server, 80, "integrity", &env);
    let reports = read_stats(&stats);
    let _ = std::fs::remove_file(&stats);
    assert_eq!(
        attached, 1,
        "the intercepted call stayed on TCP: {reports:?}"
    );
}

#[test]
fn a_region_between_pus_is_never_handed_to_a_connection_from_another_address() {
    let mut pod = pu_common::pod("smi", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    // The server accepts once both connections wait: the intruder's (queued first) is accepted
    // while the victim's region file is there.
    let stats = stats_path("pus-intruder");
    let (mut server, port) = server_on_b(
        &pod,
        2,
        &[
            ("SHM_PROBE_ACCEPT_WHEN_QUEUED", "2"),
            ("FLATMESH_SHM_STATS", stats.to_str().unwrap()),
        ],
    );
    // The intruder: no library, on the server's own PU, from 127.0.0.2 and a port S. The
    // region names carry ports only (addresses differ across the PUs' NAT), so the victim's
    // region, made for port S, has the name the intruder's connection looks up.
    let mut intruder = pod
        .on("b", || {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            socket.bind(&std::net::SocketAddr::from(([127, 0, 0, 2], 0)).into())?;
            socket.connect(&pu_common::localhost(port).into())?;
            std::io::Result::Ok(TcpStream::from(socket))
        })
        .unwrap()
        .unwrap();
    let shared_port = intruder.local_addr().unwrap().port();
    intruder
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // The victim: the library, on PU a, from the same port S. It checks its echo and that its
    // connection moved to shared memory.
    let mut victim = probe_on(&pod, "a");
    victim.args(["client", &port.to_string(), &format!("from:{shared_port}")]);
    let mut victim = Running::spawn(victim);

    let request = b"intruder request: nobody else may read this";
    intruder.write_all(request).unwrap();
    let mut echo = vec![0u8; request.len()];
    intruder
        .read_exact(&mut echo)
        .expect("the intruder's echo never came back: its connection was wired to another");
    assert_eq!(&echo, request);
    intruder.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    intruder.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "the intruder received another connection's bytes: {rest:?}"
    );

    let line = victim.expect_line("ok ", Duration::from_secs(30));
    assert!(victim.wait(Duration::from_secs(10)).success(), "{line}");
    let summary = server.expect_line("served ", Duration::from_secs(30));
    assert!(
        summary.contains("attached 1 "),
        "exactly the victim's connection must be on shared memory: {summary}"
    );
    assert!(server.wait(Duration::from_secs(10)).success());
    // The intruder's connection did find the victim's region, and the proof refused it.
    let reports = read_stats(&stats);
    let _ = std::fs::remove_file(&stats);
    assert_eq!(total(&reports, "unproven"), 1, "{reports:?}");
}

#[test]
fn with_no_agent_to_prove_it_a_connection_between_pus_stays_tcp() {
    let mut pod = pu_common::pod("sma", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let stats = stats_path("pus-no-agent");
    let (mut server, port) =
        server_on_b(&pod, 1, &[("FLATMESH_SHM_STATS", stats.to_str().unwrap())]);
    // The rules stay when an agent stops; its proof service goes.
    pod.stop_agent("b").unwrap();
    assert_eq!(client_on_a(&pod, &mut server, port, "pingpong:200", &[]), 0);
    // The acceptor found the region, could not have it proven, and kept TCP.
    let reports = read_stats(&stats);
    let _ = std::fs::remove_file(&stats);
    assert_eq!(total(&reports, "unproven"), 1, "{reports:?}");
}

#[test]
fn the_allow_list_keeps_other_ports_on_tcp() {
    let mut pod = pu_common::pod("smp", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    // The connector's list leaves the server's port out: it offers no region.
    let (mut server, port) = server_on_b(&pod, 1, &[]);
    let other = if port == 1 { "2" } else { "1" };
    let env = [("FLATMESH_SHM_PORTS", other)];
    assert_eq!(
        client_on_a(&pod, &mut server, port, "pingpong:200", &env),
        0
    );
    // The acceptor's list leaves it out: it takes none (and does not advertise).
    let (mut server, port) = server_on_b(&pod, 1, &env);
    assert_eq!(client_on_a(&pod, &mut server, port, "pingpong:200", &[]), 0);
    // Listed for the connector (and any port for the acceptor): shared memory.
    let (mut server, port) = server_on_b(&pod, 1, &[]);
    let listed = port.to_string();
    let env = [("FLATMESH_SHM_PORTS", listed.as_str())];
    assert_eq!(
        client_on_a(&pod, &mut server, port, "pingpong:200", &env),
        1
    );
}
