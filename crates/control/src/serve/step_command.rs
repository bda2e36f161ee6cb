//! The orchestrator's migration steps as a program of the operator's: `PROGRAM STEP INSTANCE
//! FROM TO` for each step of a migration or failover restart (`flatmesh control --step-command`),
//! or only a log line when no program is given (the instances are managed elsewhere).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::orchestrator::{Runtime, Step};

/// The orchestrator's migration steps: `PROGRAM STEP INSTANCE FROM TO` per step, or only a log
/// line when no program is given (the instances are started and stopped by something else).
pub struct StepCommand {
    pub program: Option<PathBuf>,
}

/// Longest a step program may run before the step counts as failed.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

fn step_slug(step: Step) -> &'static str {
    match step {
        Step::PushBinary => "push-binary",
        Step::Remove => "remove",
        Step::Cleanup => "cleanup",
        Step::MigrateState => "migrate-state",
        Step::Restart => "restart",
    }
}

impl Runtime for StepCommand {
    fn step(
        &self,
        step: Step,
        instance: &str,
        from: &str,
        to: &str,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send {
        let program = self.program.clone();
        let args: Vec<String> = vec![
            step_slug(step).to_string(),
            instance.to_string(),
            from.to_string(),
            to.to_string(),
        ];
        async move {
            let Some(program) = program else {
                tracing::info!(step = %args[0], instance = %args[1], from = %args[2], to = %args[3], "orchestrator step (no --step-command: logged only)");
                return Ok(());
            };
            tokio::task::spawn_blocking(move || run_step(&program, &args))
                .await
                .map_err(|e| format!("the step runner failed: {e}"))?
        }
    }
}

/// Run one step program to completion (or kill it at [`STEP_TIMEOUT`]). Its stdout and stderr
/// go to this process's, so whatever it says lands in the control center's log.
fn run_step(program: &Path, args: &[String]) -> Result<(), String> {
    let shown = format!("{} {}", program.display(), args.join(" "));
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run `{shown}`: {e}; check --step-command"))?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("`{shown}` failed ({status})")),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "`{shown}` did not finish within {} s and was killed",
                    STEP_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("cannot wait for `{shown}`: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn step_programs_run_and_failures_are_reported() {
        let dir = std::env::temp_dir().join(format!("flatmesh-step-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("steps.log");
        let script = dir.join("step.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"$@\" >> {}\n[ \"$1\" != fail-me ] || exit 3\n",
                log.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let args = |step: &str| -> Vec<String> {
            [step, "app/s-0", "a", "b"]
                .iter()
                .map(|s| s.to_string())
                .collect()
        };
        run_step(&script, &args("push-binary")).unwrap();
        let e = run_step(&script, &args("fail-me")).unwrap_err();
        assert!(e.contains("fail-me app/s-0 a b") && e.contains("3"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "push-binary app/s-0 a b\nfail-me app/s-0 a b\n"
        );
        let e = run_step(&dir.join("missing"), &args("restart")).unwrap_err();
        assert!(
            e.contains("cannot run") && e.contains("--step-command"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
