//! The key-value service on RocksDB (the `kv` feature) behind QingNiao's receive-side dispatch,
//! over real loopback sockets in every L7 mode. The kernel mode needs root and sk_reuseport BPF;
//! it fails with the loader's explanation otherwise.
#![allow(clippy::unwrap_used)]

use flatmesh_qnp::dispatch::{DispatchServer, Handler, Mode, Rsd};
use flatmesh_qnp::rules::RuleSet;
use flatmesh_qnp::transport::{OutReq, QnpConfig, Request};
use std::net::SocketAddr;
use std::sync::Arc;

/// The key-value service on RocksDB behind each L7 mode: a GET for a key of each of the 24
/// ranges reaches worker range mod workers (the demo's rules) and answers the pre-loaded value.
fn kv_ranges_reach_their_workers(mode: Mode) {
    use flatmesh_lab::qnp::kv_store::{preload_value, KvStore};
    use flatmesh_lab::qnp::load::{key_range, kv_key, range_keys, KEY_RANGES};
    use flatmesh_lab::qnp::services::{demo_rules, kv_service};
    use flatmesh_qnp::apps::kv;
    use flatmesh_qnp::transport::Endpoint;
    use flatmesh_qnp::QnpMessage as _;
    let (keys, workers) = (2_400, 3);
    let store = Arc::new(KvStore::temporary().unwrap());
    store.preload(keys).unwrap();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let kv = kv_service(store);
    let log = Arc::clone(&seen);
    let handler: Handler = Arc::new(move |w, req: &Request| {
        let get = kv::Get::decode(&req.payload).unwrap();
        log.lock().push((w, get.key));
        kv(w, req)
    });
    let rules = RuleSet::parse("demo", &demo_rules(workers, 4)).unwrap();
    let srv = DispatchServer::start(
        mode,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        workers,
        1,
        Arc::new(Rsd::new(rules)),
        QnpConfig::default(),
        handler,
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let client = Endpoint::new(sock, QnpConfig::default()).unwrap();
        for r in 0..KEY_RANGES {
            let n = range_keys(r, keys).start + 7;
            let req = OutReq::from_message(&kv::Get {
                key: kv_key(n, keys),
                flags: 0,
            })
            .unwrap();
            let resp = client.send_req(srv.addr(), &req).await.unwrap();
            let v = kv::Value::decode(&resp.payload).unwrap();
            assert_eq!(
                (v.status, v.value),
                (0, preload_value(n)),
                "{mode:?} key {n}"
            );
        }
    });
    srv.stop();
    let seen = seen.lock();
    assert_eq!(seen.len(), KEY_RANGES);
    for (w, key) in seen.iter() {
        let n: usize = key[1..].parse().unwrap();
        assert_eq!(*w, key_range(n, keys) % workers, "{mode:?}: {key}");
    }
}

#[test]
fn kv_key_ranges_reach_their_workers_in_every_l7_mode() {
    for mode in [Mode::Kernel, Mode::SoftwareQueue, Mode::SoftwareUds] {
        kv_ranges_reach_their_workers(mode);
    }
}
