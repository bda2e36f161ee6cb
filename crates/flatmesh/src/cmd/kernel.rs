//! `flatmesh kernel ...`: the eBPF tier (issue 4).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`flatmesh kernel` is being built (issue 4)")
}
