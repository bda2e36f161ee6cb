//! Receive-side dispatch over real loopback sockets, in every mode: follow-on packets of a request
//! go where its first packet went (the stash, §4.2.2), follow-on packets whose first packet was
//! never seen reach no worker, and rules that name a queue no worker serves are refused.
//! The kernel mode needs root and sk_reuseport BPF; it fails with the loader's explanation
//! otherwise.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use flatmesh_qnp::dispatch::{DispatchServer, Handler, Mode, Rsd};
use flatmesh_qnp::header::QnpHeader;
use flatmesh_qnp::rules::RuleSet;
use flatmesh_qnp::tlv;
use flatmesh_qnp::transport::{segment, OutReq, QnpConfig, Request};
use flatmesh_qnp::QnpError;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

const RULES: &str = "rule 1 0 0 \"a\" -> 0\nrule 1 0 0 \"b\" -> 1\n";

fn server(mode: Mode) -> DispatchServer {
    // Workers answer with their index and the request's length, so a test sees who got it whole.
    let handler: Handler = Arc::new(|w, req: &Request| {
        let mut body = vec![w as u8];
        body.extend_from_slice(&(req.payload.len() as u32).to_be_bytes());
        OutReq {
            app_id: req.app_id,
            req_type: req.req_type,
            payload: Bytes::from(body),
            dispatch_len: 0,
        }
    });
    DispatchServer::start(
        mode,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        2,
        1,
        Arc::new(Rsd::new(RuleSet::parse("r", RULES).unwrap())),
        QnpConfig::default(),
        handler,
    )
    .unwrap()
}

/// A three-packet request whose first packet carries key `b` (worker 1) and whose follow-on
/// packets each begin with bytes that read as a TLV field 0 = `a` (worker 0): a dispatcher that
/// matched follow-on packets instead of reusing the first packet's decision would split it.
fn misleading_request() -> OutReq {
    let chunk = QnpConfig::default().max_packet_bytes - flatmesh_qnp::header::HEADER_LEN;
    let mut payload = Vec::new();
    tlv::put_string(&mut payload, 0, "b-key").unwrap();
    let dispatch_len = payload.len();
    let filler_at = payload.len() + 3;
    let mut filler = vec![0x5a; 3 * chunk - filler_at - 100];
    for seq in 1..3 {
        let at = seq * chunk - filler_at;
        filler[at..at + 4].copy_from_slice(&[0, 0, 1, b'a']);
    }
    tlv::put_bytes(&mut payload, 1, &filler).unwrap();
    OutReq {
        app_id: 1,
        req_type: 0,
        payload: Bytes::from(payload),
        dispatch_len,
    }
}

/// Sends `pkts` from `sock` and waits for the response to request `id`.
fn exchange(sock: &UdpSocket, to: SocketAddr, pkts: &[Bytes], id: u32) -> Option<Vec<u8>> {
    for p in pkts {
        sock.send_to(p, to).unwrap();
    }
    let mut buf = [0u8; 2048];
    loop {
        let Ok((n, _)) = sock.recv_from(&mut buf) else {
            return None;
        };
        let (hdr, payload) = QnpHeader::parse(&buf[..n]).unwrap();
        if hdr.req_acked_id == id {
            return Some(payload.to_vec());
        }
    }
}

fn client() -> UdpSocket {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    sock
}

fn follow_on_packets_reuse_the_decision(mode: Mode) {
    let srv = server(mode);
    let sock = client();
    let req = misleading_request();
    let cfg = QnpConfig::default();
    for id in [10u32, 11] {
        let pkts = segment(&req, id, None, &cfg).unwrap();
        assert_eq!(pkts.len(), 3);
        // In order, and with the follow-on packets swapped.
        let order: Vec<Bytes> = match id {
            10 => pkts.clone(),
            _ => vec![pkts[0].clone(), pkts[2].clone(), pkts[1].clone()],
        };
        let resp = exchange(&sock, srv.addr(), &order, id)
            .unwrap_or_else(|| panic!("{mode:?}: request {id} was split or lost"));
        assert_eq!(resp[0], 1, "{mode:?}: key `b` goes to worker 1");
        assert_eq!(
            u32::from_be_bytes(resp[1..5].try_into().unwrap()) as usize,
            req.payload.len(),
            "{mode:?}: worker 1 got every packet"
        );
    }
    srv.stop();
}

#[test]
fn kernel_follow_on_packets_reuse_the_first_packets_decision() {
    follow_on_packets_reuse_the_decision(Mode::Kernel);
}

#[test]
fn software_queue_follow_on_packets_reuse_the_first_packets_decision() {
    follow_on_packets_reuse_the_decision(Mode::SoftwareQueue);
}

#[test]
fn software_uds_follow_on_packets_reuse_the_first_packets_decision() {
    follow_on_packets_reuse_the_decision(Mode::SoftwareUds);
}

/// Sends the follow-on packets of a request whose first packet is never sent, then a normal
/// request from the same socket (so, in reuseport mode, to the same worker, after the orphans);
/// returns how many orphans reached a worker's endpoint.
fn orphans_delivered(mode: Mode) -> u64 {
    let srv = server(mode);
    let sock = client();
    let cfg = QnpConfig::default();
    let pkts = segment(&misleading_request(), 20, None, &cfg).unwrap();
    for p in &pkts[1..] {
        sock.send_to(p, srv.addr()).unwrap();
    }
    let mut payload = Vec::new();
    tlv::put_string(&mut payload, 0, "a").unwrap();
    let ok = OutReq {
        app_id: 1,
        req_type: 0,
        dispatch_len: payload.len(),
        payload: Bytes::from(payload),
    };
    let resp = exchange(
        &sock,
        srv.addr(),
        &segment(&ok, 21, None, &cfg).unwrap(),
        21,
    );
    assert!(resp.is_some(), "{mode:?}: the normal request is answered");
    let (_, dropped) = srv.dispatched_dropped();
    let report = srv.stop();
    if matches!(mode, Mode::SoftwareQueue | Mode::SoftwareUds) {
        assert_eq!(dropped, 2, "{mode:?}: the dispatcher dropped both orphans");
    }
    report.rx.dropped_no_first_packet
}

#[test]
fn orphan_follow_on_packets_reach_no_worker() {
    // The control: without a dispatcher the workers see the orphans and drop them themselves.
    assert_eq!(orphans_delivered(Mode::Reuseport), 2);
    for mode in [Mode::Kernel, Mode::SoftwareQueue, Mode::SoftwareUds] {
        assert_eq!(orphans_delivered(mode), 0, "{mode:?}");
    }
}

#[test]
fn rules_for_queues_no_worker_serves_are_refused() {
    let handler: Handler = Arc::new(|_, req: &Request| OutReq {
        app_id: req.app_id,
        req_type: req.req_type,
        payload: Bytes::new(),
        dispatch_len: 0,
    });
    let start = |rules: &str| {
        DispatchServer::start(
            Mode::SoftwareQueue,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            2,
            1,
            Arc::new(Rsd::new(RuleSet::parse("r", rules).unwrap())),
            QnpConfig::default(),
            Arc::clone(&handler),
        )
    };
    let e = start("rule 1 0 0 \"a\" -> 0\nrule 1 0 0 \"b\" -> 2\n")
        .err()
        .unwrap();
    assert!(matches!(e, QnpError::Rules { line: 2, .. }), "{e}");
    assert!(
        e.to_string()
            .contains("queue 2 but there are 2 worker(s), queues 0..=1"),
        "{e}"
    );
    let e = start("default 1 0 -> 5\n").err().unwrap();
    assert!(
        e.to_string().contains("the default sends to queue 5"),
        "{e}"
    );
    let srv = start(RULES).unwrap();
    let e = srv
        .reconfigure_app(1, &RuleSet::parse("new", "rule 1 0 0 \"a\" -> 3").unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("queue 3"), "{e}");
    srv.stop();
}
