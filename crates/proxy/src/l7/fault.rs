//! Fault injection, a route's `fault:` (Envoy's HTTP fault filter): a share of the route's
//! requests is answered at once with an error (abort), or held for a while before it is
//! forwarded (delay), or both (the delay first, then the abort, as in Envoy).
//!
//! Each request draws once per fault kind ([`roll`], in [`super::decide`]); an abort that
//! hits without a delay is answered there, before anything goes upstream. A delay is waited
//! out by [`super::forward`] on tokio's clock and counts against the route's timeout: a
//! delay as long as the timeout ends in the timeout's 504. Every answer a fault made carries
//! `x-flatmesh-fault: abort` (or `delay`, for a timeout the delay caused).

use std::time::Duration;

use flatmesh_rules::{AbortStatus, FaultAction};
use http::header::HeaderValue;
use http::{Response, StatusCode};
use prometheus_client::encoding::DescriptorEncoder;

use super::body::ResponseBody;
use super::reply::local_reply;
use crate::metrics::WorkerCounter;

/// The header on every answer a fault made, naming the fault.
pub(crate) const FAULT_HEADER: &str = "x-flatmesh-fault";

/// What the draws gave one request: a delay to wait, then maybe an abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Delayed {
    pub duration: Duration,
    /// Answer with this once the delay is over instead of forwarding.
    pub abort: Option<AbortStatus>,
}

/// A route's fault, drawn for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drawn {
    /// Forward as usual.
    None,
    /// Answer at once.
    Abort(AbortStatus),
    /// Wait, then forward or abort.
    Delay(Delayed),
}

/// Draws the route's fault for one request: each kind with its own share, a fresh random
/// number per kind (the thread's generator: no lock, no syscall).
pub(crate) fn roll(fault: &FaultAction) -> Drawn {
    let abort = fault
        .abort
        .and_then(|(status, share)| share.hit(rand::random()).then_some(status));
    let delay = fault
        .delay
        .and_then(|(duration, share)| share.hit(rand::random()).then_some(duration));
    match (delay, abort) {
        (Some(duration), abort) => Drawn::Delay(Delayed { duration, abort }),
        (None, Some(status)) => Drawn::Abort(status),
        (None, None) => Drawn::None,
    }
}

/// The answer of an abort: the HTTP status (a gRPC client gets it mapped to a gRPC status,
/// trailers-only, as Envoy maps it), or the gRPC status (HTTP 200, trailers-only).
pub(crate) fn abort_reply(status: AbortStatus, route: &str, grpc: bool) -> Response<ResponseBody> {
    let message = format!("fault injected: route `{route}` aborted the request\n");
    let mut resp = match status {
        AbortStatus::Http(status) => local_reply(status, message, false, grpc),
        AbortStatus::Grpc(code) => {
            let mut resp = local_reply(StatusCode::OK, message, false, true);
            resp.headers_mut()
                .insert("grpc-status", HeaderValue::from(code));
            resp
        }
    };
    resp.headers_mut()
        .insert(FAULT_HEADER, HeaderValue::from_static("abort"));
    resp
}

/// Faults injected on the node, by kind (`/metrics`: `flatmesh_faults_injected`).
pub(crate) struct FaultCounts {
    pub aborts: WorkerCounter,
    pub delays: WorkerCounter,
}

impl FaultCounts {
    pub fn new(workers: usize) -> FaultCounts {
        FaultCounts {
            aborts: WorkerCounter::new(workers),
            delays: WorkerCounter::new(workers),
        }
    }

    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        crate::metrics::counter(
            enc,
            "flatmesh_faults_injected",
            "Requests a route's fault aborted or delayed, by kind (a request both hit counts in both)",
            &[
                ([("kind", "abort")], self.aborts.sum()),
                ([("kind", "delay")], self.delays.sum()),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use flatmesh_rules::Share;

    use super::*;

    fn fault(abort: f64, delay: f64) -> FaultAction {
        FaultAction {
            abort: Some((
                AbortStatus::Http(StatusCode::SERVICE_UNAVAILABLE),
                Share::of_percent(abort),
            )),
            delay: Some((Duration::from_secs(1), Share::of_percent(delay))),
        }
    }

    #[test]
    fn a_request_both_faults_hit_is_delayed_then_aborted() {
        let both = roll(&fault(100.0, 100.0));
        assert_eq!(
            both,
            Drawn::Delay(Delayed {
                duration: Duration::from_secs(1),
                abort: Some(AbortStatus::Http(StatusCode::SERVICE_UNAVAILABLE)),
            })
        );
        assert_eq!(
            roll(&fault(100.0, 0.0)),
            Drawn::Abort(AbortStatus::Http(StatusCode::SERVICE_UNAVAILABLE))
        );
        assert_eq!(roll(&fault(0.0, 0.0)), Drawn::None);
    }

    #[test]
    fn abort_replies_name_the_fault_and_map_grpc() {
        let http = abort_reply(
            AbortStatus::Http(StatusCode::SERVICE_UNAVAILABLE),
            "r",
            false,
        );
        assert_eq!(http.status(), 503);
        assert_eq!(http.headers()[FAULT_HEADER], "abort");
        // 503 is UNAVAILABLE (14) for a gRPC client.
        let mapped = abort_reply(
            AbortStatus::Http(StatusCode::SERVICE_UNAVAILABLE),
            "r",
            true,
        );
        assert_eq!(mapped.headers()["grpc-status"], "14");
        let grpc = abort_reply(AbortStatus::Grpc(8), "r", true);
        assert_eq!(
            (grpc.status(), &grpc.headers()["grpc-status"]),
            (StatusCode::OK, &HeaderValue::from_static("8"))
        );
        assert_eq!(grpc.headers()[FAULT_HEADER], "abort");
    }

    /// End to end on the paused clock: an HTTP/1 client, a route with `fault`, an endpoint
    /// that answers after `answer_after`. Returns each answer's status, fault header and when it came,
    /// and the connections the endpoint saw.
    /// `body`: the requests are POSTs with a 5-byte body (else GETs; the scripted endpoint
    /// reads only bodies with a content-length, and a delayed request's body is re-chunked).
    async fn through(
        fault: &str,
        timeout: &str,
        requests: usize,
        body: bool,
        answer_after: Duration,
    ) -> (Vec<(u16, Option<String>, Duration)>, usize) {
        use crate::testing::{self, ok, read_reply, Endpoint, Script};
        use tokio::io::AsyncWriteExt as _;
        let app = Endpoint::start(move |_, _, _| Script::Answer(answer_after, ok("app"))).await;
        let yaml = format!(
            "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    routes:\n      - cluster: app\n        timeout: {timeout}\n        fault: {fault}\nclusters:\n  - name: app\n    endpoints: [ {} ]\n",
            app.addr
        );
        let view = testing::view(&yaml);
        let mut client = testing::h1_client(testing::context(&view));
        let mut buf = Vec::new();
        let mut out = Vec::new();
        for _ in 0..requests {
            let started = tokio::time::Instant::now();
            let request: &[u8] = if body {
                b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhello"
            } else {
                b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"
            };
            client.write_all(request).await.unwrap();
            let reply = read_reply(&mut client, &mut buf).await.unwrap();
            out.push((
                reply.status,
                reply.header(FAULT_HEADER).map(str::to_owned),
                started.elapsed(),
            ));
        }
        (out, app.connections())
    }

    #[tokio::test(start_paused = true)]
    async fn a_delayed_request_waits_exactly_the_delay() {
        let (answers, conns) = through(
            "{ delay: { duration: 2s } }",
            "5s",
            2,
            false,
            Duration::ZERO,
        )
        .await;
        let ok = (200, None, Duration::from_secs(2));
        assert_eq!(answers, [ok.clone(), ok]);
        assert_eq!(
            conns, 1,
            "both requests on one kept-alive upstream connection"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_delay_counts_against_the_route_timeout() {
        // The delay leaves 1 s of the 3 s timeout: an answer 900 ms later makes it, one
        // 1.5 s later does not (504 at 3 s, as without the delay).
        let (answers, _) = through(
            "{ delay: { duration: 2s } }",
            "3s",
            1,
            false,
            Duration::from_millis(900),
        )
        .await;
        assert_eq!(answers, [(200, None, Duration::from_millis(2900))]);
        let (answers, _) = through(
            "{ delay: { duration: 2s } }",
            "3s",
            1,
            false,
            Duration::from_millis(1500),
        )
        .await;
        assert_eq!(answers, [(504, None, Duration::from_secs(3))]);
        // A delay as long as the timeout: 504 at the timeout, nothing sent upstream.
        let (answers, conns) = through(
            "{ delay: { duration: 10s } }",
            "1s",
            1,
            true,
            Duration::ZERO,
        )
        .await;
        assert_eq!(
            answers,
            [(504, Some("delay".to_string()), Duration::from_secs(1))]
        );
        assert_eq!(conns, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_abort_answers_at_once_and_keeps_the_connection() {
        // Three requests with bodies on one connection: each body is drained, so the next
        // request is read whole.
        let (answers, conns) =
            through("{ abort: { status: 418 } }", "5s", 3, true, Duration::ZERO).await;
        let aborted = (418, Some("abort".to_string()), Duration::ZERO);
        assert_eq!(answers, vec![aborted; 3]);
        assert_eq!(conns, 0, "an aborted request never goes upstream");
        // Delay and abort both: the abort comes after the delay.
        let (answers, conns) = through(
            "{ abort: { status: 503 }, delay: { duration: 700ms } }",
            "5s",
            1,
            true,
            Duration::ZERO,
        )
        .await;
        assert_eq!(
            answers,
            [(503, Some("abort".to_string()), Duration::from_millis(700))]
        );
        assert_eq!(conns, 0);
    }
}
