//! A node's load report (LRS) as the control plane reads it: any bytes a node sends decode to
//! a report of at most MAX_ENDPOINTS_PER_REPORT endpoints, or to nothing; never a panic.
#![no_main]

use envoy_types::pb::envoy::service::load_stats::v3::LoadStatsRequest;
use flatmesh_xds::lrs::{read_report, MAX_ENDPOINTS_PER_REPORT};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(request) = LoadStatsRequest::decode(data) else {
        return;
    };
    let load = read_report("fuzz", &request.cluster_stats);
    assert!(load.endpoints.len() <= MAX_ENDPOINTS_PER_REPORT);
});
