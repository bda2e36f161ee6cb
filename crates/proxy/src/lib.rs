//! Node data plane (being written).
