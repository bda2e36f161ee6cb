//! `flatmesh shm ...`: hetero-socket (shared-memory sockets). Owned by the shm work (issue 6).

#[derive(clap::Args)]
pub struct Args {
    /// The command to run with the shared-memory socket library preloaded.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`flatmesh shm` is being built (issue 6)")
}
