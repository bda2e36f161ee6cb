//! The one error type of the control center. Every message says what is wrong and what to do.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("cannot read {path}: {cause}; check the path, or use a preset such as preset:3xType1-SmartNIC")]
    Read {
        path: String,
        /// Not `source`: the message already includes it, and anyhow would print it twice.
        cause: std::io::Error,
    },
    #[error("{what} {path}: {message}; fix the YAML (see docs/control.md for the schema)")]
    Yaml {
        what: &'static str,
        path: String,
        message: String,
    },
    #[error("invalid {what}: {message}")]
    Invalid { what: &'static str, message: String },
    #[error("unknown preset {name}; known presets: {known}")]
    UnknownPreset { name: String, known: String },
    #[error("instance {instance} fits on no node: {reason}; add servers, lower the app's rps, or reduce shards")]
    NoFit { instance: String, reason: String },
    #[error("{0}")]
    TooLarge(String),
    #[error("ILP solver failed: {0}; the instance may be infeasible, try --algo hcm to see which instance does not fit")]
    Solver(String),
    #[error("placement violates a constraint: {0}")]
    Violation(String),
    #[error("heartbeat is {len} bytes, expected exactly 56 (or its 16-byte report); the agent and controller disagree on the wire format, upgrade the older side")]
    HeartbeatLength { len: usize },
    #[error("heartbeat from node {node}: {message}")]
    Heartbeat { node: u32, message: String },
    #[error("cannot write {path}: {cause}; check that the directory exists and is writable")]
    Write {
        path: String,
        /// Not `source`: the message already includes it, and anyhow would print it twice.
        cause: std::io::Error,
    },
    #[error("{what}: {message}")]
    Service { what: String, message: String },
    /// The addresses file of `flatmesh control --addresses` is wrong or incomplete.
    #[error("{origin}: {why}")]
    Addresses { origin: String, why: String },
    /// The heartbeat keys file of `flatmesh control --heartbeat-keys` is wrong or incomplete.
    #[error("{origin}: {why}")]
    HeartbeatKeys { origin: String, why: String },
    /// The xDS side of `flatmesh control` (its state file, its server); the message says what to do.
    #[cfg(feature = "serve")]
    #[error(transparent)]
    Xds(#[from] flatmesh_xds::XdsError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("migration of {instance} failed at step {step}: {message}; the instance keeps running on its old node")]
    Migration {
        instance: String,
        step: &'static str,
        message: String,
    },
}

pub type Result<T> = std::result::Result<T, ControlError>;
