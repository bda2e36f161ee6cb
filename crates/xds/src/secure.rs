//! The control channel's protection: TLS on the control center's gRPC port, the node's TLS
//! connector, and bootstrap tokens.
//!
//! The control center presents a certificate of its own CA (`spiffe://TD/flatmesh/control`)
//! and nodes verify it against the trust bundle they were given (`flatmesh node --xds-ca`).
//! Nodes prove themselves with a per-node bootstrap token in `authorization: Bearer TOKEN` on
//! every call, the xDS stream and the certificate API alike.
//!
//! Handshakes run in tasks of their own, at most [`MAX_HANDSHAKES`] at once and each for at
//! most [`HANDSHAKE_TIMEOUT`], so a client that connects and says nothing (or speaks
//! plaintext) costs one bounded slot and delays no other node.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::RwLock;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

/// Handshakes in progress at once; more connections wait in the kernel's accept queue.
pub const MAX_HANDSHAKES: usize = 256;
/// A handshake that has not finished by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The server's TLS configuration; replaced whole when its certificate is renewed (new
/// connections get the new one, open ones keep theirs).
#[derive(Clone)]
pub struct ServerTls {
    current: Arc<RwLock<Arc<rustls::ServerConfig>>>,
}

impl ServerTls {
    pub fn new(config: Arc<rustls::ServerConfig>) -> ServerTls {
        ServerTls {
            current: Arc::new(RwLock::new(config)),
        }
    }

    pub fn set(&self, config: Arc<rustls::ServerConfig>) {
        *self.current.write() = config;
    }

    fn get(&self) -> Arc<rustls::ServerConfig> {
        self.current.read().clone()
    }
}

/// Which node a bootstrap token belongs to.
pub trait Tokens: Send + Sync + 'static {
    /// The node that holds `token`, or `None` for a token nobody holds.
    fn node_of(&self, token: &str) -> Option<String>;
    /// Called for each call refused for a missing or unknown token (to count them).
    fn refused(&self) {}
    /// Whether `token` was revoked (its node cut off): refused as "token revoked" (and not
    /// counted by `refused`).
    fn revoked(&self, _token: &str) -> bool {
        false
    }
    /// Resolves once `token` opens no calls any more (revoked, removed): the xDS streams it
    /// opened are then ended. Never, by default.
    fn cut_off(
        &self,
        _token: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>> {
        Box::pin(std::future::pending())
    }
}

/// What a caller whose token was revoked is told.
pub fn token_revoked() -> tonic::Status {
    tonic::Status::unauthenticated(
        "token revoked: this node was cut off by the control center's operator (flatmesh ca token --revoke); give it a new token",
    )
}

/// Requires a known bootstrap token on every call (a tonic interceptor).
pub fn require_token(
    tokens: Arc<dyn Tokens>,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |request: tonic::Request<()>| {
        let token = crate::certificates::bearer_token(request.metadata());
        if token.is_some_and(|t| tokens.node_of(t).is_some()) {
            return Ok(request);
        }
        if token.is_some_and(|t| tokens.revoked(t)) {
            return Err(token_revoked());
        }
        tokens.refused();
        match token {
            Some(_) => Err(tonic::Status::unauthenticated(
                "the bootstrap token is not one this control center knows; give the node its own token (flatmesh node --bootstrap-token FILE)",
            )),
            None => Err(tonic::Status::unauthenticated(
                "no bootstrap token: this control center requires one (flatmesh node --bootstrap-token FILE)",
            )),
        }
    }
}

/// A finished server-side TLS connection, in the shape tonic's server takes.
pub struct TlsConnection(tokio_rustls::server::TlsStream<TcpStream>);

impl tonic::transport::server::Connected for TlsConnection {
    type ConnectInfo = Option<SocketAddr>;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.peer_addr().ok()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// Accepts connections on `listener` and hands on those whose TLS handshake finishes. Failed
/// handshakes are logged with the peer and the reason, and go no further.
pub fn accept_tls(
    listener: TcpListener,
    tls: ServerTls,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<TlsConnection>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::warn!(error = %e, "control channel: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.get());
            if tx.is_closed() {
                return;
            }
            let tx = tx.clone();
            tokio::spawn(async move {
                let _slot = slot;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(connection)) => {
                        let _ = tx.send(Ok(TlsConnection(connection))).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "control channel: TLS handshake failed (a node without the control center's trust bundle, or plaintext to the TLS port)")
                    }
                    Err(_) => {
                        tracing::warn!(%peer, timeout = ?HANDSHAKE_TIMEOUT, "control channel: TLS handshake not finished in time; connection dropped")
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// How a node reaches the control center: plaintext, or TLS with this client configuration
/// (its ALPN must offer `h2`).
#[derive(Clone, Default)]
pub struct ChannelSecurity {
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The node's bootstrap token, sent on every call.
    pub token: Option<String>,
}

impl std::fmt::Debug for ChannelSecurity {
    /// The token stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelSecurity")
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .finish()
    }
}

/// Opens a gRPC channel to `address` (`HOST:PORT`), over TLS when `security` says so.
pub async fn connect(
    address: &str,
    security: &ChannelSecurity,
    timeout: Duration,
) -> Result<tonic::transport::Channel, String> {
    let scheme = if security.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(timeout)
        .tcp_nodelay(true);
    let Some(tls) = &security.tls else {
        return endpoint.connect().await.map_err(|e| error_chain(&e));
    };
    let connector = tokio_rustls::TlsConnector::from(tls.clone());
    let host = address
        .rsplit_once(':')
        .map_or(address, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    // The control center is verified by its SPIFFE ID, not by name; the name only goes into
    // SNI (an IP address sends none).
    let server_name = rustls::pki_types::ServerName::try_from(host)
        .map_err(|e| format!("`{address}` has no valid host part: {e}"))?;
    let address = address.to_string();
    let connect = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let connector = connector.clone();
        let server_name = server_name.clone();
        let address = address.clone();
        async move {
            let tcp = TcpStream::connect(&address).await?;
            let _ = tcp.set_nodelay(true);
            let tls = connector.connect(server_name, tcp).await?;
            Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    endpoint
        .connect_with_connector(connect)
        .await
        .map_err(|e| error_chain(&e))
}

/// An error and its causes on one line (tonic's transport errors hide the useful part in the
/// source chain: "connection refused", "invalid peer certificate: ...").
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Adds the bootstrap token to a request, when the channel has one.
pub fn with_token<T>(
    mut request: tonic::Request<T>,
    security: &ChannelSecurity,
) -> Result<tonic::Request<T>, String> {
    if let Some(token) = &security.token {
        let value = format!("Bearer {token}").parse().map_err(|_| {
            "the bootstrap token has characters a header cannot carry; use letters, digits and -._~+/=".to_string()
        })?;
        request.metadata_mut().insert("authorization", value);
    }
    Ok(request)
}
