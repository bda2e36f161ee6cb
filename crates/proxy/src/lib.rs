//! flatmesh node data plane: listeners, shared-nothing workers, the L4 relay, the L7 HTTP
//! path, upstream pools and load balancing, telemetry and the admin endpoint.
//!
//! Follow one request: [`worker`] accepts it on a SO_REUSEPORT socket → [`http::serve`]
//! parses it and asks the rule program (crate `flatmesh-rules`) for a route → the route's
//! action picks a cluster, [`lb`] an endpoint, [`upstream`] a pooled connection → the
//! response streams back. [`node`] swaps config snapshots ([`snapshot`]) under all of it.

pub mod access_log;
mod admin;
mod body;
mod context;
mod control;
mod dispatch;
pub mod error;
pub mod h1;
mod h2;
pub mod kernel;
mod l7;
pub mod lb;
pub mod listener;
pub mod metrics;
pub mod node;
pub mod snapshot;
mod sniff;
pub mod tap;
pub mod tcp;
#[cfg(test)]
mod testing;
pub mod upstream;
pub mod worker;

pub use error::ProxyError;
pub use node::{ConfigSource, Node};
