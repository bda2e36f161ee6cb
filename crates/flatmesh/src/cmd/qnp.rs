//! `flatmesh qnp ...`: hands its arguments to the `flatmesh-qnp` binary installed beside this
//! one (see `src/bin/flatmesh-qnp/main.rs` for why it is separate).

use anyhow::Context as _;
use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;

#[derive(clap::Args)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// Everything after `qnp`, passed through unchanged (`flatmesh qnp --help` lists it).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<OsString>,
}

/// The name of the QingNiao binary, looked up next to the running `flatmesh`.
const QNP_BINARY: &str = "flatmesh-qnp";

pub fn run(args: Args) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the running flatmesh binary")?;
    let qnp = exe.with_file_name(QNP_BINARY);
    if !qnp.is_file() {
        anyhow::bail!(
            "`{}` is missing: `flatmesh qnp` runs it from the directory of `flatmesh`. \
             Build both with `cargo build --release -p flatmesh` (or copy it beside `flatmesh`).",
            qnp.display()
        );
    }
    // exec only returns on failure.
    let err = std::process::Command::new(&qnp).args(&args.args).exec();
    Err(err).with_context(|| format!("cannot run `{}`", qnp.display()))
}
