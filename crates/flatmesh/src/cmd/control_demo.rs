//! `flatmesh control demo`. Owned by the control-center work (issue 8).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`flatmesh control demo` is being built (issue 8)")
}
