//! The admin endpoint (/metrics, /ready, /config, /rules, /listeners) and the reload
//! triggers (SIGHUP and config file changes), on the node's control thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use crate::control::{ConfigSource, Shared};

pub(crate) fn run(
    shared: Arc<Shared>,
    socket: std::net::TcpListener,
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
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::from_std(socket) {
            Ok(l) => l,
            Err(err) => {
                tracing::error!(error = %err, "cannot use the admin socket");
                return;
            }
        };
        let serve = serve_admin(shared.clone(), listener);
        let watch = watch_reloads(shared);
        tokio::select! {
            _ = serve => {}
            _ = watch => {}
            _ = stop => {}
        }
    });
}

async fn serve_admin(shared: Arc<Shared>, listener: tokio::net::TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&shared, req)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
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

fn handle(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET
        && !(req.method() == Method::POST && req.uri().path() == "/reload")
    {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "admin endpoints answer GET (and POST /reload)\n",
        );
    }
    match req.uri().path() {
        "/metrics" => respond(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            shared.metrics.encode(),
        ),
        "/ready" => {
            if shared.ready.load(Ordering::Acquire) {
                respond(StatusCode::OK, "text/plain", "ready\n")
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
            json(&serde_json::json!({
                "generation": snapshot.generation,
                "source": source,
                "last_reload_error": status.last_reload_error,
                "last_reload_ok_unix": status.last_reload_ok_unix,
                "config": &*snapshot.config,
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
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain",
            "unknown admin path; try /metrics, /ready, /config, /rules, /listeners\n",
        ),
    }
}

/// SIGHUP, or a change to the config file, re-reads the config.
async fn watch_reloads(shared: Arc<Shared>) {
    let ConfigSource::File(path) = shared.source.clone() else {
        return std::future::pending().await;
    };
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(err) => {
            tracing::warn!(error = %err, "cannot watch SIGHUP; reload by changing the file instead");
            None
        }
    };
    let fingerprint = |p: &std::path::Path| std::fs::read(p).ok();
    let mut last = fingerprint(&path);
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        let by_signal = tokio::select! {
            _ = async { match hup.as_mut() { Some(h) => { h.recv().await; } None => std::future::pending().await } } => true,
            _ = tick.tick() => false,
        };
        let now = fingerprint(&path);
        if by_signal || (now.is_some() && now != last) {
            last = now;
            let shared = shared.clone();
            // Compiling a large config must not stall the admin endpoint.
            let _ = tokio::task::spawn_blocking(move || shared.reload_from_source()).await;
        }
    }
}
