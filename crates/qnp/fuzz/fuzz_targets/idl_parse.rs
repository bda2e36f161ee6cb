//! The IDL parser and generator never panic, and what parses also generates.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(schema) = flatmesh_qnp::idl::parse("fuzz.qnp", src) {
        let code = flatmesh_qnp::idl::generate(&schema, "fuzz.qnp");
        assert!(code.contains("pub const APP_ID"));
    }
});
