//! The L4 relay of `tcp` listeners: large transfers in both directions, half-close, resets.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::backends::{pattern, TcpBackend, TcpEnd, TcpMode};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn tcp_config(admin: SocketAddr, listen: SocketAddr, upstream: SocketAddr) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: db
    address: {listen}
    protocol: tcp
    cluster: db
clusters:
  - name: db
    endpoints: [ {upstream} ]
"#
    )
}

async fn connect(addr: SocketAddr) -> TcpStream {
    tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfer_both_directions_is_byte_exact() {
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (admin, listen) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&tcp_config(admin, listen, echo.addr));

    const LEN: usize = 64 * 1024 * 1024;
    let data = pattern(LEN, 0x5eed);
    let want_crc = crc32fast::hash(&data);
    let stream = connect(listen).await;
    let (mut rd, mut wr) = stream.into_split();
    let started = Instant::now();
    // Write and read at the same time: the echo backend writes back while we still send,
    // so a relay that does not pump both directions concurrently deadlocks.
    let writer = tokio::spawn(async move {
        for chunk in data.chunks(256 * 1024) {
            wr.write_all(chunk).await?;
        }
        wr.shutdown().await?;
        Ok::<_, std::io::Error>(())
    });
    let reader = tokio::spawn(async move {
        let mut hasher = crc32fast::Hasher::new();
        let mut total = 0usize;
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            total += n;
        }
        Ok::<_, std::io::Error>((total, hasher.finalize()))
    });
    let limit = Duration::from_secs(120);
    tokio::time::timeout(limit, writer)
        .await
        .expect("sending 64 MiB through the relay took over 120 s")
        .expect("writer task")
        .expect("write through the relay");
    let (total, crc) = tokio::time::timeout(limit, reader)
        .await
        .expect("reading 64 MiB back took over 120 s")
        .expect("reader task")
        .expect("read through the relay");
    assert_eq!(total, LEN, "bytes echoed back");
    assert_eq!(crc, want_crc, "echoed data differs from what was sent");
    eprintln!(
        "64 MiB each way through the relay in {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_client_shuts_write_and_still_reads_the_reply() {
    let counter = TcpBackend::start(TcpMode::Count).await;
    let (admin, listen) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&tcp_config(admin, listen, counter.addr));

    let data = pattern(1024 * 1024 + 17, 7);
    let mut stream = connect(listen).await;
    stream.write_all(&data).await.expect("write");
    // FIN from the client must reach the backend (it answers only after EOF), while the
    // path back to the client stays open.
    stream.shutdown().await.expect("shutdown write side");
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut reply))
        .await
        .expect("the backend's reply after half-close arrived within 10 s (was the FIN relayed?)")
        .expect("read reply");
    assert_eq!(
        reply,
        format!("{} {}\n", data.len(), crc32fast::hash(&data))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_reaches_the_client() {
    let resetter = TcpBackend::start(TcpMode::Reset).await;
    let (admin, listen) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&tcp_config(admin, listen, resetter.addr));

    let mut stream = connect(listen).await;
    stream
        .write_all(b"hello, then reset me")
        .await
        .expect("write");
    let mut buf = [0u8; 64];
    let got = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok(0),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the client saw the upstream's reset within 5 s");
    match got {
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "unexpected error {e}"
        ),
        Ok(_) => panic!(
            "upstream sent RST but the client got a clean EOF: a reset must propagate as a reset"
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reset_reaches_the_upstream() {
    let mut hold = TcpBackend::start(TcpMode::Hold).await;
    let (admin, listen) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&tcp_config(admin, listen, hold.addr));

    let mut stream = connect(listen).await;
    stream.write_all(b"some bytes").await.expect("write");
    // Make sure the relay has connected upstream before the client resets.
    let accepted = hold.accepted.clone();
    assert!(
        eventually(Duration::from_secs(5), || {
            let accepted = accepted.clone();
            async move { accepted.load(std::sync::atomic::Ordering::Relaxed) == 1 }
        })
        .await,
        "the relay never connected to the upstream"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    stream.set_zero_linger().expect("SO_LINGER 0");
    drop(stream);
    let end = hold
        .next_end(Duration::from_secs(5))
        .await
        .expect("the upstream connection ended within 5 s of the client's reset");
    match end {
        TcpEnd::Error(n, kind) => {
            assert_eq!(
                kind,
                std::io::ErrorKind::ConnectionReset,
                "upstream saw {kind:?}"
            );
            assert_eq!(n, 10);
        }
        TcpEnd::Eof(n) => panic!(
            "upstream saw a clean EOF after {n} bytes; a client reset should propagate as a reset"
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_closes_the_client_promptly() {
    let dead = free_addr(); // nothing listens there
    let (admin, listen) = (free_addr(), free_addr());
    let proxy = TestNode::start(&tcp_config(admin, listen, dead));
    // The proxy may reset the client as soon as the upstream refuses, which can land before
    // our connect() has finished: that counts as closed promptly too.
    let mut stream = match TcpStream::connect(listen).await {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
            proxy
                .assert_alive("after an unreachable TCP upstream")
                .await;
            return;
        }
        Err(e) => panic!("connect to {listen}: {e}"),
    };
    let _ = stream.write_all(b"anyone?").await;
    let mut buf = [0u8; 16];
    let res = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .expect("the client connection was closed within 5 s when the upstream is unreachable");
    match res {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected {n} bytes from an unreachable upstream"),
    }
    proxy
        .assert_alive("after an unreachable TCP upstream")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_connections() {
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (admin, listen) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&tcp_config(admin, listen, echo.addr));
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        tasks.push(tokio::spawn(async move {
            let data = pattern(64 * 1024 + i as usize, i + 1);
            let mut s = connect(listen).await;
            s.write_all(&data).await.expect("write");
            s.shutdown().await.expect("shutdown");
            let mut back = Vec::new();
            tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut back))
                .await
                .expect("echo in time")
                .expect("read");
            assert!(
                back == data,
                "connection {i}: echoed data differs ({} vs {} bytes)",
                back.len(),
                data.len()
            );
        }));
    }
    for t in tasks {
        t.await.expect("connection task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_from_the_upstream_keeps_the_other_direction_open() {
    let mut greeter = TcpBackend::start(TcpMode::GreetThenHold).await;
    let (admin, listen) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&tcp_config(admin, listen, greeter.addr));

    let mut stream = connect(listen).await;
    // The upstream writes `hello` and shuts its write side: we see the bytes, then EOF...
    let mut greeting = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut greeting))
        .await
        .expect("the upstream's FIN reached the client within 5 s")
        .expect("read greeting");
    assert_eq!(greeting, b"hello");
    // ...and our direction still works: the upstream receives everything we send after that.
    let data = pattern(300 * 1024, 5);
    stream
        .write_all(&data)
        .await
        .expect("write after the upstream's half-close");
    stream.shutdown().await.expect("shutdown");
    let end = greeter
        .next_end(Duration::from_secs(5))
        .await
        .expect("the upstream saw our EOF within 5 s");
    assert_eq!(
        end,
        TcpEnd::Eof(data.len() as u64),
        "bytes the upstream got after its half-close"
    );
}
