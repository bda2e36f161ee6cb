//! Differential fuzzing of the in-kernel L7 parser (bpf/dispatch.bpf.c) through real sockets:
//! arbitrary first bytes, in one or two chunks, go to a registered connection, and whenever
//! the kernel decides a backend, the user-space reference must decide the same. Needs root.
//!
//! `cargo fuzz run verdict -- -max_total_time=60` (from crates/kernel/fuzz, as root)
#![no_main]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use flatmesh_kernel::{
    decide, lower_routes, KernelConfig, KernelRoute, KernelTier, L7Decision, PathMatch, RouteSpec,
};
use libfuzzer_sys::fuzz_target;

struct Rig {
    tier: KernelTier,
    table: Vec<KernelRoute>,
    listener: TcpListener,
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        // Earlier runs end by abort (crash found, or the time limit) and leave their pins:
        // exactly the crashed-node case, so clear them the way a node start would.
        if let Ok(dir) = std::fs::read_dir("/sys/fs/bpf") {
            for e in dir.flatten() {
                if e.file_name().to_string_lossy().starts_with("fm-fuzz-") {
                    let _ = flatmesh_kernel::cleanup_stale(&e.path());
                }
            }
        }
        let cfg = KernelConfig {
            pin_dir: format!("/sys/fs/bpf/fm-fuzz-{}", std::process::id()).into(),
            capture: None,
            redirect: false,
            l7_dispatch: true,
            ..KernelConfig::default()
        };
        let tier = KernelTier::attach(&cfg)
            .unwrap_or_else(|e| panic!("fuzzing needs tier K (run as root): {e}"));
        let r = |id, m: Option<&str>, path, backend| RouteSpec {
            route_id: id,
            method: m.map(str::to_string),
            path,
            other_conditions: false,
            backend: Some(backend),
        };
        let table = lower_routes(&[
            r(0, Some("GET"), PathMatch::Exact("/a".into()), 0),
            r(1, None, PathMatch::Prefix("/api/".into()), 1),
            r(2, Some("POST"), PathMatch::Prefix("/svc.".into()), 2),
            r(3, None, PathMatch::Exact("/".into()), 3),
        ]);
        tier.set_routes(&table).unwrap_or_else(|e| panic!("{e}"));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        Rig {
            tier,
            table,
            listener,
        }
    })
}

/// HTTP/1.1 reference, as strict as the user tier: "METHOD SP target SP HTTP/1.x" with an
/// upper-case method, visible-ASCII origin-form target, then the line end; the path is the
/// target up to '?'.
fn h1_reference(input: &[u8]) -> Option<(String, String)> {
    let end = input.iter().position(|b| *b == b'\r' || *b == b'\n')?;
    let line = &input[..end];
    if line
        .iter()
        .any(|b| *b != b' ' && !(0x21..=0x7e).contains(b))
    {
        return None;
    }
    let mut parts = line.splitn(3, |b| *b == b' ');
    let method = parts.next()?;
    let target = parts.next()?;
    let version = parts.next()?;
    let version_ok =
        version.len() == 8 && version.starts_with(b"HTTP/1.") && matches!(version[7], b'0' | b'1');
    let method_ok =
        !method.is_empty() && method.len() <= 8 && method.iter().all(u8::is_ascii_uppercase);
    if !version_ok || !method_ok || !target.starts_with(b"/") {
        return None;
    }
    let path = target.split(|b| *b == b'?').next()?;
    Some((
        String::from_utf8(method.to_vec()).ok()?,
        String::from_utf8(path.to_vec()).ok()?,
    ))
}

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let rig = rig();
    let split = (data[0] as usize).min(data.len() - 1) + 1;
    let (a, b) = data[1..].split_at((split - 1).min(data.len() - 1));
    if a.is_empty() {
        return;
    }
    let Ok(port) = rig.listener.local_addr().map(|a| a.port()) else {
        return;
    };
    let Ok(mut client) = TcpStream::connect(("127.0.0.1", port)) else {
        return;
    };
    let Ok((mut server, _)) = rig.listener.accept() else {
        return;
    };
    let cookie = rig
        .tier
        .l7_register(&server)
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = server.set_read_timeout(Some(Duration::from_millis(5)));
    let mut sink = [0u8; 4096];
    let mut decision = L7Decision::Pending;
    for chunk in [a, b] {
        if chunk.is_empty() {
            continue;
        }
        let _ = client.write_all(chunk);
        let deadline = Instant::now() + Duration::from_millis(50);
        let mut got = 0;
        while got < chunk.len() && Instant::now() < deadline {
            match server.read(&mut sink) {
                Ok(n) if n > 0 => got += n,
                _ => {}
            }
        }
        assert_eq!(
            got,
            chunk.len(),
            "the verdict lost or held bytes it passed to user space"
        );
        decision = rig
            .tier
            .l7_decision(cookie)
            .unwrap_or_else(|e| panic!("{e}"));
        if decision != L7Decision::Pending {
            break;
        }
    }
    let _ = rig.tier.l7_forget(cookie);
    let L7Decision::Backend { backend, route_id } = decision else {
        return;
    };
    if data[1..].starts_with(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") {
        // The decided route's path must literally be in the stream (non-Huffman :path).
        let r = rig
            .table
            .iter()
            .find(|r| r.route_id == route_id)
            .unwrap_or_else(|| panic!("unknown route {route_id}"));
        let (PathMatch::Exact(p) | PathMatch::Prefix(p)) = &r.path else {
            panic!("route {route_id} has no path")
        };
        assert!(
            data.windows(p.len()).any(|w| w == p.as_bytes()),
            "gRPC decision without its path in the stream"
        );
        return;
    }
    let (method, path) = h1_reference(a)
        .unwrap_or_else(|| panic!("kernel decided {decision:?} for an unparseable request line"));
    let want = decide(&rig.table, &method, &path).and_then(|r| r.backend);
    assert_eq!(
        Some(backend),
        want,
        "kernel and reference disagree on {method:?} {path:?}"
    );
});
