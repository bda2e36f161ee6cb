//! Support for the crate's unit tests: a worker's view of a config written in YAML.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::context::WorkerView;
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;
use crate::upstream::Upstreams;

/// Worker 0's view of `yaml`.
pub(crate) fn view(yaml: &str) -> Arc<ArcSwap<WorkerView>> {
    let config = flatmesh_config::parse(yaml, "test.yaml").unwrap();
    let metrics = Metrics::new(1);
    let snapshot = Arc::new(Snapshot::build(config, 1, &metrics).unwrap());
    let upstreams = Upstreams::build(&snapshot, 0, None);
    Arc::new(ArcSwap::from_pointee(WorkerView {
        snapshot,
        upstreams,
    }))
}
