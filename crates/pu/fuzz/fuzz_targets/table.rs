//! Arbitrary bytes → the port table parser never panics; what it accepts claims cleanly.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(mut state) = flatmesh_pu::TableState::parse(&text) {
        let listening = state.ports.keys().take(3).copied().collect();
        let _ = state.claim("fuzz", &listening);
        assert!(!state.ports.contains_key(&0));
    }
});
