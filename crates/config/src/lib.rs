//! flatmesh configuration plane, first stage: YAML → validated [`Config`].

pub mod duration;
pub mod model;

pub use model::*;
