//! `flatmesh control`: the control center. With no subcommand it serves xDS (issue 9);
//! `flatmesh control demo` is the placement/orchestration demo (cmd/control_demo.rs, issue 8).

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<ControlCommand>,
}

#[derive(clap::Subcommand)]
enum ControlCommand {
    /// Nodes in network namespaces, emulated SmartNIC cores, real services; overload moves them.
    Demo(crate::cmd::control_demo::Args),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Some(ControlCommand::Demo(demo)) => crate::cmd::control_demo::run(demo),
        None => anyhow::bail!("`flatmesh control` (the xDS server) is being built (issue 9)"),
    }
}
