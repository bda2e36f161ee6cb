//! `flatmesh pu ...`: split network namespace across processing units. Owned by the pu work (issue 7).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`flatmesh pu` is being built (issue 7)")
}
