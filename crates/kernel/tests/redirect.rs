//! Local-hop redirect with real TCP sockets: bytes arrive intact, and they never crossed the
//! TCP stack (TCP_INFO byte counters stay at zero while the sk_msg counters grow).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use flatmesh_kernel::KernelTier;

fn tier(test: &str) -> KernelTier {
    require_root();
    let mut cfg = config(test);
    cfg.redirect = true;
    KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"))
}

/// Echoes `n` bytes in chunks through a client/server pair; returns the pair.
fn echo_pair(port: u16, listener: &std::net::TcpListener, n: usize) -> (TcpStream, TcpStream) {
    let mut client =
        TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("connect: {e}"));
    let (mut server, _) = listener.accept().unwrap_or_else(|e| panic!("accept: {e}"));
    let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        let mut seen = 0;
        while seen < n {
            let k = server
                .read(&mut buf)
                .unwrap_or_else(|e| panic!("server read: {e}"));
            assert!(k > 0, "EOF after {seen} of {n} bytes");
            server
                .write_all(&buf[..k])
                .unwrap_or_else(|e| panic!("server write: {e}"));
            seen += k;
        }
        server
    });
    let writer = {
        let mut c = client.try_clone().unwrap_or_else(|e| panic!("clone: {e}"));
        let data = data.clone();
        std::thread::spawn(move || {
            for chunk in data.chunks(10_000) {
                c.write_all(chunk)
                    .unwrap_or_else(|e| panic!("client write: {e}"));
            }
        })
    };
    let back = read_n(&mut client, n);
    let _ = writer.join();
    let server = echo
        .join()
        .unwrap_or_else(|_| panic!("echo thread panicked"));
    assert!(back == data, "echoed bytes differ from the bytes sent");
    (client, server)
}

#[test]
fn local_hop_bytes_skip_the_tcp_stack() {
    let tier = tier("redirect");
    let (listener, port) = listener();
    let (control_listener, control_port) = common::listener();
    tier.add_redirect_port(port)
        .unwrap_or_else(|e| panic!("{e}"));

    const N: usize = 4 << 20;
    let before = tier
        .status()
        .unwrap_or_else(|e| panic!("{e}"))
        .stat("fm_sk_msg");
    let (client, server) = echo_pair(port, &listener, N);
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    let moved = st.stat("fm_sk_msg").bytes - before.bytes;
    assert!(
        moved >= 2 * N as u64,
        "sk_msg moved {moved} bytes, expected both directions of {N}\n{st}"
    );
    assert!(st.entries("fm_redirect_socks") >= 2, "{st}");
    let (_, srv_rx) = tcp_bytes(&server);
    let (cli_acked, cli_rx) = tcp_bytes(&client);
    // TCP counts the SYN and FIN as one byte each; payload would be millions.
    assert!(srv_rx <= 1 && cli_rx <= 1 && cli_acked <= 1,
        "payload crossed TCP: server received {srv_rx}, client received {cli_rx}, client acked {cli_acked}");

    // The same transfer on a port that is not a local hop goes through TCP: the check above
    // can tell the difference.
    let (client, server) = echo_pair(control_port, &control_listener, 64 * 1024);
    assert!(tcp_bytes(&server).1 >= 64 * 1024 && tcp_bytes(&client).1 >= 64 * 1024);
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn half_close_reset_and_close_mid_transfer() {
    let tier = tier("redirect-close");
    let (listener, port) = listener();
    tier.add_redirect_port(port)
        .unwrap_or_else(|e| panic!("{e}"));

    // Half-close: the client's FIN reaches the server after its data; the server still answers.
    {
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
        let (mut s, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        write_all(&mut c, b"request");
        c.shutdown(Shutdown::Write)
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut got = Vec::new();
        s.read_to_end(&mut got)
            .unwrap_or_else(|e| panic!("server read_to_end: {e}"));
        assert_eq!(got, b"request");
        write_all(&mut s, b"response");
        drop(s);
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        let mut back = Vec::new();
        c.read_to_end(&mut back)
            .unwrap_or_else(|e| panic!("client read_to_end: {e}"));
        assert_eq!(back, b"response");
        assert!(
            tcp_bytes(&c).1 <= 1,
            "response crossed TCP (only the FIN may)"
        );
    }

    // Reset: the server aborts; the client sees an error or EOF, never a hang.
    {
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
        let (s, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .unwrap_or_else(|e| panic!("{e}"));
        drop(s);
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        let mut buf = [0u8; 16];
        match c.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("after a reset the client read {other:?}"),
        }
    }

    // Close mid-transfer: the writer closes with data still unread; the reader gets all of
    // it, then EOF; the sockhash forgets both sockets.
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let (mut s, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
    let data = vec![0x5au8; 200_000];
    let w = std::thread::spawn(move || {
        c.write_all(&data).unwrap_or_else(|e| panic!("{e}"));
        drop(c);
    });
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap_or_else(|e| panic!("{e}"));
    let _ = w.join();
    assert_eq!(got.len(), 200_000);
    assert!(got.iter().all(|b| *b == 0x5a));
    drop(s);
    eventually("closed sockets to leave the sockhash", || {
        let st = tier.status().ok()?;
        (st.entries("fm_redirect_socks") == 0).then_some(())
    });
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_thousand_concurrent_local_hops() {
    let tier = tier("redirect-1000");
    let (listener, port) = listener();
    tier.add_redirect_port(port)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut pairs = Vec::new();
    for _ in 0..1000 {
        let c = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("connect: {e}"));
        let (s, _) = listener.accept().unwrap_or_else(|e| panic!("accept: {e}"));
        pairs.push((c, s));
    }
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(st.entries("fm_redirect_socks"), 2000, "{st}");
    // All open at once: each pair carries its own id both ways.
    for (i, (c, _)) in pairs.iter_mut().enumerate() {
        write_all(c, format!("{i:08}").as_bytes());
    }
    for (i, (_, s)) in pairs.iter_mut().enumerate() {
        assert_eq!(read_n(s, 8), format!("{i:08}").into_bytes());
        write_all(s, format!("{:08}", i * 3).as_bytes());
    }
    for (i, (c, s)) in pairs.iter_mut().enumerate() {
        assert_eq!(read_n(c, 8), format!("{:08}", i * 3).into_bytes());
        assert!(tcp_bytes(s).1 <= 1, "pair {i} crossed TCP");
    }
    drop(pairs);
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn dual_stack_listeners_are_local_hops_too() {
    // A server on [::] (dual stack, as Go, iperf3 and many others listen) accepts IPv4
    // clients on AF_INET6 sockets with v4-mapped addresses; both ends must still find each other.
    let tier = tier("redirect-dual");
    let listener =
        std::net::TcpListener::bind("[::]:0").unwrap_or_else(|e| panic!("bind [::]: {e}"));
    let port = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port();
    tier.add_redirect_port(port)
        .unwrap_or_else(|e| panic!("{e}"));
    let (client, server) = echo_pair(port, &listener, 256 * 1024);
    assert!(
        tcp_bytes(&server).1 <= 1 && tcp_bytes(&client).1 <= 1,
        "payload crossed TCP on a dual-stack hop: server {:?}, client {:?}",
        tcp_bytes(&server),
        tcp_bytes(&client)
    );
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

/// One proxied connection, set up by hand the way the node does it: client `c` to the
/// proxy listener (accepted as `a`), proxy upstream `u` to the backend (accepted as `b`).
struct Proxied {
    c: TcpStream,
    a: TcpStream,
    u: TcpStream,
    b: TcpStream,
}

fn proxied(tier: &KernelTier) -> (Proxied, std::net::TcpListener, std::net::TcpListener) {
    let (front, front_port) = listener();
    let (back, back_port) = listener();
    tier.add_redirect_port(front_port)
        .unwrap_or_else(|e| panic!("{e}"));
    tier.add_redirect_port(back_port)
        .unwrap_or_else(|e| panic!("{e}"));
    let c = TcpStream::connect(("127.0.0.1", front_port)).unwrap_or_else(|e| panic!("{e}"));
    let (a, _) = front.accept().unwrap_or_else(|e| panic!("{e}"));
    let u = TcpStream::connect(("127.0.0.1", back_port)).unwrap_or_else(|e| panic!("{e}"));
    let (b, _) = back.accept().unwrap_or_else(|e| panic!("{e}"));
    (Proxied { c, a, u, b }, front, back)
}

/// The proxy's relay of one direction while the shortcut is armed: read `from`, write
/// `to`, arm `sender -> receiver` with the running total. Returns the bytes it relayed.
fn arming_relay(
    tier: &KernelTier,
    mut from: TcpStream,
    mut to: TcpStream,
    sender: flatmesh_kernel::SockKey,
    receiver: flatmesh_kernel::SockKey,
    armed: std::sync::mpsc::Sender<u64>,
) -> u64 {
    let mut forwarded = 0u64;
    tier.direct_arm(&sender, &receiver, 0)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("relay read: {e}"));
        if n == 0 {
            let _ = to.shutdown(Shutdown::Write);
            return forwarded;
        }
        to.write_all(&buf[..n])
            .unwrap_or_else(|e| panic!("relay write: {e}"));
        forwarded += n as u64;
        tier.direct_arm(&sender, &receiver, forwarded)
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = armed.send(forwarded);
    }
}

#[test]
fn socket_direct_skips_the_proxy_and_keeps_the_byte_order() {
    let tier = tier("redirect-direct");
    let (p, _front, _back) = proxied(&tier);
    let client_key = flatmesh_kernel::SockKey::of_peer(&p.a).unwrap_or_else(|e| panic!("{e}"));
    let backend_key = flatmesh_kernel::SockKey::of_peer(&p.u).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(client_key.local(), p.c.local_addr().ok());
    assert_eq!(backend_key.local(), p.b.local_addr().ok());
    tier.direct_begin(&client_key, &backend_key)
        .unwrap_or_else(|e| panic!("{e}"));

    // The client streams a position-dependent pattern while the proxy relays and arms, so
    // the switch from the proxy path to the direct path happens mid-stream, under load. The
    // switch needs the proxy to catch up with the client once; on a busy machine a fast
    // writer may never let it, so halfway the writer waits (bounded) until the proxy has
    // armed with everything written so far, or the shortcut has already taken over.
    const N: usize = 8 << 20;
    let pattern = |i: usize| (i % 251) as u8;
    let mut c = p.c.try_clone().unwrap_or_else(|e| panic!("{e}"));
    let (started_tx, started) = std::sync::mpsc::channel();
    let (armed_tx, armed) = std::sync::mpsc::channel::<u64>();
    let writer_tier = tier.clone();
    let writer = std::thread::spawn(move || {
        let data: Vec<u8> = (0..N).map(pattern).collect();
        let mut written = 0usize;
        for (i, chunk) in data.chunks(1000).enumerate() {
            c.write_all(chunk)
                .unwrap_or_else(|e| panic!("client write: {e}"));
            written += chunk.len();
            if i == 1000 {
                // 1 MB is on its way to the proxy before the proxy has armed anything.
                let _ = started_tx.send(());
            }
            if i == N / 2000 {
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    let direct = writer_tier
                        .status()
                        .unwrap_or_else(|e| panic!("{e}"))
                        .stat("fm_sk_msg_direct")
                        .bytes;
                    if direct > 0 {
                        break;
                    }
                    match armed.recv_timeout(Duration::from_millis(50)) {
                        Ok(n) if n >= written as u64 => break,
                        _ if Instant::now() > deadline => {
                            panic!("the proxy did not catch up with {written} bytes in 20 s")
                        }
                        _ => {}
                    }
                }
            }
        }
        c.shutdown(Shutdown::Write)
            .unwrap_or_else(|e| panic!("{e}"));
    });
    started
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("the client did not start writing: {e}"));
    let relay_tier = tier.clone();
    let (a, u) = (
        p.a.try_clone().unwrap_or_else(|e| panic!("{e}")),
        p.u.try_clone().unwrap_or_else(|e| panic!("{e}")),
    );
    let relay = std::thread::spawn(move || {
        arming_relay(&relay_tier, a, u, client_key, backend_key, armed_tx)
    });
    let mut b = p.b.try_clone().unwrap_or_else(|e| panic!("{e}"));
    let _ = b.set_read_timeout(Some(Duration::from_secs(20)));
    let mut got = Vec::with_capacity(N);
    b.read_to_end(&mut got)
        .unwrap_or_else(|e| panic!("backend read: {e}"));
    writer.join().unwrap_or_else(|_| panic!("writer panicked"));
    let relayed = relay.join().unwrap_or_else(|_| panic!("relay panicked"));
    assert_eq!(got.len(), N, "the backend got every byte, then EOF");
    if let Some(i) = (0..N).find(|&i| got[i] != pattern(i)) {
        panic!(
            "byte {i} out of order: {} instead of {} (relayed {relayed})",
            got[i],
            pattern(i)
        );
    }

    // The backend answers; its bytes go straight to the client (nothing forwarded yet: the
    // shortcut takes effect on its first message).
    tier.direct_arm(&backend_key, &client_key, 0)
        .unwrap_or_else(|e| panic!("{e}"));
    write_all(
        &mut p.b.try_clone().unwrap_or_else(|e| panic!("{e}")),
        b"answer",
    );
    let mut c = p.c.try_clone().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(read_n(&mut c, 6), b"answer");
    let _ = p.u.set_nonblocking(true);
    let mut probe = [0u8; 16];
    assert!(
        matches!((&p.u).read(&mut probe), Err(e) if e.kind() == ErrorKind::WouldBlock),
        "the answer reached the proxy's upstream socket instead of going direct"
    );

    let direct = tier
        .direct_end(&client_key, &backend_key)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        direct.client_to_backend + relayed,
        N as u64,
        "direct plus relayed bytes are all the bytes: {direct:?}, relayed {relayed}"
    );
    assert!(
        direct.client_to_backend > 0,
        "nothing went direct: {direct:?}"
    );
    assert!(
        relayed >= 1_000_000,
        "the first megabyte went through the proxy: relayed {relayed}"
    );
    eprintln!("socket direct: relayed {relayed}, direct {direct:?}");
    assert_eq!(direct.backend_to_client, 6, "{direct:?}");
    // None of it crossed TCP on any of the four sockets (SYN/FIN count one each).
    for (name, s) in [
        ("client", &p.c),
        ("accepted", &p.a),
        ("upstream", &p.u),
        ("backend", &p.b),
    ] {
        assert!(
            tcp_bytes(s).1 <= 1,
            "{name} received payload through TCP: {:?}",
            tcp_bytes(s)
        );
    }
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        st.stat("fm_sk_msg_direct").bytes,
        N as u64 - relayed + 6,
        "{st}"
    );
    assert_eq!(st.entries("fm_shortcuts"), 0, "{st}");
    assert_eq!(st.entries("fm_direct_bytes"), 0, "{st}");
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

/// Child helper: in its own network namespace (the parent runs it under `unshare -n`),
/// brings loopback up, opens a connection on port FM_NETNS_PORT, exchanges a line, prints
/// "open", and holds the connection until stdin closes.
#[test]
#[ignore = "helper run as a child process in a new network namespace"]
fn child_hop_in_other_netns() {
    let Ok(port) = std::env::var("FM_NETNS_PORT") else {
        return;
    };
    let up = std::process::Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .unwrap_or_else(|e| panic!("ip link set lo up: {e}"));
    assert!(up.success(), "ip link set lo up failed");
    let l = std::net::TcpListener::bind(format!("127.0.0.1:{port}"))
        .unwrap_or_else(|e| panic!("bind in the new namespace: {e}"));
    let mut c = TcpStream::connect(format!("127.0.0.1:{port}")).unwrap_or_else(|e| panic!("{e}"));
    let (mut s, _) = l.accept().unwrap_or_else(|e| panic!("{e}"));
    write_all(&mut c, b"ping");
    assert_eq!(read_n(&mut s, 4), b"ping");
    println!("open");
    let _ = std::io::stdout().flush();
    let mut wait = String::new();
    let _ = std::io::stdin().read_line(&mut wait);
}

#[test]
fn sockets_of_other_network_namespaces_are_left_alone() {
    let tier = tier("redirect-netns");
    let (listener, port) = listener();
    tier.add_redirect_port(port)
        .unwrap_or_else(|e| panic!("{e}"));
    // The same port in another namespace (as a second node, or a pod, would have it).
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let mut child = std::process::Command::new("unshare")
        .arg("-n")
        .arg(exe)
        .args([
            "child_hop_in_other_netns",
            "--exact",
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env("FM_NETNS_PORT", port.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("unshare -n (util-linux) is needed: {e}"));
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap_or_else(|| panic!("stdout")));
    child_line(&mut out, "open");
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        st.entries("fm_redirect_socks"),
        0,
        "the other namespace's hop joined this node's sockhash\n{st}"
    );
    // Control: the same port in this namespace does join.
    let c = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let (s, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(st.entries("fm_redirect_socks"), 2, "{st}");
    drop((c, s));
    drop(child.stdin.take());
    let status = child.wait().unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "the child in the other namespace failed");
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}
