//! The generated code for the example IDL files is checked in; these tests keep it fresh and
//! exercise it. Regenerate with `flatmesh qnp idl compile crates/qnp/examples/idl/kv.qnp --out
//! crates/qnp/src/apps` (or run this test with QNP_BLESS=1).

use flatmesh_qnp::apps::{kv, pingpong};
use flatmesh_qnp::tlv::{self, TlvReader};
use flatmesh_qnp::{idl, QnpError, QnpMessage};
use proptest::prelude::*;
use std::path::Path;

#[test]
fn checked_in_code_is_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for name in ["kv", "pingpong"] {
        let idl_path = root.join("examples/idl").join(format!("{name}.qnp"));
        let src = std::fs::read_to_string(&idl_path).unwrap();
        let (file, code) = idl::compile(&format!("{name}.qnp"), &src).unwrap();
        assert_eq!(file, format!("{name}.rs"));
        let gen_path = root.join("src/apps").join(&file);
        if std::env::var_os("QNP_BLESS").is_some() {
            std::fs::write(&gen_path, &code).unwrap();
        }
        let checked_in = std::fs::read_to_string(&gen_path).unwrap_or_default();
        assert!(
            checked_in == code,
            "{} is stale; regenerate it with `flatmesh qnp idl compile {} --out {}`",
            gen_path.display(),
            idl_path.display(),
            root.join("src/apps").display()
        );
    }
}

#[test]
fn dispatch_fields_come_first_on_the_wire() {
    let ping = pingpong::Ping {
        body: vec![9; 128],
        lane: "lane-3".into(),
        sent_ns: 42,
    };
    let mut buf = Vec::new();
    let dispatch_len = ping.encode(&mut buf).unwrap();
    assert_eq!(dispatch_len, 3 + 6);
    let order: Vec<u8> = TlvReader::new(&buf).map(|t| t.unwrap().field).collect();
    assert_eq!(
        order,
        [0, 1, 2],
        "the dispatch field `lane` (0) leads although declared second"
    );
    assert_eq!(tlv::find_field(&buf, 0), Some(&b"lane-3"[..]));
    assert_eq!(pingpong::Ping::decode(&buf).unwrap(), ping);
    assert_eq!(<pingpong::Ping as QnpMessage>::APP_ID, 2);
}

#[test]
fn decode_skips_unknown_fields_and_rejects_bad_input() {
    let mut buf = Vec::new();
    tlv::put_string(&mut buf, 0, "k").unwrap();
    tlv::put_i32(&mut buf, 9, 1); // unknown: skipped
    tlv::put_i32(&mut buf, 1, 5);
    let get = kv::Get::decode(&buf).unwrap();
    assert_eq!(
        get,
        kv::Get {
            key: "k".into(),
            flags: 5
        }
    );
    // A missing field decodes to its default.
    assert_eq!(kv::Get::decode(&[]).unwrap(), kv::Get::default());
    // Wrong width, duplicate field, invalid UTF-8, truncation.
    let mut wrong = Vec::new();
    tlv::put_bytes(&mut wrong, 1, &[1, 2]).unwrap();
    assert!(matches!(kv::Get::decode(&wrong), Err(QnpError::Tlv { .. })));
    let mut dup = buf.clone();
    tlv::put_string(&mut dup, 0, "again").unwrap();
    assert!(kv::Get::decode(&dup).is_err());
    let mut utf = Vec::new();
    tlv::put_bytes(&mut utf, 0, &[0xff]).unwrap();
    assert!(kv::Get::decode(&utf).is_err());
    assert!(kv::Get::decode(&buf[..buf.len() - 1]).is_err());
}

proptest! {
    #[test]
    fn put_round_trips(key in ".{0,40}", value in proptest::collection::vec(any::<u8>(), 0..3000), ttl in any::<i64>()) {
        let put = kv::Put { key, value, ttl_ms: ttl };
        let mut buf = Vec::new();
        let dispatch_len = put.encode(&mut buf).unwrap();
        prop_assert_eq!(dispatch_len, 3 + put.key.len());
        prop_assert_eq!(kv::Put::decode(&buf).unwrap(), put);
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = kv::Get::decode(&bytes);
        let _ = kv::Put::decode(&bytes);
        let _ = kv::Value::decode(&bytes);
        let _ = pingpong::Ping::decode(&bytes);
    }
}
