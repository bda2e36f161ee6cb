//! The split namespace in real network namespaces, as root: direct calls over localhost in both
//! directions, port conflicts, interception with the original destination read on the other PU,
//! an agent restart (a real process, killed with SIGKILL) that keeps the table, and 100 ports
//! churned. Each test uses its own namespace name, so they can run in parallel.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use flatmesh_pu::echo::{ask, EchoServer, Mode};
use flatmesh_pu::relay::Relay;
use flatmesh_pu::PuBackend as _;

#[test]
fn direct_calls_cross_pus_over_localhost_both_ways() {
    let mut pod = pod("dir", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let _on_a = pod
        .on("a", || {
            EchoServer::start(listen_raw(7101), "svc@a", Mode::Describe).unwrap()
        })
        .unwrap();
    let _on_b = pod
        .on("b", || {
            EchoServer::start(listen_raw(7102), "svc@b", Mode::Describe).unwrap()
        })
        .unwrap();
    wait_owner(&pod, 7101, Some("a"));
    wait_owner(&pod, 7102, Some("b"));
    eventually("both PUs map the other's port", || {
        mapped(&pod, "a") == 1 && mapped(&pod, "b") == 1
    });

    for (from, port, name) in [("a", 7102, "svc@b"), ("b", 7101, "svc@a")] {
        let (answer, local) = pod
            .on(from, || ask(localhost(port), "hi"))
            .unwrap()
            .unwrap();
        // The receiver sees a local caller, the caller a local receiver: neither can tell.
        assert!(answer.starts_with(name), "{from} -> {port}: {answer}");
        assert!(answer.contains("peer=127.0.0.1:"), "{answer}");
        assert!(
            answer.contains(&format!("local=127.0.0.1:{port}")),
            "{answer}"
        );
        assert_eq!(local.ip().to_string(), "127.0.0.1");
    }
    // A port nobody owns is refused, as on one host.
    let refused = pod.on("a", || TcpStream::connect(localhost(7199))).unwrap();
    assert_eq!(
        refused.unwrap_err().kind(),
        std::io::ErrorKind::ConnectionRefused
    );
    host_has_no_tables();
}

/// Binds on the calling thread (which must be inside a PU).
fn listen_raw(port: u16) -> std::net::TcpListener {
    std::net::TcpListener::bind(("127.0.0.1", port)).unwrap()
}

#[test]
fn port_conflicts_across_pus() {
    let mut pod = pod("cfl", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let held = listen(&pod, "b", 7201);
    wait_owner(&pod, 7201, Some("b"));
    eventually("a reserves 7201", || {
        bind_errno(&pod, "a", 7201) == Some(libc::EADDRINUSE)
    });
    // SO_REUSEADDR does not help: the placeholder does not set it.
    assert_eq!(bind_errno(&pod, "a", 7201), Some(libc::EADDRINUSE));
    let v6 = pod
        .on("a", || std::net::TcpListener::bind("[::]:7201").map(|_| ()))
        .unwrap();
    assert_eq!(v6.unwrap_err().raw_os_error(), Some(libc::EADDRINUSE));

    // Released on b: a may take it, and then b may not.
    drop(held);
    wait_owner(&pod, 7201, None);
    eventually("a releases its placeholder", || {
        bind_errno(&pod, "a", 7201).is_none()
    });
    let on_a = listen(&pod, "a", 7201);
    wait_owner(&pod, 7201, Some("a"));
    eventually("b reserves 7201", || {
        bind_errno(&pod, "b", 7201) == Some(libc::EADDRINUSE)
    });
    drop(on_a);
}

#[test]
fn interception_keeps_the_original_destination_on_the_proxy_pu() {
    let mut pod = pod(
        "icp",
        "intercept:\n  - { proxy_port: 15001, ports: [80, 443] }\n",
    );
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let target: SocketAddr = "10.96.0.10:80".parse().unwrap();
    eventually("a has its rules", || {
        rules_text(&pod, "a").contains("redirect to :15001")
    });
    // No proxy anywhere yet: refused, as on one host whose sidecar is down.
    let early = pod
        .on("a", || {
            TcpStream::connect_timeout(&target, Duration::from_secs(2))
        })
        .unwrap();
    assert_eq!(
        early.unwrap_err().kind(),
        std::io::ErrorKind::ConnectionRefused
    );

    let relay = pod
        .on("b", || Relay::start(listen_raw(15001)).unwrap())
        .unwrap();
    wait_owner(&pod, 15001, Some("b"));
    eventually("a routes port 80 to b's relay", || {
        pod.on("a", || {
            TcpStream::connect_timeout(&target, Duration::from_secs(2)).is_ok()
        })
        .unwrap()
    });
    for target in ["10.96.0.10:80", "192.0.2.7:443"] {
        let target: SocketAddr = target.parse().unwrap();
        let local = pod
            .on("a", || {
                let s = TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
                // The app still believes it talks to the original destination.
                assert_eq!(s.peer_addr().unwrap(), target);
                s.local_addr().unwrap()
            })
            .unwrap();
        let mut found = None;
        for _ in 0..100 {
            found = relay.records().into_iter().find(|r| r.peer == local);
            if found.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let record = found.expect("the relay on b never saw the connection");
        assert_eq!(record.original_dst.map(SocketAddr::V4), Some(target));
    }
    // Ports not in the rule are not intercepted (here: no route beyond b, so no relay record).
    let before = relay.records().len();
    let _ = pod
        .on("a", || {
            TcpStream::connect_timeout(
                &"10.96.0.10:8080".parse().unwrap(),
                Duration::from_millis(300),
            )
        })
        .unwrap();
    assert_eq!(relay.records().len(), before);
    host_has_no_tables();
}

#[test]
fn agent_restart_keeps_the_port_table() {
    let pod = pod("rst", "");
    let dir = pod.config.table_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("split.yaml");
    std::fs::write(
        &yaml,
        format!(
            "namespace: {}\nstate_dir: {STATE_DIR}\npoll_interval_ms: 20\npus:\n  - {{ name: a, cpus: \"0\" }}\n  - {{ name: b }}\nuplink: b\n",
            pod.config.namespace
        ),
    )
    .unwrap();
    let spawn = |pu: &str| {
        let index = pod.pu(pu).unwrap();
        pod.backend
            .command(index, env!("CARGO_BIN_EXE_flatmesh-pu-agent").as_ref())
            .unwrap()
            .args(["--pu", pu, "--config"])
            .arg(&yaml)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut agent_a = spawn("a");
    let mut agent_b = spawn("b");
    let _svc = pod
        .on("b", || {
            EchoServer::start(listen_raw(7301), "svc@b", Mode::Describe).unwrap()
        })
        .unwrap();
    wait_owner(&pod, 7301, Some("b"));
    eventually("a reserves 7301", || {
        bind_errno(&pod, "a", 7301) == Some(libc::EADDRINUSE)
    });
    eventually("a maps 7301", || mapped(&pod, "a") == 1);

    // The owner's agent crashes: the table and the rules stay, traffic keeps flowing.
    agent_b.kill().unwrap();
    agent_b.wait().unwrap();
    assert_eq!(
        pod.table()
            .read()
            .unwrap()
            .ports
            .get(&7301)
            .map(String::as_str),
        Some("b")
    );
    let (answer, _) = pod.on("a", || ask(localhost(7301), "x")).unwrap().unwrap();
    assert!(answer.starts_with("svc@b"), "{answer}");

    // Restarted, it finds its port where it left it and keeps it.
    let mut agent_b = spawn("b");
    eventually("the new agent of b registers", || {
        pod.table().read().unwrap().agents.get("b") == Some(&agent_b.id())
    });
    std::thread::sleep(Duration::from_millis(100));
    let state = pod.table().read().unwrap();
    assert_eq!(state.ports.get(&7301).map(String::as_str), Some("b"));
    assert_eq!(state.agents.get("b"), Some(&agent_b.id()));

    // The other agent crashes: its placeholders go with it, and come back with the restart.
    agent_a.kill().unwrap();
    agent_a.wait().unwrap();
    let mut agent_a = spawn("a");
    eventually("the restarted agent on a reserves port 7301 again", || {
        bind_errno(&pod, "a", 7301) == Some(libc::EADDRINUSE)
    });
    let (answer, _) = pod.on("a", || ask(localhost(7301), "y")).unwrap().unwrap();
    assert!(answer.starts_with("svc@b"), "{answer}");
    for child in [&mut agent_a, &mut agent_b] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

#[test]
fn a_hundred_ports_churned() {
    let mut pod = pod("chn", "");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let ports: Vec<u16> = (7400..7500).collect();
    for round in 0..2 {
        let (owner, other) = if round == 0 { ("b", "a") } else { ("a", "b") };
        let servers = pod
            .on(owner, || {
                ports
                    .iter()
                    .map(|&p| EchoServer::start(listen_raw(p), "churn", Mode::Describe).unwrap())
                    .collect::<Vec<_>>()
            })
            .unwrap();
        assert!(
            pod.wait_for_table(Duration::from_secs(10), |s| ports.iter().all(|p| s
                .ports
                .get(p)
                .map(String::as_str)
                == Some(owner)))
        );
        eventually("100 ports mapped", || mapped(&pod, other) == 100);
        let failures = pod
            .on(other, || {
                ports
                    .iter()
                    .filter_map(|&p| match ask(localhost(p), "c") {
                        Ok((a, _)) if a.starts_with("churn") => None,
                        other => Some(format!("{p}: {other:?}")),
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap();
        assert!(
            failures.is_empty(),
            "round {round}: {} of 100 calls {other} -> {owner} failed: {:?}",
            failures.len(),
            &failures[..failures.len().min(3)]
        );
        assert!(ports
            .iter()
            .all(|&p| bind_errno(&pod, other, p) == Some(libc::EADDRINUSE)));
        drop(servers);
        assert!(pod.wait_for_table(Duration::from_secs(10), |s| ports
            .iter()
            .all(|p| !s.ports.contains_key(p))));
        // Every placeholder and map element is gone again.
        eventually("all 100 unmapped", || mapped(&pod, other) == 0);
        eventually("all 100 placeholders closed", || {
            ports.iter().all(|&p| bind_errno(&pod, other, p).is_none())
        });
    }
}

#[test]
fn cleanup_finds_leftovers_of_a_crashed_run() {
    require_root();
    let config = config("cln", "");
    let backend = flatmesh_pu::Emulated::new(&config);
    backend.up().unwrap();
    // As if the process had died here: nothing torn down.
    let report =
        flatmesh_pu::cleanup::cleanup(Some(&config.namespace), std::path::Path::new(STATE_DIR))
            .unwrap();
    assert_eq!(report.netns.len(), 2, "{report:?}");
    assert!(flatmesh_pu::netns::list(&format!("fmpu-{}-", config.namespace)).is_empty());
    assert!(!backend.exists(0) && !backend.exists(1));
    host_has_no_tables();
}
