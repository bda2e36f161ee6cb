//! What an accepted connection becomes: a `tcp` listener's goes to the L4 relay; an `http`
//! listener's is offered to tier K first when it decides this listener's first requests,
//! then its first bytes tell HTTP/2 (the server on `h2`, `crate::h2`) from HTTP/1 (flatmesh's
//! own, `crate::h1`).

use std::sync::Arc;

use flatmesh_config::ListenerProtocol;
use tokio::net::TcpStream;

use crate::context::{ConnContext, WorkerView};
use crate::kernel::{FirstRequest, KernelBinding, StripSettingsAck};
use crate::snapshot::Snapshot;
use crate::sniff::{sniff, Protocol};
use crate::tap::Rewind;
use crate::tls::{ListenerTlsPlan, Stream};

/// Serves one accepted connection to its end, counting it for its listener.
pub(crate) async fn serve(ctx: Arc<ConnContext>, stream: TcpStream) {
    let current = ctx.view.load_full();
    let plan = current
        .snapshot
        .listener_at(ctx.listener_address, ctx.protocol)
        .map(|l| &current.snapshot.listeners[l]);
    // A tcp listener's connection_rate_limit, in user space: the connection is accepted,
    // then reset at once. Where tier K enforces it, the kernel dropped the SYNs over the
    // limit before this connection existed, and it is not counted twice.
    if let Some(limiter) = plan
        .filter(|_| ctx.protocol == ListenerProtocol::Tcp)
        .and_then(|l| l.rate_limit.as_ref())
        .filter(|_| {
            !ctx.kernel
                .as_ref()
                .is_some_and(|k| k.limits_connections(ctx.listener_address))
        })
    {
        if limiter
            .admit(
                tokio::time::Instant::now(),
                crate::resilience::rate_limit::Key::None,
            )
            .is_err()
        {
            crate::relay::reset_on_close(&stream);
            return;
        }
    }
    let stats = plan.map(|l| l.stats.clone());
    let worker = ctx.worker;
    if let Some(s) = &stats {
        s.connections_opened.add_shared(worker, 1);
    }
    // Each protocol's future is boxed: this one lives as long as the connection, and unboxed
    // it would be as large as the largest of them whichever the connection speaks.
    match (ctx.protocol, plan.and_then(|l| l.tls.clone())) {
        (protocol, Some(tls)) => {
            Box::pin(serve_tls(
                ctx.clone(),
                &tls,
                stream,
                protocol,
                &current.snapshot,
            ))
            .await
        }
        (ListenerProtocol::Tcp, None) => {
            Box::pin(crate::tcp::relay(ctx, Stream::Plain(stream))).await
        }
        // Validation requires an hbone listener's `tls`: never tunnel in the clear.
        (ListenerProtocol::Hbone, None) => {}
        // A qnp listener's sockets are UDP (`crate::qnp`): no connection ever comes here.
        (ListenerProtocol::Qnp, None) => {}
        (ListenerProtocol::Http, None) => match &ctx.kernel {
            Some(k) if plan.is_some_and(|l| l.kernel_l7) => {
                let k = k.clone();
                Box::pin(serve_http_with_kernel(ctx, &k, stream, &current)).await
            }
            _ => {
                let _ = stream.set_nodelay(true);
                Box::pin(serve_http(ctx, stream, &current.snapshot)).await
            }
        },
    }
    if let Some(s) = &stats {
        s.connections_closed.add_shared(worker, 1);
    }
}

/// The L7 listener with tier K: the kernel decides the first request; a decided connection is
/// spliced to an endpoint of its cluster, anything else runs the user L7 path over the bytes
/// read so far.
async fn serve_http_with_kernel(
    ctx: Arc<ConnContext>,
    kernel: &KernelBinding,
    stream: TcpStream,
    view: &WorkerView,
) {
    let snapshot = &view.snapshot;
    let _ = stream.set_nodelay(true);
    let buffered = match kernel
        .first_request(&stream, snapshot.config.limits.header_read_timeout)
        .await
    {
        FirstRequest::Closed => return,
        FirstRequest::UserTier {
            buffered,
            strip_settings_ack: true,
        } => {
            // The proxy sent the client an HTTP/2 SETTINGS frame while the kernel decided;
            // the user tier must not see the client's ACK of it.
            let stream = StripSettingsAck::new(Rewind::new(buffered, stream));
            return serve_http(ctx, stream, snapshot).await;
        }
        FirstRequest::UserTier { buffered, .. } => buffered,
        FirstRequest::Decided {
            cluster,
            cookie,
            buffered,
            consumed,
        } => {
            let listener = snapshot
                .listener_at(ctx.listener_address, ctx.protocol)
                .map(|l| &snapshot.listeners[l]);
            let name = listener.map(|l| l.name.as_str()).unwrap_or("");
            let connected = match snapshot.clusters.get(cluster) {
                Some(_) => crate::tcp::connect_upstream(&ctx, view, name, cluster).await,
                None => None,
            };
            match connected {
                // The lowering gives the kernel no route to a cluster that originates TLS,
                // so a decided connection's upstream is in the clear.
                Some((Stream::Plain(mut up), _in_flight)) => {
                    match kernel
                        .take_decided(cookie, &stream, &mut up, &buffered, consumed)
                        .await
                    {
                        Ok(path) => {
                            let relay = crate::tcp::Relay::of(&listener_limits(&ctx, snapshot));
                            let (_, _, in_kernel) =
                                crate::tcp::pump_path(Some(kernel), stream, up, path, relay).await;
                            if let (Some(l), true) = (listener, in_kernel) {
                                l.stats.kernel_spliced.add_shared(ctx.worker, 1);
                            }
                        }
                        Err(err) => {
                            tracing::debug!(error = %err, "upstream closed before the first request was written");
                        }
                    }
                    kernel.forget(&[cookie]);
                    return;
                }
                // No endpoint answered: the user tier gives the client its 503.
                Some((Stream::Tls(_), _)) | None => {
                    kernel.forget(&[cookie]);
                    buffered
                }
            }
        }
    };
    serve_http(ctx, Rewind::new(buffered, stream), snapshot).await
}

/// A TLS listener's connection: the handshake (bounded by the header read timeout, counted,
/// and logged with its reason when it fails), then the relay or the HTTP codecs on the
/// decrypted stream. Tier K never sees such a connection: its bytes are ciphertext.
async fn serve_tls(
    ctx: Arc<ConnContext>,
    tls: &ListenerTlsPlan,
    stream: TcpStream,
    protocol: ListenerProtocol,
    snapshot: &Arc<Snapshot>,
) {
    let limits = listener_limits(&ctx, snapshot);
    let Some(listener) = snapshot
        .listener_at(ctx.listener_address, ctx.protocol)
        .map(|l| &snapshot.listeners[l])
    else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let stream = match tls.accept(stream, limits.header_read_timeout).await {
        Ok(stream) => {
            listener.stats.tls.handshakes.add_shared(ctx.worker, 1);
            stream
        }
        Err(err) => {
            listener.stats.tls.failed(err.reason);
            tracing::info!(listener = %listener.name, peer = %ctx.peer, reason = err.reason, error = %err.detail,
                "TLS handshake with a client failed; the connection is closed");
            return;
        }
    };
    // The client's SPIFFE ID, verified in the handshake, is who the policies see.
    let ctx = match flatmesh_identity::tls::peer_identity(stream.get_ref().1) {
        Some(id) => Arc::new(ConnContext {
            principal: Some(Arc::from(id.as_str())),
            ..(*ctx).clone()
        }),
        None => ctx,
    };
    match protocol {
        ListenerProtocol::Tcp => {
            let stream = Stream::Tls(Box::new(tokio_rustls::TlsStream::Server(stream)));
            crate::tcp::relay(ctx, stream).await
        }
        // ALPN `h2` is the client's word that it speaks HTTP/2: no sniff, and an opening
        // that is not the preface is a connection error (RFC 9113 §3.4), not HTTP/1.1.
        ListenerProtocol::Http
            if stream.get_ref().1.alpn_protocol() == Some(flatmesh_identity::tls::ALPN_H2) =>
        {
            crate::h2::serve(ctx, stream, &limits).await
        }
        ListenerProtocol::Http => serve_http(ctx, stream, snapshot).await,
        ListenerProtocol::Hbone => {
            if let Some(lid) = snapshot.listener_at(ctx.listener_address, ctx.protocol) {
                crate::hbone::server::serve(ctx, stream, snapshot.clone(), lid).await
            }
        }
        // Validation refuses `tls` on a qnp listener, whose sockets are UDP anyway.
        ListenerProtocol::Qnp => {}
    }
}

/// An http listener's connection: the first bytes tell the protocol. The HTTP/2 preface goes
/// to the HTTP/2 server (`crate::h2`), anything else to flatmesh's own HTTP/1 path.
pub(crate) async fn serve_http<S>(ctx: Arc<ConnContext>, mut stream: S, snapshot: &Snapshot)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let limits = &listener_limits(&ctx, snapshot);
    // Small: a connection that has sent nothing yet, or one request head, needs no more.
    let mut first = bytes::BytesMut::with_capacity(crate::h1::IDLE_BUFFER);
    let mut deadline = tokio::time::Instant::now() + limits.idle_timeout;
    let protocol = loop {
        if let Some(protocol) = sniff(&first) {
            break protocol;
        }
        let read = tokio::io::AsyncReadExt::read_buf(&mut stream, &mut first);
        match tokio::time::timeout_at(deadline, read).await {
            Ok(Ok(n)) if n > 0 => {}
            // Closed, failed, or silent: nothing to answer.
            _ => return,
        }
        deadline = deadline.min(tokio::time::Instant::now() + limits.header_read_timeout);
    };
    match protocol {
        // Boxed: an HTTP/2 connection is large, and an HTTP/1 connection need not carry
        // room for it.
        Protocol::Http2 => {
            Box::pin(crate::h2::serve(
                ctx,
                Rewind::new(first.to_vec(), stream),
                limits,
            ))
            .await
        }
        Protocol::Http1 => crate::h1::serve(ctx, stream, first).await,
    }
}

/// The limits of the connection's listener: the node's, with the listener's own over them.
fn listener_limits(ctx: &ConnContext, snapshot: &Snapshot) -> flatmesh_config::Limits {
    let config = &snapshot.config;
    match snapshot.listener_at(ctx.listener_address, ctx.protocol) {
        Some(lid) => config.limits.for_listener(&config.listeners[lid]),
        None => config.limits.clone(),
    }
}

#[cfg(test)]
mod tests {
    //! The protocol sniff and the waits before a request is known, on the paused clock.
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use http_body_util::BodyExt as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::time::Instant;

    use crate::testing::{self, read_reply};

    const CONFIG: &str = r#"
limits:
  header_read_timeout: 2s
  idle_timeout: 5s
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: { path: { prefix: / } }
        direct_response: { status: 200, body: "direct" }
"#;

    fn client() -> tokio::io::DuplexStream {
        testing::http_client(testing::context(&testing::view(CONFIG)))
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_sends_nothing_is_closed_at_the_idle_timeout() {
        let mut c = client();
        let started = Instant::now();
        assert_eq!(c.read(&mut [0u8; 16]).await.unwrap(), 0);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_stalled_half_way_gets_408_at_the_header_read_timeout() {
        let mut c = client();
        let started = Instant::now();
        c.write_all(b"GET /x HTTP/1.1\r\nHost: t.local\r\nX-Slow: ")
            .await
            .unwrap();
        let reply = read_reply(&mut c, &mut Vec::new()).await.unwrap();
        assert_eq!(reply.status, 408);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        // The first byte of a preface that then stalls is cut off at the same bound.
        let mut c = client();
        let started = Instant::now();
        c.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        assert_eq!(c.read(&mut [0u8; 16]).await.unwrap(), 0);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    /// Each connection's future lives as long as the connection: an idle keep-alive one must
    /// not carry room for a request's forwarding, retries or HTTP/2 (they are boxed while
    /// they run). It was 20 KB per connection before, more than Envoy's whole connection.
    #[tokio::test]
    async fn an_idle_http1_connection_holds_a_small_future() {
        let ctx = testing::context(&testing::view(CONFIG));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        let (client, (accepted, _)) = (client.unwrap(), accepted.unwrap());
        let view = ctx.view.load_full();
        let connection = std::mem::size_of_val(&super::serve(ctx.clone(), accepted));
        let http = std::mem::size_of_val(&super::serve_http(ctx, client, &view.snapshot));
        assert!(
            connection <= 512 && http <= 2048,
            "a connection's future is {connection} bytes and its HTTP part {http}: box what grew"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_http2_preface_goes_to_the_http2_server_however_it_is_split() {
        // Whole, through hyper's client (the test's HTTP/2 client).
        let mut h2 = testing::h2_client(testing::context(&testing::view(CONFIG))).await;
        let req = http::Request::get("http://t.local/a")
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let resp = h2.send_request(req).await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"direct");
        // A byte at a time, with pauses (within the header read timeout, 2s, in all): the
        // server's SETTINGS frame answers.
        let mut c = client();
        for b in crate::sniff::H2_PREFACE {
            c.write_all(&[*b]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut frame = [0u8; 9];
        c.read_exact(&mut frame).await.unwrap();
        assert_eq!(frame[3], 4, "a SETTINGS frame");
        // HTTP/1 that begins like the preface is HTTP/1.
        let mut c = client();
        c.write_all(b"PUT / HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        let reply = read_reply(&mut c, &mut Vec::new()).await.unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (200, "direct"));
    }
}
