//! `flatmesh drain --admin ADDR`: drain a running node (`POST /drain`) and wait until it has
//! stopped: its open requests finish, its connections close, then it exits. Made for a
//! Kubernetes preStop hook (docs/resilience.md, "Graceful drain").

use std::path::PathBuf;
use std::time::{Duration, Instant};

use flatmesh_config::AdminAddress;

#[derive(clap::Args)]
pub struct Args {
    /// The node's admin endpoint (IP:PORT or unix:/path).
    #[arg(long, value_name = "ADDR")]
    admin: AdminAddress,
    /// The admin token (`admin.token` / `admin.token_file` of the node), read from FILE.
    #[arg(long, value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// How long to wait for the node to stop; `0s` returns once the drain has begun. Give it
    /// a little more than the node's `drain_timeout`.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    wait: Duration,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    flatmesh_config::duration::parse(text)
}

/// How often the node is asked whether it is still there.
const POLL: Duration = Duration::from_millis(100);

pub fn run(args: Args) -> anyhow::Result<()> {
    let token = match &args.admin_token_file {
        Some(path) => {
            Some(flatmesh_config::admin::read_token_file(path).map_err(|e| anyhow::anyhow!(e))?)
        }
        None => None,
    };
    let answer = super::admin_client::request(&args.admin, "POST", "/drain", token.as_deref())?;
    if answer.status != 202 {
        anyhow::bail!(answer.refusal(&args.admin, token.as_deref(), "POST /drain"));
    }
    print!("{}", answer.body);
    if args.wait.is_zero() {
        return Ok(());
    }
    let started = Instant::now();
    while super::admin_client::reachable(&args.admin) {
        if started.elapsed() >= args.wait {
            anyhow::bail!(
                "the node at {} is still running after {}; it is draining and stops by itself after its drain_timeout",
                args.admin,
                flatmesh_config::duration::format(&args.wait)
            );
        }
        std::thread::sleep(POLL);
    }
    println!(
        "drained: the node has stopped ({} ms)",
        started.elapsed().as_millis()
    );
    Ok(())
}

/// The admin address as `--admin` parses it, for tests.
#[cfg(test)]
fn parse_admin(text: &str) -> AdminAddress {
    text.parse().unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_node_that_is_not_there_gets_an_error_that_names_the_address() {
        let args = Args {
            admin: parse_admin("127.0.0.1:1"),
            admin_token_file: None,
            wait: Duration::ZERO,
        };
        let err = run(args).unwrap_err().to_string();
        assert!(err.contains("127.0.0.1:1"), "{err}");
        assert!(err.contains("is it running"), "{err}");
    }
}
