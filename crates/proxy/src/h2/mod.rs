//! The HTTP/2 codec: its server for HTTP/2 clients (h2c with prior knowledge, gRPC), on the
//! `h2` crate, and in [`client`], the client of `protocol: http2` clusters, on `h2` too. Both are thin
//! adapters over the L7 layer (`crate::l7`): a request is decided there, forwarded through
//! its retry driver, and answered with its replies.
//!
//! The server runs on `h2` itself rather than on hyper's server because what bounds a
//! client's hold on the node is per stream: hyper hides each stream's send handle, so a
//! stream whose client never opens its window (and never reads) could not be reset, and
//! it kept its buffers and its upstream connection for as long as the client sent PINGs.
//! Here every connection is bounded by configuration (docs/config.md, "limits"):
//! - `http2_max_concurrent_streams` streams, each granted `http2_stream_window` bytes of
//!   upload and the connection `http2_connection_window`;
//! - response data queued in the node: at most `http2_stream_window` per stream (h2's send
//!   buffer) and `per_connection_buffer_bytes` for all streams together, taken from the
//!   node's `memory_budget_bytes` ([`stream::Metered`] gives it back once h2 has written
//!   it); over the node's budget, new streams are refused (REFUSED_STREAM);
//! - a stream that can send nothing for `stream_stall_timeout` (the client does not open
//!   its window, or does not read) is reset, which frees its buffers and its upstream;
//! - at most `max_upstream_per_downstream` upstream connections held by one connection's
//!   streams at once;
//! - a connection that moves no byte for `idle_timeout` is closed;
//! - a connection with no stream that moves no byte for [`RELEASE_AFTER`] gives back its read
//!   and write buffers (h2 holds 24 KiB per connection otherwise; vendor/h2/FLATMESH.md).

pub(crate) mod client;
mod received;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::Limits;
use tokio::task::JoinSet;

use crate::context::ConnContext;
use crate::idle::{idle, Activity, ActivityTap};
use crate::tap::Tapped;
use stream::{ConnBudget, Metered};

/// How long a connection with no stream and no traffic keeps its buffers before h2 gives them
/// back. Long enough that a client sending one call after another never pays for it.
const RELEASE_AFTER: Duration = Duration::from_secs(1);

/// How often a connection whose buffers were given back looks again: if it moved bytes
/// meanwhile (a PING, say) without opening a stream, they were allocated again.
const RECHECK_RELEASED: Duration = Duration::from_secs(30);

/// Serves an HTTP/2 client connection until it ends or stays idle for `idle_timeout`.
pub(crate) async fn serve<S>(ctx: Arc<ConnContext>, stream: S, limits: &Limits)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::default());
    let io = Tapped {
        inner: stream,
        tap: ActivityTap(activity.clone()),
    };
    let budget = Arc::new(ConnBudget::new(&ctx, limits));
    tokio::select! {
        _ = run(ctx, io, limits, budget, &activity) => {}
        // Dropping the connection (and its streams' tasks) closes the socket.
        _ = idle(&activity, limits.idle_timeout) => {
            tracing::debug!("closing idle downstream connection");
        }
    }
}

/// The connection's handshake and its streams, each on a task of its own.
async fn run<S>(
    ctx: Arc<ConnContext>,
    io: S,
    limits: &Limits,
    budget: Arc<ConnBudget>,
    activity: &Activity,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .initial_window_size(limits.http2_stream_window)
        .initial_connection_window_size(limits.http2_connection_window)
        .max_send_buffer_size(limits.http2_stream_window as usize)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let mut conn = match builder.handshake::<_, Metered>(io).await {
        Ok(conn) => conn,
        Err(err) => {
            tracing::debug!(error = %err, "HTTP/2 handshake failed");
            return;
        }
    };
    // Dropped with the connection: a stream's task never outlives it.
    let mut streams = JoinSet::new();
    let mut draining = ctx.draining.clone();
    let mut goaway_sent = false;
    let mut quiet = Quiet::new(activity);
    loop {
        tokio::select! {
            // The node drains: GOAWAY; the streams open now finish, no new one is taken, and
            // `accept` ends once they have.
            () = draining.begun(), if !goaway_sent => {
                goaway_sent = true;
                conn.graceful_shutdown();
            }
            accepted = conn.accept() => match accepted {
                Some(Ok((req, respond))) => {
                    streams.spawn(stream::serve(ctx.clone(), req, respond, budget.clone()));
                }
                Some(Err(err)) => {
                    tracing::debug!(error = %err, "downstream connection ended with an error");
                    break;
                }
                // The client went away, or said GOAWAY and its last stream is done.
                None => break,
            },
            Some(_) = streams.join_next(), if !streams.is_empty() => {}
            // Checked only while no stream runs: a stream's task may be between reads.
            () = quiet.next_check(), if streams.is_empty() => {
                // h2 says what it gave back: its write and read buffers (16 and 8 KiB) and
                // its stream table; nothing when they were given back already.
                if quiet.check(activity) {
                    if let Some(freed) = conn.release_idle_buffers() {
                        budget.node.count_idle_freed(freed);
                    }
                }
            }
        }
    }
}

/// When a connection has been quiet long enough to give its buffers back: one timer per
/// connection, firing every [`RELEASE_AFTER`] while traffic goes on and every
/// [`RECHECK_RELEASED`] once released (an idle connection costs a wake-up per 30 s).
struct Quiet {
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The activity count at the last check.
    seen: u64,
    released: bool,
}

impl Quiet {
    fn new(activity: &Activity) -> Quiet {
        Quiet {
            timer: Box::pin(tokio::time::sleep(RELEASE_AFTER)),
            seen: activity.get(),
            released: false,
        }
    }

    async fn next_check(&mut self) {
        self.timer.as_mut().await;
    }

    /// Whether to release now: nothing moved since the last check and the buffers are not
    /// already given back. Arms the next check.
    fn check(&mut self, activity: &Activity) -> bool {
        let now = activity.get();
        let quiet = now == self.seen;
        self.seen = now;
        // Released now if quiet and not before; a byte moved means h2 allocated them again.
        let release = quiet && !self.released;
        self.released = quiet;
        let wait = if self.released {
            RECHECK_RELEASED
        } else {
            RELEASE_AFTER
        };
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + wait);
        release
    }
}

#[cfg(test)]
mod tests {
    //! The HTTP/2 adapter end to end on the test's runtime, on the paused clock: an HTTP/2
    //! client over an in-memory pipe, HTTP/1.1 endpoints on loopback.
    #![allow(clippy::unwrap_used)]
    use std::net::SocketAddr;
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full};
    use tokio::time::Instant;

    use crate::testing::{self, dead_endpoint, ok, Endpoint, Script};

    fn config(endpoints: &[SocketAddr], retries: &str) -> String {
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
        format!(
            r#"
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
        timeout: 1s
{retries}
clusters:
  - name: app
    endpoints: [ {} ]
"#,
            endpoints.join(", ")
        )
    }

    async fn get(
        yaml: &str,
        grpc: bool,
    ) -> (
        http::Response<Bytes>,
        std::sync::Arc<arc_swap::ArcSwap<crate::context::WorkerView>>,
    ) {
        let view = testing::view(yaml);
        let mut h2 = testing::h2_client(testing::context(&view)).await;
        let mut req = http::Request::post("http://t.local/svc/Method");
        if grpc {
            req = req.header("content-type", "application/grpc");
        }
        let resp = h2
            .send_request(req.body(Full::new(Bytes::new())).unwrap())
            .await
            .unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (http::Response::from_parts(parts, body), view)
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_http1_cluster_gets_504_at_the_route_timeout() {
        let app =
            Endpoint::start(|_, _, _| Script::Answer(Duration::from_secs(30), ok("late"))).await;
        let started = Instant::now();
        let (resp, _) = get(&config(&[app.addr], ""), false).await;
        assert_eq!(resp.status(), 504);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_endpoint_is_retried_and_the_answer_comes_from_the_live_one() {
        let app = Endpoint::start(|_, _, head| {
            assert!(head.starts_with("POST /svc/Method HTTP/1.1"), "{head}");
            assert!(
                head.contains("host: t.local"),
                "the authority becomes Host: {head}"
            );
            Script::Answer(Duration::ZERO, ok("live"))
        })
        .await;
        let yaml = config(
            &[dead_endpoint(), app.addr],
            "        retries: { attempts: 1, on: [ connect-failure ] }",
        );
        let (resp, view) = get(&yaml, false).await;
        assert_eq!(
            (resp.status(), &resp.body()[..]),
            (http::StatusCode::OK, &b"live"[..])
        );
        assert_eq!(view.load().snapshot.clusters[0].stats.retries.sum(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_client_gets_a_grpc_status_when_the_cluster_is_unreachable() {
        let (resp, _) = get(&config(&[dead_endpoint()], ""), true).await;
        assert_eq!(
            resp.status(),
            200,
            "gRPC errors travel as trailers-only answers"
        );
        assert_eq!(resp.headers()["grpc-status"], "14");
        let message = resp.headers()["grpc-message"].to_str().unwrap();
        assert!(
            message.starts_with("upstream connect error: cluster `app`"),
            "{message}"
        );
    }
}
