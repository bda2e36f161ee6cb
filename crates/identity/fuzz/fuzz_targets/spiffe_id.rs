//! SPIFFE IDs and allow-list patterns from any text: parse never panics, and what parses
//! prints back to itself and obeys the specification's rules.
#![no_main]

use flatmesh_identity::{IdPattern, SpiffeId};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(id) = SpiffeId::parse(text) {
        assert_eq!(id.as_str(), text);
        assert!(text.len() <= flatmesh_identity::spiffe::MAX_ID_BYTES);
        assert!(!id.trust_domain().is_empty());
        assert!(!id.path().ends_with('/'));
        assert!(!id.path().contains("/../") && !id.path().contains("/./"));
        assert_eq!(SpiffeId::parse(&id.to_string()).ok(), Some(id.clone()));
        if let Ok(pattern) = IdPattern::parse(&format!("spiffe://{}/*", id.trust_domain())) {
            assert!(pattern.matches(&id) || id.path().is_empty());
        }
    }
    if let Ok(pattern) = IdPattern::parse(text) {
        assert_eq!(IdPattern::parse(&pattern.to_string()).ok(), Some(pattern));
    }
});
