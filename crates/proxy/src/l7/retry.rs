//! The one retry loop of the proxy, for every codec (Pingora's single loop in
//! `pingora-proxy` is the model). It picks an endpoint, has the codec make one try at it
//! (the codec's part, an [`Attempt`]), and judges the outcome with the route's policy:
//! - a pooled connection that the endpoint had closed while it sat idle gets one more try on
//!   a fresh connection, for free (not a retry by policy, not counted);
//! - a failure is tried again while attempts are left and the route's `retries.on` names it
//!   (`connect-failure`, `reset`, `gateway-error`); a try that runs out of the route's
//!   `per_try_timeout` is always tried again;
//! - an answer is thrown away and tried again while attempts are left and `retries.on` names
//!   its status (`5xx`, `gateway-error`) or the gRPC status in its headers (`unavailable`,
//!   `resource-exhausted`, `cancelled`, `deadline-exceeded`: a trailers-only answer);
//! - a retry goes to an endpoint that has not failed this request yet, when the cluster has
//!   one that is in, after a backoff: a random wait below `base × 2^(n-1)`, capped at `max`
//!   (Envoy's exponential backoff with full jitter);
//! - the route's timeout bounds all tries and waits together. It starts once the client's
//!   request is complete (Envoy's route timeout): a slow but live upload is not cut short by
//!   it, while an upload that stalls is cut by the idle timeout of the body's relay.
//!
//! Only a request the codec can send again is retried (`replayable`): one without a body, or
//! one whose body of a declared length fits the route's `retries.max_replay_body`, which the
//! codec keeps while it sends it and sends again from there. A try that failed with part of
//! such a body sent ([`Attempt::can_resend`]) ends the retries: the rest was lost with it.
//!
//! The cluster's circuit breaker (`crate::resilience`) bounds it: the request takes a place
//! under `max_requests` before its first try (none left: answered 503 at once), and a retry
//! takes one under `max_retries`. Each retry also takes one from the cluster's retry budget
//! (`crate::resilience::budget`). Either refuses: the answer or failure in hand goes back.
//! A retry after a connection that could not be opened takes nothing from the budget: the
//! request reached no app, so its retry adds no work where the budget guards against a retry
//! storm, and an endpoint that died before its removal reached the node (a pod killed under
//! load) is exactly when retries must not run out. `attempts` and `max_retries` still bound it.
//! Each try's outcome goes to the cluster's outlier detection, which may eject the endpoint.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use flatmesh_config::{RetryBackoff, RetryBudget, RetryOn};
use flatmesh_rules::CompiledRoute;
use tokio::sync::watch;

use super::error::{Kind, UpstreamError};
use crate::lb::InFlight;
use crate::load_report::TryEnd;
use crate::original_dst::Dialled;
use crate::resilience::{Outcome, Overflow, Permit};
use crate::snapshot::ClusterPlan;
use crate::upstream::{NoPick, Picked, Upstream};

/// One try, as the driver hands it to the codec.
pub(crate) struct Try {
    /// The endpoint's index in the cluster.
    pub index: usize,
    pub endpoint: SocketAddr,
    /// No other try follows this one, whatever it gets: the codec may hand over what it
    /// would otherwise keep for the next (the request's headers).
    pub last: bool,
}

/// What a successful try gives back: an answer whose head the policy may look at.
pub(crate) trait Answer {
    fn status(&self) -> u16;

    /// The `grpc-status` in the answer's headers: only a trailers-only gRPC answer has one
    /// there. `None` without one (the codec's default: HTTP/1 answers carry no gRPC).
    fn grpc_status(&self) -> Option<u32> {
        None
    }
}

/// A codec's way of making one try at an endpoint.
pub(crate) trait Attempt {
    type Answer: Answer;

    fn attempt(
        &mut self,
        to: Try,
    ) -> impl Future<Output = Result<Self::Answer, UpstreamError>> + Send;

    /// Whether the request can be sent again after the tries so far: false once part of a
    /// kept body went out and the rest was lost with the try (the codec's default: true).
    fn can_resend(&self) -> bool {
        true
    }
}

/// The answer a try got, the endpoint that gave it, and that endpoint's in-flight count
/// (held for as long as the codec relays the answer).
pub(crate) struct Answered<A> {
    pub answer: A,
    pub endpoint: SocketAddr,
    pub in_flight: InFlight,
}

/// What a try came to, as far as the endpoint is concerned: `None` when the try ended by
/// nobody's fault that is the endpoint's. Outlier detection and the load report both judge
/// by it.
fn endpoint_outcome<A: Answer>(tried: &Result<A, UpstreamError>) -> Option<Outcome> {
    match tried {
        Ok(answer) => Some(Outcome::Answered(answer.status())),
        // A pooled connection the endpoint closed while idle is not its failure.
        Err(err) if err.is_stale_connection() => None,
        Err(err) => match err.kind {
            Kind::ConnectFailed => Some(Outcome::ConnectFailed),
            Kind::Closed | Kind::Timeout | Kind::PerTryTimeout | Kind::InvalidResponse => {
                Some(Outcome::Failed)
            }
            // The client's doing, or the proxy's own refusal: not the endpoint's.
            _ => None,
        },
    }
}

/// One request's retry plan: where it goes and what the route's policy allows.
pub(crate) struct Retry<'a> {
    plan: &'a ClusterPlan,
    upstream: &'a Upstream,
    worker: usize,
    /// The request's hash key, for ring hash and Maglev.
    key: u64,
    /// The route's timeout, over all tries.
    pub timeout: Duration,
    attempts: usize,
    on: &'a [RetryOn],
    per_try_timeout: Option<Duration>,
    backoff: RetryBackoff,
    budget: RetryBudget,
    replayable: bool,
    /// The client's request body while it is on its way (`None`: there is none, the request
    /// is complete), and the idle timeout that bounds a stall of it.
    uploaded: Option<(watch::Receiver<bool>, Duration)>,
    /// Where the client was going, for an `original_dst` cluster (`crate::original_dst`).
    dialled: Option<Dialled>,
}

/// Whether a request body of `length` bytes (`None`: not declared up front, chunked) is kept
/// for a retry on `route`: it has a retry policy and the body fits its `max_replay_body`.
pub(crate) fn replayable_body(route: &CompiledRoute, length: Option<u64>) -> bool {
    match (&route.retries, length) {
        (Some(policy), Some(length)) => length <= policy.max_replay_body(),
        _ => false,
    }
}

impl<'a> Retry<'a> {
    /// `replayable`: the codec can send the request again (no body, or one it keeps, see
    /// [`replayable_body`]). `default_timeout` applies when the route sets none.
    pub fn new(
        route: &'a CompiledRoute,
        plan: &'a ClusterPlan,
        upstream: &'a Upstream,
        worker: usize,
        key: u64,
        replayable: bool,
        default_timeout: Duration,
    ) -> Self {
        let policy = route.retries.as_ref();
        Retry {
            plan,
            upstream,
            worker,
            key,
            timeout: route.timeout.unwrap_or(default_timeout),
            attempts: match (policy, replayable) {
                (Some(r), true) => 1 + r.attempts as usize,
                _ => 1,
            },
            on: policy.map_or(&[], |r| &r.on),
            per_try_timeout: policy.and_then(|r| r.per_try_timeout),
            backoff: policy.map(|r| r.backoff()).unwrap_or_default(),
            budget: policy.map(|r| r.budget()).unwrap_or_default(),
            replayable,
            uploaded: None,
            dialled: None,
        }
    }

    /// For an `original_dst` cluster: the tries go where the client's connection was going.
    pub fn toward(mut self, dialled: Option<Dialled>) -> Self {
        self.dialled = dialled;
        self
    }

    /// For a request whose body is still arriving: its sender marks `uploaded` (with `false`)
    /// each time a piece of the body moves on, and sets it `true` once the body is complete
    /// (or drops it). Until then the route's timeout waits, and a body that moves nothing for
    /// `idle` fails the request with [`Kind::UploadStalled`].
    pub fn timed_from_upload(mut self, uploaded: watch::Receiver<bool>, idle: Duration) -> Self {
        self.uploaded = Some((uploaded, idle));
        self
    }

    /// Runs tries until one gets an answer the policy keeps, or the policy gives up; the
    /// error is then the last try's, with the endpoint it came from.
    pub async fn drive<A: Attempt>(
        &self,
        codec: &mut A,
    ) -> Result<Answered<A::Answer>, UpstreamError> {
        let (uploaded, timeout) = (self.uploaded.clone(), self.timeout);
        // The upload, bounded by its idle timeout; then the route's timeout. `sleep`
        // saturates a deadline past the clock's range rather than overflowing.
        let timer = async move {
            if let Some((mut uploaded, idle)) = uploaded {
                while !*uploaded.borrow_and_update() {
                    match tokio::time::timeout(idle, uploaded.changed()).await {
                        Ok(Ok(())) => {}
                        // The body is gone: nothing more will move.
                        Ok(Err(_)) => break,
                        Err(_) => return UpstreamError::upload_stalled(idle),
                    }
                }
            }
            tokio::time::sleep(timeout).await;
            UpstreamError::timeout()
        };
        tokio::pin!(timer);
        let guard = &self.plan.guard;
        let mut request = Some(
            guard
                .breaker
                .acquire(Overflow::Requests)
                .map_err(UpstreamError::overflow)?,
        );
        // Every request to the cluster adds to its retry budget (Linkerd's deposit).
        guard.budget.request();
        // One place under `max_retries` for all of this request's retries, taken at its
        // first; then one retry of the budget for each.
        let mut retrying: Option<Permit> = None;
        let mut may_retry = |reached_the_app: bool| {
            let permitted = retrying.is_some() || {
                retrying = guard.breaker.acquire(Overflow::Retries).ok();
                retrying.is_some()
            };
            permitted && {
                let budgeted = !reached_the_app || guard.budget.try_retry(&self.budget);
                if !budgeted {
                    self.plan.stats.retries_over_budget.add(self.worker, 1);
                }
                budgeted
            }
        };
        // The endpoints that failed this request: a retry goes elsewhere when it can.
        let mut failed: Vec<usize> = Vec::new();
        let mut tries = 0;
        let mut stale_retried = false;
        loop {
            let Picked {
                index,
                endpoint,
                mut in_flight,
            } = match self
                .upstream
                .pick(self.plan, self.dialled, self.key, tries, &failed)
            {
                Ok(picked) => picked,
                Err(NoPick::NoEndpoint) => return Err(UpstreamError::no_endpoint()),
                Err(NoPick::Refused(refused)) => {
                    return Err(UpstreamError::destination_refused(&refused))
                }
            };
            let last = tries + 1 >= self.attempts;
            let load = self.plan.load.get(index);
            if let Some(load) = load {
                load.begin(self.worker);
            }
            let began = tokio::time::Instant::now();
            let attempt = self.bounded(codec.attempt(Try {
                index,
                endpoint,
                last,
            }));
            let tried = tokio::select! {
                biased;
                tried = attempt => tried,
                err = &mut timer => Err(err),
            };
            let outcome = endpoint_outcome(&tried);
            if let (Some(outlier), Some(outcome)) = (&self.plan.guard.outlier, outcome) {
                outlier.report(index, outcome);
            }
            if let Some(load) = load {
                let end = match outcome {
                    Some(Outcome::Answered(status)) => TryEnd::Answered(status, began.elapsed()),
                    Some(_) => TryEnd::Unanswered,
                    None => TryEnd::Uncounted,
                };
                load.end(self.worker, end);
            }
            match tried {
                Ok(answer)
                    if !last
                        && self.retries_answer(&answer)
                        && codec.can_resend()
                        && may_retry(true) => {}
                Ok(answer) => {
                    in_flight.hold(request.take());
                    return Ok(Answered {
                        answer,
                        endpoint,
                        in_flight,
                    });
                }
                Err(err)
                    if err.is_stale_connection()
                        && self.replayable
                        && codec.can_resend()
                        && !stale_retried =>
                {
                    tracing::debug!(%endpoint, error = %err.detail, "pooled connection was closed; retrying on a new one");
                    stale_retried = true;
                    continue;
                }
                Err(mut err) => {
                    if last
                        || !self.retries_failure(err.kind)
                        || !codec.can_resend()
                        || !may_retry(err.kind != Kind::ConnectFailed)
                    {
                        err.endpoint = Some(endpoint);
                        return Err(err);
                    }
                }
            }
            if !failed.contains(&index) {
                failed.push(index);
            }
            tries += 1;
            self.plan.stats.retries.add(self.worker, 1);
            // The backoff, inside the route's timeout too.
            let wait = self.backoff_before(tries, rand::random::<f64>());
            tokio::select! {
                biased;
                () = tokio::time::sleep(wait) => {}
                mut err = &mut timer => {
                    err.endpoint = Some(endpoint);
                    return Err(err);
                }
            }
        }
    }

    /// A try, bounded by the route's per-try timeout when it has one.
    async fn bounded<T>(
        &self,
        attempt: impl Future<Output = Result<T, UpstreamError>>,
    ) -> Result<T, UpstreamError> {
        let Some(per_try) = self.per_try_timeout else {
            return attempt.await;
        };
        match tokio::time::timeout(per_try, attempt).await {
            Ok(tried) => tried,
            Err(_) => {
                self.plan.stats.per_try_timeouts.add(self.worker, 1);
                Err(UpstreamError::per_try_timeout(per_try))
            }
        }
    }

    /// The wait before retry `retry` (from 1): `jitter` (in [0, 1)) of
    /// `min(max, base × 2^(retry-1))`.
    fn backoff_before(&self, retry: usize, jitter: f64) -> Duration {
        let doubled = self
            .backoff
            .base
            .saturating_mul(1u32 << (retry - 1).min(31));
        doubled
            .min(self.backoff.max())
            .mul_f64(jitter.clamp(0.0, 1.0))
    }

    fn retries_failure(&self, kind: Kind) -> bool {
        // A per-try timeout is retried whatever `on` says: that is what it is for.
        kind == Kind::PerTryTimeout
            || self.on.iter().any(|r| {
                matches!(
                    (r, kind),
                    (RetryOn::ConnectFailure, Kind::ConnectFailed)
                        | (RetryOn::Reset, Kind::Closed)
                        | (RetryOn::GatewayError, Kind::ConnectFailed | Kind::Closed)
                )
            })
    }

    fn retries_answer<A: Answer>(&self, answer: &A) -> bool {
        let status = answer.status();
        let grpc = answer.grpc_status();
        self.on.iter().any(|r| match r {
            RetryOn::Status5xx => (500..600).contains(&status),
            RetryOn::GatewayError => matches!(status, 502..=504),
            r => r.grpc_status().is_some_and(|code| grpc == Some(code)),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::VecDeque;

    use tokio::time::Instant;

    use super::*;
    use crate::testing;

    /// What a scripted try does.
    enum Step {
        Answer(u16),
        /// A 200 with this `grpc-status` in its headers (a trailers-only gRPC answer).
        Grpc(u32),
        Fail(UpstreamError),
        /// Never answers: only the route's timeout ends it.
        Hang,
    }

    /// A codec whose tries follow a script, recording the endpoints they went to.
    struct Scripted {
        steps: VecDeque<Step>,
        tried: Vec<(SocketAddr, bool)>,
    }

    struct Status(u16, Option<u32>);
    impl Answer for Status {
        fn status(&self) -> u16 {
            self.0
        }
        fn grpc_status(&self) -> Option<u32> {
            self.1
        }
    }

    impl Attempt for Scripted {
        type Answer = Status;
        async fn attempt(&mut self, to: Try) -> Result<Status, UpstreamError> {
            self.tried.push((to.endpoint, to.last));
            match self.steps.pop_front().expect("a step for every try") {
                Step::Answer(status) => Ok(Status(status, None)),
                Step::Grpc(code) => Ok(Status(200, Some(code))),
                Step::Fail(err) => Err(err),
                Step::Hang => std::future::pending().await,
            }
        }
    }

    fn config(retries: &str) -> String {
        config_lb(retries, "round_robin")
    }

    fn config_lb(retries: &str, lb: &str) -> String {
        format!(
            r#"
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: c
        timeout: 3s
{retries}
clusters:
  - name: c
    lb: {lb}
    endpoints: [ 127.0.0.1:10, 127.0.0.1:11, 127.0.0.1:12 ]
"#
        )
    }

    /// The retry driver of the first route of `view` (a config from [`config`]), for a request
    /// with a body (`replayable: false`) or without.
    fn driver(view: &crate::context::WorkerView, replayable: bool) -> Retry<'_> {
        let snap = &view.snapshot;
        let flatmesh_rules::TableKind::Http(table) = &snap.program.listeners()[0].kind else {
            panic!("an http listener");
        };
        Retry::new(
            &table.routes[0],
            &snap.clusters[0],
            &view.upstreams.by_cluster[0],
            0,
            0,
            replayable,
            Duration::from_secs(15),
        )
    }

    /// Drives `steps` for a request (`replayable`: without a body) under `retries`, and
    /// returns the outcome, the endpoints tried and the retries counted.
    async fn run(
        retries: &str,
        replayable: bool,
        steps: Vec<Step>,
    ) -> (Result<u16, UpstreamError>, Vec<(SocketAddr, bool)>, u64) {
        let view = testing::view(&config(retries));
        let view = view.load();
        let (outcome, tried) = drive(&view, replayable, steps).await;
        (
            outcome,
            tried,
            view.snapshot.clusters[0].stats.retries.sum(),
        )
    }

    /// One request through `view`'s driver, its tries following `steps`: the status it ends
    /// with, and the endpoints its tries went to.
    async fn drive(
        view: &crate::context::WorkerView,
        replayable: bool,
        steps: Vec<Step>,
    ) -> (Result<u16, UpstreamError>, Vec<(SocketAddr, bool)>) {
        let retry = driver(view, replayable);
        let mut codec = Scripted {
            steps: steps.into(),
            tried: Vec::new(),
        };
        let outcome = retry.drive(&mut codec).await.map(|a| a.answer.0);
        (outcome, codec.tried)
    }

    const RETRY_ALL: &str = "        retries: { attempts: 2, on: [ connect-failure, reset, 5xx ] }";

    #[tokio::test(start_paused = true)]
    async fn an_answer_is_kept_without_retries() {
        let (outcome, tried, retries) = run("", true, vec![Step::Answer(503)]).await;
        assert_eq!(outcome.unwrap(), 503);
        assert_eq!(tried.len(), 1);
        assert!(tried[0].1, "the only try is the last");
        assert_eq!(retries, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_and_statuses_the_policy_names_are_retried_on_other_endpoints() {
        let steps = vec![
            Step::Fail(UpstreamError::connect("refused")),
            Step::Answer(500),
            Step::Answer(200),
        ];
        let (outcome, tried, retries) = run(RETRY_ALL, true, steps).await;
        assert_eq!(outcome.unwrap(), 200);
        let endpoints: Vec<u16> = tried.iter().map(|(e, _)| e.port()).collect();
        assert_eq!(endpoints, [10, 11, 12], "round robin moves on at each try");
        assert_eq!(
            tried.iter().map(|(_, last)| *last).collect::<Vec<_>>(),
            [false, false, true]
        );
        assert_eq!(retries, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_try_answers_whatever_its_status() {
        let steps = vec![Step::Answer(502), Step::Answer(502), Step::Answer(502)];
        let (outcome, tried, retries) = run(RETRY_ALL, true, steps).await;
        assert_eq!(outcome.unwrap(), 502);
        assert_eq!((tried.len(), retries), (3, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn what_the_policy_does_not_name_is_not_retried() {
        // The default policy retries connect failures only.
        let steps = vec![Step::Fail(UpstreamError::closed("reset", false, true))];
        let (outcome, tried, retries) = run("        retries: { attempts: 2 }", true, steps).await;
        let err = outcome.unwrap_err();
        assert_eq!(err.kind, Kind::Closed);
        assert_eq!(err.endpoint.map(|e| e.port()), Some(10));
        assert_eq!((tried.len(), retries), (1, 0));
        let steps = vec![Step::Answer(503)];
        let (outcome, ..) = run("        retries: { attempts: 2 }", true, steps).await;
        assert_eq!(outcome.unwrap(), 503, "5xx is not in the default policy");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_with_a_body_is_sent_once() {
        let steps = vec![Step::Fail(UpstreamError::connect("refused"))];
        let (outcome, tried, retries) = run(RETRY_ALL, false, steps).await;
        assert_eq!(outcome.unwrap_err().kind, Kind::ConnectFailed);
        assert_eq!((tried.len(), retries), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_pooled_connection_gets_one_free_try() {
        let stale = || UpstreamError::closed("closed while idle", true, false);
        // No retry policy at all: the stale connection is not the endpoint's failure.
        let (outcome, tried, retries) =
            run("", true, vec![Step::Fail(stale()), Step::Answer(200)]).await;
        assert_eq!(outcome.unwrap(), 200);
        assert_eq!((tried.len(), retries), (2, 0));
        // Only once per request.
        let (outcome, tried, _) =
            run("", true, vec![Step::Fail(stale()), Step::Fail(stale())]).await;
        assert_eq!(outcome.unwrap_err().kind, Kind::Closed);
        assert_eq!(tried.len(), 2);
        // Not for a request with a body, nor after bytes of an answer arrived.
        let (outcome, ..) = run("", false, vec![Step::Fail(stale())]).await;
        assert_eq!(outcome.unwrap_err().kind, Kind::Closed);
        let answered = UpstreamError::closed("cut off", true, true);
        let (outcome, tried, _) = run("", true, vec![Step::Fail(answered)]).await;
        assert_eq!((outcome.unwrap_err().kind, tried.len()), (Kind::Closed, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn the_route_timeout_bounds_every_try_together() {
        let started = Instant::now();
        let steps = vec![Step::Fail(UpstreamError::connect("refused")), Step::Hang];
        let (outcome, tried, retries) = run(RETRY_ALL, true, steps).await;
        let err = outcome.unwrap_err();
        assert_eq!(err.kind, Kind::Timeout);
        assert_eq!(err.endpoint.map(|e| e.port()), Some(11));
        assert_eq!((tried.len(), retries), (2, 1));
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(3),
            "the route's timeout: 3s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_route_timeout_starts_when_the_request_is_complete() {
        // Issue 23 item 9: a slow but live upload must not run out the route's timeout (3s).
        let view = testing::view(&config(""));
        let view = view.load();
        let (uploaded, watched) = watch::channel(false);
        let retry = driver(&view, false).timed_from_upload(watched, Duration::from_secs(2));
        let started = Instant::now();
        // The upload takes 10 s, a piece every second (the idle timeout is 2 s); then the
        // endpoint never answers.
        tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                uploaded.send_replace(false);
            }
            uploaded.send_replace(true);
            // Dropping the sender after the end changes nothing.
        });
        let mut codec = Scripted {
            steps: vec![Step::Hang].into(),
            tried: Vec::new(),
        };
        let err = retry.drive(&mut codec).await.err().unwrap();
        assert_eq!(err.kind, Kind::Timeout);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(13),
            "10s upload + 3s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_upload_that_stalls_fails_after_the_idle_timeout() {
        let view = testing::view(&config(""));
        let view = view.load();
        let (uploaded, watched) = watch::channel(false);
        let retry = driver(&view, false).timed_from_upload(watched, Duration::from_secs(2));
        let started = Instant::now();
        // One piece after 1 s, then nothing.
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            uploaded.send_replace(false);
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(uploaded);
        });
        let mut codec = Scripted {
            steps: vec![Step::Hang].into(),
            tried: Vec::new(),
        };
        let err = retry.drive(&mut codec).await.err().unwrap();
        assert_eq!(err.kind, Kind::UploadStalled);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(3),
            "1s, then 2s idle"
        );
        sender.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_past_the_clock_s_range_does_not_panic() {
        // Issue 23 item 9: `i64::MAX` seconds from xDS panicked every request's task. Inputs
        // are capped at 365 days now; the driver saturates whatever it is given.
        let view = testing::view(&config(""));
        let view = view.load();
        let mut retry = driver(&view, true);
        retry.timeout = Duration::from_secs(i64::MAX as u64);
        let mut codec = Scripted {
            steps: vec![Step::Answer(200)].into(),
            tried: Vec::new(),
        };
        let answered = retry.drive(&mut codec).await;
        assert_eq!(answered.map(|a| a.answer.0).ok(), Some(200));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cluster_without_endpoints_is_an_internal_failure() {
        // A config cannot say it (validation refuses), but a cluster fed by xDS can be empty.
        let view = testing::view(&config(""));
        let view = view.load();
        let snap = &view.snapshot;
        let flatmesh_rules::TableKind::Http(table) = &snap.program.listeners()[0].kind else {
            panic!("an http listener");
        };
        let plan = &snap.clusters[0];
        let empty = Upstream {
            balancer: crate::lb::Balancer::new(plan.policy, Vec::new().into(), &plan.table, 0),
            pool: view.upstreams.by_cluster[0].pool.clone(),
        };
        let retry = Retry::new(
            &table.routes[0],
            plan,
            &empty,
            0,
            0,
            true,
            Duration::from_secs(15),
        );
        let mut codec = Scripted {
            steps: VecDeque::new(),
            tried: Vec::new(),
        };
        let err = retry.drive(&mut codec).await.err().unwrap();
        assert_eq!(
            (err.kind, err.source),
            (Kind::NoEndpoint, super::super::error::Source::Internal)
        );
        assert!(codec.tried.is_empty() && err.endpoint.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn grpc_statuses_in_the_answer_s_headers_are_retried_when_named() {
        let policy = "        retries: { attempts: 2, on: [ unavailable, resource-exhausted ] }";
        let steps = vec![Step::Grpc(14), Step::Grpc(8), Step::Grpc(0)];
        let (outcome, tried, retries) = run(policy, true, steps).await;
        assert_eq!(outcome.unwrap(), 200);
        assert_eq!((tried.len(), retries), (3, 2));
        // A status the policy does not name is the answer, and so is a 503 under it.
        let (_, tried, retries) = run(policy, true, vec![Step::Grpc(4)]).await;
        assert_eq!((tried.len(), retries), (1, 0));
        let (outcome, tried, _) = run(policy, true, vec![Step::Answer(503)]).await;
        assert_eq!((outcome.unwrap(), tried.len()), (503, 1));
        let policy = "        retries: { attempts: 1, on: [ cancelled, deadline-exceeded ] }";
        let (_, tried, _) = run(policy, true, vec![Step::Grpc(1), Step::Grpc(0)]).await;
        assert_eq!(tried.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_try_past_the_per_try_timeout_is_retried_inside_the_route_timeout() {
        let policy =
            "        retries: { attempts: 2, per_try_timeout: 1s, backoff: { base: 100ms } }";
        let started = Instant::now();
        let view = testing::view(&config(policy));
        let view = view.load();
        let retry = driver(&view, true);
        let mut codec = Scripted {
            steps: vec![Step::Hang, Step::Answer(200)].into(),
            tried: Vec::new(),
        };
        let outcome = retry.drive(&mut codec).await.map(|a| a.answer.0);
        assert_eq!(outcome.unwrap(), 200);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_millis(1100),
            "1 s per try, then a backoff below 100 ms: {took:?}"
        );
        let stats = &view.snapshot.clusters[0].stats;
        assert_eq!((stats.per_try_timeouts.sum(), stats.retries.sum()), (1, 1));
        // Every try hangs: 3 tries of 1 s, under the route's 3 s; the last one is cut by
        // the route's timeout or its own, whichever comes first, and answers a timeout.
        let (outcome, tried, _) = run(policy, true, vec![Step::Hang, Step::Hang, Step::Hang]).await;
        let err = outcome.unwrap_err();
        assert!(
            matches!(err.kind, Kind::Timeout | Kind::PerTryTimeout),
            "{err}"
        );
        assert_eq!(tried.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_waits_grow_exponentially_with_full_jitter_up_to_max() {
        let view = testing::view(&config(
            "        retries: { attempts: 4, on: [ 5xx ], backoff: { base: 100ms, max: 300ms }, budget: { min_per_s: 1000 } }",
        ));
        let view = view.load();
        let retry = driver(&view, true);
        let ms = |d: Duration| d.as_millis();
        // The cap doubles from base to max; the jitter takes a share of it.
        assert_eq!(ms(retry.backoff_before(1, 0.999_999)), 99);
        assert_eq!(ms(retry.backoff_before(2, 0.999_999)), 199);
        assert_eq!(ms(retry.backoff_before(3, 0.999_999)), 299);
        assert_eq!(ms(retry.backoff_before(9, 0.5)), 150);
        assert_eq!(retry.backoff_before(1, 0.0), Duration::ZERO);
        // On the clock: 4 retries wait at most 100 + 200 + 300 + 300 ms, and the waits are
        // random, so over 100 requests they add up to about half of that.
        let mut total = Duration::ZERO;
        for _ in 0..100 {
            let started = Instant::now();
            let mut codec = Scripted {
                steps: (0..5).map(|_| Step::Answer(503)).collect(),
                tried: Vec::new(),
            };
            let outcome = retry.drive(&mut codec).await.map(|a| a.answer.0);
            assert_eq!(outcome.unwrap(), 503);
            let took = started.elapsed();
            assert!(took <= Duration::from_millis(900), "{took:?}");
            total += took;
        }
        let mean = total / 100;
        assert!(
            mean > Duration::from_millis(300) && mean < Duration::from_millis(600),
            "the mean wait of 4 retries is about 450 ms: {mean:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_never_goes_back_to_an_endpoint_that_failed_while_others_are_in() {
        for lb in ["random", "least_request", "ring_hash", "round_robin"] {
            let view = testing::view(&config_lb(
                "        retries: { attempts: 2, on: [ 5xx, connect-failure ], budget: { min_per_s: 1000 } }",
                lb,
            ));
            let view = view.load();
            for _ in 0..200 {
                let steps = vec![
                    Step::Answer(503),
                    Step::Fail(UpstreamError::connect("refused")),
                    Step::Answer(200),
                ];
                let (outcome, tried) = drive(&view, true, steps).await;
                assert_eq!(outcome.unwrap(), 200);
                let mut ports: Vec<u16> = tried.iter().map(|(e, _)| e.port()).collect();
                ports.sort_unstable();
                assert_eq!(ports, [10, 11, 12], "{lb}: three tries, three endpoints");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn over_the_budget_the_answer_in_hand_goes_back() {
        // No reserve, 10% of requests: the first request has 0.1 retries of budget.
        let policy =
            "        retries: { attempts: 3, on: [ 5xx ], budget: { ratio: 0.1, min_per_s: 0 } }";
        let view = testing::view(&config(policy));
        let view = view.load();
        let mut answered = Vec::new();
        for _ in 0..100 {
            let steps = (0..4).map(|_| Step::Answer(503)).collect();
            let (outcome, tried) = drive(&view, true, steps).await;
            assert_eq!(outcome.unwrap(), 503);
            answered.push(tried.len());
        }
        let stats = &view.snapshot.clusters[0].stats;
        let retries = stats.retries.sum();
        // 100 requests: at most 10 retries; each refusal is counted.
        assert_eq!(retries, 10);
        assert_eq!(answered.iter().sum::<usize>(), 110);
        assert!(stats.retries_over_budget.sum() >= 90);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_could_not_be_opened_is_retried_outside_the_budget() {
        // The same empty budget: every refused connection is still retried, within `attempts`.
        let policy = "        retries: { attempts: 2, on: [ connect-failure, 5xx ], budget: { ratio: 0.1, min_per_s: 0 } }";
        let view = testing::view(&config(policy));
        let view = view.load();
        for _ in 0..100 {
            let steps = vec![
                Step::Fail(UpstreamError::connect("refused")),
                Step::Answer(200),
            ];
            assert_eq!(drive(&view, true, steps).await.0.unwrap(), 200);
        }
        let stats = &view.snapshot.clusters[0].stats;
        assert_eq!(stats.retries.sum(), 100);
        assert_eq!(stats.retries_over_budget.sum(), 0);
        // An answer that reached the app still spends it: 10 requests' worth is there.
        let mut retried = 0;
        for _ in 0..100 {
            let steps = vec![Step::Answer(503), Step::Answer(200)];
            if drive(&view, true, steps).await.0.unwrap() == 200 {
                retried += 1;
            }
        }
        assert!(
            retried <= 20,
            "{retried} retries of answers from a budget of 20"
        );
        assert!(stats.retries_over_budget.sum() >= 80);
    }
}
