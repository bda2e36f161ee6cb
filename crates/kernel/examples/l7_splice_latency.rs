//! Proxied ping-pong latency: a user-space relay (read/write per message, what a userspace L4/L7
//! proxy does at best) against the tier-K L7 splice (first request decided by the sk_skb verdict,
//! the rest moved by the kernel). 64-byte messages over loopback, one connection each.
//!
//! Run as root: `taskset -c 1 cargo run --release -p flatmesh-kernel --example l7_splice_latency -- 20000`

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use flatmesh_kernel::{
    KernelAction, KernelConfig, KernelEntry, KernelTier, L7Decision, PathKey, Protocols,
};

mod common;
use common::pct;

const FIRST: &[u8; 64] =
    b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";

fn echo_backend() -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let _ = s.set_nodelay(true);
            std::thread::spawn(move || {
                let mut b = [0u8; 64];
                while s.read_exact(&mut b).is_ok() {
                    if s.write_all(&b).is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(addr)
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut b = [0u8; 16 * 1024];
    while let Ok(n) = from.read(&mut b) {
        if n == 0 || to.write_all(&b[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Classic user-space relay: one thread per direction.
fn user_relay(backend: SocketAddr) -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let Ok(u) = TcpStream::connect(backend) else {
                return;
            };
            let _ = (c.set_nodelay(true), u.set_nodelay(true));
            let (Ok(c2), Ok(u2)) = (c.try_clone(), u.try_clone()) else {
                return;
            };
            std::thread::spawn(move || copy(c, u));
            std::thread::spawn(move || copy(u2, c2));
        }
    });
    Ok(addr)
}

/// Tier-K proxy: register, wait for the kernel's decision, connect, splice.
fn kernel_proxy(tier: KernelTier, backend: SocketAddr) -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::spawn(
        move || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let mut keep = Vec::new();
            for c in l.incoming() {
                let mut c = c?;
                let cookie = tier.l7_register(&c)?;
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                let decision = loop {
                    let n = c.read(&mut tmp)?;
                    buf.extend_from_slice(&tmp[..n]);
                    match tier.l7_decision(cookie)? {
                        L7Decision::Pending if n > 0 => continue,
                        d => break d,
                    }
                };
                let L7Decision::Backend { .. } = decision else {
                    return Err(format!("kernel did not decide: {decision:?}").into());
                };
                let mut u = TcpStream::connect(backend)?;
                u.set_nodelay(true)?;
                let up = tier.l7_attach_upstream(cookie, &u)?;
                u.write_all(&buf)?;
                tier.l7_pair(cookie, up)?;
                keep.push((c, u));
            }
            Ok(())
        },
    );
    Ok(addr)
}

fn ping_pong(addr: SocketAddr, rounds: usize) -> std::io::Result<Vec<Duration>> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut back = [0u8; 64];
    s.write_all(FIRST)?;
    s.read_exact(&mut back)?;
    common::timed_rounds(&mut s, rounds, b'p')
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds = common::rounds_arg()?;
    let cfg = KernelConfig {
        pin_dir: format!("/sys/fs/bpf/fm-l7-latency-{}", std::process::id()).into(),
        capture: None,
        redirect: false,
        l7_dispatch: true,
        // FM_STREAM_PARSER=1 compares strparser mode (see docs/kernel.md).
        l7_stream_parser: std::env::var_os("FM_STREAM_PARSER").is_some(),
        ..KernelConfig::default()
    };
    let tier = KernelTier::attach(&cfg)?;
    tier.set_routes(&[KernelEntry {
        route: 0,
        method: Some("GET".into()),
        path: PathKey::Prefix("/echo".into()),
        action: KernelAction::Forward {
            cluster: 0,
            protocols: Protocols::HTTP1,
        },
    }])?;
    let backend = echo_backend()?;
    let direct = backend;
    let relay = user_relay(backend)?;
    let kernel = kernel_proxy(tier.clone(), backend)?;
    println!("64 B ping-pong, {rounds} round trips per run, µs");
    println!("run  direct_p50  relay_p50  relay_p99  tierK_p50  tierK_p99");
    for run in 0..3 {
        let d = ping_pong(direct, rounds).map_err(|e| format!("direct: {e}"))?;
        let r = ping_pong(relay, rounds).map_err(|e| format!("user relay: {e}"))?;
        let k = match ping_pong(kernel, rounds) {
            Ok(k) => k,
            Err(e) => {
                // Let the proxy thread report why it closed the connection.
                std::thread::sleep(Duration::from_millis(200));
                return Err(format!("tier K: {e}\n{}", tier.status()?).into());
            }
        };
        println!(
            "{run:>3}  {:>10.2}  {:>9.2}  {:>9.2}  {:>9.2}  {:>9.2}",
            pct(&d, 0.5),
            pct(&r, 0.5),
            pct(&r, 0.99),
            pct(&k, 0.5),
            pct(&k, 0.99)
        );
    }
    let st = tier.status()?;
    println!(
        "fm_verdict spliced {} bytes in {} runs",
        st.stat("fm_verdict").bytes,
        st.stat("fm_verdict").runs
    );
    tier.detach()?;
    Ok(())
}
