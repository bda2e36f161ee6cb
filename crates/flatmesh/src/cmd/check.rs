//! `flatmesh check --config FILE [--explain]`: validate a config, optionally print its rule program.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The YAML config to validate.
    #[arg(long, short)]
    config: PathBuf,
    /// Print the compiled rule program: every table, every rule and the tier it runs in.
    #[arg(long)]
    explain: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = flatmesh_config::load(&args.config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let program = flatmesh_rules::compile(&config)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    if args.explain {
        print!("{}", program.explain());
    }
    println!("{}: ok", args.config.display());
    Ok(())
}
