//! The lab's one error type. Failures of the product crates pass through with their own
//! messages; the lab's own say what went wrong and what to do.

use std::path::PathBuf;

use flatmesh_control::ControlError;
use flatmesh_pu::PuError;
use flatmesh_qnp::QnpError;
use flatmesh_rules::RulesError;

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error(transparent)]
    Qnp(#[from] QnpError),
    #[error(transparent)]
    Rules(#[from] RulesError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Pu(#[from] PuError),
    #[error(
        "could not bind the {service} demo service on 127.0.0.1: {source}; \
         check that the loopback interface is up and that the open-file limit (ulimit -n) is not exhausted"
    )]
    Bind {
        service: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("could not start the demo's async runtime: {0}; the system may be out of threads or memory, free some and retry")]
    Runtime(#[source] std::io::Error),
    #[error("the built-in demo config does not validate: {0}; this is a flatmesh bug, please report it with this message")]
    BuiltinConfig(String),
    /// The proxy's own message says what went wrong and what to do.
    #[error("the node proxy did not start: {0}")]
    NodeStart(String),
    #[error("the node proxy reports no bound address for listener `{0}`; this is a flatmesh bug, please report it")]
    MissingListener(&'static str),
    #[error("the node proxy did not become ready within {waited:?} (last answer from http://{admin}/ready: {last}); check the warnings above (RUST_LOG=debug shows more)")]
    NotReady {
        admin: std::net::SocketAddr,
        waited: std::time::Duration,
        last: String,
    },
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("invalid load plan: {0}")]
    InvalidPlan(String),
    #[error("invalid {what}: {message}")]
    Invalid { what: &'static str, message: String },
    /// A step of a demo failed; `message` says why and what to do.
    #[error("{what}: {message}")]
    Demo { what: String, message: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {cause}; check that the directory exists and is writable")]
    Write {
        path: String,
        /// Not `source`: the message already includes it, and anyhow would print it twice.
        cause: std::io::Error,
    },
    /// The key-value store failed.
    #[error("RocksDB at {}: {msg}; check that the directory is writable and not opened by another process", path.display())]
    Store { path: PathBuf, msg: String },
    #[error("the `kv` workload runs on RocksDB, which this build of flatmesh leaves out; rebuild with `cargo build --release -p flatmesh --features kv` (needs librocksdb-dev), or use `--workload pingpong`")]
    KvNotBuilt,
    #[error("internal error in the lab: {0}; please report it")]
    Internal(String),
}

impl LabError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        LabError::Io {
            what: what.into(),
            source,
        }
    }
}

pub type Result<T, E = LabError> = std::result::Result<T, E>;
