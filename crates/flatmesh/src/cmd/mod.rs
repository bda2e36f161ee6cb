//! One module per subcommand.

pub mod ca;
pub mod check;
pub mod control;
pub mod control_demo;
pub mod demo;
pub mod kernel;
pub mod node;
pub mod place;
pub mod pu;
pub mod qnp;
pub mod shm;
pub mod simulate;

/// Logs go to stderr as text; `RUST_LOG` sets the level (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal as _;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}
