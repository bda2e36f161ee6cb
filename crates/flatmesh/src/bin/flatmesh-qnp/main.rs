//! `flatmesh-qnp`: the QingNiao tools (`flatmesh qnp ...` runs this binary).
//!
//! They are a binary of their own because the key-value example app links the system
//! RocksDB (and with it libstdc++). Kept out of `flatmesh`, the node proxy never maps those
//! libraries, which is several megabytes of resident memory on every node.

use clap::Parser;

mod qnp;

#[derive(Parser)]
#[command(
    name = "flatmesh qnp",
    bin_name = "flatmesh qnp",
    version,
    about = "QingNiao: IDL compiler, skip-and-check rules and their RAM/CAM image, dispatch demo and benchmark"
)]
struct Cli {
    #[command(flatten)]
    args: qnp::Args,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // End quietly, like other Unix tools, when the output goes to a pipe that closes early
    // (`flatmesh qnp rules compile ... | head`). QingNiao only uses datagram sockets (UDP, Unix
    // datagrams), which never raise SIGPIPE, so this cannot end a benchmark early.
    // SAFETY: plain signal disposition change at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    match qnp::run(cli.args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
