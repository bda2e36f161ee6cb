//! The connection rate-limit socket filter (`bpf/conn_limit.bpf.c`) on a listening socket of
//! the test's own: a port's limit is installed, read back, enforced on SYNs (the burst
//! connects, the rest are dropped unanswered and counted) and removed. Needs root.

mod common;

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use common::*;
use flatmesh_kernel::{ConnLimit, KernelTier};

/// Whether a connection to `port` is established within 300 ms: a dropped SYN is not
/// answered, and the client's first retransmission comes only after 1 s.
fn connects(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(300),
    )
    .is_ok()
}

#[test]
fn a_port_s_limit_drops_syns_past_the_burst_until_it_is_removed() {
    require_root();
    let mut cfg = config("conn-limit");
    cfg.conn_limit = true;
    let tier = KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert!(cfg.pin_dir.join("prog_fm_conn_limit").exists());

    let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let port = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port();
    tier.limit_connections(&listener)
        .unwrap_or_else(|e| panic!("{e}"));
    // The filter without a limit for the port passes everything.
    assert!(connects(port) && connects(port));
    assert_eq!(
        tier.conn_limit(port).unwrap_or_else(|e| panic!("{e}")),
        None
    );

    // One a second, two at once.
    let limit = ConnLimit {
        interval_ns: 1_000_000_000,
        tolerance_ns: 2_000_000_000,
    };
    tier.set_conn_limit(port, limit)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        tier.conn_limit(port).unwrap_or_else(|e| panic!("{e}")),
        Some(limit)
    );
    let got: Vec<bool> = (0..4).map(|_| connects(port)).collect();
    // The burst, then nothing: the four attempts take about 0.6 s, under one interval.
    assert_eq!(got, [true, true, false, false]);
    assert_eq!(
        tier.conn_limit_drops(port)
            .unwrap_or_else(|e| panic!("{e}")),
        2
    );

    // Setting it again starts a full bucket and keeps the count.
    tier.set_conn_limit(port, limit)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(connects(port));
    assert_eq!(
        tier.conn_limit_drops(port)
            .unwrap_or_else(|e| panic!("{e}")),
        2
    );

    // Removed: every SYN passes again, and the count is gone.
    tier.remove_conn_limit(port)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!((0..4).all(|_| connects(port)));
    assert_eq!(
        tier.conn_limit_drops(port)
            .unwrap_or_else(|e| panic!("{e}")),
        0
    );
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}
