//! flatmesh demo: built-in demo services and node config, a load generator and
//! the report that `flatmesh demo` prints.
//!
//! [`run`] does it all: start the services, start a node proxy in-process with
//! the built-in config, drive load through it, and build a [`report::Report`].
//! [`load`] is usable on its own by benchmarks and tests.

pub mod config;
pub mod load;
pub mod report;
pub mod run;
pub mod services;

pub use report::Report;
pub use run::{run, Options};

/// Everything that can stop the demo before it has a report.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
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
    #[error("internal error in the demo: {0}; please report it")]
    Internal(String),
}
