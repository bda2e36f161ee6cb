//! A QNP server's duplicate-response cache must not answer a forged source (issue 23, item 10).
//!
//! On the in-memory network an attacker "spoofs" the victim by opening a socket at the victim's
//! address and sending a bare header that names the victim's answered request. The server must
//! send nothing: only a byte-exact retransmission of the request's first packet is answered.
//! Before the fix the server sent the whole cached response to that address, each time it was
//! asked, for the whole dedup window.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use flatmesh_qnp::header::{QnpHeader, FLAG_DATA};
use flatmesh_qnp::transport::{Datagram, Endpoint, MemNet, OutReq, QnpConfig};

fn a(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

#[tokio::test(start_paused = true)]
async fn a_forged_retransmission_gets_no_cached_response() {
    let net = MemNet::new();
    let server = Arc::new(Endpoint::new(net.socket(a(1)), QnpConfig::default()).unwrap());
    let client = Endpoint::new(net.socket(a(2)), QnpConfig::default()).unwrap();
    let srv = Arc::clone(&server);
    let answered = tokio::spawn(async move {
        let req = srv.recv_req().await.unwrap();
        let big = OutReq {
            app_id: req.app_id,
            req_type: req.req_type,
            payload: Bytes::from(vec![9u8; 60_000]),
            dispatch_len: 0,
        };
        srv.respond(&req, &big).await.unwrap();
        req.req_id
    });
    let req = OutReq {
        app_id: 1,
        req_type: 2,
        payload: Bytes::from_static(b"get key"),
        dispatch_len: 0,
    };
    let resp = client.send_req(a(1), &req).await.unwrap();
    assert_eq!(resp.payload.len(), 60_000);
    let req_id = answered.await.unwrap();
    drop(client);

    // The attacker takes the victim's address and names the answered request: 22 bytes.
    let attacker = net.socket(a(2));
    let forged = QnpHeader {
        app_id: 1,
        req_type: 2,
        req_id,
        req_len_in_bytes: 0,
        req_len_in_pkts: 1,
        pkt_flag: FLAG_DATA,
        ..QnpHeader::default()
    }
    .to_bytes();
    for _ in 0..10 {
        attacker.send_to(&forged, a(1)).await.unwrap();
    }
    let mut buf = vec![0u8; 2048];
    let reflected =
        tokio::time::timeout(Duration::from_secs(1), attacker.recv_from(&mut buf)).await;
    assert!(
        reflected.is_err(),
        "the server sent {} bytes to the forged source",
        reflected.unwrap().unwrap().0
    );
    assert_eq!(server.stats().delivered, 1);
}
