//! The Envoy bootstrap import must turn any text into a config or a clear error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = flatmesh_xds::bootstrap::parse(text, "fuzz.yaml");
    }
});
