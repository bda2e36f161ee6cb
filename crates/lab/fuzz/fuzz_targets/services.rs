#![no_main]
//! The demo microservices' inputs: any checkpoint bytes (what a migrated instance restarts from)
//! and any request (method, key, body) against every kind of state. Nothing panics, a decoded
//! checkpoint re-encodes, and the stores never grow past their key limit.
use flatmesh_lab::control::services::kinds::MAX_KEYS;
use flatmesh_lab::control::services::{Data, Kind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = serde_json::from_slice::<Data>(data) {
        let again = serde_json::to_vec(&d).expect("a decoded checkpoint encodes");
        let back: Data = serde_json::from_slice(&again).expect("and decodes again");
        assert_eq!(back.kind(), d.kind());
        assert_eq!(back.keys(), d.keys());
    }
    let Some((&m, rest)) = data.split_first() else {
        return;
    };
    let method = [
        http::Method::GET,
        http::Method::PUT,
        http::Method::POST,
        http::Method::DELETE,
    ][usize::from(m % 4)]
    .clone();
    let text = String::from_utf8_lossy(rest);
    let (key, body) = text.split_once('\n').unwrap_or((&text, ""));
    for kind in Kind::ALL {
        let mut d = Data::new(kind, 10.0, 5.0);
        let (status, _) = d.execute(&method, key, body);
        assert!((200..600).contains(&status));
        assert!(d.keys() <= MAX_KEYS);
    }
});
