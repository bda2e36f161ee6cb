//! The split namespace in real network namespaces, as root: direct calls over localhost in both
//! directions, port conflicts (refused at bind() by the bind hook, also for two binds racing),
//! interception with the original destination read on the other PU
//! (and on the proxy's own PU, and after the proxy moved), an agent restart (a real process,
//! killed with SIGKILL) that keeps the table, one agent per PU, no rule outside a PU, 100 ports
//! churned, and the clean-up of a crashed run. Each test uses its own namespace name, so they
//! can run in parallel.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use flatmesh_lab::pu::echo::{ask, EchoServer, Mode};
use flatmesh_pu::relay::Relay;

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

/// The relay's record of the connection from `local`, waiting up to 5 s (the relay records a
/// connection once its upstream connect has succeeded or failed).
fn record_for(relay: &Relay, local: SocketAddr) -> flatmesh_pu::relay::RelayRecord {
    for _ in 0..250 {
        if let Some(r) = relay.records().into_iter().find(|r| r.peer == local) {
            return r;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "the relay never saw the connection from {local}: {:?}",
        relay.records()
    );
}

/// Gives PU `pu` a route to 10.96.0.0/24 via the other PU, which does not forward (only the
/// uplink does): a way out whose far end never answers. Packets that no rule intercepts vanish.
fn route_to_nowhere(pod: &flatmesh_pu::pod::Pod, pu: &str) {
    let topo = pod.backend.topology();
    let me = pod.pu(pu).unwrap();
    let link = &topo.links(me)[0];
    let ns = topo.netns(me);
    let via = link.peer_addr.to_string();
    flatmesh_pu::exec::run(
        "ip",
        &["-n", &ns, "route", "add", "10.96.0.0/24", "via", &via],
    )
    .unwrap();
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
    // Refused at once: the bind claimed the port, no agent pass is needed.
    assert_eq!(owner(&pod, 7201).as_deref(), Some("b"));
    // SO_REUSEADDR and SO_REUSEPORT do not help, nor another address or family.
    assert_eq!(bind_errno(&pod, "a", 7201), Some(libc::EADDRINUSE));
    for addr in ["0.0.0.0:7201", "[::]:7201", "[::1]:7201"] {
        let e = pod
            .on("a", || std::net::TcpListener::bind(addr).map(|_| ()))
            .unwrap();
        assert_eq!(
            e.unwrap_err().raw_os_error(),
            Some(libc::EADDRINUSE),
            "{addr}"
        );
    }

    // A socket bound but not listening still holds the port: b's agent does not release it.
    // The bind waits for the release of `held`'s port: while the agent releases a port it holds
    // it for a moment with its probe (probe.rs), and a bind on the PU in that moment fails.
    drop(held);
    wait_owner(&pod, 7201, None);
    let bound = pod
        .on("b", || {
            let s =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.bind(&localhost(7201).into()).unwrap();
            s
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(10 * pod.config.poll_interval_ms));
    assert_eq!(owner(&pod, 7201).as_deref(), Some("b"));
    assert_eq!(bind_errno(&pod, "a", 7201), Some(libc::EADDRINUSE));

    // Released on b: a may take it, and then b may not.
    drop(bound);
    wait_owner(&pod, 7201, None);
    let on_a = listen(&pod, "a", 7201);
    assert_eq!(owner(&pod, 7201).as_deref(), Some("a"));
    assert_eq!(bind_errno(&pod, "b", 7201), Some(libc::EADDRINUSE));
    drop(on_a);
}

/// Binds `port` on the calling thread (inside a PU) as IPv4 or IPv6, with SO_REUSEADDR.
fn try_bind(port: u16, v6: bool) -> Result<socket2::Socket, i32> {
    let (domain, addr) = if v6 {
        (socket2::Domain::IPV6, SocketAddr::from(([0u16; 8], port)))
    } else {
        (socket2::Domain::IPV4, localhost(port))
    };
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)
        .map_err(|e| e.raw_os_error().unwrap_or(0))?;
    s.set_reuse_address(true)
        .map_err(|e| e.raw_os_error().unwrap_or(0))?;
    s.bind(&addr.into())
        .map_err(|e| e.raw_os_error().unwrap_or(0))?;
    Ok(s)
}

#[test]
fn a_bind_of_a_port_another_pu_owns_fails_at_once_without_any_agent() {
    // No agent runs: the kernel alone claims and refuses.
    let pod = pod("now", "");
    for (round, port) in (7210..7220).enumerate() {
        let (first, second) = if round % 2 == 0 {
            ("a", "b")
        } else {
            ("b", "a")
        };
        let held = pod
            .on(first, || try_bind(port, round % 4 < 2))
            .unwrap()
            .unwrap();
        // The very next bind, no poll in between.
        let refused = pod.on(second, || try_bind(port, round % 4 >= 2)).unwrap();
        assert_eq!(refused.err(), Some(libc::EADDRINUSE), "port {port}");
        assert_eq!(owner(&pod, port).as_deref(), Some(first));
        // The owner's own PU binds it as on one host (SO_REUSEADDR on both, not listening).
        assert!(pod.on(first, || try_bind(port, false)).unwrap().is_ok());
        drop(held);
    }
    // Port 0 binds are left to the kernel: each PU gets an ephemeral port.
    for pu in ["a", "b"] {
        assert!(pod.on(pu, || try_bind(0, false)).unwrap().is_ok());
    }
    let stats = flatmesh_kernel::PuPorts::stats(pod.table().path()).unwrap();
    assert_eq!(stats.refused, 10, "{stats:?}");
    assert_eq!(stats.claimed, 10, "{stats:?}");
}

#[test]
fn two_pus_racing_for_a_port_exactly_one_wins() {
    const ROUNDS: u16 = 300;
    let pod = pod("rce", "");
    let start = std::sync::Barrier::new(2);
    let results: Vec<Vec<Result<socket2::Socket, i32>>> = std::thread::scope(|scope| {
        let racers: Vec<_> = ["a", "b"]
            .into_iter()
            .enumerate()
            .map(|(i, pu)| {
                let (pod, start) = (&pod, &start);
                scope.spawn(move || {
                    pod.backend.enter_thread(pod.pu(pu).unwrap()).unwrap();
                    (0..ROUNDS)
                        .map(|round| {
                            start.wait();
                            // Both families: bind4 and bind6 consult one table.
                            try_bind(7600 + round, (round as usize + i).is_multiple_of(2))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let table = pod.table().read().unwrap();
    let mut wins = [0; 2];
    for (round, (a, b)) in results[0].iter().zip(&results[1]).enumerate() {
        let port = 7600 + round as u16;
        let winner = match (a, b) {
            (Ok(_), Err(libc::EADDRINUSE)) => "a",
            (Err(libc::EADDRINUSE), Ok(_)) => "b",
            other => panic!("port {port}: expected exactly one bind to succeed and the other to fail with EADDRINUSE, got {other:?}"),
        };
        wins[usize::from(winner == "b")] += 1;
        assert_eq!(
            table.ports.get(&port).map(String::as_str),
            Some(winner),
            "port {port}"
        );
    }
    eprintln!("{ROUNDS} races: a won {}, b won {}", wins[0], wins[1]);
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
        let record = record_for(&relay, local);
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
    assert_eq!(bind_errno(&pod, "a", 7301), Some(libc::EADDRINUSE));
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

    // The other agent crashes: binds on its PU are still refused (by the kernel).
    agent_a.kill().unwrap();
    agent_a.wait().unwrap();
    assert_eq!(bind_errno(&pod, "a", 7301), Some(libc::EADDRINUSE));
    // While it is down, b opens another port: only b's side of the table changes.
    let _svc2 = pod
        .on("b", || {
            EchoServer::start(listen_raw(7302), "svc2@b", Mode::Describe).unwrap()
        })
        .unwrap();
    wait_owner(&pod, 7302, Some("b"));
    assert_eq!(
        mapped(&pod, "a"),
        1,
        "nobody updates a's rules while its agent is down"
    );
    let mut agent_a = spawn("a");
    // The restarted agent catches up with what changed meanwhile.
    eventually("the restarted agent on a maps 7302", || {
        mapped(&pod, "a") == 2
    });
    for (port, name) in [(7301, "svc@b"), (7302, "svc2@b")] {
        let (answer, _) = pod.on("a", || ask(localhost(port), "y")).unwrap().unwrap();
        assert!(answer.starts_with(name), "{answer}");
    }

    // A clean stop (SIGTERM): the agent deregisters and exits 0; ports and rules stay.
    // SAFETY: kill with the pid of our own child and a valid signal.
    assert_eq!(unsafe { libc::kill(agent_b.id() as i32, libc::SIGTERM) }, 0);
    let status = wait_exit(&mut agent_b, Duration::from_secs(10));
    assert!(status.success(), "agent b exited with {status}");
    let state = pod.table().read().unwrap();
    assert_eq!(state.agents.get("b"), None, "{state:?}");
    assert_eq!(state.ports.get(&7301).map(String::as_str), Some("b"));
    let (answer, _) = pod.on("a", || ask(localhost(7301), "z")).unwrap().unwrap();
    assert!(answer.starts_with("svc@b"), "{answer}");
    agent_a.kill().unwrap();
    agent_a.wait().unwrap();
    host_has_no_tables();
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
        // Every map element is gone again, and the other PU may bind the ports (which claims
        // them for it until its agent releases them).
        eventually("all 100 unmapped", || mapped(&pod, other) == 0);
        assert!(ports.iter().all(|&p| bind_errno(&pod, other, p).is_none()));
        assert!(pod.wait_for_table(Duration::from_secs(10), |s| s.ports.is_empty()));
    }
}

/// Removes a split namespace when dropped, for the tests that build one without a `Pod`.
struct Remove(String);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = flatmesh_pu::cleanup::cleanup(Some(&self.0), std::path::Path::new(STATE_DIR));
    }
}

#[test]
fn the_next_start_cleans_up_after_a_crashed_run() {
    require_root();
    reap_stale();
    let config = config("cln", "");
    let _guard = Remove(config.namespace.clone());
    let backend = flatmesh_pu::backend::for_config(&config);
    let table_dir = config.table_dir();

    // A run that crashes: PUs up, both agents running (real processes, rules written, table
    // filled), an app process on PU a; then everything is killed with SIGKILL, no destructor runs.
    backend.up().unwrap();
    std::fs::create_dir_all(&table_dir).unwrap();
    let yaml = table_dir.join("split.yaml");
    std::fs::write(&yaml, config_text("cln", "")).unwrap();
    let mut agents: Vec<_> = ["a", "b"]
        .iter()
        .map(|pu| {
            backend
                .command(
                    config.pu_index(pu).unwrap(),
                    env!("CARGO_BIN_EXE_flatmesh-pu-agent").as_ref(),
                )
                .unwrap()
                .args(["--pu", pu, "--config"])
                .arg(&yaml)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut app = backend
        .command(0, "sleep".as_ref())
        .unwrap()
        .arg("60")
        .spawn()
        .unwrap();
    let table = flatmesh_pu::PortTable::new(&config);
    eventually("both agents registered", || {
        table.read().is_ok_and(|s| s.agents.len() == 2)
    });
    let nft_table = backend.topology().nft_table();
    eventually("both PUs have their rules", || {
        (0..2).all(|pu| {
            flatmesh_pu::backend::run_on(backend.as_ref(), pu, || {
                flatmesh_pu::exec::run("nft", &["list", "table", "ip", &nft_table]).is_ok()
            })
            .unwrap()
        })
    });
    let old_ns =
        flatmesh_pu::netns::id_of(&flatmesh_pu::netns::path(&backend.topology().netns(0))).unwrap();
    for agent in &mut agents {
        agent.kill().unwrap();
        agent.wait().unwrap();
    }
    assert!(!flatmesh_pu::cleanup::leftovers(&config.namespace, &table_dir).is_empty());

    // The next start of the same namespace removes all of it first: the app left in the PU is
    // stopped, the namespaces (with their veths and rules) and the table are new.
    let pod = flatmesh_pu::pod::Pod::up(config.clone()).unwrap();
    let exited = (0..500).any(|_| {
        let done = app.try_wait().unwrap().is_some();
        if !done {
            std::thread::sleep(Duration::from_millis(10));
        }
        done
    });
    assert!(
        exited,
        "the process left in the crashed PU is still running"
    );
    let new_ns =
        flatmesh_pu::netns::id_of(&flatmesh_pu::netns::path(&backend.topology().netns(0))).unwrap();
    assert_ne!(old_ns, new_ns, "PU a was not re-created");
    assert_eq!(
        pod.table().read().unwrap(),
        flatmesh_pu::TableState::empty()
    );
    assert_eq!(rules_text(&pod, "a"), "", "old rules survived");
    pod.down().unwrap();
    assert_eq!(
        flatmesh_pu::cleanup::leftovers(&config.namespace, &table_dir),
        Vec::<String>::new()
    );

    // `flatmesh pu cleanup` (the library call) finds the leftovers of a crash just as well.
    backend.up().unwrap();
    std::fs::create_dir_all(&table_dir).unwrap();
    let report =
        flatmesh_pu::cleanup::cleanup(Some(&config.namespace), std::path::Path::new(STATE_DIR))
            .unwrap();
    assert_eq!(report.netns.len(), 2, "{report:?}");
    assert_eq!(report.state_dirs, vec![table_dir.clone()]);
    assert_eq!(
        report.port_tables,
        vec![flatmesh_pu::topology::pin_dir(&config.namespace)]
    );
    assert_eq!(
        flatmesh_pu::cleanup::leftovers(&config.namespace, &table_dir),
        Vec::<String>::new()
    );
    host_has_no_tables();
}

#[test]
fn interception_follows_the_proxy_to_the_other_pu() {
    let mut pod = pod(
        "mov",
        "intercept:\n  - { proxy_port: 15001, ports: [80] }\n",
    );
    route_to_nowhere(&pod, "b");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let target: SocketAddr = "10.96.0.10:80".parse().unwrap();
    let relay_b = pod
        .on("b", || Relay::start(listen_raw(15001)).unwrap())
        .unwrap();
    wait_owner(&pod, 15001, Some("b"));
    eventually("a sends port 80 to b", || {
        rules_text(&pod, "a").contains("meta mark set 0x4d500001")
    });
    // The proxy moves: b's goes away, one starts on a. The agents rewrite the split rules.
    drop(relay_b);
    wait_owner(&pod, 15001, None);
    let relay_a = pod
        .on("a", || Relay::start(listen_raw(15001)).unwrap())
        .unwrap();
    wait_owner(&pod, 15001, Some("a"));
    eventually("b sends port 80 to a", || {
        rules_text(&pod, "b").contains("meta mark set 0x4d500000")
    });
    let local = pod
        .on("b", || {
            let s = TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
            assert_eq!(s.peer_addr().unwrap(), target);
            s.local_addr().unwrap()
        })
        .unwrap();
    let record = record_for(&relay_a, local);
    assert_eq!(record.original_dst.map(SocketAddr::V4), Some(target));
    host_has_no_tables();
}

/// Sets the calling thread's effective (and so file-system) uid with the raw system call, which,
/// unlike libc's setresuid, changes this thread only. Sockets it creates belong to `uid`.
fn set_thread_euid(uid: u32) {
    // SAFETY: setresuid with -1 (unchanged) for the real and saved ids.
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, u32::MAX, uid, u32::MAX) };
    assert_eq!(rc, 0, "setresuid: {}", std::io::Error::last_os_error());
}

#[test]
fn interception_on_the_proxy_pu_exempts_the_proxy_uid() {
    // The proxy runs as root here (uid 0), the app on the same PU as uid 4242.
    let mut pod = pod(
        "uid",
        "intercept:\n  - { proxy_port: 15001, ports: [80], proxy_uid: 0 }\n",
    );
    route_to_nowhere(&pod, "b");
    pod.start_agent("a").unwrap();
    pod.start_agent("b").unwrap();
    let relay = pod
        .on("b", || Relay::start(listen_raw(15001)).unwrap())
        .unwrap();
    wait_owner(&pod, 15001, Some("b"));
    eventually("b intercepts its own apps", || {
        rules_text(&pod, "b").contains("meta skuid != 0")
    });
    let target: SocketAddr = "10.96.0.10:80".parse().unwrap();
    let local = pod
        .on("b", || {
            set_thread_euid(4242);
            let s = TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
            assert_eq!(s.peer_addr().unwrap(), target);
            s.local_addr().unwrap()
        })
        .unwrap();
    let record = record_for(&relay, local);
    assert_eq!(record.original_dst.map(SocketAddr::V4), Some(target));
    // The proxy's own uid is not intercepted: its connection goes out (and here, nowhere).
    let before = relay.records().len();
    let own = pod
        .on("b", || {
            TcpStream::connect_timeout(&target, Duration::from_millis(300))
        })
        .unwrap();
    assert_eq!(own.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(relay.records().len(), before);
}

#[test]
fn one_agent_per_pu_and_clear_errors_for_bad_input() {
    let mut pod = pod("lck", "");
    pod.start_agent("a").unwrap();
    let dir = pod.config.table_dir();
    eventually("agent a registered", || {
        pod.table().read().is_ok_and(|s| s.agents.contains_key("a"))
    });
    let yaml = dir.join("split.yaml");
    std::fs::write(&yaml, config_text("lck", "")).unwrap();
    let other = dir.join("other.yaml");
    std::fs::write(
        &other,
        config_text("lck", "")
            .replace(&pod.config.namespace, &format!("{}x", pod.config.namespace)),
    )
    .unwrap();
    let agent = |args: &[&str]| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_flatmesh-pu-agent"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = wait_exit(&mut child, Duration::from_secs(10));
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        (status, err)
    };
    let y = yaml.to_str().unwrap();
    for (args, needle) in [
        (vec!["--pu", "a", "--config", y], "already running"),
        (vec!["--pu", "nope", "--config", y], "no PU named `nope`"),
        (
            vec!["--pu", "a", "--config", "/nonexistent.yaml"],
            "cannot read /nonexistent.yaml",
        ),
        (
            vec!["--pu", "a", "--config", other.to_str().unwrap()],
            "flatmesh pu up",
        ),
        (vec!["--pu", "a"], "usage"),
    ] {
        let (status, err) = agent(&args);
        assert!(!status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // Once the running agent has stopped, a new one starts.
    pod.stop_agent("a").unwrap();
    let mut child = pod
        .backend
        .command(0, env!("CARGO_BIN_EXE_flatmesh-pu-agent").as_ref())
        .unwrap()
        .args(["--pu", "a", "--config", y])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    eventually("the new agent of a registers", || {
        pod.table()
            .read()
            .is_ok_and(|s| s.agents.get("a") == Some(&pid))
    });
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn the_agent_never_writes_rules_outside_its_pu() {
    let pod = pod("hst", "");
    let mut agent = flatmesh_pu::Agent::new(&pod.config, "a").unwrap();
    // On a thread of the host namespace: refused before anything is written.
    let e = agent.start(pod.backend.as_ref()).unwrap_err().to_string();
    assert!(e.contains("refusing to write rules"), "{e}");
    host_has_no_tables();
    // Started on its PU, then called from another PU's thread or the host's: refused.
    let backend = pod.backend.clone();
    let mut agent = pod
        .on("a", move || {
            agent.start(backend.as_ref()).unwrap();
            agent
        })
        .unwrap();
    let e = agent.tick().unwrap_err().to_string();
    assert!(e.contains("not in its network namespace"), "{e}");
    let (agent, e) = pod
        .on("b", move || {
            let r = agent.tick().map(|_| ());
            (agent, r)
        })
        .unwrap();
    assert!(e.is_err());
    assert_eq!(rules_text(&pod, "b"), "", "b got a's rules");
    host_has_no_tables();
    drop(agent);
}
