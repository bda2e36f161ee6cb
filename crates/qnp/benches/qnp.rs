//! Micro-benchmarks: the TLV codec of generated code, segmentation, and the dispatch decision
//! against the number of skip-and-checks per rule and the number of rules (the paper's Figs.
//! 15–16 dimensions), for the software matcher and for the Matcher reference model.
//!
//! Run: `CARGO_TARGET_DIR=/work/target-qnp taskset -c 1 cargo bench -p flatmesh-qnp --bench qnp`

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use flatmesh_qnp::apps::kv;
use flatmesh_qnp::dispatch::{Rsd, Stash, STASH_DEPTH};
use flatmesh_qnp::image::Image;
use flatmesh_qnp::rules::{Decision, RuleSet};
use flatmesh_qnp::tlv;
use flatmesh_qnp::transport::{segment, OutReq, QnpConfig};
use flatmesh_qnp::QnpMessage;
use std::net::SocketAddr;

fn codec(c: &mut Criterion) {
    let put = kv::Put {
        key: "user:000042".into(),
        value: vec![7; 100],
        ttl_ms: 60_000,
    };
    let mut buf = Vec::with_capacity(256);
    c.bench_function("codec/encode_put_128B", |b| {
        b.iter(|| {
            buf.clear();
            black_box(put.encode(&mut buf).ok());
        })
    });
    buf.clear();
    let _ = put.encode(&mut buf);
    c.bench_function("codec/decode_put_128B", |b| {
        b.iter(|| black_box(kv::Put::decode(black_box(&buf)).ok()))
    });
    let req = OutReq {
        app_id: 1,
        req_type: 1,
        payload: Bytes::from(vec![0u8; 5000]),
        dispatch_len: 14,
    };
    let cfg = QnpConfig::default();
    c.bench_function("codec/segment_5000B", |b| {
        b.iter(|| black_box(segment(&req, 1, None, &cfg).ok()))
    });
}

/// `rules` rules of `checks` skip-and-checks each ("." then 5 bytes, as the paper's 5 matched
/// bytes per check), differing only in their last check, and a request that passes every check
/// and hits the last rule.
fn workload(checks: usize, rules: usize) -> (RuleSet, Vec<u8>) {
    let mut src = String::new();
    for r in 0..rules {
        let mut p = String::new();
        for k in 0..checks {
            let tag = if k + 1 == checks { r } else { k };
            p.push_str(&format!(".\\x{:02x}bcd\\x{:02x}", tag % 256, tag / 256));
        }
        src.push_str(&format!("rule 1 0 0 \"{p}\" -> {}\n", r % 8));
    }
    let mut value = Vec::new();
    for k in 0..checks {
        let tag = if k + 1 == checks { rules - 1 } else { k };
        value.extend_from_slice(&[b'-', (tag % 256) as u8, b'b', b'c', b'd', (tag / 256) as u8]);
    }
    (
        RuleSet::parse("bench", &src).expect("bench rules parse"),
        value,
    )
}

fn packet(value: &[u8]) -> Vec<u8> {
    let mut payload = Vec::new();
    let _ = tlv::put_bytes(&mut payload, 0, value);
    let req = OutReq {
        app_id: 1,
        req_type: 0,
        payload: Bytes::from(payload.clone()),
        dispatch_len: payload.len(),
    };
    segment(&req, 1, None, &QnpConfig::default())
        .expect("bench packet fits")
        .remove(0)
        .to_vec()
}

fn dispatch(c: &mut Criterion) {
    let peer = SocketAddr::from(([10, 0, 0, 1], 9));
    let mut g = c.benchmark_group("dispatch_vs_checks");
    // The paper's skip-and-check sweep: 32 rules.
    for checks in [1usize, 4, 12, 24, 48] {
        let (set, value) = workload(checks, 32);
        let rsd = Rsd::new(set.clone());
        let pkt = packet(&value);
        let mut stash = Stash::new(STASH_DEPTH);
        assert_eq!(rsd.decide(&pkt, peer, &mut stash), Decision::Queue(31 % 8));
        g.bench_with_input(BenchmarkId::new("software_rsd", checks), &checks, |b, _| {
            b.iter(|| black_box(rsd.decide(black_box(&pkt), peer, &mut stash)))
        });
        let img = Image::compile(&set).expect("fits");
        g.bench_with_input(BenchmarkId::new("image_model", checks), &checks, |b, _| {
            b.iter(|| black_box(img.run(1, 0, |_| Some(&value[..]))))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("dispatch_vs_rules");
    // The paper's rule sweep: 4 skip-and-checks per rule; 508 such rules fill the image.
    for rules in [1usize, 32, 128, 256, 508] {
        let (set, value) = workload(4, rules);
        let rsd = Rsd::new(set.clone());
        let pkt = packet(&value);
        let mut stash = Stash::new(STASH_DEPTH);
        assert_eq!(
            rsd.decide(&pkt, peer, &mut stash),
            Decision::Queue(((rules - 1) % 8) as u8)
        );
        g.bench_with_input(BenchmarkId::new("software_rsd", rules), &rules, |b, _| {
            b.iter(|| black_box(rsd.decide(black_box(&pkt), peer, &mut stash)))
        });
        let img = Image::compile(&set).expect("fits");
        let (_, lookups) = img.run(1, 0, |_| Some(&value[..]));
        assert_eq!(
            lookups, 5,
            "shared leading checks, one state for the last: the CAM matches all rules at once"
        );
        g.bench_with_input(BenchmarkId::new("image_model", rules), &rules, |b, _| {
            b.iter(|| black_box(img.run(1, 0, |_| Some(&value[..]))))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = codec, dispatch
}
criterion_main!(benches);
