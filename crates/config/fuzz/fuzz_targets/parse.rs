//! Arbitrary bytes → `parse` must never panic, and whatever it accepts must
//! survive the admin `/config` JSON round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match flatmesh_config::parse(&text, "fuzz.yaml") {
        Ok(config) => {
            let json = config.to_json();
            let back: flatmesh_config::Config =
                serde_json::from_str(&json).expect("to_json output must parse back");
            assert_eq!(back, config, "JSON round trip changed the config");
        }
        Err(error) => {
            // Every diagnostic has a real position and says what to do.
            for d in error.diagnostics() {
                assert!(d.line >= 1 && d.column >= 1, "{d}");
                assert!(!d.hint.is_empty(), "{d}");
            }
        }
    }
});
