//! The one error type of the crate. Every message says what to do next.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PuError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },

    #[error("cannot read {path}: {source}; check the path and that it is readable")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("the port table {path}: {message}; run `flatmesh pu up --config FILE` as root (it attaches the bind hook and creates the table)")]
    PortTable { path: PathBuf, message: String },

    #[error("{path}: {source}; check that the state directory exists and is writable (root)")]
    StateIo {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("`{command}` failed: {message}; is iproute2/nftables installed and are you root?")]
    Command { command: String, message: String },

    #[error("PU `{pu}` does not exist (no network namespace {netns}); run `flatmesh pu up --config FILE` first")]
    NoSuchPu { pu: String, netns: String },

    #[error("cannot enter network namespace {netns}: {source}; run as root and check that it exists (`ip netns list`)")]
    EnterNetns {
        netns: String,
        source: std::io::Error,
    },

    #[error("cpuset for PU `{pu}`: {message}")]
    Cpuset { pu: String, message: String },

    #[error("cannot parse {what}: {message}")]
    Parse { what: String, message: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },

    #[error("an agent for PU `{pu}` is already running{pid}; stop it first (or see `flatmesh pu status --config FILE`)")]
    AgentRunning { pu: String, pid: String },

    #[error("refusing to write rules for PU `{pu}`: this thread is not in its network namespace {netns} (the rules would land in the wrong namespace, e.g. the host's); start the agent with `flatmesh pu agent`, which enters the PU itself")]
    NotOnPu { pu: String, netns: String },

    #[error("this needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; run it with sudo or as root")]
    NotRoot,
}

impl PuError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        PuError::Io {
            context: context.into(),
            source,
        }
    }
}

pub type Result<T, E = PuError> = std::result::Result<T, E>;
