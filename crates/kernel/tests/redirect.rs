//! Local-hop redirect with real TCP sockets: bytes arrive intact, and they never crossed the
//! TCP stack (TCP_INFO byte counters stay at zero while the sk_msg counters grow).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

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
