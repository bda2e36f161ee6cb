//! Arbitrary bytes → the /proc/net/tcp parser never panics and never reports port 0.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut ports = std::collections::BTreeSet::new();
    let _ = flatmesh_pu::scan::parse_listening(&text, &mut ports);
    assert!(!ports.contains(&0));
});
