//! An `hbone` listener's connection, after its mutual TLS handshake: an HTTP/2 server whose
//! every stream must be a `CONNECT` to an allowed `IP:PORT`. Each accepted stream is answered
//! 200 and relayed to a new TCP connection to that destination; a refused one gets its
//! status (400, 403, 503), a log line and a count by reason, and no other stream notices.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use flatmesh_config::destination::Destination;
use http::{Method, Response, StatusCode};
use tokio::net::TcpStream;

use super::stream::H2Stream;
use super::Refusal;
use crate::context::ConnContext;
use crate::relay::{copy_until_idle, reset_on_close, ByteCount, Relay, RelayEnd};
use crate::snapshot::{ListenerPlan, Snapshot};
use crate::tap::Tapped;

/// What every stream of one tunnel connection shares.
struct Tunnel {
    ctx: Arc<ConnContext>,
    snapshot: Arc<Snapshot>,
    listener: usize,
    limits: flatmesh_config::Limits,
    /// The peer's authorization, decided once (its principal is the connection's) and
    /// counted for each stream.
    authz: Option<flatmesh_rules::AuthzDecision>,
    /// Streams being admitted or relayed now.
    open: AtomicUsize,
}

impl Tunnel {
    fn plan(&self) -> &ListenerPlan {
        &self.snapshot.listeners[self.listener]
    }
}

/// Serves the tunnel connection `stream` of listener `listener` until the peer closes it,
/// it fails, or it stays without a stream for `limits.idle_timeout`.
pub async fn serve<S>(ctx: Arc<ConnContext>, stream: S, snapshot: Arc<Snapshot>, listener: usize)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let config = &snapshot.config;
    let limits = config.limits.for_listener(&config.listeners[listener]);
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .initial_window_size(limits.http2_stream_window)
        .initial_connection_window_size(limits.http2_connection_window)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let name = snapshot.listeners[listener].name.clone();
    let handshake = tokio::time::timeout(limits.header_read_timeout, builder.handshake(stream));
    let mut conn = match handshake.await {
        Ok(Ok(conn)) => conn,
        Ok(Err(err)) => {
            tracing::info!(listener = %name, peer = %ctx.peer, error = %err,
                "HBONE peer did not speak HTTP/2; the connection is closed");
            return;
        }
        Err(_) => {
            tracing::info!(listener = %name, peer = %ctx.peer,
                "HBONE peer sent no HTTP/2 preface within limits.header_read_timeout; the connection is closed");
            return;
        }
    };
    let authz = snapshot
        .program
        .authz(listener)
        .map(|authz| authz.check_connection(ctx.peer()));
    let idle = limits.idle_timeout;
    let mut draining = ctx.draining.clone();
    let mut goaway_sent = false;
    let tunnel = Arc::new(Tunnel {
        ctx,
        snapshot,
        listener,
        limits,
        authz,
        open: AtomicUsize::new(0),
    });
    loop {
        // `accept` is cancel safe: an idle timeout that finds streams still open waits on.
        let next = tokio::select! {
            next = tokio::time::timeout(idle, conn.accept()) => next,
            // The node drains: GOAWAY; the open tunnels finish, no new one is taken.
            () = draining.begun(), if !goaway_sent => {
                goaway_sent = true;
                conn.graceful_shutdown();
                continue;
            }
        };
        let next = match next {
            Ok(next) => next,
            Err(_) if tunnel.open.load(Ordering::Relaxed) == 0 => {
                tracing::debug!(listener = %name, "HBONE connection idle; closing it");
                break;
            }
            Err(_) => continue,
        };
        match next {
            Some(Ok((request, respond))) => {
                tokio::spawn(stream_task(tunnel.clone(), request, respond));
            }
            Some(Err(err)) => {
                tracing::debug!(listener = %name, error = %err, "HBONE connection ended with an error");
                break;
            }
            None => break,
        }
    }
}

async fn stream_task(
    tunnel: Arc<Tunnel>,
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    // The connection is not idle while a stream is admitted (a connect may take a while) or
    // relayed.
    tunnel.open.fetch_add(1, Ordering::Relaxed);
    let _open = OpenStream(&tunnel.open);
    let plan = tunnel.plan();
    let worker = tunnel.ctx.worker;
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    let (up, _slot, _buffers, destination) = match admit(&tunnel, &request, &authority).await {
        Ok(admitted) => admitted,
        Err((status, reason, detail)) => {
            plan.stats.hbone.refused(reason);
            // The local workload the stream was for, when its port names one.
            let workload = super::authority::parse(&authority)
                .ok()
                .and_then(|d| tunnel.snapshot.workloads.serving(d.port()));
            tracing::info!(listener = %plan.name, peer = %tunnel.ctx.peer, principal = ?tunnel.ctx.principal,
                %authority, workload = tunnel.snapshot.workloads.name(workload), status = status.as_u16(), reason, "{detail}");
            let _ = respond.send_response(reply(status), true);
            return;
        }
    };
    let send = match respond.send_response(reply(StatusCode::OK), false) {
        Ok(send) => send,
        Err(err) => {
            tracing::debug!(listener = %plan.name, error = %err, "HBONE stream closed before it was answered");
            return;
        }
    };
    plan.stats.hbone.opened.add_shared(worker, 1);
    let workload = tunnel.snapshot.workloads.serving(destination.port());
    plan.count_workload(worker, workload);
    tracing::debug!(listener = %plan.name, principal = ?tunnel.ctx.principal, %destination,
        workload = tunnel.snapshot.workloads.name(workload), "HBONE stream delivered");
    let _ = up.set_nodelay(true);
    let mut from_peer = Tapped {
        inner: H2Stream::new(send, request.into_body()),
        tap: ByteCount::default(),
    };
    let mut to_destination = Tapped {
        inner: up,
        tap: ByteCount::default(),
    };
    let relay = Relay::of(&tunnel.limits);
    match copy_until_idle(&mut from_peer, &mut to_destination, relay).await {
        RelayEnd::Closed | RelayEnd::Idle => {}
        RelayEnd::Failed(err) => {
            tracing::debug!(listener = %plan.name, %destination, error = %err,
                "HBONE stream ended with an error; resetting both sides");
            from_peer.inner.reset();
            reset_on_close(&to_destination.inner);
        }
    }
    plan.stats.bytes_in.add_shared(worker, from_peer.tap.0);
    plan.stats
        .bytes_out
        .add_shared(worker, to_destination.tap.0);
}

/// A stream counted in [`Tunnel::open`] until it is dropped.
struct OpenStream<'a>(&'a AtomicUsize);

impl Drop for OpenStream<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

type Refused = (StatusCode, Refusal, String);

/// Everything a stream must pass before it is answered 200, in order: a CONNECT, an
/// `IP:PORT` authority, the listener's policies, its destinations, the node's budgets, and
/// the destination accepting the connection within `limits.connect_timeout`.
async fn admit(
    tunnel: &Tunnel,
    request: &http::Request<h2::RecvStream>,
    authority: &str,
) -> Result<
    (
        TcpStream,
        crate::limits::SocketSlot,
        crate::limits::Reservation,
        std::net::SocketAddr,
    ),
    Refused,
> {
    let plan = tunnel.plan();
    if request.method() != Method::CONNECT {
        return Err((
            StatusCode::BAD_REQUEST,
            "not_connect",
            format!(
                "HBONE stream is a {} request; only CONNECT is tunnelled",
                request.method()
            ),
        ));
    }
    let destination = super::authority::parse(authority).map_err(|why| {
        (
            StatusCode::BAD_REQUEST,
            "bad_authority",
            format!("HBONE CONNECT refused: {why}"),
        )
    })?;
    if let (Some(d), Some(authz)) = (tunnel.authz, tunnel.snapshot.program.authz(tunnel.listener)) {
        plan.count_authz(tunnel.ctx.worker, d);
        if !d.allowed {
            return Err((
                StatusCode::FORBIDDEN,
                "denied",
                format!(
                    "HBONE CONNECT denied by the listener's authorization ({})",
                    d.policy
                        .map_or("no policy allows the peer", |p| authz.policy_name(p))
                ),
            ));
        }
    }
    if !allowed(&plan.destinations, destination) {
        return Err((
            StatusCode::FORBIDDEN,
            "destination_not_allowed",
            format!("HBONE CONNECT to {destination} refused: not in the listener's hbone.destinations (by default loopback only)"),
        ));
    }
    let slot = crate::limits::upstream_socket().map_err(|err| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "fd_limit",
            format!("HBONE CONNECT refused: {err}"),
        )
    })?;
    let relay = Relay::of(&tunnel.limits);
    let config = &tunnel.snapshot.config;
    let buffers = tunnel
        .ctx
        .budget
        .memory
        .try_take(2 * relay.buffer, config.limits.memory_budget_bytes)
        .ok_or_else(|| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "memory_budget",
                "HBONE CONNECT refused: the node's limits.memory_budget_bytes is spent".into(),
            )
        })?;
    let timeout = tunnel.limits.connect_timeout;
    let up = match tokio::time::timeout(timeout, TcpStream::connect(destination)).await {
        Ok(Ok(up)) => up,
        Ok(Err(err)) => {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "connect_failed",
                format!("HBONE destination {destination} refused the connection: {err}"),
            ))
        }
        Err(_) => {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "connect_timeout",
                format!(
                "HBONE destination {destination} did not accept within limits.connect_timeout ({})",
                flatmesh_config::duration::format(&timeout)
            ),
            ))
        }
    };
    Ok((up, slot, buffers, destination))
}

/// True if `destination` is within `destinations`, or (when none are written) on loopback.
pub fn allowed(destinations: &[Destination], destination: std::net::SocketAddr) -> bool {
    let list = if destinations.is_empty() {
        &flatmesh_config::destination::DEFAULT_DESTINATIONS[..]
    } else {
        destinations
    };
    list.iter().any(|d| d.allows(destination))
}

fn reply(status: StatusCode) -> Response<()> {
    let mut response = Response::new(());
    *response.status_mut() = status;
    response
}
