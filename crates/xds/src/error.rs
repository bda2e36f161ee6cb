//! The crate's error type. Every message says what to do about it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// An xDS resource (or a bootstrap section) uses something flatmesh does not support or is
    /// malformed. `at` names the resource and the field, e.g. `Cluster "api": lb_policy`.
    /// This text is what goes into a NACK's `error_detail`.
    #[error("{at}: {why}")]
    Resource { at: String, why: String },

    /// The resources translated, but the flatmesh config they form is not valid.
    #[error("the pushed resources do not form a valid flatmesh config: {0}")]
    Invalid(String),

    /// The node refused to apply the config (e.g. a listener address is taken).
    #[error("the node could not apply the config: {0}")]
    Apply(String),

    #[error("cannot read {}: {source}; check that the path is right and readable", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A bootstrap or state file that is not YAML/JSON at all.
    #[error("{origin}: not valid YAML/JSON: {why}")]
    Syntax { origin: String, why: String },

    #[error("cannot reach the xDS server at {address}: {why}; check that the control plane runs and that --xds names its gRPC port")]
    Connect { address: String, why: String },

    #[error("the xDS stream to {address} failed: {why}")]
    Stream { address: String, why: String },

    /// The control center would not (or could not) give a workload certificate.
    #[error("cannot get a certificate for {id} from the control center at {server}: {why}")]
    Certificate {
        id: String,
        server: String,
        why: String,
        /// The control center could not be reached or was not ready: worth trying again.
        /// (A refusal is not: it would be refused again.)
        transient: bool,
    },

    #[error("cannot serve xDS on {address}: {why}; pick a free port with --listen")]
    Serve { address: String, why: String },
}

impl XdsError {
    pub(crate) fn resource(at: impl Into<String>, why: impl Into<String>) -> XdsError {
        XdsError::Resource {
            at: at.into(),
            why: why.into(),
        }
    }
}

pub type Result<T, E = XdsError> = std::result::Result<T, E>;
