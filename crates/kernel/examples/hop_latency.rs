//! Local-hop latency with and without the sockmap redirect: 64-byte TCP ping-pong over
//! loopback, one connection each, same process. Prints p50/p99 round-trip times.
//!
//! Run as root: `cargo run --release -p flatmesh-kernel --example hop_latency -- 20000`
//! (pin it with `taskset -c 1` for steadier numbers).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use flatmesh_kernel::{KernelConfig, KernelTier};

mod common;
use common::pct;

fn ping_pong(listener: &TcpListener, rounds: usize) -> std::io::Result<Vec<Duration>> {
    let port = listener.local_addr()?.port();
    let mut client = TcpStream::connect(("127.0.0.1", port))?;
    let (mut server, _) = listener.accept()?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut b = [0u8; 64];
        loop {
            if server.read_exact(&mut b).is_err() {
                return Ok(());
            }
            server.write_all(&b)?;
        }
    });
    let rtts = common::timed_rounds(&mut client, rounds, 7)?;
    drop(client);
    let _ = echo.join();
    Ok(rtts)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds = common::rounds_arg()?;
    let cfg = KernelConfig {
        pin_dir: format!("/sys/fs/bpf/fm-hop-latency-{}", std::process::id()).into(),
        capture: None,
        redirect: true,
        l7_dispatch: false,
        ..KernelConfig::default()
    };
    let tier = KernelTier::attach(&cfg)?;
    let plain = TcpListener::bind("127.0.0.1:0")?;
    let redirected = TcpListener::bind("127.0.0.1:0")?;
    tier.add_redirect_port(redirected.local_addr()?.port())?;
    // Alternate so drift on a noisy machine hits both alike.
    let mut rows = Vec::new();
    for round in 0..3 {
        let a = ping_pong(&plain, rounds)?;
        let b = ping_pong(&redirected, rounds)?;
        rows.push((round, a, b));
    }
    println!("64 B ping-pong, {rounds} round trips per run, µs");
    println!("run  tcp_p50  tcp_p99  sockmap_p50  sockmap_p99");
    for (round, a, b) in &rows {
        println!(
            "{round:>3}  {:>7.2}  {:>7.2}  {:>11.2}  {:>11.2}",
            pct(a, 0.5),
            pct(a, 0.99),
            pct(b, 0.5),
            pct(b, 0.99)
        );
    }
    let st = tier.status()?;
    println!(
        "fm_sk_msg redirected {} bytes in {} messages",
        st.stat("fm_sk_msg").bytes,
        st.stat("fm_sk_msg").hits
    );
    tier.detach()?;
    Ok(())
}
