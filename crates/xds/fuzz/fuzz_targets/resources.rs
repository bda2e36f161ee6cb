//! What a control plane pushes must turn into a config or a NACK reason, never a panic; and the
//! caching translator the client uses must give exactly what a fresh translation gives.
//!
//! Input: records of [type byte][length: 2 bytes, big-endian][protobuf bytes], each decoded as a
//! Listener, RouteConfiguration, Cluster or ClusterLoadAssignment (type byte % 4).
#![no_main]

use flatmesh_xds::resources::{Resource, Resources, ORDER};
use flatmesh_xds::to_model::{translate, Translator};
use libfuzzer_sys::fuzz_target;

fn decode(mut data: &[u8]) -> Vec<Resource> {
    let mut out = Vec::new();
    while data.len() >= 3 && out.len() < 16 {
        let type_url = ORDER[data[0] as usize % ORDER.len()];
        let len = (usize::from(data[1]) << 8 | usize::from(data[2])).min(data.len() - 3);
        let any = envoy_types::pb::google::protobuf::Any {
            type_url: type_url.to_string(),
            value: data[3..3 + len].to_vec(),
        };
        if let Ok(r) = Resource::decode(&any, type_url) {
            out.push(r);
        }
        data = &data[3 + len..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let base = flatmesh_xds::bootstrap::empty_config();
    let all = decode(data);
    let mut translator = Translator::default();
    let mut held = Resources::default();
    // Apply the resources one at a time, as a stream of updates would.
    for r in all {
        held.insert(r);
        let cached = translator.translate(&held, &base);
        let fresh = translate(&held, &base);
        match (&cached, &fresh) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "the cache changed the result"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            _ => panic!("cached {cached:?} vs fresh {fresh:?}"),
        }
    }
});
