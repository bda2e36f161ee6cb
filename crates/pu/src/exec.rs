//! Running the system tools (`ip`, `nft`) with clear errors.

use std::io::Write as _;
use std::process::{Command, Stdio};

use crate::error::{PuError, Result};

/// Runs `program args..` and fails with its stderr if it exits non-zero.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    run_with_input(program, args, None)
}

/// As `run`, with `input` written to the tool's stdin (for `nft -f -`).
pub fn run_with_input(program: &str, args: &[&str], input: Option<&str>) -> Result<String> {
    let command = format!("{program} {}", args.join(" "));
    let fail = |message: String| PuError::Command {
        command: command.clone(),
        message,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot start {program}: {e}")))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| fail(format!("cannot write to {program}: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| fail(format!("cannot wait for {program}: {e}")))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(fail(format!("{} ({})", stderr.trim(), out.status)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
