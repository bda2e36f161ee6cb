//! A cluster's outlier detection (Envoy's `outlier_detection`: the consecutive-failure kinds,
//! success rate and failure percentage): per node, shared by every worker. Each try's outcome is reported for its endpoint; an
//! endpoint with N consecutive failures of one kind is ejected for `base_ejection_time` ×
//! the number of times it has been ejected (capped at Envoy's `max_ejection_time`, 300 s, or
//! the base if longer), and is back once that time has passed. That number drops by one for
//! each `interval` the endpoint stays in, as Envoy's interval timer does. No more than
//! `max_ejection_percent` of the endpoints are out at once (Envoy's rule: the ejection that
//! would pass it is not made, so 10% of fewer than ten endpoints ejects none).
//!
//! Success rate and failure percentage are judged once per `interval` over the requests of
//! that interval (`judge_interval`): among the endpoints with enough requests, if there are
//! enough of them, one whose success rate is below mean − factor × standard deviation, or
//! whose failure share reaches the threshold, is ejected, lowest success rate first.
//!
//! Envoy runs a timer to re-admit endpoints and decay the counts; here both are computed
//! from timestamps when they are next looked at, which gives the same answers without a
//! task per cluster; likewise the interval's judgement is made by the first report after
//! the interval ends (an interval without requests has nothing to judge). Re-admission is therefore exact to the millisecond rather than rounded
//! up to the next interval tick.
//!
//! The request path costs: a success, a load per failure kind (a store only if a streak was
//! running); a pick, one load while nothing is ejected. Ejecting takes a lock, on the
//! failure path only, so that the percent limit is exact across workers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::{FailurePercentage, OutlierDetection, SuccessRate};
use parking_lot::Mutex;

/// Envoy's default `max_ejection_time`: no ejection lasts longer, unless the base does.
const MAX_EJECTION: Duration = Duration::from_secs(300);

/// Why an endpoint was ejected: which streak reached its threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Consecutive5xx = 0,
    GatewayErrors = 1,
    ConnectFailures = 2,
    SuccessRate = 3,
    FailurePercentage = 4,
}

/// The consecutive kinds: the ones with a streak per endpoint.
const STREAKS: usize = 3;
const STREAK_REASONS: [Reason; STREAKS] = [
    Reason::Consecutive5xx,
    Reason::GatewayErrors,
    Reason::ConnectFailures,
];

impl Reason {
    pub const ALL: [Reason; 5] = [
        Reason::Consecutive5xx,
        Reason::GatewayErrors,
        Reason::ConnectFailures,
        Reason::SuccessRate,
        Reason::FailurePercentage,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Consecutive5xx => "consecutive_5xx",
            Reason::GatewayErrors => "consecutive_gateway_errors",
            Reason::ConnectFailures => "consecutive_connect_failures",
            Reason::SuccessRate => "success_rate",
            Reason::FailurePercentage => "failure_percentage",
        }
    }
}

/// What one try at an endpoint came to, as outlier detection sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The endpoint answered with this status.
    Answered(u16),
    /// No connection could be opened.
    ConnectFailed,
    /// A connection was made but no complete answer came (reset, invalid answer, timeout).
    /// Counted like the 502/504 it is answered with, as Envoy does by default.
    Failed,
    /// A tcp relay's connection was opened (no answer to judge): ends a connect streak.
    Connected,
}

/// Ejections of one cluster by reason; kept by cluster name across reloads.
#[derive(Default)]
pub struct EjectionCounts([AtomicU64; 5]);

impl EjectionCounts {
    pub fn get(&self, reason: Reason) -> u64 {
        self.0[reason as usize].load(Ordering::Relaxed)
    }
}

/// One endpoint's record.
#[derive(Default)]
struct Health {
    /// Consecutive failures, by [`Reason`] (the consecutive kinds).
    streak: [AtomicU32; STREAKS],
    /// Tries and failed tries in the current interval (only while an interval kind is on).
    tries: AtomicU32,
    failures: AtomicU32,
    /// While ejected: when it is back (clock milliseconds); 0 while in.
    until: AtomicU64,
    /// Times ejected, as Envoy counts them for the next ejection's length (written under
    /// the decision lock).
    times: AtomicU32,
    /// When the last ejection ended (0: never ejected): `times` decays from then.
    back_at: AtomicU64,
}

pub struct Outlier {
    /// By [`Reason`]; 0 turns that kind off.
    thresholds: [u32; STREAKS],
    success_rate: Option<SuccessRate>,
    failure_percentage: Option<FailurePercentage>,
    /// When the current interval ends (clock milliseconds), the interval kinds' judgement
    /// then due; the lock makes one report judge it.
    judge_at: Mutex<u64>,
    interval_ms: u64,
    base_ms: u64,
    max_ms: u64,
    percent: u32,
    endpoints: Box<[Health]>,
    /// Ejections that may still be in force (an expired one leaves when it is next seen).
    out: AtomicU32,
    /// Serializes ejection decisions so the percent limit holds across workers.
    decide: Mutex<()>,
    /// Time zero of the clock milliseconds.
    epoch: tokio::time::Instant,
    counts: Arc<EjectionCounts>,
    /// For the log line of an ejection.
    cluster: String,
    addresses: Box<[SocketAddr]>,
}

/// Milliseconds an ejection lasts when it is the endpoint's `times`th (from 1).
pub fn ejection_ms(base_ms: u64, max_ms: u64, times: u32) -> u64 {
    base_ms
        .saturating_mul(u64::from(times))
        .min(max_ms.max(base_ms))
}

/// `times` after the endpoint has been in from `back_at` to `now`: one less per whole
/// `interval_ms` (Envoy's interval timer decrements it once per tick the endpoint is in).
pub fn decayed(times: u32, back_at: u64, now: u64, interval_ms: u64) -> u32 {
    if back_at == 0 || interval_ms == 0 {
        return times;
    }
    let intervals = now.saturating_sub(back_at) / interval_ms;
    times.saturating_sub(u32::try_from(intervals).unwrap_or(u32::MAX))
}

/// May one more of `endpoints` be ejected while `active` are? Only if the share out after
/// it stays within `percent`, as Envoy decides (without its `always_eject_one_host`).
pub fn may_eject(active: usize, endpoints: usize, percent: u32) -> bool {
    active < endpoints && (active + 1) * 100 <= percent as usize * endpoints
}

/// What the interval kinds eject, from each endpoint's (tries, failed tries) over one
/// interval, as Envoy judges them: success-rate outliers, lowest rate first, then endpoints
/// whose failure share reaches the threshold (not already named).
pub fn interval_outliers(
    counts: &[(u32, u32)],
    success_rate: Option<&SuccessRate>,
    failure_percentage: Option<&FailurePercentage>,
) -> Vec<(usize, Reason)> {
    // (endpoint, percent of its tries that succeeded) for the endpoints with `volume` tries.
    let judged = |volume: u32, hosts: u32| -> Option<Vec<(usize, f64)>> {
        let judged: Vec<(usize, f64)> = counts
            .iter()
            .enumerate()
            .filter(|(_, &(tries, _))| tries > 0 && tries >= volume)
            .map(|(i, &(tries, failed))| {
                let ok = tries.saturating_sub(failed);
                (i, 100.0 * f64::from(ok) / f64::from(tries))
            })
            .collect();
        (judged.len() >= hosts.max(1) as usize).then_some(judged)
    };
    let mut out = Vec::new();
    if let Some(sr) = success_rate {
        if let Some(rates) = judged(sr.request_volume, sr.minimum_hosts) {
            let n = rates.len() as f64;
            let mean = rates.iter().map(|(_, r)| r).sum::<f64>() / n;
            let variance = rates.iter().map(|(_, r)| (r - mean).powi(2)).sum::<f64>() / n;
            let limit = mean - f64::from(sr.stdev_factor) / 1000.0 * variance.sqrt();
            let mut low: Vec<(usize, f64)> =
                rates.into_iter().filter(|&(_, r)| r < limit).collect();
            low.sort_by(|a, b| a.1.total_cmp(&b.1));
            out.extend(low.into_iter().map(|(i, _)| (i, Reason::SuccessRate)));
        }
    }
    if let Some(fp) = failure_percentage {
        if let Some(rates) = judged(fp.request_volume, fp.minimum_hosts) {
            for (i, ok) in rates {
                let failed = 100.0 - ok;
                if failed >= f64::from(fp.threshold) && !out.iter().any(|&(j, _)| j == i) {
                    out.push((i, Reason::FailurePercentage));
                }
            }
        }
    }
    out
}

impl Outlier {
    pub fn new(
        cluster: &str,
        config: &OutlierDetection,
        endpoints: &[SocketAddr],
        counts: Arc<EjectionCounts>,
    ) -> Arc<Outlier> {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
        Arc::new(Outlier {
            thresholds: [
                config.consecutive_5xx,
                config.consecutive_gateway_errors,
                config.consecutive_connect_failures,
            ],
            success_rate: config
                .success_rate
                .enforcing
                .then(|| config.success_rate.clone()),
            failure_percentage: config
                .failure_percentage
                .enforcing
                .then(|| config.failure_percentage.clone()),
            judge_at: Mutex::new(ms(config.interval) + 1),
            interval_ms: ms(config.interval),
            base_ms: ms(config.base_ejection_time),
            max_ms: ms(MAX_EJECTION),
            percent: config.max_ejection_percent.min(100),
            endpoints: endpoints.iter().map(|_| Health::default()).collect(),
            out: AtomicU32::new(0),
            decide: Mutex::new(()),
            epoch: tokio::time::Instant::now(),
            counts,
            cluster: cluster.to_owned(),
            addresses: endpoints.into(),
        })
    }

    /// Clock milliseconds; never 0, which marks "not ejected".
    pub fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Whether some endpoint may be ejected: the pick's fast path looks no further.
    #[inline]
    pub fn any_out(&self) -> bool {
        self.out.load(Ordering::Relaxed) > 0
    }

    /// Whether endpoint `index` is ejected at `now`. An ejection found expired is ended here.
    pub fn is_out(&self, index: usize, now: u64) -> bool {
        let Some(h) = self.endpoints.get(index) else {
            return false;
        };
        let until = h.until.load(Ordering::Acquire);
        if until == 0 {
            return false;
        }
        if now < until {
            return true;
        }
        if h.until
            .compare_exchange(until, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.out.fetch_sub(1, Ordering::AcqRel);
        }
        false
    }

    /// Endpoints ejected right now (the gauge; changes nothing).
    pub fn ejected(&self) -> usize {
        let now = self.now();
        self.endpoints
            .iter()
            .filter(|h| {
                let until = h.until.load(Ordering::Relaxed);
                until != 0 && now < until
            })
            .count()
    }

    /// Counts the outcome of a try at endpoint `index`, and ejects it when a streak reaches
    /// its threshold.
    pub fn report(&self, index: usize, outcome: Outcome) {
        let Some(h) = self.endpoints.get(index) else {
            return;
        };
        if self.success_rate.is_some() || self.failure_percentage.is_some() {
            self.count_try(h, outcome);
        }
        let reset = |reason: Reason| {
            let s = &h.streak[reason as usize];
            if s.load(Ordering::Relaxed) != 0 {
                s.store(0, Ordering::Relaxed);
            }
        };
        let bump = |reason: Reason| {
            let threshold = self.thresholds[reason as usize];
            threshold > 0
                && h.streak[reason as usize].fetch_add(1, Ordering::AcqRel) + 1 >= threshold
        };
        // Connect failures first: the most specific reason wins.
        let (connect, gateway, any5xx) = match outcome {
            Outcome::Connected => {
                reset(Reason::ConnectFailures);
                return;
            }
            Outcome::Answered(status) if status < 500 => {
                STREAK_REASONS.into_iter().for_each(reset);
                return;
            }
            Outcome::Answered(status) => {
                reset(Reason::ConnectFailures);
                let gateway = if (502..=504).contains(&status) {
                    bump(Reason::GatewayErrors)
                } else {
                    reset(Reason::GatewayErrors);
                    false
                };
                (false, gateway, bump(Reason::Consecutive5xx))
            }
            Outcome::ConnectFailed => (
                bump(Reason::ConnectFailures),
                bump(Reason::GatewayErrors),
                bump(Reason::Consecutive5xx),
            ),
            Outcome::Failed => {
                reset(Reason::ConnectFailures);
                (
                    false,
                    bump(Reason::GatewayErrors),
                    bump(Reason::Consecutive5xx),
                )
            }
        };
        let reason = if connect {
            Reason::ConnectFailures
        } else if gateway {
            Reason::GatewayErrors
        } else if any5xx {
            Reason::Consecutive5xx
        } else {
            return;
        };
        self.eject(index, reason, self.now());
    }

    /// Counts a try for the interval kinds, and judges the interval that ended, if one did.
    fn count_try(&self, h: &Health, outcome: Outcome) {
        let failed = match outcome {
            // A relay's connection: no answer to judge.
            Outcome::Connected => return,
            Outcome::Answered(status) => status >= 500,
            Outcome::ConnectFailed | Outcome::Failed => true,
        };
        let now = self.now();
        if now >= *self.judge_at.lock() {
            self.judge_interval(now);
        }
        h.tries.fetch_add(1, Ordering::Relaxed);
        if failed {
            h.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Judges the interval that ended by `now` (once: the first report after it does), then
    /// starts the next. An interval that passed without any report had no requests, so
    /// there is nothing to judge for it.
    fn judge_interval(&self, now: u64) {
        let Some(mut judge_at) = self.judge_at.try_lock() else {
            return; // another worker judges it
        };
        if now < *judge_at {
            return;
        }
        *judge_at = now.saturating_add(self.interval_ms);
        let counts: Vec<(u32, u32)> = self
            .endpoints
            .iter()
            .map(|h| {
                (
                    h.tries.swap(0, Ordering::Relaxed),
                    h.failures.swap(0, Ordering::Relaxed),
                )
            })
            .collect();
        drop(judge_at);
        for (index, reason) in interval_outliers(
            &counts,
            self.success_rate.as_ref(),
            self.failure_percentage.as_ref(),
        ) {
            self.eject(index, reason, now);
        }
    }

    /// Ejects endpoint `index` at `now` if the percent limit allows.
    fn eject(&self, index: usize, reason: Reason, now: u64) {
        let _deciding = self.decide.lock();
        let Some(h) = self.endpoints.get(index) else {
            return;
        };
        if self.is_out(index, now) {
            // Failures of requests that were under way when it went out: stale streaks.
            h.streak.iter().for_each(|s| s.store(0, Ordering::Relaxed));
            return;
        }
        let active = (0..self.endpoints.len())
            .filter(|&i| self.is_out(i, now))
            .count();
        if !may_eject(active, self.endpoints.len(), self.percent) {
            // The streak stays: the next failure asks again, once another ejection ended.
            return;
        }
        let times = decayed(
            h.times.load(Ordering::Relaxed),
            h.back_at.load(Ordering::Relaxed),
            now,
            self.interval_ms,
        )
        .saturating_add(1);
        let lasts = ejection_ms(self.base_ms, self.max_ms, times);
        let until = now.saturating_add(lasts);
        h.times.store(times, Ordering::Relaxed);
        h.back_at.store(until, Ordering::Relaxed);
        h.until.store(until, Ordering::Release);
        self.out.fetch_add(1, Ordering::AcqRel);
        h.streak.iter().for_each(|s| s.store(0, Ordering::Relaxed));
        self.counts.0[reason as usize].fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            cluster = %self.cluster,
            endpoint = %self.addresses[index],
            reason = reason.as_str(),
            ejected_for_ms = lasts,
            times,
            "outlier detection ejected an endpoint"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ejection_time_grows_with_each_ejection_up_to_the_cap() {
        let (base, max) = (30_000, 300_000);
        assert_eq!(ejection_ms(base, max, 1), 30_000);
        assert_eq!(ejection_ms(base, max, 2), 60_000);
        assert_eq!(ejection_ms(base, max, 10), 300_000);
        assert_eq!(ejection_ms(base, max, 11), 300_000, "capped at max");
        // A base longer than the cap is the cap.
        assert_eq!(ejection_ms(600_000, max, 3), 600_000);
        assert_eq!(ejection_ms(u64::MAX, max, u32::MAX), u64::MAX, "saturates");
    }

    #[test]
    fn the_count_decays_by_one_per_interval_in() {
        let interval = 10_000;
        assert_eq!(
            decayed(3, 0, 1_000_000, interval),
            3,
            "never back: no decay"
        );
        assert_eq!(
            decayed(3, 50_000, 59_999, interval),
            3,
            "not a whole interval"
        );
        assert_eq!(decayed(3, 50_000, 60_000, interval), 2);
        assert_eq!(decayed(3, 50_000, 75_000, interval), 1);
        assert_eq!(decayed(3, 50_000, 80_000, interval), 0);
        assert_eq!(decayed(3, 50_000, u64::MAX, interval), 0);
        assert_eq!(decayed(3, 50_000, 1, interval), 3, "clock before back_at");
    }

    #[test]
    fn the_percent_limits_ejections() {
        // Envoy's default 10%: none of 3 endpoints (33%), one of 10.
        assert!(!may_eject(0, 3, 10));
        assert!(may_eject(0, 10, 10) && !may_eject(1, 10, 10));
        // 34% of 3: one.
        assert!(may_eject(0, 3, 34));
        // 50% of 3: one (33%), not two (67%).
        assert!(may_eject(0, 3, 50));
        assert!(!may_eject(1, 3, 50));
        // 70% of 3: two.
        assert!(may_eject(1, 3, 70));
        assert!(!may_eject(2, 3, 70));
        assert!(may_eject(2, 3, 100) && !may_eject(3, 3, 100));
        assert!(!may_eject(0, 3, 0), "0% ejects nothing");
        assert!(!may_eject(0, 0, 100), "no endpoints");
    }

    fn addrs(n: u16) -> Vec<SocketAddr> {
        (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 9000 + i)))
            .collect()
    }

    fn config(percent: u32) -> OutlierDetection {
        OutlierDetection {
            consecutive_5xx: 3,
            consecutive_gateway_errors: 0,
            consecutive_connect_failures: 2,
            interval: Duration::from_secs(10),
            base_ejection_time: Duration::from_secs(30),
            max_ejection_percent: percent,
            success_rate: SuccessRate {
                enforcing: false,
                ..SuccessRate::default()
            },
            failure_percentage: FailurePercentage::default(),
        }
    }

    #[test]
    fn success_rate_ejects_below_mean_minus_factor_stdev() {
        let sr = SuccessRate::default(); // 5 hosts, 100 requests, 1.9 stdev
                                         // Nine endpoints at 100%, one at 50%: mean 95, stdev 15, limit 66.5.
        let mut counts = vec![(200, 0); 9];
        counts.push((200, 100));
        assert_eq!(
            interval_outliers(&counts, Some(&sr), None),
            vec![(9, Reason::SuccessRate)]
        );
        // Too few requests at the bad one: it is not judged (and the rest are all alike).
        counts[9] = (99, 99);
        assert!(interval_outliers(&counts, Some(&sr), None).is_empty());
        // Fewer than minimum_hosts with the volume: nothing is judged.
        let few = [(200, 0), (200, 0), (200, 0), (200, 200)];
        assert!(interval_outliers(&few, Some(&sr), None).is_empty());
        // All alike (no spread): nobody is below the mean.
        assert!(interval_outliers(&[(100, 50); 6], Some(&sr), None).is_empty());
        // Lowest first.
        let mut two = vec![(1000, 0); 18];
        two.push((1000, 500));
        two.push((1000, 800));
        assert_eq!(
            interval_outliers(&two, Some(&sr), None),
            vec![(19, Reason::SuccessRate), (18, Reason::SuccessRate)]
        );
    }

    #[test]
    fn failure_percentage_ejects_at_the_threshold() {
        let fp = FailurePercentage {
            enforcing: true,
            threshold: 50,
            minimum_hosts: 2,
            request_volume: 10,
        };
        let counts = [(10, 5), (10, 4), (9, 9), (100, 0)];
        assert_eq!(
            interval_outliers(&counts, None, Some(&fp)),
            vec![(0, Reason::FailurePercentage)],
            "50% is at the threshold; 9 tries are under the volume"
        );
        // Named once when both kinds find it.
        let sr = SuccessRate {
            minimum_hosts: 2,
            request_volume: 10,
            ..SuccessRate::default()
        };
        let mut all = vec![(100, 0); 9];
        all.push((100, 90));
        assert_eq!(
            interval_outliers(&all, Some(&sr), Some(&fp)),
            vec![(9, Reason::SuccessRate)]
        );
        // Failed counts read a moment after the tries may pass them: never a negative rate.
        assert_eq!(
            interval_outliers(&[(10, 12), (10, 0)], None, Some(&fp)),
            vec![(0, Reason::FailurePercentage)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_interval_is_judged_by_the_first_report_after_it() {
        let mut c = config(100);
        c.consecutive_5xx = 0;
        c.consecutive_connect_failures = 0;
        c.success_rate.enforcing = true;
        let counts = Arc::new(EjectionCounts::default());
        let o = Outlier::new("c", &c, &addrs(6), counts.clone());
        // Five good endpoints and one that fails half its requests, 100 each.
        for round in 0..100 {
            for i in 0..6 {
                let status = if i == 5 && round % 2 == 0 { 503 } else { 200 };
                o.report(i, Outcome::Answered(status));
            }
        }
        assert!(!o.any_out(), "judged only when the interval ends");
        tokio::time::advance(Duration::from_secs(10)).await;
        o.report(0, Outcome::Answered(200));
        assert!(o.is_out(5, o.now()), "50% against 100%: out");
        assert_eq!(counts.get(Reason::SuccessRate), 1);
        assert_eq!(o.ejected(), 1);
        // The next interval starts empty: the report that judged is its first try, and
        // nothing is judged again before it ends.
        tokio::time::advance(Duration::from_secs(9)).await;
        o.report(0, Outcome::Answered(200));
        assert_eq!(counts.get(Reason::SuccessRate), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_streak_ejects_and_time_readmits_for_longer_each_time() {
        let counts = Arc::new(EjectionCounts::default());
        let o = Outlier::new("c", &config(100), &addrs(3), counts.clone());
        o.report(0, Outcome::Answered(503));
        o.report(0, Outcome::Answered(503));
        o.report(0, Outcome::Answered(200));
        o.report(0, Outcome::Answered(500));
        o.report(0, Outcome::Answered(500));
        assert!(!o.any_out(), "a success broke the streak");
        o.report(0, Outcome::Answered(500));
        assert!(o.any_out() && o.is_out(0, o.now()));
        assert_eq!((o.ejected(), counts.get(Reason::Consecutive5xx)), (1, 1));
        tokio::time::advance(Duration::from_millis(29_999)).await;
        assert!(o.is_out(0, o.now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!o.is_out(0, o.now()), "back after 30 s");
        assert!(!o.any_out() && o.ejected() == 0);
        // Ejected again at once: twice the time.
        o.report(0, Outcome::ConnectFailed);
        o.report(0, Outcome::ConnectFailed);
        assert_eq!(counts.get(Reason::ConnectFailures), 1);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(o.is_out(0, o.now()));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!o.is_out(0, o.now()), "back after 60 s");
        // In for 20 s (two intervals): the count drops from 2 to 0, so the next is 30 s.
        tokio::time::advance(Duration::from_secs(20)).await;
        for _ in 0..3 {
            o.report(0, Outcome::Failed);
        }
        tokio::time::advance(Duration::from_secs(29)).await;
        assert!(o.is_out(0, o.now()));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!o.is_out(0, o.now()));
    }

    #[tokio::test(start_paused = true)]
    async fn the_percent_holds_and_stale_failures_do_not_count() {
        let o = Outlier::new("c", &config(50), &addrs(3), Arc::default());
        for _ in 0..3 {
            o.report(0, Outcome::Answered(500));
            o.report(1, Outcome::Answered(500));
        }
        assert_eq!(o.ejected(), 1, "50% of 3 endpoints is one");
        assert!(o.is_out(0, o.now()) && !o.is_out(1, o.now()));
        // Once 0 is back, 1's running streak ejects it at its next failure.
        tokio::time::advance(Duration::from_secs(30)).await;
        o.report(1, Outcome::Answered(500));
        assert!(!o.is_out(0, o.now()) && o.is_out(1, o.now()));
        // Failures of requests already under way at 1 do not extend nor re-eject it.
        for _ in 0..10 {
            o.report(1, Outcome::Answered(500));
        }
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(!o.is_out(1, o.now()));
        assert_eq!(o.ejected(), 0);
    }

    #[test]
    fn gateway_errors_count_only_502_to_504() {
        let mut c = config(100);
        c.consecutive_5xx = 0;
        c.consecutive_gateway_errors = 2;
        let counts = Arc::new(EjectionCounts::default());
        let o = Outlier::new("c", &c, &addrs(2), counts.clone());
        o.report(0, Outcome::Answered(502));
        o.report(0, Outcome::Answered(500));
        o.report(0, Outcome::Answered(504));
        assert!(!o.any_out(), "a 500 broke the gateway streak");
        o.report(0, Outcome::Answered(503));
        assert!(o.any_out());
        assert_eq!(counts.get(Reason::GatewayErrors), 1);
    }
}
