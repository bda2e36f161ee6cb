//! TLS on listeners and clusters: the rustls configurations a snapshot loads (the identity
//! crate's SPIFFE verifiers), the handshakes with their time bound and failure reason, and
//! [`Stream`], one connection type for plaintext and TLS alike.
//!
//! Certificates and keys are read when a config is loaded or reloaded: a file that is missing
//! or does not parse fails the load with its path, and the node keeps the config it runs.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use flatmesh_config::{ClusterTls, ListenerProtocol, ListenerTls};
use flatmesh_identity::tls::{client_config, failure_reason, server_config, ClientAuth};
use flatmesh_identity::{IdPattern, Svid, TrustBundle};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::error::ProxyError;
use crate::metrics::ClusterStats;
use crate::read_ahead::ReadAhead;

/// A listener's TLS: what it presents and whom it admits.
pub struct ListenerTlsPlan {
    acceptor: tokio_rustls::TlsAcceptor,
    /// The identity the listener presents, and until when.
    pub presents: Presented,
}

/// A certificate a listener or a cluster presents: its SPIFFE ID and its expiry, for the
/// `flatmesh_tls_certificate_expiry_timestamp_seconds` gauge.
#[derive(Clone, Debug)]
pub struct Presented {
    pub id: String,
    pub not_after: std::time::SystemTime,
}

impl Presented {
    fn of(svid: &Svid) -> Presented {
        Presented {
            id: svid.id.to_string(),
            not_after: svid.not_after,
        }
    }
}

/// A cluster's TLS: whom its endpoints must be, and what the node presents to them.
pub struct ClusterTlsPlan {
    cluster: String,
    /// For HTTP (and HBONE tunnels): offers the ALPN the cluster's protocol speaks.
    connector: tokio_rustls::TlsConnector,
    /// For a tcp listener's relay: the same, without ALPN, since the bytes it carries are
    /// the client's and the node cannot promise any protocol for them.
    relay_connector: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
    /// The handshake's bound: the cluster's connect timeout.
    timeout: Duration,
    /// The client certificate the cluster presents, if it has one.
    pub presents: Option<Presented>,
}

/// ALPN a TLS http listener offers: both codecs (the first bytes pick one either way).
const HTTP_ALPN: [&[u8]; 2] = [
    flatmesh_identity::tls::ALPN_H2,
    flatmesh_identity::tls::ALPN_HTTP11,
];

fn patterns(at: &str, written: &[String]) -> Result<Vec<IdPattern>, ProxyError> {
    written
        .iter()
        .map(|p| IdPattern::parse(p).map_err(|e| ProxyError::Config(format!("{at}: {e}"))))
        .collect()
}

/// The roots of `ca`, with the revocation lists of `crl` when given (read at every load, so
/// a changed CRL applies to the connections after the next reload).
fn trust_bundle(
    ca: &std::path::Path,
    crl: Option<&std::path::Path>,
) -> Result<TrustBundle, flatmesh_identity::IdentityError> {
    let bundle = TrustBundle::load(ca)?;
    match crl {
        Some(crl) => bundle.with_crl_file(crl),
        None => Ok(bundle),
    }
}

fn identity_error(at: &str) -> impl Fn(flatmesh_identity::IdentityError) -> ProxyError + '_ {
    move |e| ProxyError::Config(format!("{at}: {e}"))
}

impl ListenerTlsPlan {
    /// Loads `tls` for listener `name`; `http` listeners offer ALPN `h2` and `http/1.1`,
    /// `hbone` listeners `h2` only.
    pub fn load(
        name: &str,
        tls: &ListenerTls,
        protocol: ListenerProtocol,
    ) -> Result<ListenerTlsPlan, ProxyError> {
        let at = format!("listener `{name}` tls");
        let svid = Svid::load(&tls.cert, &tls.key).map_err(identity_error(&at))?;
        let client_auth = match &tls.client_ca {
            Some(ca) => Some(ClientAuth {
                bundle: trust_bundle(ca, tls.crl.as_deref()).map_err(identity_error(&at))?,
                allow: patterns(&format!("{at}.allow"), &tls.allow)?,
            }),
            None => None,
        };
        let alpn: &[&[u8]] = match protocol {
            ListenerProtocol::Http => &HTTP_ALPN,
            ListenerProtocol::Hbone => &[flatmesh_identity::tls::ALPN_H2],
            ListenerProtocol::Tcp | ListenerProtocol::Qnp => &[],
        };
        let config = server_config(&svid, client_auth, alpn).map_err(identity_error(&at))?;
        Ok(ListenerTlsPlan {
            acceptor: tokio_rustls::TlsAcceptor::from(config),
            presents: Presented::of(&svid),
        })
    }

    /// The server side of the handshake on `stream`, within `timeout`. Err: a short reason
    /// for the log and the `reason` label of the failure counter.
    pub async fn accept<S>(
        &self,
        stream: S,
        timeout: Duration,
    ) -> Result<tokio_rustls::server::TlsStream<ReadAhead<S>>, HandshakeError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        handshake(self.acceptor.accept(ReadAhead::new(stream)), timeout).await
    }
}

impl ClusterTlsPlan {
    /// Loads the TLS settings of `cluster`; `timeout` bounds each handshake.
    pub fn load(
        cluster: &flatmesh_config::Cluster,
        tls: &ClusterTls,
        timeout: Duration,
    ) -> Result<ClusterTlsPlan, ProxyError> {
        let name = cluster.name.as_str();
        let alpn = match (cluster.tunnel, cluster.protocol) {
            // A tunnel is HTTP/2 whatever the tunnelled bytes are.
            (Some(_), _) | (None, flatmesh_config::UpstreamProtocol::Http2) => {
                flatmesh_identity::tls::ALPN_H2
            }
            (None, flatmesh_config::UpstreamProtocol::Http1) => flatmesh_identity::tls::ALPN_HTTP11,
        };
        let at = format!("cluster `{name}` tls");
        let bundle = trust_bundle(&tls.ca, tls.crl.as_deref()).map_err(identity_error(&at))?;
        let svid = match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => Some(Svid::load(cert, key).map_err(identity_error(&at))?),
            _ => None,
        };
        let server_ids = patterns(&format!("{at}.server_ids"), &tls.server_ids)?;
        let config = client_config(svid.as_ref(), &bundle, server_ids, &[alpn])
            .map_err(identity_error(&at))?;
        // SPIFFE peers are checked by ID, so the name only matters to a server that selects a
        // certificate by SNI; without `sni` none is sent.
        let (server_name, send_sni) = match &tls.sni {
            Some(sni) => (
                ServerName::try_from(sni.clone()).map_err(|_| {
                    ProxyError::Config(format!(
                        "{at}.sni: `{sni}` is not a DNS name or an IP address"
                    ))
                })?,
                true,
            ),
            None => (
                ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
                false,
            ),
        };
        let mut config = Arc::unwrap_or_clone(config);
        config.enable_sni = send_sni;
        let mut relay_config = config.clone();
        relay_config.alpn_protocols.clear();
        Ok(ClusterTlsPlan {
            cluster: name.to_owned(),
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            relay_connector: tokio_rustls::TlsConnector::from(Arc::new(relay_config)),
            server_name,
            timeout,
            presents: svid.as_ref().map(Presented::of),
        })
    }

    /// The cluster's TLS presenting workload `w`'s certificate instead of the cluster's own
    /// (a tunnel cluster carrying `w`'s connections). The certificate must name the
    /// workload's declared identity.
    pub fn load_as(
        cluster: &flatmesh_config::Cluster,
        tls: &ClusterTls,
        w: &flatmesh_config::Workload,
        timeout: Duration,
    ) -> Result<ClusterTlsPlan, ProxyError> {
        let at = format!("workload `{}`", w.name);
        let (Some(cert), Some(key)) = (&w.cert, &w.key) else {
            return Err(ProxyError::Config(format!(
                "{at}: no `cert` and `key` to present its identity with"
            )));
        };
        let declared = flatmesh_identity::SpiffeId::parse(&w.identity)
            .map_err(identity_error(&format!("{at}.identity")))?;
        let as_workload = ClusterTls {
            cert: Some(cert.clone()),
            key: Some(key.clone()),
            ..tls.clone()
        };
        let plan = ClusterTlsPlan::load(cluster, &as_workload, timeout)
            .map_err(|e| ProxyError::Config(format!("{at}: {e}")))?;
        match &plan.presents {
            Some(p) if p.id == declared.as_str() => Ok(plan),
            presented => Err(ProxyError::Config(format!(
                "{at}: its certificate {} names `{}`, not its identity `{declared}`; issue one for it (`flatmesh ca issue --id {declared}`)",
                cert.display(),
                presented.as_ref().map_or("nothing", |p| p.id.as_str()),
            ))),
        }
    }

    /// The client side of the handshake over a freshly connected `stream` for HTTP (with
    /// the cluster's ALPN), counted in `stats` and logged when it fails.
    pub async fn originate(
        &self,
        stream: TcpStream,
        stats: &ClusterStats,
        worker: usize,
    ) -> Result<Stream, HandshakeError> {
        self.handshake_with(&self.connector, stream, stats, worker)
            .await
    }

    /// The same for a tcp listener's relay: no ALPN is offered.
    pub async fn originate_relay(
        &self,
        stream: TcpStream,
        stats: &ClusterStats,
        worker: usize,
    ) -> Result<Stream, HandshakeError> {
        self.handshake_with(&self.relay_connector, stream, stats, worker)
            .await
    }

    async fn handshake_with(
        &self,
        connector: &tokio_rustls::TlsConnector,
        stream: TcpStream,
        stats: &ClusterStats,
        worker: usize,
    ) -> Result<Stream, HandshakeError> {
        let endpoint = stream.peer_addr().ok();
        let pending = connector.connect(self.server_name.clone(), ReadAhead::new(stream));
        match handshake(pending, self.timeout).await {
            Ok(tls) => {
                stats.tls.handshakes.add_shared(worker, 1);
                Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(tls))))
            }
            Err(err) => {
                stats.tls.failed(err.reason);
                tracing::warn!(cluster = %self.cluster, endpoint = ?endpoint, reason = err.reason, error = %err.detail,
                    "upstream TLS handshake failed; check the cluster's `tls.ca` and `tls.server_ids` against the endpoint's certificate");
                Err(err)
            }
        }
    }
}

/// Loads every TLS setting of `config` as the node would (the files read, the certificates,
/// keys and patterns checked) without serving anything: `flatmesh check` runs it, so a bad
/// file is found before a node fails to start on it. Returns how many were loaded.
pub fn check_files(config: &flatmesh_config::Config) -> Result<usize, ProxyError> {
    let mut loaded = 0;
    for l in &config.listeners {
        if let Some(tls) = &l.tls {
            ListenerTlsPlan::load(&l.name, tls, l.protocol)?;
            loaded += 1;
        }
    }
    for c in &config.clusters {
        if let Some(tls) = &c.tls {
            ClusterTlsPlan::load(c, tls, Duration::from_secs(1))?;
            loaded += 1;
        }
    }
    // Each workload's certificate, as a tunnel presents it.
    let tunnel = config
        .clusters
        .iter()
        .find_map(|c| Some((c, c.tls.as_ref().filter(|_| c.tunnel.is_some())?)));
    if let Some((c, tls)) = tunnel {
        for w in config.workloads.iter().filter(|w| w.is_client()) {
            ClusterTlsPlan::load_as(c, tls, w, Duration::from_secs(1))?;
            loaded += 1;
        }
    }
    Ok(loaded)
}

/// Why a handshake failed.
#[derive(Debug)]
pub struct HandshakeError {
    /// Bounded: a metric label.
    pub reason: &'static str,
    pub detail: String,
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.detail, self.reason)
    }
}

async fn handshake<T>(
    pending: impl std::future::Future<Output = io::Result<T>>,
    timeout: Duration,
) -> Result<T, HandshakeError> {
    match tokio::time::timeout(timeout, pending).await {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(err)) => Err(classify(&err)),
        Err(_) => Err(HandshakeError {
            reason: "timeout",
            detail: format!(
                "the handshake did not finish within {}",
                flatmesh_config::duration::format(&timeout)
            ),
        }),
    }
}

/// tokio-rustls reports a TLS failure as an io::Error around the rustls error.
fn classify(err: &io::Error) -> HandshakeError {
    if let Some(tls) = err
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        return HandshakeError {
            reason: failure_reason(tls),
            detail: tls.to_string(),
        };
    }
    let reason = match err.kind() {
        io::ErrorKind::UnexpectedEof => "closed",
        _ => "io",
    };
    HandshakeError {
        reason,
        detail: err.to_string(),
    }
}

/// What one read through the record layer may add to a buffer.
const READ_ROOM: usize = 16 * 1024;

/// A connection in the clear or inside TLS (either side of the handshake).
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<ReadAhead<TcpStream>>>),
}

impl Stream {
    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0.get_ref(),
        }
    }

    /// Reads what has arrived into `buf`. In the clear it reads the socket straight into the
    /// buffer; inside TLS it goes through the record layer.
    pub fn poll_read_buf(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        match self {
            Stream::Plain(s) => loop {
                std::task::ready!(s.poll_read_ready(cx))?;
                match s.try_read_buf(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    result => return Poll::Ready(result),
                }
            },
            Stream::Tls(s) => {
                // Zeroed room for the record layer to fill (safe code cannot hand it the
                // uninitialised spare capacity); cut back to what was read.
                let start = buf.len();
                buf.resize(start + READ_ROOM, 0);
                let mut read = ReadBuf::new(&mut buf[start..]);
                let polled = Pin::new(s.as_mut()).poll_read(cx, &mut read);
                let n = read.filled().len();
                buf.truncate(start + n);
                polled.map_ok(|()| n)
            }
        }
    }

    /// True if an idle connection is known to be unusable: closed, reset, or holding bytes
    /// nobody asked for. Never blocks, and costs no system call unless the reactor has seen
    /// the socket become readable.
    pub fn is_stale(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match self {
            Stream::Plain(s) => match s.poll_read_ready(&mut cx) {
                Poll::Pending => false,
                Poll::Ready(Err(_)) => true,
                Poll::Ready(Ok(())) => {
                    let mut probe = [0u8; 1];
                    !matches!(s.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
                }
            },
            // Through the record layer: a session ticket the server sent after the handshake
            // is consumed there and is no sign of a dead connection; close_notify, EOF or
            // application data is.
            Stream::Tls(s) => {
                let mut probe = [0u8; 1];
                let mut read = ReadBuf::new(&mut probe);
                !matches!(
                    Pin::new(s.as_mut()).poll_read(&mut cx, &mut read),
                    Poll::Pending
                )
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => poll_read_records(s.as_mut(), cx, buf),
        }
    }
}

/// Reads as many decrypted records as are at hand, up to `buf`'s room. The record layer hands
/// out one record (at most 16 KiB) per read, so a relay with a 64 KiB buffer would otherwise
/// write each record to the other side with a system call of its own.
fn poll_read_records<S: AsyncRead + Unpin>(
    tls: &mut S,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    let start = buf.filled().len();
    loop {
        let before = buf.filled().len();
        match Pin::new(&mut *tls).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before && buf.remaining() > 0 => {}
            // Whatever came before a wait, an end or an error goes out first; the end or the
            // error shows again on the next read.
            Poll::Pending | Poll::Ready(Err(_)) if buf.filled().len() > start => {
                return Poll::Ready(Ok(()))
            }
            other => return other,
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
