//! One module per subcommand.

pub mod admin_client;
pub mod ca;
pub mod check;
pub mod console_feed;
pub mod control;
pub mod control_demo;
pub mod demo;
pub mod drain;
pub mod kernel;
pub mod node;
pub mod place;
pub mod pu;
pub mod qnp;
pub mod shm;
pub mod simulate;
pub mod top;

/// The process log, once a command has set it up.
static PROCESS_LOG: std::sync::OnceLock<flatmesh_proxy::logging::ProcessLog> =
    std::sync::OnceLock::new();

/// Logs go to stderr as text; `RUST_LOG` sets the level (default `info`). A worker never
/// writes to stderr itself: lines go through a queue bounded in bytes
/// (`flatmesh_proxy::logging::PROCESS_LOG_QUEUE_BYTES`) that a writer thread drains, so a
/// stalled reader of stderr costs dropped (and counted) lines, never a frozen worker; a
/// warning that repeats is logged a few times per window and then counted.
pub fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal as _;
    let ansi = std::io::stderr().is_terminal();
    let log = match flatmesh_proxy::logging::ProcessLog::start(
        Box::new(std::io::stderr()),
        flatmesh_proxy::logging::PROCESS_LOG_QUEUE_BYTES,
    ) {
        Ok(log) => PROCESS_LOG.get_or_init(|| log),
        Err(err) => {
            eprintln!(
                "warning: cannot start the log writer thread ({err}); logging straight to stderr"
            );
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_ansi(ansi)
                .with_writer(std::io::stderr)
                .try_init();
            return;
        }
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(log.rate_limit())
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(ansi)
                .with_writer(log.writer()),
        )
        .try_init();
}

/// Write out what the process log still holds (for at most 2 s): at exit, so the last lines
/// are not lost with the writer thread.
pub fn flush_logs() {
    if let Some(log) = PROCESS_LOG.get() {
        log.flush(std::time::Duration::from_secs(2));
    }
}
