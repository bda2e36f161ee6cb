//! What an HBONE peer controls: the `:authority` of its CONNECT (the destination), and what
//! an operator writes in `hbone.destinations`. Neither parser may panic; a destination read
//! from `:authority` is a concrete `IP:PORT` that reads back the same when written out; a
//! `hbone.destinations` entry allows what it names (an IPv4-mapped IPv6 one included) and
//! nothing of the other address family.
#![no_main]

use std::net::SocketAddr;

use flatmesh_config::destination::Destination;
use flatmesh_proxy::fuzz::hbone_authority;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    if let Ok(addr) = hbone_authority(text) {
        assert_ne!(addr.port(), 0, "{text:?}");
        assert_eq!(hbone_authority(&addr.to_string()), Ok(addr), "{text:?}");
    }
    match Destination::parse(text) {
        Ok(Destination::Exact(addr)) => assert!(Destination::Exact(addr).allows(addr)),
        Ok(block @ Destination::Block { network, .. }) => {
            assert!(block.allows(SocketAddr::new(network, 1)), "{text:?}");
            let other: SocketAddr = if network.is_ipv4() {
                "[fd00::1]:1".parse().unwrap()
            } else {
                "10.0.0.1:1".parse().unwrap()
            };
            assert!(!block.allows(other), "{text:?}");
        }
        Err(_) => {}
    }
});
