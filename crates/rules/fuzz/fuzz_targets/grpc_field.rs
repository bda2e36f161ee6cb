//! The `grpc_field` reader on hostile request bodies: `protobuf::first_message` and
//! `protobuf::find_field` must never panic, never read past the bytes they get, and a found
//! string value must lie inside the message.
#![no_main]

use flatmesh_rules::protobuf::{
    find_field, first_message, wanted_prefix, FieldValue, MESSAGE_PREFIX_MAX,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&number, body)) = data.split_first() else {
        return;
    };
    if let Some(want) = wanted_prefix(body) {
        assert!((5..=5 + MESSAGE_PREFIX_MAX).contains(&want));
    }
    let Some(message) = first_message(body) else {
        return;
    };
    assert!(message.len() <= MESSAGE_PREFIX_MAX);
    // Small field numbers are the ones a random message holds; 0 must never be found.
    for n in [0, u32::from(number % 16), u32::from(number)] {
        if let Some(FieldValue::Bytes(value) | FieldValue::Partial { start: value, .. }) =
            find_field(message, n)
        {
            assert!(n != 0, "field 0 does not exist");
            let start = message.as_ptr() as usize;
            let at = value.as_ptr() as usize;
            assert!(at >= start && at + value.len() <= start + message.len());
        }
    }
});
