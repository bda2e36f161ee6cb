//! `qnp` listeners: QNP requests (the generated `kv` and `pingpong` messages of
//! `flatmesh_qnp::apps`) sent over real loopback UDP to a node in this process reach the local
//! worker their listener's skip-and-check rules name, and the worker's answer comes back; in
//! user space, and in the kernel (sk_reuseport) when tier K is attached (needs root). Malformed
//! packets are counted and dropped without stalling anything; a reload swaps the rules without
//! losing a request of the apps it leaves alone.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use flatmesh_qnp::apps::{kv, pingpong};
use flatmesh_qnp::transport::{Endpoint, OutReq, QnpConfig};
use flatmesh_qnp::QnpMessage as _;

/// Local workers: each answers every request with a `kv::Value` whose status is its index,
/// and counts what it answered.
struct Workers {
    addrs: Vec<SocketAddr>,
    answered: Vec<Arc<AtomicU64>>,
}

impl Workers {
    async fn start(n: usize) -> Workers {
        let mut addrs = Vec::new();
        let mut answered = Vec::new();
        for index in 0..n {
            let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            addrs.push(sock.local_addr().unwrap());
            let count = Arc::new(AtomicU64::new(0));
            answered.push(count.clone());
            let ep = Endpoint::new(sock, QnpConfig::default()).unwrap();
            tokio::spawn(async move {
                while let Ok(req) = ep.recv_req().await {
                    let answer = kv::Value {
                        status: index as i32,
                        value: req.payload.to_vec(),
                    };
                    count.fetch_add(1, Ordering::Relaxed);
                    ep.respond(&req, &OutReq::from_message(&answer).unwrap())
                        .await
                        .unwrap();
                }
            });
        }
        Workers { addrs, answered }
    }

    fn answered(&self) -> Vec<u64> {
        self.answered
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// kv GETs by key: `a…` to worker 0, `b…` to 1, the rest to 2; kv PUTs whose key has `x` as its
/// third byte to 1, no other PUT (dropped); pingpong lane `lane-1` to 1, the other lanes to 0.
const RULES: &str = r#"
        rule 1 0 0 "a" -> 0
        rule 1 0 0 "b" -> 1
        default 1 0 -> 2
        rule 1 1 0 "..x" -> 1
        rule 2 0 0 "lane-1" -> 1
        default 2 0 -> 0
"#;

fn config(admin: SocketAddr, workers: &Workers, rules: &str, kernel: Option<&str>) -> String {
    let list: Vec<String> = workers.addrs.iter().map(ToString::to_string).collect();
    let kernel = kernel
        .map(|pin_dir| {
            format!("kernel: {{ pin_dir: {pin_dir}, redirect: false, tcp_splice: false }}\n")
        })
        .unwrap_or_default();
    format!(
        r#"
admin: {admin}
workers: 2
{kernel}listeners:
  - name: kv
    address: 127.0.0.1:0
    protocol: qnp
    qnp:
      workers: [ {} ]
      rules: |
{}
"#,
        list.join(", "),
        rules
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| format!("        {}", l.trim()))
            .collect::<Vec<_>>()
            .join("\n")
    )
}

/// A client endpoint. Its retransmission timer is long, so a request is sent once unless a
/// packet is really lost: the node's per-worker counts are then exact.
async fn client(attempts: u32) -> Endpoint<tokio::net::UdpSocket> {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let cfg = QnpConfig {
        rto: Duration::from_millis(800),
        max_attempts: attempts,
        dedup_window: Duration::from_secs(20),
        ..QnpConfig::default()
    };
    Endpoint::new(sock, cfg).unwrap()
}

/// Sends `req` and returns the index of the worker that answered.
async fn worker_of(c: &Endpoint<tokio::net::UdpSocket>, to: SocketAddr, req: &OutReq) -> i32 {
    let resp = c
        .send_req(to, req)
        .await
        .unwrap_or_else(|e| panic!("no answer through the node: {e}"));
    kv::Value::decode(&resp.payload).unwrap().status
}

fn get(key: &str) -> OutReq {
    OutReq::from_message(&kv::Get {
        key: key.into(),
        flags: 0,
    })
    .unwrap()
}

/// A PUT of `len` value bytes: over 1472 bytes it takes several packets, and only the first
/// carries the key, so the follow-on packets go where the first went.
fn put(key: &str, len: usize) -> OutReq {
    OutReq::from_message(&kv::Put {
        key: key.into(),
        value: vec![7; len],
        ttl_ms: 0,
    })
    .unwrap()
}

fn ping(lane: &str) -> OutReq {
    OutReq::from_message(&pingpong::Ping {
        body: vec![0; 64],
        lane: lane.into(),
        sent_ns: 0,
    })
    .unwrap()
}

/// The requests of the check and the worker each must reach.
fn cases() -> Vec<(OutReq, i32)> {
    vec![
        (get("apple"), 0),
        (get("banana"), 1),
        (get("cherry"), 2),
        (get(""), 2),
        (put("a-x-key", 10), 1),
        (put("zzx", 5000), 1),
        (ping("lane-1"), 1),
        (ping("lane-7"), 0),
    ]
}

/// Sends every case and checks the worker that answered; returns how many each worker got.
async fn check_dispatch(to: SocketAddr, rounds: usize) -> [u64; 3] {
    let c = client(3).await;
    let mut want = [0u64; 3];
    for _ in 0..rounds {
        for (req, worker) in cases() {
            assert_eq!(
                worker_of(&c, to, &req).await,
                worker,
                "app {} type {} went to the wrong worker",
                req.app_id,
                req.req_type
            );
            want[worker as usize] += 1;
        }
    }
    want
}

async fn requests(node: &TestNode, worker: u8, tier: &str) -> f64 {
    metric(
        node,
        "flatmesh_qnp_requests_total",
        &[
            "listener=\"kv\"",
            &format!("worker=\"{worker}\""),
            &format!("tier=\"{tier}\""),
        ],
    )
    .await
}

/// Pings lanes 1 and 2 with one transmission per request (a lost packet fails the test) until
/// told to stop, and at least 50 times.
fn pinging(kv: SocketAddr) -> (Arc<AtomicBool>, tokio::task::JoinHandle<u32>) {
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    let task = tokio::spawn(async move {
        let c = client(1).await;
        let mut sent = 0u32;
        while !stop.load(Ordering::Relaxed) || sent < 50 {
            assert_eq!(worker_of(&c, kv, &ping("lane-1")).await, 1);
            assert_eq!(worker_of(&c, kv, &ping("lane-2")).await, 0);
            sent += 2;
        }
        sent
    });
    (done, task)
}

async fn stop_pinging(node: &TestNode, done: Arc<AtomicBool>, pings: tokio::task::JoinHandle<u32>) {
    done.store(true, Ordering::Relaxed);
    match pings.await {
        Ok(sent) => assert!(sent >= 50),
        Err(e) => panic!("{e}\nthe node's counts:\n{}", qnp_metrics(node).await),
    }
}

/// The node's qnp series, for failure messages.
async fn qnp_metrics(node: &TestNode) -> String {
    let text = node.metrics().await;
    text.lines()
        .filter(|l| l.starts_with("flatmesh_qnp"))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn dropped(node: &TestNode, reason: &str) -> f64 {
    metric(
        node,
        "flatmesh_qnp_packets_dropped_total",
        &["listener=\"kv\"", &format!("reason=\"{reason}\"")],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_the_worker_the_rules_name_in_user_space() {
    let workers = Workers::start(3).await;
    let node = TestNode::start(&config(free_addr(), &workers, RULES, None));
    let kv = node.listener("kv");
    let want = check_dispatch(kv, 3).await;
    assert_eq!(workers.answered(), want.to_vec());
    for (w, n) in want.iter().enumerate() {
        assert_eq!(
            requests(&node, w as u8, "user").await,
            *n as f64,
            "worker {w}"
        );
    }
    assert_eq!(requests(&node, 0, "kernel").await, 0.0);

    // A PUT no rule takes is dropped in the node (the client gives up); so is a follow-on
    // packet whose first packet never came.
    let once = client(1).await;
    assert!(once.send_req(kv, &put("nope", 10)).await.is_err());
    let no_rule = dropped(&node, "no_rule").await;
    assert!(no_rule >= 1.0, "no_rule drops: {no_rule}");
    assert_eq!(workers.answered(), want.to_vec(), "no worker saw it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_packets_are_counted_and_dropped_and_stall_nothing() {
    let workers = Workers::start(3).await;
    let node = TestNode::start(&config(free_addr(), &workers, RULES, None));
    let kv = node.listener("kv");
    let raw = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    // Shorter than the header, empty, and 64 KiB of noise.
    let junk: [&[u8]; 3] = [b"hello", b"", &[0xff; 65_000]];
    for _ in 0..10 {
        for j in junk {
            raw.send_to(j, kv).await.unwrap();
        }
    }
    // A header whose TLV payload lies about its lengths: the rule's field reads as missing.
    let mut liar = flatmesh_qnp::header::QnpHeader {
        app_id: 1,
        req_type: 0,
        req_id: 9,
        req_len_in_bytes: 100,
        req_len_in_pkts: 1,
        pkt_flag: flatmesh_qnp::header::FLAG_DATA,
        ..Default::default()
    }
    .to_bytes()
    .to_vec();
    liar.extend_from_slice(&[0, 0xff, 0xff, b'a']);
    raw.send_to(&liar, kv).await.unwrap();
    let counted = eventually(Duration::from_secs(5), || async {
        dropped(&node, "malformed").await >= 20.0
    })
    .await;
    assert!(
        counted,
        "malformed drops: {}",
        dropped(&node, "malformed").await
    );
    // Every worker still gets its requests.
    check_dispatch(kv, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_swaps_the_rules_and_loses_no_request_of_the_other_apps() {
    let workers = Workers::start(3).await;
    let admin = free_addr();
    let node = TestNode::start(&config(admin, &workers, RULES, None));
    let kv = node.listener("kv");
    check_dispatch(kv, 1).await;

    // pingpong runs with one transmission per request while app 1's rules flip.
    let (done, pings) = pinging(kv);
    let swapped = RULES
        .replace("\"a\" -> 0", "\"a\" -> 1")
        .replace("\"b\" -> 1", "\"b\" -> 0");
    let c = client(3).await;
    for round in 0..4 {
        let (rules, a, b) = if round % 2 == 0 {
            (&swapped, 1, 0)
        } else {
            (&RULES.to_owned(), 0, 1)
        };
        node.write_config(&config(admin, &workers, rules, None));
        let (status, body) = node.reload().await;
        assert!(status.is_success(), "reload refused: {body}");
        assert_eq!(worker_of(&c, kv, &get("apple")).await, a, "round {round}");
        assert_eq!(worker_of(&c, kv, &get("banana")).await, b, "round {round}");
    }
    stop_pinging(&node, done, pings).await;

    // Rules that send to a worker the listener does not have are refused, and the old
    // rules stay.
    node.write_config(&config(admin, &workers, "rule 1 0 0 \"a\" -> 3\n", None));
    let (status, body) = node.reload().await;
    assert!(!status.is_success(), "{body}");
    assert!(body.contains("queue 3"), "{body}");
    assert_eq!(worker_of(&c, kv, &get("apple")).await, 0);
}

/// With tier K attached, the listener's sk_reuseport program dispatches: every request is
/// counted with `tier="kernel"`. Needs root (CAP_BPF, CAP_NET_ADMIN); fails otherwise, as the
/// kernel dispatcher's own tests do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_k_dispatches_by_the_rules_image_in_the_kernel() {
    use std::os::unix::fs::MetadataExt as _;
    let uid = std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    assert_eq!(
        uid, 0,
        "this test loads the sk_reuseport dispatcher and needs root: run it as root (CI does)"
    );
    if !std::path::Path::new("/sys/fs/bpf").join(".").exists() {
        panic!("/sys/fs/bpf is missing: mount bpffs (`mount -t bpf bpf /sys/fs/bpf`)");
    }
    let workers = Workers::start(3).await;
    let admin = free_addr();
    let pin_dir = format!("/sys/fs/bpf/fm-test-qnp-{}", std::process::id());
    let node = TestNode::start(&config(admin, &workers, RULES, Some(&pin_dir)));
    let kv = node.listener("kv");
    let want = check_dispatch(kv, 3).await;
    assert_eq!(workers.answered(), want.to_vec());
    for (w, n) in want.iter().enumerate() {
        assert_eq!(
            requests(&node, w as u8, "kernel").await,
            *n as f64,
            "worker {w} (the node's log says why tier K did not dispatch)"
        );
    }
    assert_eq!(requests(&node, 0, "user").await, 0.0);

    // Junk is dropped in the kernel and stalls nothing.
    let raw = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for j in [&b"hello"[..], b"", &[0xff; 3000]] {
        raw.send_to(j, kv).await.unwrap();
    }

    // A reload that swaps app 1's rules and adds a worker: the program's maps follow.
    let more = Workers::start(1).await;
    let four = Workers {
        addrs: workers.addrs.iter().chain(&more.addrs).copied().collect(),
        answered: Vec::new(),
    };
    let rules = format!("{RULES}\nrule 1 0 0 \"d\" -> 3\n").replace("\"b\" -> 1", "\"b\" -> 2");
    // pingpong, whose rules stay, loses nothing meanwhile: its map entries are not touched.
    let (done, pings) = pinging(kv);
    node.write_config(&config(admin, &four, &rules, Some(&pin_dir)));
    let (status, body) = node.reload().await;
    assert!(status.is_success(), "reload refused: {body}");
    stop_pinging(&node, done, pings).await;
    let c = client(3).await;
    assert_eq!(worker_of(&c, kv, &get("banana")).await, 2);
    assert_eq!(worker_of(&c, kv, &get("apple")).await, 0);
    assert_eq!(
        worker_of(&c, kv, &get("date")).await,
        0,
        "worker 3 answers 0: it is `more`'s first"
    );
    assert_eq!(more.answered(), vec![1]);
    assert_eq!(requests(&node, 3, "kernel").await, 1.0);
    assert_eq!(worker_of(&c, kv, &ping("lane-1")).await, 1);
}

/// When tier K's dispatcher cannot load, the listener runs in user space, with the same
/// workers: here the thread that starts the node has dropped CAP_BPF and CAP_SYS_ADMIN from its
/// effective set, as a node run without them would have (the node logs one warning naming the
/// listener and the loader's error). Needs root, to have the capabilities to drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_bpf_the_listener_falls_back_to_user_space() {
    use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
    let caps = capabilities(None).unwrap();
    assert!(
        caps.effective.contains(CapabilitySet::BPF | CapabilitySet::SYS_ADMIN),
        "this test drops CAP_BPF to make the kernel dispatcher fail and needs root: run it as root (CI does)"
    );
    let workers = Workers::start(3).await;
    let pin_dir = format!("/sys/fs/bpf/fm-test-qnp-nobpf-{}", std::process::id());
    let mut without = caps;
    without
        .effective
        .remove(CapabilitySet::BPF | CapabilitySet::SYS_ADMIN | CapabilitySet::PERFMON);
    set_capabilities(None, without).unwrap();
    let node = std::panic::catch_unwind(|| {
        TestNode::start(&config(free_addr(), &workers, RULES, Some(&pin_dir)))
    });
    set_capabilities(None, caps).unwrap();
    let node = node.unwrap_or_else(|e| std::panic::resume_unwind(e));
    let kv = node.listener("kv");
    let want = check_dispatch(kv, 2).await;
    assert_eq!(workers.answered(), want.to_vec());
    for (w, n) in want.iter().enumerate() {
        assert_eq!(
            requests(&node, w as u8, "user").await,
            *n as f64,
            "worker {w}"
        );
    }
    assert_eq!(requests(&node, 0, "kernel").await, 0.0);
}
