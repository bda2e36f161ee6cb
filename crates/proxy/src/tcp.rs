//! The L4 relay for `tcp` listeners: no parsing, bytes spliced between two sockets.
//! Half-close is carried through (a FIN on one side becomes a shutdown(WR) on the other)
//! and a reset on one side becomes a reset on the other. When tier K carries the bytes
//! (socket direct or splice, see `kernel/`), the relay only carries what reaches user space
//! anyway: the bytes sent before the kernel took over, the FIN and the reset.

use std::sync::Arc;

use tokio::net::TcpStream;

use crate::context::{ConnContext, WorkerView};
use crate::kernel::{DirectConn, DirectDir, KernelBinding, KernelPath};
use crate::lb::{hash_client, InFlight};
use crate::limits::{upstream_socket, SocketSlot};
pub use crate::relay::{copy_until_idle, Relay, RelayEnd};
use crate::relay::{reset_on_close, ByteCount};
use crate::resilience::{Outcome, Overflow, Permit};
use crate::tap::Tapped;
use crate::tls::Stream;
use crate::upstream::{NoPick, Picked};
use flatmesh_rules::ClusterId;

/// Relays a tcp listener's connection (in the clear, or out of the listener's TLS) to an
/// endpoint of its cluster (in the clear, or inside the cluster's TLS).
pub async fn relay(ctx: Arc<ConnContext>, downstream: Stream) {
    let view = ctx.view.load_full();
    let snap = &view.snapshot;
    let Some(lid) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        reset_on_close(downstream.tcp());
        return;
    };
    let listener = &snap.listeners[lid];
    let Some(cid) = snap.program.tcp_cluster(lid) else {
        tracing::warn!(listener = %listener.name, "tcp listener has no cluster; closing the connection");
        return;
    };
    // Authorization happens once, before anything is spent on the connection.
    if let Some(authz) = snap.program.authz(lid) {
        let d = authz.check_connection(ctx.peer());
        listener.count_authz(ctx.worker, d);
        if !d.allowed {
            tracing::debug!(listener = %listener.name, principal = ?ctx.principal, policy = ?d.policy.map(|p| authz.policy_name(p)), "connection denied");
            reset_on_close(downstream.tcp());
            return;
        }
    }
    // A tunnel cluster carries the connection as a CONNECT stream (crate::hbone).
    // It presents the identity of the workload that made it (`crate::workload`).
    if snap.clusters[cid].tunnel_port.is_some() {
        let who = match downstream.tcp().local_addr() {
            Ok(local) => {
                snap.workloads
                    .client_of(ctx.kernel.as_deref(), ctx.peer, local)
                    .await
            }
            Err(_) => None,
        };
        listener.count_workload(ctx.worker, who);
        return crate::hbone::client::relay(&ctx, &view, lid, cid, downstream, who).await;
    }
    // The in-flight guard lives as long as the connection: least_request counts connections.
    let Some((up, _in_flight)) = connect_upstream(&ctx, &view, &listener.name, cid).await else {
        reset_on_close(downstream.tcp());
        return;
    };
    let _ = downstream.tcp().set_nodelay(true);
    // The relay's two buffers come out of the node's memory budget.
    let relay = Relay::of(&snap.config.limits.for_listener(&snap.config.listeners[lid]));
    let Some(_buffers) = ctx
        .budget
        .memory
        .try_take(2 * relay.buffer, snap.config.limits.memory_budget_bytes)
    else {
        tracing::debug!(listener = %listener.name, "memory budget spent; closing the relay");
        reset_on_close(downstream.tcp());
        return;
    };
    let (bytes_in, bytes_out, in_kernel) = match (downstream, up) {
        // Tier K: from here on the kernel may move the bytes; the relay then only carries
        // what was already queued, the half-close and the reset.
        (Stream::Plain(downstream), Stream::Plain(up)) => {
            let path = match &ctx.kernel {
                Some(k) => k.choose_path(listener.kernel_splice, &downstream, &up),
                None => KernelPath::User,
            };
            pump_path(ctx.kernel.as_deref(), downstream, up, path, relay).await
        }
        // TLS on either side: only user space has the bytes in the clear.
        (downstream, up) => {
            let (i, o) = pump(downstream, up, Some(relay)).await;
            (i, o, false)
        }
    };
    listener.stats.bytes_in.add_shared(ctx.worker, bytes_in);
    listener.stats.bytes_out.add_shared(ctx.worker, bytes_out);
    if in_kernel {
        listener.stats.kernel_spliced.add_shared(ctx.worker, 1);
    }
}

/// Relays a connection on `path` until both sides are done. Returns the bytes from the
/// client and from the upstream (what the kernel carried included, when it counts them) and
/// whether the kernel carried any of it.
pub async fn pump_path(
    kernel: Option<&KernelBinding>,
    client: TcpStream,
    upstream: TcpStream,
    path: KernelPath,
    relay: Relay,
) -> (u64, u64, bool) {
    match path {
        KernelPath::User => {
            let (i, o) = pump(Stream::Plain(client), Stream::Plain(upstream), Some(relay)).await;
            (i, o, false)
        }
        KernelPath::Spliced(a, b) => {
            let (i, o) = pump(Stream::Plain(client), Stream::Plain(upstream), None).await;
            // What the relay read plus what the kernel moved without it.
            let (ki, ko) = kernel.and_then(|k| k.splice_end(a, b)).unwrap_or_default();
            (i + ki, o + ko, true)
        }
        KernelPath::Direct(d) => pump_direct(client, upstream, *d).await,
    }
}

/// The relay of a socket-direct connection: a plain two-way copy that re-arms each direction's
/// shortcut after every forward, so the kernel switches to the direct path as soon as the
/// proxy has caught up (bpf/redirect.bpf.c). FIN and RST reach the proxy as always: the
/// kernel's direct bytes are already in the receiver's queue by the time the sender's FIN
/// is sent, so a plain shutdown keeps them ahead of it.
async fn pump_direct(
    mut client: TcpStream,
    mut upstream: TcpStream,
    mut d: DirectConn,
) -> (u64, u64, bool) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let (relayed_in, relayed_out) = (AtomicU64::new(0), AtomicU64::new(0));
    let result = {
        let (mut cr, mut cw) = client.split();
        let (mut ur, mut uw) = upstream.split();
        tokio::try_join!(
            direct_one_way(
                &mut cr,
                &mut uw,
                &mut d.to_backend,
                &relayed_in,
                "client to upstream"
            ),
            direct_one_way(
                &mut ur,
                &mut cw,
                &mut d.to_client,
                &relayed_out,
                "upstream to client"
            )
        )
    };
    if let Err(err) = result {
        tracing::debug!(error = %err, "socket-direct relay ended with an error; resetting both sides");
        reset_on_close(&client);
        reset_on_close(&upstream);
    }
    let direct = d.end();
    (
        relayed_in.load(Relaxed) + direct.client_to_backend,
        relayed_out.load(Relaxed) + direct.backend_to_client,
        direct.client_to_backend + direct.backend_to_client > 0,
    )
}

/// One direction of [`pump_direct`], counting what it relays into `relayed`.
async fn direct_one_way(
    from: &mut tokio::net::tcp::ReadHalf<'_>,
    to: &mut tokio::net::tcp::WriteHalf<'_>,
    dir: &mut DirectDir,
    relayed: &std::sync::atomic::AtomicU64,
    what: &str,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let tag =
        |op: &str, e: std::io::Error| std::io::Error::new(e.kind(), format!("{op} ({what}): {e}"));
    // Small: once the shortcut takes over, nothing but the FIN reaches this loop.
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await.map_err(|e| tag("read", e))?;
        if n == 0 {
            break;
        }
        to.write_all(&buf[..n]).await.map_err(|e| tag("write", e))?;
        relayed.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        dir.forwarded(n, to.as_ref());
    }
    to.shutdown().await.map_err(|e| tag("shutdown", e))
}

/// What an upstream connection holds while it is open: its endpoint's in-flight count (for
/// least_request, which counts connections here) and its place in the fd budget.
pub struct Held {
    _in_flight: InFlight,
    _slot: SocketSlot,
    /// Its place under the cluster's `circuit_breaker.max_connections`.
    _counted: Permit,
}

/// Connects to an endpoint of cluster `cid`, picked by the worker's balancer for the client's
/// address, and makes the cluster's TLS handshake when it has `tls:`. Tries each endpoint at
/// most once (up to 3), so one dead endpoint does not fail the client. The cluster's circuit
/// breaker bounds the connections (`max_connections`) and those still opening
/// (`max_pending`); its outlier detection hears of every connect's outcome.
pub async fn connect_upstream(
    ctx: &ConnContext,
    view: &WorkerView,
    listener: &str,
    cid: ClusterId,
) -> Option<(Stream, Held)> {
    let plan = &view.snapshot.clusters[cid];
    let upstream = &view.upstreams.by_cluster[cid];
    let key = hash_client(ctx.peer.ip());
    let tries = plan.endpoints.len().clamp(1, 3);
    for attempt in 0..tries {
        let Picked {
            index,
            endpoint,
            in_flight,
        } = match upstream.pick(plan, ctx.dialled, key, attempt, &[]) {
            Ok(picked) => picked,
            Err(NoPick::NoEndpoint) => return None,
            Err(NoPick::Refused(refused)) => {
                tracing::warn!(%listener, cluster = %plan.name, peer = %ctx.peer, "tcp connection refused: {refused}");
                return None;
            }
        };
        let breaker = &plan.guard.breaker;
        let permits = breaker
            .acquire(Overflow::Pending)
            .and_then(|pending| Ok((pending, breaker.acquire(Overflow::Connections)?)));
        let (pending, counted) = match permits {
            Ok(permits) => permits,
            Err(kind) => {
                tracing::warn!(%listener, cluster = %plan.name, limit = kind.key(),
                    "tcp connection refused: the cluster's circuit breaker is at its limit; raise circuit_breaker.{}", kind.key());
                return None;
            }
        };
        let report = |outcome| {
            if let Some(outlier) = &plan.guard.outlier {
                outlier.report(index, outcome);
            }
        };
        let slot = match upstream_socket() {
            Ok(slot) => slot,
            Err(err) => {
                plan.stats.connect_failures.add_shared(ctx.worker, 1);
                tracing::warn!(%listener, cluster = %plan.name, error = %err, "tcp upstream connect refused");
                return None;
            }
        };
        let stream =
            match tokio::time::timeout(plan.connect_timeout, TcpStream::connect(endpoint)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => {
                    plan.stats.connect_failures.add_shared(ctx.worker, 1);
                    report(Outcome::ConnectFailed);
                    tracing::warn!(%listener, cluster = %plan.name, %endpoint, error = %err,
                    "tcp upstream connect failed; check that the endpoint is listening");
                    continue;
                }
                Err(_) => {
                    plan.stats.connect_failures.add_shared(ctx.worker, 1);
                    report(Outcome::ConnectFailed);
                    tracing::warn!(%listener, cluster = %plan.name, %endpoint,
                    "tcp upstream connect timed out; check the endpoint or raise connect_timeout");
                    continue;
                }
            };
        plan.stats.connections.add_shared(ctx.worker, 1);
        report(Outcome::Connected);
        drop(pending);
        let _ = stream.set_nodelay(true);
        let stream = match &plan.tls {
            None => Stream::Plain(stream),
            Some(tls) => match tls.originate_relay(stream, &plan.stats, ctx.worker).await {
                Ok(stream) => stream,
                Err(_) => continue,
            },
        };
        return Some((
            stream,
            Held {
                _in_flight: in_flight,
                _slot: slot,
                _counted: counted,
            },
        ));
    }
    None
}

/// Moves bytes both ways until both sides are done. A FIN becomes a shutdown(WR) on the other
/// side; a reset (or error) on either side resets both. `relay`: copied in user space, with
/// its buffers and idle timeout; `None`: spliced by the kernel, whose bytes the proxy does
/// not see, so only the FIN and the reset are carried (and no idle timeout applies: the
/// endpoints' own keep-alives end such connections). Returns the bytes read from the client
/// and from the upstream (by user space: a spliced pair's kernel-moved bytes are not in them).
pub async fn pump(client: Stream, upstream: Stream, relay: Option<Relay>) -> (u64, u64) {
    let mut client = Tapped {
        inner: client,
        tap: ByteCount::default(),
    };
    let mut server = Tapped {
        inner: upstream,
        tap: ByteCount::default(),
    };
    let result = match (relay, &mut client.inner, &mut server.inner) {
        (None, Stream::Plain(c), Stream::Plain(s)) => spliced_pump(c, s).await,
        // The kernel splices sockets in the clear only (the lowering keeps TLS from it).
        (None, _, _) => Err(std::io::Error::other("a TLS connection cannot be spliced")),
        (Some(relay), _, _) => match copy_until_idle(&mut client, &mut server, relay).await {
            RelayEnd::Closed => Ok(()),
            RelayEnd::Idle => {
                tracing::debug!(
                    idle = %flatmesh_config::duration::format(&relay.idle),
                    "tcp relay idle; closing both sides"
                );
                Ok(())
            }
            RelayEnd::Failed(err) => Err(err),
        },
    };
    if let Err(err) = result {
        tracing::debug!(error = %err, spliced = relay.is_none(), "relay ended with an error; resetting both sides");
        // One side reset (or failed): pass the reset on rather than a clean FIN.
        reset_on_close(client.inner.tcp());
        reset_on_close(server.inner.tcp());
    }
    (client.tap.0, server.tap.0)
}

/// The relay of a pair the kernel splices. It differs from a plain copy in one place: on EOF
/// from one side, the kernel may still hold bytes it redirected toward the other side's
/// socket (the sockmap backlog, not yet in the send queue); a shutdown now would send the FIN
/// ahead of them and lose them. So the FIN waits until the other side has acknowledged every
/// byte the first side sent.
async fn spliced_pump(client: &mut TcpStream, upstream: &mut TcpStream) -> std::io::Result<()> {
    let (mut cr, mut cw) = client.split();
    let (mut ur, mut uw) = upstream.split();
    tokio::try_join!(
        spliced_one_way(&mut cr, &mut uw, Opened::Actively),
        spliced_one_way(&mut ur, &mut cw, Opened::Passively)
    )?;
    Ok(())
}

/// How the socket we write to was opened: its `tcpi_bytes_acked` counts the SYN only when
/// it connected (actively).
#[derive(Clone, Copy)]
enum Opened {
    Actively,
    Passively,
}

async fn spliced_one_way(
    from: &mut tokio::net::tcp::ReadHalf<'_>,
    to: &mut tokio::net::tcp::WriteHalf<'_>,
    to_opened: Opened,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 16 * 1024];
    let tag = |op: &str, e: std::io::Error| {
        std::io::Error::new(
            e.kind(),
            format!(
                "{op} ({}): {e}",
                match to_opened {
                    Opened::Actively => "client to upstream",
                    Opened::Passively => "upstream to client",
                }
            ),
        )
    };
    loop {
        let n = from.read(&mut buf).await.map_err(|e| tag("read", e))?;
        if n == 0 {
            break;
        }
        to.write_all(&buf[..n]).await.map_err(|e| tag("write", e))?;
    }
    wait_delivered(from.as_ref(), to.as_ref(), to_opened).await;
    to.shutdown().await.map_err(|e| tag("shutdown", e))
}

/// How long a FIN may wait for the kernel to deliver spliced bytes; past it, the FIN goes.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits (bounded) until `to`'s peer has acknowledged every payload byte `from` received.
/// The kernel's counts are in sequence numbers: `from`'s received bytes include the FIN
/// that ended it, and `to`'s acknowledged bytes include the SYN when `to` connected.
async fn wait_delivered(from: &TcpStream, to: &TcpStream, to_opened: Opened) {
    let syn = match to_opened {
        Opened::Actively => 1,
        Opened::Passively => 0,
    };
    let deadline = tokio::time::Instant::now() + DRAIN_LIMIT;
    while tokio::time::Instant::now() < deadline {
        match (
            flatmesh_kernel::tcp_counters(from),
            flatmesh_kernel::tcp_counters(to),
        ) {
            (Ok(f), Ok(t)) if t.acked.saturating_sub(syn) < f.received.saturating_sub(1) => {}
            (f, t) => {
                tracing::debug!(
                    from_received = f.ok().map(|f| f.received),
                    to_acked = t.ok().map(|t| t.acked),
                    syn,
                    "spliced bytes delivered"
                );
                return;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    tracing::debug!("spliced bytes not acknowledged in time; closing anyway");
}

#[cfg(test)]
mod tests {
    //! The relay's idle timeout, on the paused clock, over loopback sockets (the TCP relay)
    //! and in-memory pipes (the two-way copy that upgraded HTTP connections run on).
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::time::Instant;

    use super::*;
    use crate::testing;

    /// A client connection relayed to a backend that takes bytes and never answers, with
    /// `limits.tcp_idle_timeout: 60s`; returns the client's end and the backend's.
    async fn relayed() -> (TcpStream, TcpStream) {
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let view = testing::view(&format!(
            "limits: {{ tcp_idle_timeout: 60s }}\nlisteners:\n  - {{ name: db, address: 127.0.0.1:1, protocol: tcp, cluster: db }}\nclusters:\n  - {{ name: db, endpoints: [ {} ] }}\n",
            backend.local_addr().unwrap()
        ));
        let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(front.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = front.accept().await.unwrap();
        tokio::spawn(relay(testing::context(&view), Stream::Plain(accepted)));
        let (upstream, _) = backend.accept().await.unwrap();
        (client, upstream)
    }

    #[tokio::test(start_paused = true)]
    async fn a_relay_that_moves_no_byte_is_closed_at_the_idle_timeout() {
        let (mut client, mut upstream) = relayed().await;
        client.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        upstream.read_exact(&mut got).await.unwrap();
        let quiet_since = Instant::now();
        // Nothing moves: both sides see the close, a quarter of the timeout late at most
        // (the watchdog looks every 15 s).
        let mut rest = [0u8; 8];
        let closed = tokio::time::timeout(Duration::from_secs(600), client.read(&mut rest));
        assert_eq!(closed.await.expect("closed in time").unwrap(), 0);
        assert_eq!(upstream.read(&mut [0u8; 8]).await.unwrap(), 0);
        let waited = quiet_since.elapsed();
        assert!(
            (Duration::from_secs(60)..=Duration::from_secs(75)).contains(&waited),
            "closed after {waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_relay_that_moves_bytes_either_way_stays_open() {
        let (mut client, mut upstream) = relayed().await;
        let started = Instant::now();
        // A byte every 40 s, one way then the other: never 60 s of quiet.
        for round in 0..4 {
            tokio::time::sleep(Duration::from_secs(40)).await;
            let mut got = [0u8; 1];
            if round % 2 == 0 {
                client.write_all(b"c").await.unwrap();
                upstream.read_exact(&mut got).await.unwrap();
            } else {
                upstream.write_all(b"u").await.unwrap();
                client.read_exact(&mut got).await.unwrap();
            }
        }
        assert!(started.elapsed() >= Duration::from_secs(160));
        // Then quiet: closed.
        let mut rest = [0u8; 8];
        let closed = tokio::time::timeout(Duration::from_secs(600), client.read(&mut rest));
        assert_eq!(closed.await.expect("closed in time").unwrap(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_two_way_copy_of_an_upgraded_connection_ends_when_idle() {
        let (mut client, mut client_side) = tokio::io::duplex(1024);
        let (mut upstream_side, mut upstream) = tokio::io::duplex(1024);
        let relay = Relay {
            buffer: 1024,
            idle: Duration::from_secs(3600),
        };
        let copy = tokio::spawn(async move {
            let started = Instant::now();
            let end = copy_until_idle(&mut client_side, &mut upstream_side, relay).await;
            (end, started.elapsed())
        });
        client.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        upstream.read_exact(&mut got).await.unwrap();
        upstream.write_all(b"pong").await.unwrap();
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        let ended = tokio::time::timeout(Duration::from_secs(3 * 3600), copy);
        let (end, elapsed) = ended.await.expect("ended in time").unwrap();
        assert!(matches!(end, RelayEnd::Idle), "{end:?}");
        assert!(
            (Duration::from_secs(3600)..=Duration::from_secs(4500)).contains(&elapsed),
            "{elapsed:?}"
        );
    }
}
