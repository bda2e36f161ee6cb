//! `flatmesh top --admin ADDR`: a live table of a node's routes, like `linkerd viz top`.
//!
//! Every `--interval` it reads the node's cumulative per-route counters (`GET /stats/routes`)
//! and prints, per (listener, route, cluster), what happened since the previous sample:
//! requests per second, success rate (answers that are not 5xx, Linkerd's definition), p50
//! and p99 latency from the node's duration histogram, and the tier the route runs in
//! (`GET /rules`). On a terminal the table is redrawn in place; otherwise each sample is
//! printed below the last, so the output can be piped or logged.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use flatmesh_config::AdminAddress;
use serde::Deserialize;

#[derive(clap::Args)]
pub struct Args {
    /// The node's admin endpoint (IP:PORT or unix:/path).
    #[arg(long, value_name = "ADDR")]
    admin: AdminAddress,
    /// The admin token (`admin.token` / `admin.token_file` of the node), read from FILE.
    #[arg(long, value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// Time between samples; the rates are over this window.
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    interval: Duration,
    /// Column the rows are sorted by (highest first; `route` sorts by name).
    #[arg(long, value_enum, default_value_t = SortBy::Rps)]
    sort: SortBy,
    /// Show at most this many rows.
    #[arg(long, default_value_t = 40)]
    limit: usize,
    /// Print this many tables, then exit (default: until interrupted).
    #[arg(long, value_name = "N")]
    samples: Option<u64>,
    /// Also show routes that had no request in the window.
    #[arg(long)]
    all: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SortBy {
    Rps,
    Success,
    P50,
    P99,
    Route,
}

/// The shortest window: shorter ones measure the admin round trip more than the traffic.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = flatmesh_config::duration::parse(text)?;
    if d < MIN_INTERVAL {
        return Err(format!(
            "{text} is shorter than {} ms; rates over so short a window are noise",
            MIN_INTERVAL.as_millis()
        ));
    }
    Ok(d)
}

/// The node's answer to `GET /stats/routes` (crates/proxy/src/metrics.rs, `route_stats`).
#[derive(Debug, Clone, Deserialize)]
pub struct Sample {
    /// Upper bounds of the histogram's finite buckets; the last bucket is +Inf.
    bucket_bounds_seconds: Vec<f64>,
    routes: Vec<RouteCounters>,
}

impl Sample {
    /// How many (listener, route, cluster) rows it holds.
    pub fn routes_len(&self) -> usize {
        self.routes.len()
    }
}

#[derive(Debug, Clone, Deserialize)]
struct RouteCounters {
    listener: String,
    route: String,
    cluster: String,
    /// 1xx, 2xx, 3xx, 4xx, 5xx.
    status_classes: [u64; 5],
    duration_buckets: Vec<u64>,
}

/// One line of the table: a route over one window.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub listener: String,
    pub route: String,
    pub cluster: String,
    pub tier: String,
    pub requests: u64,
    pub rps: f64,
    /// Share of answers that were not 5xx; `None` with no request in the window.
    pub success: Option<f64>,
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let token = match &args.admin_token_file {
        Some(path) => {
            Some(flatmesh_config::admin::read_token_file(path).map_err(|e| anyhow::anyhow!(e))?)
        }
        None => None,
    };
    let token = token.as_deref();
    let redraw = std::io::stdout().is_terminal();
    let mut tiers = route_tiers(&args.admin, token)?;
    let mut before = (Instant::now(), sample(&args.admin, token)?);
    let mut shown = 0u64;
    while args.samples.is_none_or(|n| shown < n) {
        std::thread::sleep(args.interval);
        let after = (Instant::now(), sample(&args.admin, token)?);
        // A reload can add routes or move them between tiers; the rules are cheap to read.
        if after.1.routes.len() != before.1.routes.len() {
            tiers = route_tiers(&args.admin, token)?;
        }
        let mut rows = window(&before.1, &after.1, after.0 - before.0, &tiers);
        if !args.all {
            rows.retain(|r| r.requests > 0);
        }
        sort(&mut rows, args.sort);
        rows.truncate(args.limit);
        let table = render(&rows);
        let mut out = std::io::stdout().lock();
        if redraw {
            // Home the cursor and clear the screen, so the table stays in place.
            write!(out, "\x1b[H\x1b[2J")?;
        }
        writeln!(
            out,
            "flatmesh top: {} | window {} ms | sorted by {:?} | {} routes with traffic",
            args.admin,
            (after.0 - before.0).as_millis(),
            args.sort,
            rows.iter().filter(|r| r.requests > 0).count()
        )?;
        writeln!(out, "{table}")?;
        out.flush()?;
        before = after;
        shown += 1;
    }
    Ok(())
}

/// Reads the node's cumulative counters.
pub(crate) fn sample(admin: &AdminAddress, token: Option<&str>) -> anyhow::Result<Sample> {
    let answer = super::admin_client::request(admin, "GET", "/stats/routes", token)?;
    if answer.status != 200 {
        anyhow::bail!(answer.refusal(admin, token, "/stats/routes"));
    }
    parse_sample(&answer.body).with_context(|| {
        format!("{admin} answered /stats/routes with something else than route counters; is it a flatmesh node of this version?")
    })
}

/// Parses and checks `/stats/routes`: every route's histogram has one bucket per bound plus
/// +Inf, so the quantiles below index within it.
pub fn parse_sample(body: &str) -> anyhow::Result<Sample> {
    let sample: Sample = serde_json::from_str(body)?;
    let buckets = sample.bucket_bounds_seconds.len() + 1;
    if let Some(r) = sample
        .routes
        .iter()
        .find(|r| r.duration_buckets.len() != buckets)
    {
        anyhow::bail!(
            "route {} has {} histogram buckets, the bounds say {buckets}",
            r.route,
            r.duration_buckets.len()
        );
    }
    Ok(sample)
}

/// (listener, route) → the tier its rule runs in, from `GET /rules`.
pub(crate) fn route_tiers(
    admin: &AdminAddress,
    token: Option<&str>,
) -> anyhow::Result<HashMap<(String, String), String>> {
    let answer = super::admin_client::request(admin, "GET", "/rules", token)?;
    if answer.status != 200 {
        anyhow::bail!(answer.refusal(admin, token, "/rules"));
    }
    let rules: serde_json::Value = serde_json::from_str(&answer.body)
        .with_context(|| format!("{admin} answered /rules with something else than JSON"))?;
    Ok(tiers_of(&rules))
}

fn tiers_of(rules: &serde_json::Value) -> HashMap<(String, String), String> {
    let mut tiers = HashMap::new();
    let listeners = rules["listeners"].as_array().into_iter().flatten();
    for listener in listeners {
        let name = listener["name"].as_str().unwrap_or_default();
        for route in listener["routes"].as_array().into_iter().flatten() {
            if let (Some(route_name), Some(tier)) = (route["name"].as_str(), route["tier"].as_str())
            {
                tiers.insert((name.to_string(), route_name.to_string()), tier.to_string());
            }
        }
    }
    tiers
}

/// What happened between two samples. A route whose counters went down (the node restarted,
/// or a reload dropped and re-added it) counts from zero.
pub fn window(
    before: &Sample,
    after: &Sample,
    elapsed: Duration,
    tiers: &HashMap<(String, String), String>,
) -> Vec<Row> {
    let earlier: HashMap<(&str, &str, &str), &RouteCounters> = before
        .routes
        .iter()
        .map(|r| {
            (
                (r.listener.as_str(), r.route.as_str(), r.cluster.as_str()),
                r,
            )
        })
        .collect();
    let secs = elapsed.as_secs_f64().max(f64::EPSILON);
    after
        .routes
        .iter()
        .map(|now| {
            let key = (
                now.listener.as_str(),
                now.route.as_str(),
                now.cluster.as_str(),
            );
            let then = earlier.get(&key).filter(|then| {
                then.status_classes
                    .iter()
                    .zip(&now.status_classes)
                    .all(|(a, b)| a <= b)
            });
            let classes: Vec<u64> = match then {
                Some(then) => delta(&then.status_classes, &now.status_classes),
                None => now.status_classes.to_vec(),
            };
            let buckets: Vec<u64> = match then {
                Some(then) => delta(&then.duration_buckets, &now.duration_buckets),
                None => now.duration_buckets.clone(),
            };
            let requests: u64 = classes.iter().sum();
            let failed = classes.get(4).copied().unwrap_or(0);
            Row {
                listener: now.listener.clone(),
                route: now.route.clone(),
                cluster: now.cluster.clone(),
                tier: tiers
                    .get(&(now.listener.clone(), now.route.clone()))
                    .cloned()
                    .unwrap_or_else(|| "-".into()),
                requests,
                rps: requests as f64 / secs,
                success: (requests > 0).then(|| (requests - failed) as f64 / requests as f64),
                p50: quantile(&after.bucket_bounds_seconds, &buckets, 0.50),
                p99: quantile(&after.bucket_bounds_seconds, &buckets, 0.99),
            }
        })
        .collect()
}

fn delta(then: &[u64], now: &[u64]) -> Vec<u64> {
    now.iter()
        .zip(then.iter().chain(std::iter::repeat(&0)))
        .map(|(n, t)| n.saturating_sub(*t))
        .collect()
}

/// The `q` quantile of a histogram, as Prometheus's `histogram_quantile` estimates it:
/// linear within the bucket that holds it; in the +Inf bucket, the highest finite bound.
pub fn quantile(bounds: &[f64], buckets: &[u64], q: f64) -> Option<Duration> {
    let total: u64 = buckets.iter().sum();
    if total == 0 || bounds.is_empty() {
        return None;
    }
    let rank = q * total as f64;
    let mut below = 0u64;
    for (i, &count) in buckets.iter().enumerate() {
        if count > 0 && (below + count) as f64 >= rank {
            let Some(&upper) = bounds.get(i) else {
                return Some(Duration::from_secs_f64(bounds[bounds.len() - 1]));
            };
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            let within = ((rank - below as f64) / count as f64).clamp(0.0, 1.0);
            return Some(Duration::from_secs_f64(lower + (upper - lower) * within));
        }
        below += count;
    }
    bounds.last().map(|b| Duration::from_secs_f64(*b))
}

pub fn sort(rows: &mut [Row], by: SortBy) {
    let key = |r: &Row| -> f64 {
        match by {
            SortBy::Rps => r.rps,
            SortBy::Success => r.success.unwrap_or(-1.0),
            SortBy::P50 => r.p50.map_or(-1.0, |d| d.as_secs_f64()),
            SortBy::P99 => r.p99.map_or(-1.0, |d| d.as_secs_f64()),
            SortBy::Route => 0.0,
        }
    };
    match by {
        SortBy::Route => rows.sort_by(|a, b| {
            (&a.listener, &a.route, &a.cluster).cmp(&(&b.listener, &b.route, &b.cluster))
        }),
        // Highest first; ties by name so the table does not shuffle between samples.
        _ => rows.sort_by(|a, b| {
            key(b)
                .total_cmp(&key(a))
                .then_with(|| (&a.listener, &a.route).cmp(&(&b.listener, &b.route)))
        }),
    }
}

pub fn render(rows: &[Row]) -> comfy_table::Table {
    let mut table = comfy_table::Table::new();
    table.load_style(comfy_table::presets::UTF8_FULL_CONDENSED);
    table.set_header([
        "listener", "route", "cluster", "tier", "req/s", "success", "p50", "p99",
    ]);
    let latency = |d: Option<Duration>| match d {
        Some(d) if d < Duration::from_millis(1) => format!("{} µs", d.as_micros()),
        Some(d) => format!("{:.1} ms", d.as_secs_f64() * 1e3),
        None => "-".into(),
    };
    for r in rows {
        table.add_row([
            r.listener.clone(),
            r.route.clone(),
            r.cluster.clone(),
            r.tier.clone(),
            format!("{:.1}", r.rps),
            r.success
                .map_or_else(|| "-".into(), |s| format!("{:.2}%", s * 100.0)),
            latency(r.p50),
            latency(r.p99),
        ]);
    }
    for column in 4..8 {
        if let Some(c) = table.column_mut(column) {
            c.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    table
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const BOUNDS: [f64; 3] = [0.001, 0.01, 0.1];

    fn sample(routes: &[(&str, [u64; 5], [u64; 4])]) -> Sample {
        Sample {
            bucket_bounds_seconds: BOUNDS.to_vec(),
            routes: routes
                .iter()
                .map(|(name, classes, buckets)| RouteCounters {
                    listener: "web".into(),
                    route: name.to_string(),
                    cluster: format!("{name}-c"),
                    status_classes: *classes,
                    duration_buckets: buckets.to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_window_counts_only_what_happened_between_the_samples() {
        let before = sample(&[("a", [0, 100, 0, 0, 0], [100, 0, 0, 0])]);
        let after = sample(&[
            ("a", [0, 280, 0, 0, 20], [100, 180, 20, 0]),
            ("b", [0, 10, 0, 0, 0], [10, 0, 0, 0]),
        ]);
        let tiers = HashMap::from([(("web".into(), "a".into()), "U7".into())]);
        let rows = window(&before, &after, Duration::from_secs(2), &tiers);
        let a = &rows[0];
        assert_eq!(a.requests, 200);
        assert!((a.rps - 100.0).abs() < 1e-9);
        assert_eq!(a.success, Some(0.9));
        assert_eq!(a.tier, "U7");
        // 180 of 200 in (1 ms, 10 ms]: the median sits 100/180 of the way up that bucket.
        let p50 = a.p50.unwrap().as_secs_f64();
        assert!(
            (p50 - (0.001 + 0.009 * 100.0 / 180.0)).abs() < 1e-9,
            "{p50}"
        );
        // A route new in this window counts from zero; it has no tier known.
        assert_eq!(rows[1].requests, 10);
        assert_eq!(rows[1].tier, "-");
    }

    #[test]
    fn counters_that_went_down_count_from_zero() {
        let before = sample(&[("a", [0, 500, 0, 0, 0], [500, 0, 0, 0])]);
        let after = sample(&[("a", [0, 7, 0, 0, 0], [7, 0, 0, 0])]);
        let rows = window(&before, &after, Duration::from_secs(1), &HashMap::new());
        assert_eq!(rows[0].requests, 7);
    }

    #[test]
    fn quantiles_follow_histogram_quantile() {
        assert_eq!(quantile(&BOUNDS, &[0, 0, 0, 0], 0.5), None);
        // All in the first bucket: linear from 0.
        let q = quantile(&BOUNDS, &[10, 0, 0, 0], 0.5).unwrap();
        assert!((q.as_secs_f64() - 0.0005).abs() < 1e-12);
        // In the +Inf bucket: the highest finite bound.
        assert_eq!(
            quantile(&BOUNDS, &[0, 0, 0, 5], 0.99),
            Some(Duration::from_secs_f64(0.1))
        );
        // p99 of 99 fast and 1 slow lands at the top of the fast bucket.
        let q = quantile(&BOUNDS, &[99, 0, 1, 0], 0.99).unwrap();
        assert!((q.as_secs_f64() - 0.001).abs() < 1e-12);
    }

    #[test]
    fn sorting_puts_the_highest_first_and_breaks_ties_by_name() {
        let before = sample(&[]);
        let after = sample(&[
            ("a", [0, 10, 0, 0, 0], [10, 0, 0, 0]),
            ("b", [0, 30, 0, 0, 0], [0, 30, 0, 0]),
            ("c", [0, 10, 0, 0, 0], [10, 0, 0, 0]),
        ]);
        let mut rows = window(&before, &after, Duration::from_secs(1), &HashMap::new());
        sort(&mut rows, SortBy::Rps);
        let names: Vec<_> = rows.iter().map(|r| r.route.as_str()).collect();
        assert_eq!(names, ["b", "a", "c"]);
        sort(&mut rows, SortBy::Route);
        let names: Vec<_> = rows.iter().map(|r| r.route.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
    }

    #[test]
    fn a_malformed_answer_is_an_error_not_a_panic() {
        assert!(parse_sample("not json").is_err());
        let short = r#"{"bucket_bounds_seconds":[0.1,1.0],"routes":[{"listener":"l","route":"r","cluster":"c","status_classes":[0,1,0,0,0],"duration_buckets":[1]}]}"#;
        let err = parse_sample(short).unwrap_err().to_string();
        assert!(err.contains("histogram buckets"), "{err}");
    }

    #[test]
    fn tiers_come_from_the_rules_json() {
        let rules = serde_json::json!({
            "listeners": [
                { "name": "web", "routes": [ { "name": "api", "tier": "K" } ] },
                { "name": "raw", "rule": { "tier": "U4" } },
            ]
        });
        let tiers = tiers_of(&rules);
        assert_eq!(tiers.len(), 1);
        assert_eq!(tiers[&("web".to_string(), "api".to_string())], "K");
    }
}
