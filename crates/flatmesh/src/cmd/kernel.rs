//! `flatmesh kernel status|cleanup`: tier K (eBPF) as the node left it in bpffs. Both read the
//! pins, so they work from any process while a node runs, and after one has crashed.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: KernelCommand,
}

#[derive(clap::Subcommand)]
enum KernelCommand {
    /// Programs, maps, entries, and per-program run counts and bytes moved in the kernel.
    Status {
        /// The node's pin directory (`kernel.pin_dir` in its config).
        #[arg(long, default_value = flatmesh_kernel::DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
    /// Remove the pins a crashed node left behind (refused while their owner runs).
    Cleanup {
        #[arg(long, default_value = flatmesh_kernel::DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        KernelCommand::Status { pin_dir } => {
            let status = flatmesh_kernel::status(&pin_dir).map_err(|e| {
                anyhow::anyhow!("cannot read tier K's pins under {}: {e}", pin_dir.display())
            })?;
            let mut text = status.to_string();
            if status.programs.is_empty() {
                if let Some(missing) = flatmesh_kernel::probe() {
                    text.push_str(&missing);
                    text.push('\n');
                }
            }
            // A closed pipe (`| head`) is not an error worth a panic.
            match std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
                _ => Ok(()),
            }
        }
        KernelCommand::Cleanup { pin_dir } => {
            let report =
                flatmesh_kernel::cleanup_stale(&pin_dir).map_err(|e| anyhow::anyhow!("{e}"))?;
            if report.removed.is_empty() {
                println!("nothing to clean under {}", pin_dir.display());
            } else {
                let owner = report
                    .owner
                    .map(|p| format!(" of dead pid {p}"))
                    .unwrap_or_default();
                println!(
                    "removed {} pins{owner} under {}",
                    report.removed.len(),
                    pin_dir.display()
                );
            }
            Ok(())
        }
    }
}
