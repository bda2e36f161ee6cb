//! `flatmesh demo`: built-in demo services and node config, a load generator and
//! the report it prints.
//!
//! [`run`] does it all: start the services, start a node proxy in-process with
//! the built-in config, drive load through it, and build a [`report::Report`].
//! [`load`] is usable on its own by benchmarks and tests.

pub mod config;
pub mod load;
pub mod mtls;
pub mod report;
pub mod run;
pub mod services;

pub use report::Report;
pub use run::{run, Options};
