//! The kernel dispatcher (the sk_reuseport program walking the RAM/CAM image in BPF maps)
//! decides as the plain rule semantics do, on random rule sets and requests sent over real
//! loopback sockets. Needs root and sk_reuseport BPF; fails with the loader's explanation
//! otherwise.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use flatmesh_qnp::dispatch::{DispatchServer, Handler, Mode, Rsd};
use flatmesh_qnp::rules::{Decision, RuleSet};
use flatmesh_qnp::tlv;
use flatmesh_qnp::transport::{Endpoint, OutReq, QnpConfig, Request};
use flatmesh_qnp::QnpError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const APP: u8 = 5;

/// Patterns over a tiny alphabet so that random values often match; some longer than one CAM
/// check (8 bytes).
fn pattern(rng: &mut StdRng) -> String {
    let pieces = ["a", "b", ".", "ab", "..", "abababababa"];
    (0..rng.random_range(0..5))
        .map(|_| pieces[rng.random_range(0..pieces.len())])
        .collect()
}

fn rule_file(rng: &mut StdRng) -> String {
    let mut s = String::new();
    for _ in 0..rng.random_range(1..8) {
        s += &format!(
            "rule {APP} {} {} \"{}\" -> {}\n",
            rng.random_range(0..2),
            rng.random_range(0..2),
            pattern(rng),
            rng.random_range(0..3)
        );
    }
    for t in 0..2 {
        if rng.random_bool(0.6) {
            s += &format!("default {APP} {t} -> {}\n", rng.random_range(0..3));
        }
    }
    s
}

/// A request with fields 0 and 1 (each maybe absent, in random order) and filler.
fn request(rng: &mut StdRng) -> (u8, Vec<Option<Vec<u8>>>, OutReq) {
    let req_type = rng.random_range(0..2);
    let fields: Vec<Option<Vec<u8>>> = (0..2)
        .map(|_| {
            rng.random_bool(0.85).then(|| {
                (0..rng.random_range(0..14))
                    .map(|_| b"abc"[rng.random_range(0..3)])
                    .collect()
            })
        })
        .collect();
    let mut payload = Vec::new();
    let order: [usize; 2] = if rng.random_bool(0.5) { [0, 1] } else { [1, 0] };
    for f in order {
        if let Some(v) = &fields[f] {
            tlv::put_bytes(&mut payload, f as u8, v).unwrap();
        }
    }
    let dispatch_len = payload.len();
    tlv::put_bytes(&mut payload, 7, &[0x5a; 40]).unwrap();
    let req = OutReq {
        app_id: APP,
        req_type,
        payload: Bytes::from(payload),
        dispatch_len,
    };
    (req_type, fields, req)
}

#[test]
fn the_kernel_dispatcher_agrees_with_the_rule_semantics() {
    let handler: Handler = Arc::new(|w, req: &Request| OutReq {
        app_id: req.app_id,
        req_type: req.req_type,
        payload: Bytes::from(vec![w as u8]),
        dispatch_len: 0,
    });
    let server = DispatchServer::start(
        Mode::Kernel,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        3,
        1,
        Arc::new(Rsd::new(RuleSet::parse("empty", "").unwrap())),
        QnpConfig::default(),
        handler,
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let (mut checked, mut dropped) = (0, 0);
    rt.block_on(async {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        // Loopback loses nothing: one transmission, and a short wait for the drops.
        let cfg = QnpConfig {
            max_attempts: 1,
            rto: Duration::from_millis(60),
            ..QnpConfig::default()
        };
        let client = Endpoint::new(sock, cfg).unwrap();
        for set_no in 0..25 {
            let src = rule_file(&mut rng);
            let set = RuleSet::parse("random", &src).unwrap();
            // Reconfiguring through the server rewrites the kernel maps (and fails, changing
            // nothing, for a set that does not fit the image).
            if server.reconfigure_app(APP, &set).is_err() {
                continue;
            }
            for _ in 0..12 {
                let (req_type, fields, req) = request(&mut rng);
                let want = set.eval(APP, req_type, |f| {
                    fields.get(usize::from(f)).and_then(|v| v.as_deref())
                });
                let got = match client.send_req(server.addr(), &req).await {
                    Ok(resp) => Decision::Queue(resp.payload[0]),
                    Err(QnpError::Timeout { .. }) => Decision::Drop,
                    Err(e) => panic!("{e}"),
                };
                assert_eq!(
                    got, want,
                    "rule set {set_no}:\n{src}request type {req_type} fields {fields:?}"
                );
                checked += 1;
                dropped += usize::from(want == Decision::Drop);
            }
        }
    });
    server.stop();
    assert!(checked > 150, "{checked} requests checked");
    assert!(
        dropped > 0 && dropped < checked / 2,
        "drops and matches both covered ({dropped} of {checked} dropped)"
    );
}
