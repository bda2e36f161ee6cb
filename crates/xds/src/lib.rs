//! flatmesh speaks Envoy's data-plane API (xDS v3), as a client and as a server.
//!
//! - [`to_model`]: LDS/RDS/CDS/EDS resources -> flatmesh's config model, the subset flatmesh runs;
//!   anything else is an error naming the field (the NACK's `error_detail`).
//! - [`from_model`]: the config model -> xDS resources, for the server and for Envoy.
//! - [`tls`]: a listener's and a cluster's `tls` <-> Envoy's TLS transport sockets, both ways.
//! - [`rbac`]: a listener's `authorization` <-> Envoy's RBAC filters, both ways.
//! - [`bootstrap`]: an Envoy v3 bootstrap file (`static_resources`) -> the config model.
//! - [`client`]: the ADS client of `flatmesh node --xds`, state-of-the-world and delta.
//! - [`server`]: the ADS server of `flatmesh control`.
//! - [`secure`]: the control channel's TLS and bootstrap tokens; [`certificates`]: the
//!   certificate API over it (Istio's CA API), through which nodes get their SVIDs;
//!   [`identities`]: the node's side, which fetches them and renews them at half life.
//! - [`feed`]: what `flatmesh control` serves: its state file plus the endpoints of placed
//!   services (the control crate places them and moves them).
//! - [`apply`]: the client's [`client::Apply`] for a node proxy (start, then reload); the
//!   caller supplies the proxy.
#![forbid(unsafe_code)]
// Envoy configs in the wild still use deprecated fields (header `exact_match`, cluster
// `http2_protocol_options`, ...); accepting them is part of the job.
#![allow(deprecated)]

pub mod apply;
pub mod bootstrap;
pub mod certificates;
pub mod client;
pub mod error;
pub mod fault;
pub mod feed;
pub mod from_model;
pub mod hbone;
pub mod identities;
pub mod local_ratelimit;
pub mod lrs;
pub mod original_dst;
pub mod rbac;
pub mod resources;
pub mod sds;
pub mod secure;
pub mod server;
pub mod tls;
pub mod to_model;
mod unset;

pub use error::{Result, XdsError};
pub use resources::{Resource, Resources};

/// Read the `--config` file that goes with `--xds` (node settings: admin, workers, limits,
/// access log; and any static listeners and clusters), or the `--state` file of
/// `flatmesh control`. Unlike a plain `flatmesh node --config` file it may have no listeners
/// (xDS brings them) and clusters without endpoints (EDS or the placement brings them).
pub fn load_base(path: &std::path::Path) -> Result<flatmesh_config::Config> {
    let allowed = |d: &flatmesh_config::Diagnostic| {
        d.message.starts_with("config has no listeners") || d.message.ends_with("has no endpoints")
    };
    match flatmesh_config::load(path) {
        Ok(config) => Ok(config),
        Err(e) if !e.diagnostics().is_empty() && e.diagnostics().iter().all(allowed) => {
            let text = std::fs::read_to_string(path).map_err(|source| XdsError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            let config: flatmesh_config::Config =
                serde_norway::from_str(&text).map_err(|e| XdsError::Syntax {
                    origin: path.display().to_string(),
                    why: e.to_string(),
                })?;
            to_model::check(&config)?;
            Ok(config)
        }
        Err(e) => Err(XdsError::Invalid(e.to_string())),
    }
}

#[cfg(test)]
mod tests;
