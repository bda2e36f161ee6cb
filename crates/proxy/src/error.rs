//! The proxy crate's error type. Every message says what went wrong and what to do.

use std::net::SocketAddr;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("cannot listen on {address} for {what}: {source}; stop the process that holds the port (`ss -ltnp 'sport = :{port}'`) or change the address in the config", port = address.port())]
    Bind {
        what: String,
        address: SocketAddr,
        source: std::io::Error,
    },

    #[error("cannot listen on the admin socket {}: {why}", path.display())]
    AdminSocket {
        path: std::path::PathBuf,
        why: String,
    },

    #[error("config rejected: {0}")]
    Config(String),

    #[error("rule program could not be compiled: {0}; run `flatmesh check --config FILE --explain` to see the program")]
    Rules(String),

    #[error("cannot start worker thread {worker}: {source}; the machine may be out of threads or memory")]
    Thread {
        worker: usize,
        source: std::io::Error,
    },

    #[error("config reload is only possible for a node started from a file (flatmesh node --config FILE)")]
    NoConfigFile,
}
