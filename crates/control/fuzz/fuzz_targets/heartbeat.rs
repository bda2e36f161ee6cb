#![no_main]
//! Any bytes: decode never panics, and a decoded heartbeat re-encodes to the same 16 bytes.
use flatmesh_control::heartbeat::Heartbeat;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hb) = Heartbeat::decode(data) {
        assert_eq!(&hb.encode()[..], data);
        let _ = hb.samples().count();
    }
});
