//! flatmesh: the binary. Each subcommand lives in `cmd/<name>.rs` and only calls into the libraries.

use clap::{Parser, Subcommand};

mod cmd;

#[derive(Parser)]
#[command(
    name = "flatmesh",
    version,
    about = "A sidecar-free service mesh node proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up and consumed at once: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the node proxy.
    Node(cmd::node::Args),
    /// Drain a running node (POST /drain) and wait until it has stopped: a preStop hook.
    Drain(cmd::drain::Args),
    /// A live table of a node's routes: req/s, success rate, p50/p99 and tier (like `linkerd viz top`).
    Top(cmd::top::Args),
    /// The mesh CA: `ca init`, `ca issue` (X.509 SVIDs), `ca rotate`, `ca retire`.
    Ca(cmd::ca::Args),
    /// Validate a config; --explain prints the rule program and where each rule runs,
    /// --nic-image writes tier N's image, --admin asks a running node.
    Check(cmd::check::Args),
    /// Start built-in services and a node proxy, drive load, print a report.
    Demo(cmd::demo::Args),
    /// QingNiao: IDL compiler, skip-and-check rules and their RAM/CAM image, dispatch demo and benchmark.
    Qnp(cmd::qnp::Args),
    /// Place microservice DAGs on hosts and SmartNICs (E3: hcm, anneal, ilp).
    Place(cmd::place::Args),
    /// Reproduce E3's Table 6 (placement at scale) and Table 5 / Fig. 10 (energy, cost).
    Simulate(cmd::simulate::Args),
    /// Control center: serve xDS to nodes and Envoy; `control demo` shows placement and migration.
    Control(cmd::control::Args),
    /// The kernel (eBPF) tier: status and clean-up.
    Kernel(cmd::kernel::Args),
    /// Shared-memory sockets: `shm run -- CMD` runs CMD with the hetero-socket library preloaded.
    Shm(cmd::shm::Args),
    /// Split network namespace across processing units: `pu agent`, `pu demo`.
    Pu(cmd::pu::Args),
}

/// Commands that print a report and exit end quietly, like other Unix tools, when their output
/// goes to a pipe that closes early (`flatmesh place ... | head`), instead of panicking on the
/// failed print. Long-running commands keep Rust's default (SIGPIPE ignored): a peer closing a
/// socket must never kill the node. (`flatmesh qnp` is among the quiet ones: QingNiao only uses
/// datagram sockets, UDP and Unix datagrams, which never raise SIGPIPE, so this cannot end its
/// demo or benchmark early.)
fn end_quietly_on_closed_stdout() {
    // SAFETY: plain signal disposition change at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Check(_)
            | Command::Ca(_)
            | Command::Place(_)
            | Command::Simulate(_)
            | Command::Kernel(_)
            | Command::Qnp(_)
            | Command::Top(_)
    ) {
        end_quietly_on_closed_stdout();
    }
    let result = match cli.command {
        Command::Node(args) => cmd::node::run(args),
        Command::Drain(args) => cmd::drain::run(args),
        Command::Top(args) => cmd::top::run(args),
        Command::Ca(args) => cmd::ca::run(args),
        Command::Check(args) => cmd::check::run(args),
        Command::Demo(args) => cmd::demo::run(args),
        Command::Qnp(args) => cmd::qnp::run(args),
        Command::Place(args) => cmd::place::run(args),
        Command::Simulate(args) => cmd::simulate::run(args),
        Command::Control(args) => cmd::control::run(args),
        Command::Kernel(args) => cmd::kernel::run(args),
        Command::Shm(args) => cmd::shm::run(args),
        Command::Pu(args) => cmd::pu::run(args),
    };
    cmd::flush_logs();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
