//! The demo report: per-route rate, latency percentiles, errors and backend
//! shares, checked against the expected shares, rendered as a table.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};
use hdrhistogram::Histogram;

use crate::demo::load::{Results, TargetResult};
use crate::demo::mtls::MtlsRow;

/// Least slack allowed between an observed and an expected share (absolute, 3 points).
pub const MIN_SHARE_TOLERANCE: f64 = 0.03;

/// A set of backends whose answers count together, and their expected weight.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareGroup {
    /// Shown in the report, e.g. `api` or `api-1`.
    pub label: String,
    /// Backend names (`x-backend` values) that belong to this group.
    pub backends: Vec<String>,
    /// Relative weight; the expected share is weight / sum of the route's weights.
    /// `None`: shown but not checked, because the share depends on other traffic
    /// (a round-robin cursor shared with other routes only balances over all of them).
    pub weight: Option<f64>,
}

/// How a route's answers should be spread over backends.
#[derive(Debug, Clone, PartialEq)]
pub struct Expectation {
    /// The target name this applies to.
    pub route: String,
    pub groups: Vec<ShareGroup>,
}

/// Backends of a round-robin cluster that should get equal shares of all the
/// answers they gave over the whole run, whichever routes sent the requests.
#[derive(Debug, Clone, PartialEq)]
pub struct Balance {
    pub cluster: String,
    pub backends: Vec<String>,
}

/// Everything the report checks the results against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expectations {
    pub routes: Vec<Expectation>,
    pub balances: Vec<Balance>,
}

/// The share of a route's answers that one group (or one unexpected backend) gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    pub label: String,
    pub count: u64,
    /// Fraction of the route's successful answers, 0..=1.
    pub observed: f64,
    /// `None` when nothing was expected for this route.
    pub expected: Option<f64>,
}

/// Group backend answer counts into shares. With groups, each group gets a share
/// (expected = its weight's fraction of the weighted groups) and any backend
/// outside every group gets an extra share expected to be 0. Without groups,
/// each backend is its own share, expected nothing.
pub fn shares(backends: &BTreeMap<String, u64>, groups: &[ShareGroup]) -> Vec<Share> {
    let total: u64 = backends.values().sum();
    let fraction = |count: u64| {
        if total == 0 {
            0.0
        } else {
            count as f64 / total as f64
        }
    };
    if groups.is_empty() {
        return backends
            .iter()
            .map(|(label, &count)| Share {
                label: label.clone(),
                count,
                observed: fraction(count),
                expected: None,
            })
            .collect();
    }
    let weight_sum: f64 = groups
        .iter()
        .filter_map(|g| g.weight)
        .map(|w| w.max(0.0))
        .sum();
    let mut out: Vec<Share> = groups
        .iter()
        .map(|group| {
            let count = group.backends.iter().filter_map(|b| backends.get(b)).sum();
            Share {
                label: group.label.clone(),
                count,
                observed: fraction(count),
                expected: group.weight.map(|w| {
                    if weight_sum > 0.0 {
                        w.max(0.0) / weight_sum
                    } else {
                        0.0
                    }
                }),
            }
        })
        .collect();
    for (backend, &count) in backends {
        if !groups.iter().any(|g| g.backends.contains(backend)) {
            out.push(Share {
                label: backend.clone(),
                count,
                observed: fraction(count),
                expected: Some(0.0),
            });
        }
    }
    out
}

/// How far an observed share may stray from `expected` after `n` answers.
/// None at all when the expectation is certain (0 or 1): then one stray answer
/// is a misroute. Otherwise at least [`MIN_SHARE_TOLERANCE`], widened to four
/// standard deviations of a binomial draw so that small samples of a random
/// split do not fail by chance.
pub fn share_tolerance(expected: f64, n: u64) -> f64 {
    let p = expected.clamp(0.0, 1.0);
    if p == 0.0 || p == 1.0 {
        return 0.0;
    }
    if n == 0 {
        return MIN_SHARE_TOLERANCE;
    }
    let sigma = (p * (1.0 - p) / n as f64).sqrt();
    MIN_SHARE_TOLERANCE.max(4.0 * sigma)
}

/// The latency at quantile `q` (0..=1), or `None` when nothing was recorded.
pub fn percentile(latency_us: &Histogram<u64>, q: f64) -> Option<Duration> {
    if latency_us.is_empty() {
        return None;
    }
    Some(Duration::from_micros(
        latency_us.value_at_quantile(q.clamp(0.0, 1.0)),
    ))
}

/// Per-second rate of `count` events over `elapsed`.
pub fn rate(count: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        0.0
    } else {
        count as f64 / secs
    }
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub name: String,
    /// Attempts, successful or not.
    pub requests: u64,
    pub per_second: f64,
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
    pub errors: u64,
    pub shares: Vec<Share>,
    pub error_samples: Vec<String>,
}

impl Row {
    fn new(result: &TargetResult, elapsed: Duration, groups: &[ShareGroup]) -> Row {
        Row {
            name: result.name.clone(),
            requests: result.attempts(),
            per_second: rate(result.attempts(), elapsed),
            p50: percentile(&result.latency_us, 0.50),
            p99: percentile(&result.latency_us, 0.99),
            errors: result.errors,
            shares: shares(&result.backends, groups),
            error_samples: result.error_samples.clone(),
        }
    }

    /// What is wrong with this row, if anything.
    fn problems(&self, out: &mut Vec<String>) {
        if self.requests == 0 {
            out.push(format!(
                "{}: sent no requests; the load generator could not keep up, try a longer --duration",
                self.name
            ));
        }
        if self.errors > 0 {
            out.push(format!(
                "{}: {} of {} requests failed, e.g. {}",
                self.name,
                self.errors,
                self.requests,
                self.error_samples.join(" | ")
            ));
        }
        let answered = self.requests - self.errors.min(self.requests);
        check_shares(&self.name, &self.shares, answered, out);
    }
}

/// Flag every share that strays from its expectation by more than the tolerance.
fn check_shares(name: &str, shares: &[Share], answered: u64, out: &mut Vec<String>) {
    for share in shares {
        let Some(expected) = share.expected else {
            continue;
        };
        let tolerance = share_tolerance(expected, answered);
        if (share.observed - expected).abs() > tolerance {
            out.push(format!(
                "{name}: {} got {:.1}% of the answers, expected {:.1}% ± {:.1}%; \
                 check the route's weights and the cluster's lb policy",
                share.label,
                share.observed * 100.0,
                expected * 100.0,
                tolerance * 100.0
            ));
        }
    }
}

/// A cluster's balance over the whole run.
#[derive(Debug, Clone, PartialEq)]
pub struct BalanceRow {
    pub cluster: String,
    /// Answers its backends gave, over all routes.
    pub answered: u64,
    pub shares: Vec<Share>,
}

impl BalanceRow {
    fn new(balance: &Balance, results: &Results) -> BalanceRow {
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for result in &results.http {
            for (backend, &count) in &result.backends {
                if balance.backends.contains(backend) {
                    *counts.entry(backend.clone()).or_default() += count;
                }
            }
        }
        let groups: Vec<ShareGroup> = balance
            .backends
            .iter()
            .map(|b| ShareGroup {
                label: b.clone(),
                backends: vec![b.clone()],
                weight: Some(1.0),
            })
            .collect();
        BalanceRow {
            cluster: balance.cluster.clone(),
            answered: counts.values().sum(),
            shares: shares(&counts, &groups),
        }
    }
}

/// The whole report: HTTP rows, then the TCP row.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub elapsed: Duration,
    pub http: Vec<Row>,
    pub tcp: Option<Row>,
    pub balances: Vec<BalanceRow>,
    /// The mTLS part: each caller's identity and what it got (`crate::demo::mtls`).
    pub mtls: Vec<MtlsRow>,
}

impl Report {
    /// Build the report from measured results and the expected shares per target name.
    pub fn new(results: &Results, expectations: &Expectations) -> Report {
        let groups_for = |name: &str| {
            expectations
                .routes
                .iter()
                .find(|e| e.route == name)
                .map(|e| e.groups.as_slice())
                .unwrap_or(&[])
        };
        Report {
            elapsed: results.elapsed,
            http: results
                .http
                .iter()
                .map(|r| Row::new(r, results.elapsed, groups_for(&r.name)))
                .collect(),
            tcp: results
                .tcp
                .as_ref()
                .map(|r| Row::new(r, results.elapsed, &[])),
            balances: expectations
                .balances
                .iter()
                .map(|b| BalanceRow::new(b, results))
                .collect(),
            mtls: Vec::new(),
        }
    }

    /// Every failed check, as a sentence that says what went wrong. Empty means sane.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for row in self.http.iter().chain(&self.tcp) {
            row.problems(&mut out);
        }
        for balance in &self.balances {
            let name = format!("cluster {} (all routes)", balance.cluster);
            if balance.answered == 0 {
                out.push(format!("{name}: no backend of the cluster answered"));
            }
            check_shares(&name, &balance.shares, balance.answered, &mut out);
        }
        for row in self.mtls.iter().filter(|r| !r.ok) {
            out.push(format!(
                "mTLS caller {} ({}): expected {}, got {}",
                row.caller, row.presents, row.expected, row.got
            ));
        }
        out
    }

    /// The mTLS part as a comfy-table: who called, as whom, and what it got.
    pub fn mtls_table(&self) -> Table {
        let mut table = Table::new();
        table.load_style(UTF8_FULL_CONDENSED).set_header(vec![
            "mTLS caller",
            "presents (SPIFFE ID)",
            "expected",
            "got",
        ]);
        for row in &self.mtls {
            table.add_row(vec![
                row.caller.to_string(),
                row.presents.clone(),
                row.expected.clone(),
                row.got.clone(),
            ]);
        }
        table
    }

    /// The report as a comfy-table.
    pub fn table(&self) -> Table {
        let mut table = Table::new();
        table.load_style(UTF8_FULL_CONDENSED).set_header(vec![
            "route", "requests", "req/s", "p50", "p99", "errors", "backends",
        ]);
        for row in self.http.iter().chain(&self.tcp) {
            table.add_row(vec![
                row.name.clone(),
                row.requests.to_string(),
                format!("{:.0}", row.per_second),
                format_latency(row.p50),
                format_latency(row.p99),
                row.errors.to_string(),
                format_shares(&row.shares),
            ]);
        }
        for column in 1..=5 {
            if let Some(c) = table.column_mut(column) {
                c.set_cell_alignment(CellAlignment::Right);
            }
        }
        table
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.table())?;
        if !self.mtls.is_empty() {
            writeln!(f, "{}", self.mtls_table())?;
        }
        for balance in &self.balances {
            writeln!(
                f,
                "cluster {} over all routes: {}",
                balance.cluster,
                format_shares(&balance.shares)
            )?;
        }
        let total: u64 = self.http.iter().map(|r| r.requests).sum();
        write!(
            f,
            "{total} HTTP requests in {:.1}s ({:.0} req/s)",
            self.elapsed.as_secs_f64(),
            rate(total, self.elapsed)
        )
    }
}

/// `850µs`, `1.25ms`, `2.10s`, or `-` for no data.
pub fn format_latency(latency: Option<Duration>) -> String {
    match latency {
        None => "-".into(),
        Some(d) if d < Duration::from_millis(1) => format!("{}µs", d.as_micros()),
        Some(d) if d < Duration::from_secs(1) => format!("{:.2}ms", d.as_secs_f64() * 1e3),
        Some(d) => format!("{:.2}s", d.as_secs_f64()),
    }
}

/// `api-1 50.1% api-2 49.9%`.
pub fn format_shares(shares: &[Share]) -> String {
    shares
        .iter()
        .map(|s| format!("{} {:.1}%", s.label, s.observed * 100.0))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    fn group(label: &str, backends: &[&str], weight: Option<f64>) -> ShareGroup {
        ShareGroup {
            label: label.into(),
            backends: backends.iter().map(|b| b.to_string()).collect(),
            weight,
        }
    }

    fn histogram(values_us: impl IntoIterator<Item = u64>) -> Histogram<u64> {
        let mut h = Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
        for v in values_us {
            h.record(v).expect("in range");
        }
        h
    }

    #[test]
    fn percentiles_of_a_uniform_spread() {
        // 1..=1000 ms: p50 is 500 ms and p99 is 990 ms, within HDR's 3 significant digits.
        let h = histogram((1..=1000).map(|ms| ms * 1000));
        let p50 = percentile(&h, 0.5).expect("data").as_micros() as f64;
        let p99 = percentile(&h, 0.99).expect("data").as_micros() as f64;
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.002, "{p50}");
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.002, "{p99}");
        assert_eq!(percentile(&histogram([]), 0.5), None);
    }

    #[test]
    fn p99_sees_the_tail() {
        // 98 fast answers and 2 slow ones: the median stays fast, p99 is slow.
        let h = histogram(std::iter::repeat_n(100, 98).chain([50_000, 50_000]));
        assert_eq!(percentile(&h, 0.5), Some(Duration::from_micros(100)));
        let p99 = percentile(&h, 0.99).expect("data");
        assert!(p99 >= Duration::from_micros(49_950), "{p99:?}");
    }

    #[test]
    fn shares_group_backends_by_weight() {
        let got = shares(
            &counts(&[("api-1", 450), ("api-2", 452), ("canary", 98)]),
            &[
                group("api", &["api-1", "api-2"], Some(90.0)),
                group("canary", &["canary"], Some(10.0)),
            ],
        );
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].label.as_str(), got[0].count), ("api", 902));
        assert!((got[0].observed - 0.902).abs() < 1e-9);
        assert_eq!(got[0].expected, Some(0.9));
        assert!((got[1].observed - 0.098).abs() < 1e-9);
        assert_eq!(format_shares(&got), "api 90.2% canary 9.8%");
    }

    #[test]
    fn unexpected_backend_gets_its_own_share_expected_zero() {
        let got = shares(
            &counts(&[("api-1", 90), ("stray", 10)]),
            &[group("api-1", &["api-1"], Some(1.0))],
        );
        assert_eq!(got[1].label, "stray");
        assert_eq!(got[1].expected, Some(0.0));
        assert!((got[1].observed - 0.1).abs() < 1e-9);
    }

    #[test]
    fn shares_without_groups_or_answers() {
        let got = shares(&counts(&[("a", 1), ("b", 3)]), &[]);
        assert_eq!(format_shares(&got), "a 25.0% b 75.0%");
        assert!(got.iter().all(|s| s.expected.is_none()));
        let none = shares(&BTreeMap::new(), &[group("a", &["a"], Some(1.0))]);
        assert_eq!(none[0].observed, 0.0);
    }

    #[test]
    fn tolerance_widens_for_small_samples_only() {
        assert_eq!(share_tolerance(0.9, 100_000), MIN_SHARE_TOLERANCE);
        // 40 answers of a 90/10 split: sigma = sqrt(0.09/40) = 0.047, 4 sigma = 0.19.
        assert!((share_tolerance(0.9, 40) - 0.1897).abs() < 1e-3);
        // A certain expectation (0 or 1) allows no stray answer at all.
        assert_eq!(share_tolerance(1.0, 5), 0.0);
        assert_eq!(share_tolerance(0.0, 100_000), 0.0);
    }

    fn row(name: &str, requests: u64, errors: u64, shares: Vec<Share>) -> Row {
        Row {
            name: name.into(),
            requests,
            per_second: 0.0,
            p50: None,
            p99: None,
            errors,
            shares,
            error_samples: vec!["status 503 (expected 200): no healthy upstream".into()],
        }
    }

    fn share(label: &str, observed: f64, expected: f64) -> Share {
        Share {
            label: label.into(),
            count: 0,
            observed,
            expected: Some(expected),
        }
    }

    #[test]
    fn problems_flag_errors_skewed_splits_and_idle_routes() {
        let report = Report {
            elapsed: Duration::from_secs(1),
            http: vec![
                row(
                    "ok",
                    10_000,
                    0,
                    vec![share("a", 0.51, 0.5), share("b", 0.49, 0.5)],
                ),
                row("skewed", 10_000, 0, vec![share("api", 0.80, 0.9)]),
                row("failing", 100, 3, vec![]),
                row("idle", 0, 0, vec![]),
            ],
            tcp: None,
            balances: vec![],
            mtls: vec![MtlsRow {
                caller: "intruder",
                presents: "spiffe://demo.local/ns/shop/sa/intruder".into(),
                expected: "403 (denied by policy)".into(),
                got: "200".into(),
                ok: false,
            }],
        };
        let problems = report.problems();
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(problems[0].starts_with("skewed: api got 80.0% of the answers, expected 90.0%"));
        assert!(problems[1].contains("3 of 100 requests failed, e.g. status 503"));
        assert!(problems[2].starts_with("idle: sent no requests"));
        assert_eq!(
            problems[3],
            "mTLS caller intruder (spiffe://demo.local/ns/shop/sa/intruder): expected 403 (denied by policy), got 200"
        );
    }

    /// A result with `count` answers of 100 µs from each backend.
    fn result(name: &str, answers: &[(&str, u64)]) -> Result<TargetResult, crate::LabError> {
        let mut result = TargetResult::new(name)?;
        for &(backend, count) in answers {
            for _ in 0..count {
                result
                    .latency_us
                    .record(100)
                    .map_err(|e| crate::LabError::Internal(format!("{e:?}")))?;
            }
            result.backends.insert(backend.into(), count);
        }
        Ok(result)
    }

    fn demo_like_expectations() -> Expectations {
        Expectations {
            routes: vec![
                Expectation {
                    route: "api".into(),
                    groups: vec![
                        group("api-1", &["api-1"], None),
                        group("api-2", &["api-2"], None),
                    ],
                },
                Expectation {
                    route: "split".into(),
                    groups: vec![
                        group("api", &["api-1", "api-2"], Some(90.0)),
                        group("canary", &["canary"], Some(10.0)),
                    ],
                },
            ],
            balances: vec![Balance {
                cluster: "api".into(),
                backends: vec!["api-1".into(), "api-2".into()],
            }],
        }
    }

    #[test]
    fn report_from_results_and_rendering() -> Result<(), crate::LabError> {
        // Per route the api backends are skewed (a shared round-robin cursor does
        // that), but over the whole run the cluster is balanced: no problem.
        let results = Results {
            elapsed: Duration::from_secs(2),
            http: vec![
                result("api", &[("api-1", 600), ("api-2", 400)])?,
                result("split", &[("api-1", 300), ("api-2", 500), ("canary", 200)])?,
            ],
            tcp: None,
        };
        let expectations = Expectations {
            routes: vec![Expectation {
                route: "split".into(),
                groups: vec![
                    group("api", &["api-1", "api-2"], Some(80.0)),
                    group("canary", &["canary"], Some(20.0)),
                ],
            }],
            ..demo_like_expectations()
        };
        let report = Report::new(&results, &expectations);
        let row = &report.http[0];
        assert_eq!(row.requests, 1000);
        assert_eq!(row.per_second, 500.0);
        assert_eq!(row.p50, Some(Duration::from_micros(100)));
        assert!(report.problems().is_empty(), "{:?}", report.problems());
        let text = report.to_string();
        assert!(text.contains("api-1 60.0% api-2 40.0%"), "{text}");
        assert!(text.contains("api 80.0% canary 20.0%"), "{text}");
        assert!(
            text.contains("cluster api over all routes: api-1 50.0% api-2 50.0%"),
            "{text}"
        );
        assert!(
            text.contains("2000 HTTP requests in 2.0s (1000 req/s)"),
            "{text}"
        );
        Ok(())
    }

    #[test]
    fn imbalanced_cluster_and_stray_backend_are_problems() -> Result<(), crate::LabError> {
        let results = Results {
            elapsed: Duration::from_secs(1),
            http: vec![
                result("api", &[("api-1", 750), ("api-2", 250), ("canary", 5)])?,
                result("split", &[("api-1", 450), ("api-2", 550), ("canary", 111)])?,
            ],
            tcp: None,
        };
        let report = Report::new(&results, &demo_like_expectations());
        let problems = report.problems();
        assert_eq!(problems.len(), 3, "{problems:#?}");
        // Any answer from a backend the route must not reach is a misroute, however few.
        assert!(
            problems[0].starts_with("api: canary got 0.5% of the answers, expected 0.0% ± 0.0%")
        );
        assert!(problems[1].starts_with("cluster api (all routes): api-1 got 60.0%"));
        assert!(problems[2].starts_with("cluster api (all routes): api-2 got 40.0%"));
        Ok(())
    }

    #[test]
    fn latency_formatting() {
        assert_eq!(format_latency(None), "-");
        assert_eq!(format_latency(Some(Duration::from_micros(850))), "850µs");
        assert_eq!(format_latency(Some(Duration::from_micros(1250))), "1.25ms");
        assert_eq!(format_latency(Some(Duration::from_millis(2100))), "2.10s");
        assert_eq!(rate(10, Duration::ZERO), 0.0);
    }
}
