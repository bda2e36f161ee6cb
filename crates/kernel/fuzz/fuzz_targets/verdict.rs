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
    KernelAction, KernelConfig, KernelEntry, KernelTier, L7Decision, PathKey, Protocols,
};
use libfuzzer_sys::fuzz_target;

struct Rig {
    tier: KernelTier,
    table: Vec<KernelEntry>,
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
        let r = |route, m: Option<&str>, path, cluster| KernelEntry {
            route,
            method: m.map(str::to_string),
            path,
            action: KernelAction::Forward {
                cluster,
                protocols: Protocols::HTTP1 | Protocols::HTTP2,
            },
        };
        let table = vec![
            r(0, Some("GET"), PathKey::Exact("/a".into()), 0),
            r(1, None, PathKey::Prefix("/api/".into()), 1),
            r(2, Some("POST"), PathKey::Prefix("/svc.".into()), 2),
            r(3, None, PathKey::Exact("/".into()), 3),
        ];
        tier.set_routes(&table).unwrap_or_else(|e| panic!("{e}"));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        Rig {
            tier,
            table,
            listener,
        }
    })
}

/// The table's reference executor: the first entry matching decides (the tier-K lowering's
/// `KernelLowering::decide` runs the same `KernelEntry::matches`).
fn reference(table: &[KernelEntry], method: &str, path: &str, protocol: Protocols) -> Option<u32> {
    let e = table.iter().find(|e| e.matches(method, path))?;
    e.cluster_for(protocol).and_then(|c| u32::try_from(c).ok())
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

/// HTTP/2 reference, as strict as the user tier (hyper/h2, RFC 9113 8.3) on what the kernel
/// reads: the first HEADERS frame after any other frames, whole (END_HEADERS, complete in
/// the input), HPACK-decoded with the static table (a dynamic-table reference is `None`: the
/// kernel must leave it to user space), Huffman strings decoded by `huffman::decode` (checked
/// against RFC 7541's vectors in its unit tests). Pseudo-headers come first, each at most once,
/// only :method, :scheme, :authority, :path; :scheme and :path are present and the method is not
/// CONNECT. Returns (method, path up to '?').
fn h2_reference(stream: &[u8]) -> Option<(String, String)> {
    let mut at = 0;
    let (flags, payload) = loop {
        let h = stream.get(at..at + 9)?;
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let payload = stream.get(at + 9..at + 9 + len)?;
        match h[3] {
            1 => break (h[4], payload),
            9 => return None,
            _ => at += 9 + len,
        }
    };
    if flags & 0x4 == 0 {
        return None;
    }
    let mut block = payload;
    let mut pad = 0;
    if flags & 0x8 != 0 {
        pad = usize::from(*block.first()?);
        block = &block[1..];
    }
    if flags & 0x20 != 0 {
        block = block.get(5..)?;
    }
    block = block.get(..block.len().checked_sub(pad)?)?;

    fn int(b: &[u8], at: &mut usize, prefix: u8) -> Option<usize> {
        let max = (1usize << prefix) - 1;
        let mut v = usize::from(*b.get(*at)?) & max;
        *at += 1;
        if v < max {
            return Some(v);
        }
        let mut shift = 0;
        loop {
            let c = *b.get(*at)?;
            *at += 1;
            v = v.checked_add(usize::from(c & 0x7f).checked_shl(shift)?)?;
            shift += 7;
            if c & 0x80 == 0 || shift > 28 {
                return (c & 0x80 == 0).then_some(v);
            }
        }
    }
    /// A string literal: (Huffman-coded?, its bytes as sent).
    fn string(b: &[u8], at: &mut usize) -> Option<(bool, Vec<u8>)> {
        let huff = *b.get(*at)? & 0x80 != 0;
        let len = int(b, at, 7)?;
        let raw = b.get(*at..*at + len)?;
        *at += len;
        Some((huff, raw.to_vec()))
    }
    fn decoded((huff, raw): (bool, Vec<u8>)) -> Option<Vec<u8>> {
        if huff {
            flatmesh_kernel::huffman::decode(&raw)
        } else {
            Some(raw)
        }
    }
    // Static table (RFC 7541 Appendix A): the pseudo-header entries with their values; every
    // other entry up to 61 is a regular header.
    fn static_entry(idx: usize) -> Option<(&'static [u8], &'static [u8])> {
        Some(match idx {
            1 => (b":authority", b""),
            2 => (b":method", b"GET"),
            3 => (b":method", b"POST"),
            4 => (b":path", b"/"),
            5 => (b":path", b"/index.html"),
            6 => (b":scheme", b"http"),
            7 => (b":scheme", b"https"),
            8..=14 => (b":status", b""),
            15..=61 => (b"regular", b""),
            _ => return None,
        })
    }

    let (mut method, mut path, mut scheme, mut authority) = (None, None, false, false);
    let mut regular = false;
    let mut at = 0;
    let mut first = true;
    while at < block.len() {
        let b = block[at];
        // Values other than :method's and :path's are kept as sent: the kernel reads neither
        // their Huffman coding nor their bytes (docs/kernel.md, "Known limits").
        let (name, value): (Vec<u8>, (bool, Vec<u8>)) = if b & 0x80 != 0 {
            let (n, v) = static_entry(int(block, &mut at, 7)?)?;
            (n.to_vec(), (false, v.to_vec()))
        } else if b & 0xe0 == 0x20 {
            if !first || int(block, &mut at, 5)? > 4096 {
                return None;
            }
            continue;
        } else {
            let idx = int(block, &mut at, if b & 0x40 != 0 { 6 } else { 4 })?;
            let name = if idx == 0 {
                decoded(string(block, &mut at)?)?
            } else {
                static_entry(idx)?.0.to_vec()
            };
            (name, string(block, &mut at)?)
        };
        first = false;
        if !name.starts_with(b":") {
            regular = true;
            continue;
        }
        if regular {
            return None;
        }
        let slot = match name.as_slice() {
            b":method" => &mut method,
            b":path" => &mut path,
            b":scheme" => {
                if std::mem::replace(&mut scheme, true) {
                    return None;
                }
                continue;
            }
            b":authority" => {
                if std::mem::replace(&mut authority, true) {
                    return None;
                }
                continue;
            }
            _ => return None,
        };
        if slot.replace(decoded(value)?).is_some() {
            return None;
        }
    }
    let (method, path) = (method?, path?);
    if !scheme || method == b"CONNECT" {
        return None;
    }
    if method.is_empty() || !method.iter().all(u8::is_ascii_uppercase) {
        return None;
    }
    if !path.starts_with(b"/") || !path.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return None;
    }
    let path = path.split(|b| *b == b'?').next()?;
    Some((
        String::from_utf8(method).ok()?,
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
    let L7Decision::Backend { backend, .. } = decision else {
        return;
    };
    if let Some(stream) = data[1..].strip_prefix(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") {
        let (method, path) = h2_reference(stream).unwrap_or_else(|| {
            panic!("kernel decided {decision:?} for a first HEADERS block the user tier refuses")
        });
        let want = reference(&rig.table, &method, &path, Protocols::HTTP2);
        assert_eq!(
            Some(backend),
            want,
            "kernel and reference disagree on h2 {method:?} {path:?}"
        );
        return;
    }
    let (method, path) = h1_reference(a)
        .unwrap_or_else(|| panic!("kernel decided {decision:?} for an unparseable request line"));
    let want = reference(&rig.table, &method, &path, Protocols::HTTP1);
    assert_eq!(
        Some(backend),
        want,
        "kernel and reference disagree on {method:?} {path:?}"
    );
});
