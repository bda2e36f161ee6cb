//! Live traffic for the web console (`--ui`; docs/console.md): one thread per node polls the
//! node proxy's admin `GET /stats/routes` once a second through the CLI's admin client and
//! turns two samples into per-route windows with `flatmesh top`'s [`window`]; the tiers come
//! from `GET /rules`, re-read when the set of routes changes.
//!
//! Bounded: at most [`MAX_POLLED_NODES`] nodes; each exchange is the admin client's (5 s
//! timeout, answer size capped), so a slow or dead node delays only its own thread and shows
//! as `unreachable` on the page.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flatmesh_config::AdminAddress;
use flatmesh_control::console::{Console, RouteWindow};

use super::top::{route_tiers, sample, window, Sample};

/// Nodes polled at most; more are left out with a warning.
pub const MAX_POLLED_NODES: usize = 64;
/// How often each node is read.
pub const POLL: Duration = Duration::from_secs(1);

/// Starts one poller per node (`(node id, admin address)`); they stop when `stop` is set.
pub fn poll_routes(
    console: &Console,
    nodes: Vec<(String, AdminAddress)>,
    token: Option<String>,
    stop: Arc<AtomicBool>,
) {
    if nodes.len() > MAX_POLLED_NODES {
        tracing::warn!(
            nodes = nodes.len(),
            polled = MAX_POLLED_NODES,
            "console: polling the routes of the first {MAX_POLLED_NODES} nodes only"
        );
    }
    for (node, admin) in nodes.into_iter().take(MAX_POLLED_NODES) {
        let (console, token, stop) = (console.clone(), token.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("console-poll-{node}"))
            .spawn(move || poll_node(&console, &node, &admin, token.as_deref(), &stop));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "console: cannot start a poller thread");
        }
    }
}

fn poll_node(
    console: &Console,
    node: &str,
    admin: &AdminAddress,
    token: Option<&str>,
    stop: &AtomicBool,
) {
    let mut tiers: Option<HashMap<(String, String), String>> = None;
    let no_tiers = HashMap::new();
    let mut before: Option<(Instant, Sample)> = None;
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        match sample(admin, token) {
            Ok(after) => {
                let routes_changed = before
                    .as_ref()
                    .is_some_and(|(_, b)| b.routes_len() != after.routes_len());
                if tiers.is_none() || routes_changed {
                    // Without tiers the routes still show, with tier `-`.
                    tiers = route_tiers(admin, token).ok();
                }
                if let Some((then, earlier)) = &before {
                    let rows = window(
                        earlier,
                        &after,
                        now - *then,
                        tiers.as_ref().unwrap_or(&no_tiers),
                    );
                    let windows = rows
                        .into_iter()
                        .map(|r| RouteWindow {
                            node: node.to_string(),
                            listener: r.listener,
                            route: r.route,
                            cluster: r.cluster,
                            tier: r.tier,
                            rps: r.rps,
                            success: r.success,
                            p99_ms: r.p99.map(|d| d.as_secs_f64() * 1e3),
                        })
                        .collect();
                    console.set_routes(node, Ok(windows));
                }
                before = Some((now, after));
            }
            Err(e) => {
                console.set_routes(node, Err(format!("{e:#}")));
                before = None;
                tiers = None;
            }
        }
        next += POLL;
        let wait = next.saturating_duration_since(Instant::now());
        if wait.is_zero() {
            // Fell behind (a slow node): start the schedule again from now.
            next = Instant::now();
        }
        std::thread::sleep(wait);
    }
}
