//! `flatmesh demo`: built-in services, an in-process node proxy with the built-in config,
//! load with a progress bar, and a report. The work is in the lab (`flatmesh_lab::demo`).

use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// How long to drive load, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    duration: u64,
    /// Concurrent HTTP keep-alive connections.
    #[arg(long, value_name = "N", default_value_t = 8)]
    connections: usize,
    /// Do not draw the progress bar.
    #[arg(long)]
    no_progress: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Only the node's warnings and errors by default: info lines would break up the
    // progress bar. `RUST_LOG` still overrides.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let options = flatmesh_lab::demo::Options {
        duration: Duration::from_secs(args.duration),
        connections: args.connections,
        progress: !args.no_progress,
    };
    let report = flatmesh_lab::demo::run(&options)?;
    println!("{report}");
    let problems = report.problems();
    if problems.is_empty() {
        println!("all routes answered without errors and every split is within tolerance");
        return Ok(());
    }
    anyhow::bail!(
        "the demo's results are not sane:\n  - {}",
        problems.join("\n  - ")
    )
}
