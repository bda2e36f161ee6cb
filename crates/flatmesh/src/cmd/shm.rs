//! `flatmesh shm run -- CMD ...`: runs CMD with the hetero-socket library (`libflatmesh_shm.so`,
//! built from crates/shm) preloaded, so CMD's local TCP connections to other preloaded
//! programs move their data path to shared memory. See docs/shm.md.

use anyhow::{bail, Context};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

const LIBRARY: &str = "libflatmesh_shm.so";

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: ShmCommand,
}

#[derive(clap::Subcommand)]
enum ShmCommand {
    /// Run a command with the shared-memory socket library preloaded (LD_PRELOAD).
    ///
    /// The library is looked up in FLATMESH_SHM_LIB, then next to the flatmesh binary.
    Run {
        /// The command and its arguments (put them after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        ShmCommand::Run { command } => run_preloaded(&command),
    }
}

/// Where the library is: FLATMESH_SHM_LIB, else next to this binary.
fn find_library() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("FLATMESH_SHM_LIB") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("FLATMESH_SHM_LIB points to {}, which is not a file: build the library with `cargo build --release -p flatmesh-shm` and point it at target/release/{LIBRARY}", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("cannot find the flatmesh binary's own path")?;
    let dir = exe
        .parent()
        .context("the flatmesh binary has no parent directory")?;
    let path = dir.join(LIBRARY);
    if !path.is_file() {
        bail!(
            "{LIBRARY} is not next to {}: build it with `cargo build --release -p flatmesh-shm` (it lands in the same target directory), or set FLATMESH_SHM_LIB to its path",
            exe.display()
        );
    }
    Ok(path)
}

fn run_preloaded(command: &[String]) -> anyhow::Result<()> {
    let Some((program, arguments)) = command.split_first() else {
        bail!("no command given: use `flatmesh shm run -- CMD [ARGS...]`");
    };
    let library = find_library()?;
    let library = library.canonicalize().unwrap_or(library);
    // Keep whatever the caller already preloads; ours goes first.
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(existing) if !existing.trim().is_empty() => format!("{}:{existing}", library.display()),
        _ => library.display().to_string(),
    };
    // exec replaces this process, so exit status and signals are CMD's own.
    let error = std::process::Command::new(program)
        .args(arguments)
        .env("LD_PRELOAD", preload)
        .exec();
    Err(error).with_context(|| format!("cannot run `{program}`: is it installed and on PATH?"))
}
