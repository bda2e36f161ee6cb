//! The admin endpoint (/metrics, /ready, /config, /rules, /listeners, POST /reload) and the
//! reload triggers (`watch`), on the node's control thread.
//!
//! The endpoint shows the config and can reload the node, so it is closed by default
//! (docs/security.md): on loopback or a Unix socket of mode 0600, a `Host` check against DNS
//! rebinding, an optional bearer token (`access`), secrets hidden from `/config` (`redact`),
//! and limits that keep slow or many clients from holding it (or the node's fds): a header
//! read timeout, a per-connection deadline, and a cap on open connections.

mod access;
mod redact;
mod watch;

use std::net::IpAddr;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use flatmesh_config::{Admin, AdminAddress};
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::control::{ConfigSource, Shared};
use crate::error::ProxyError;
use access::Refusal;

/// Largest request head the admin endpoint reads (hyper's minimum buffer is 8 KiB).
const MAX_HEAD_BYTES: usize = 16 * 1024;

/// The admin endpoint's listening socket, bound before the node starts.
pub(crate) enum AdminListener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener, PathBuf),
}

/// Bind the admin endpoint where `admin.address` says; returns the socket and its actual
/// address (the port may have been 0).
pub(crate) fn bind(admin: &Admin) -> Result<(AdminListener, AdminAddress), ProxyError> {
    match &admin.address {
        AdminAddress::Tcp(address) => {
            let socket = crate::listener::bind_admin(*address)?;
            let actual = socket.local_addr().map_err(|source| ProxyError::Bind {
                what: "the admin endpoint".into(),
                address: *address,
                source,
            })?;
            if !admin.address.is_local() {
                tracing::warn!(%actual, token = admin.token.is_some() || admin.token_file.is_some(),
                    "the admin endpoint can be reached from other hosts (`allow_remote: true`); set a token unless a firewall keeps others out");
            }
            Ok((AdminListener::Tcp(socket), AdminAddress::Tcp(actual)))
        }
        AdminAddress::Unix(path) => {
            let socket =
                bind_unix(path, admin.unix_mode()).map_err(|why| ProxyError::AdminSocket {
                    path: path.clone(),
                    why,
                })?;
            Ok((
                AdminListener::Unix(socket, path.clone()),
                admin.address.clone(),
            ))
        }
    }
}

/// A Unix socket at `path` with permissions `mode`, set before it listens: no one else can
/// connect in between.
fn bind_unix(path: &Path, mode: u32) -> Result<std::os::unix::net::UnixListener, String> {
    use socket2::{Domain, SockAddr, Socket, Type};
    remove_stale_socket(path)?;
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None).map_err(|e| e.to_string())?;
    let address = SockAddr::unix(path).map_err(|e| e.to_string())?;
    socket.bind(&address).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!(
            "{e}; create the directory {} first",
            path.parent().unwrap_or(path).display()
        ),
        _ => format!("{e}; check the directory's permissions"),
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set its mode to 0{mode:o}: {e}"))?;
    socket.listen(128).map_err(|e| e.to_string())?;
    socket.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(socket.into())
}

/// A socket file left by a node that is gone is removed; one that a live process answers
/// on, or a file that is not a socket, is left alone and refused.
fn remove_stale_socket(path: &Path) -> Result<(), String> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err("the path exists and is not a socket; flatmesh does not remove it: choose another path or remove the file".into());
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(
            "another process answers on it; stop it (another flatmesh node?) or choose another path"
                .into(),
        );
    }
    std::fs::remove_file(path)
        .map_err(|e| format!("a stale socket is there and cannot be removed: {e}"))
}

pub(crate) fn run(
    shared: Arc<Shared>,
    socket: AdminListener,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            tracing::error!(error = %err, "cannot build the admin runtime; admin endpoint and reloads are off");
            return;
        }
    };
    let unix_path = match &socket {
        AdminListener::Unix(_, path) => Some(path.clone()),
        AdminListener::Tcp(_) => None,
    };
    // The node's one health checker runs here, on the control runtime, not on the workers.
    let checker = shared.metrics.resilience.take_checker();
    rt.block_on(async move {
        let watch = watch::watch_reloads(shared.clone());
        let health = async move {
            match checker {
                Some(clusters) => crate::resilience::health::run(clusters).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = serve(shared, socket) => {}
            _ = watch => {}
            _ = health => {}
            _ = stop => {}
        }
    });
    if let Some(path) = unix_path {
        let _ = std::fs::remove_file(path);
    }
}

/// What one admin connection is: the address it came in on (for the Host check; none for a
/// Unix socket).
#[derive(Clone, Copy)]
struct ConnInfo {
    local: Option<IpAddr>,
}

async fn serve(shared: Arc<Shared>, socket: AdminListener) {
    let open = Arc::new(AtomicUsize::new(0));
    match socket {
        AdminListener::Tcp(socket) => {
            let listener = match tokio::net::TcpListener::from_std(socket) {
                Ok(l) => l,
                Err(err) => return tracing::error!(error = %err, "cannot use the admin socket"),
            };
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let local = stream.local_addr().ok().map(|a| a.ip());
                        admit(&shared, &open, stream, ConnInfo { local });
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        }
        AdminListener::Unix(socket, _) => {
            let listener = match tokio::net::UnixListener::from_std(socket) {
                Ok(l) => l,
                Err(err) => return tracing::error!(error = %err, "cannot use the admin socket"),
            };
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => admit(&shared, &open, stream, ConnInfo { local: None }),
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        }
    }
}

/// One open connection, counted against `admin.max_connections` until it ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serve `stream` unless `admin.max_connections` are open already: then it gets a 503 (if
/// its socket takes it at once) and is closed, so holding connections open costs the node
/// no more than the cap.
fn admit<S>(shared: &Arc<Shared>, open: &Arc<AtomicUsize>, stream: S, conn: ConnInfo)
where
    S: AsyncRead + AsyncWrite + TryWrite + Unpin + Send + 'static,
{
    let admin = shared.snapshot().config.admin.clone();
    if open.fetch_add(1, Ordering::Relaxed) >= admin.max_connections {
        open.fetch_sub(1, Ordering::Relaxed);
        shared.metrics.admin_refused.busy.add_shared(0, 1);
        let body = "admin endpoint busy: too many open admin connections (admin.max_connections); try again\n";
        let answer = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.try_write_now(answer.as_bytes());
        return;
    }
    let slot = Slot(open.clone());
    let shared = shared.clone();
    tokio::spawn(async move {
        let _slot = slot;
        let svc = {
            let shared = shared.clone();
            service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&shared, req, conn)) }
            })
        };
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(admin.header_read_timeout)
            .max_buf_size(MAX_HEAD_BYTES)
            .serve_connection(TokioIo::new(stream), svc);
        tokio::pin!(connection);
        // The deadline: then no more requests on this connection, and the one in flight
        // gets as long again to finish.
        tokio::select! {
            _ = connection.as_mut() => return,
            _ = tokio::time::sleep(admin.request_timeout) => {}
        }
        connection.as_mut().graceful_shutdown();
        let _ = tokio::time::timeout(admin.request_timeout, connection).await;
    });
}

/// Write what the socket takes right now, never waiting: for the "busy" answer.
trait TryWrite {
    fn try_write_now(&self, bytes: &[u8]);
}

impl TryWrite for tokio::net::TcpStream {
    fn try_write_now(&self, bytes: &[u8]) {
        let _ = self.try_write(bytes);
    }
}

impl TryWrite for tokio::net::UnixStream {
    fn try_write_now(&self, bytes: &[u8]) {
        let _ = self.try_write(bytes);
    }
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}

fn json(value: &serde_json::Value) -> Response<Full<Bytes>> {
    let text =
        serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    respond(StatusCode::OK, "application/json", text + "\n")
}

/// Whether `req` may go on: its Host names this endpoint, and it carries the token when
/// one is needed.
fn check_access(shared: &Shared, req: &Request<Incoming>, conn: ConnInfo) -> Result<(), Refusal> {
    let snapshot = shared.snapshot();
    let admin = &snapshot.config.admin;
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or(""));
    if !access::host_allowed(host, admin, conn.local) {
        return Err(Refusal::Host);
    }
    let token = snapshot.admin_token.as_deref();
    if access::needs_token(req.method(), req.uri().path(), admin, token)
        && !token.is_some_and(|t| access::bearer_matches(req.headers(), t))
    {
        return Err(Refusal::Token);
    }
    Ok(())
}

fn refuse(refusal: Refusal) -> Response<Full<Bytes>> {
    match refusal {
        Refusal::Host => respond(
            StatusCode::FORBIDDEN,
            "text/plain",
            "the Host header does not name this admin endpoint; use a loopback address or localhost, or add the name to admin.hosts\n",
        ),
        Refusal::Token => {
            let mut resp = respond(
                StatusCode::UNAUTHORIZED,
                "text/plain",
                "this admin endpoint needs its token: send `Authorization: Bearer TOKEN` (flatmesh check --admin ADDR --admin-token-file FILE)\n",
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"flatmesh-admin\""),
            );
            resp
        }
    }
}

fn handle(shared: &Shared, req: Request<Incoming>, conn: ConnInfo) -> Response<Full<Bytes>> {
    if let Err(refusal) = check_access(shared, &req, conn) {
        let counter = match refusal {
            Refusal::Host => &shared.metrics.admin_refused.host,
            Refusal::Token => &shared.metrics.admin_refused.token,
        };
        counter.add_shared(0, 1);
        return refuse(refusal);
    }
    let post = matches!(req.uri().path(), "/reload" | "/drain");
    if req.method() != Method::GET && !(post && req.method() == Method::POST) {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "admin endpoints answer GET (and POST /reload, POST /drain)\n",
        );
    }
    match req.uri().path() {
        "/metrics" => respond(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            shared.metrics.encode(shared.route_tiers()),
        ),
        "/ready" => {
            // Anyone may ask whether the node is ready (a probe has no token); the detail
            // lines say how the node is built and loaded, so they need the token when one is set.
            let detailed = shared
                .snapshot()
                .admin_token
                .as_deref()
                .is_none_or(|t| access::bearer_matches(req.headers(), t));
            if shared.ready.load(Ordering::Acquire) && !detailed {
                respond(StatusCode::OK, "text/plain", "ready\n")
            } else if shared.ready.load(Ordering::Acquire) {
                // The detail lines: the fd limit and the budgets in use (`crate::limits`),
                // and where TLS runs.
                let detail = shared
                    .metrics
                    .budget
                    .report(&shared.snapshot().config.limits);
                let ktls = crate::ktls::probe();
                respond(
                    StatusCode::OK,
                    "text/plain",
                    format!("ready\n{detail}{ktls}\n"),
                )
            } else if shared.drain.started() {
                respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "draining\n")
            } else {
                respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "not ready\n")
            }
        }
        "/config" => {
            let snapshot = shared.snapshot();
            let status = shared.status();
            let source = match &shared.source {
                ConfigSource::File(p) => p.display().to_string(),
                ConfigSource::Inline => "inline".into(),
            };
            let mut config = serde_json::to_value(&*snapshot.config)
                .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }));
            redact::redact(&mut config);
            json(&serde_json::json!({
                "generation": snapshot.generation,
                "source": source,
                "last_reload_error": status.last_reload_error,
                "last_reload_ok_unix": status.last_reload_ok_unix,
                "config": config,
            }))
        }
        // Where each rule runs on this node; `?format=text` is `flatmesh check --explain`'s view.
        "/rules" => {
            let (program, tiers) = (&shared.snapshot().program, shared.tiers());
            match req.uri().query() {
                Some("format=text") => respond(
                    StatusCode::OK,
                    "text/plain; charset=utf-8",
                    program.explain_on(&tiers),
                ),
                _ => json(&program.to_json_on(&tiers)),
            }
        }
        // Cumulative per-route request counters as JSON: what `flatmesh top` samples.
        "/stats/routes" => json(&shared.metrics.route_stats(&shared.route_tiers())),
        "/listeners" => {
            let map: serde_json::Map<String, serde_json::Value> = shared
                .listener_addresses()
                .into_iter()
                .map(|(name, addr)| (name, serde_json::Value::String(addr.to_string())))
                .collect();
            json(&serde_json::Value::Object(map))
        }
        "/reload" if req.method() == Method::POST => match shared.reload_from_source() {
            Ok(()) => respond(StatusCode::OK, "text/plain", "reloaded\n"),
            Err(e) => respond(
                StatusCode::BAD_REQUEST,
                "text/plain",
                format!("reload refused: {e}\n"),
            ),
        },
        "/drain" if req.method() == Method::POST => {
            shared.begin_drain();
            let timeout = shared.snapshot().config.drain_timeout;
            respond(
                StatusCode::ACCEPTED,
                "text/plain",
                format!(
                    "draining: {} connections open; the node stops once they close, or after drain_timeout ({})\n",
                    shared.metrics.budget.open_connections(),
                    flatmesh_config::duration::format(&timeout)
                ),
            )
        }
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!(
                "unknown admin path; try {} (and POST /reload, POST /drain)\n",
                flatmesh_config::admin::READ_PATHS.join(", ")
            ),
        ),
    }
}
