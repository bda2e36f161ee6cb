//! flatmesh on Kubernetes (issue 20, item 1): the control plane from the API server.
//!
//! - [`routes`]: the Gateway API mesh routes (`HTTPRoute`, `GRPCRoute`), hand-mapped to the
//!   fields flatmesh uses; a route whose `parentRefs` name a Service is a GAMMA mesh route.
//! - [`translate`]: Namespaces, Services, EndpointSlices, Pods and routes in, each node's
//!   snapshot out (a flatmesh config served over xDS, and the SPIFFE identities of its pods).
//!   A pure function: no I/O, no clock.
//! - [`controller`]: the watchers (kube-rs reflectors) that keep those objects current and
//!   publish every node's snapshot to the xDS server's store, debounced.
//! - [`schedule`]: E3 as a Kubernetes scheduler (item 3): pods of `schedulerName: flatmesh`
//!   placed by HCM and bound through the Binding API.
//!
//! docs/kubernetes.md says what is watched, how it maps to xDS and what is not done yet.
#![forbid(unsafe_code)]

pub mod controller;
pub mod error;
pub mod routes;
pub mod schedule;
pub mod translate;

pub use controller::{connect, Controller, Options};
pub use error::{K8sError, Result};
pub use translate::{translate, NodeSnapshot, Objects, Translation};
