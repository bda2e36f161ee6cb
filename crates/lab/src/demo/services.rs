//! Built-in demo services: three small HTTP backends that name themselves in an
//! `x-backend` response header, and a TCP echo service. All bind 127.0.0.1:0 so
//! nothing collides with whatever else runs on the machine.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::LabError;

/// The response header in which every demo backend names itself.
pub const BACKEND_HEADER: &str = "x-backend";

/// Which HTTP versions a demo backend speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpVersions {
    /// HTTP/1.1 only.
    Http1,
    /// HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on one port.
    Http1AndH2c,
}

/// The running demo services. Dropping this stops them.
#[derive(Debug)]
pub struct DemoServices {
    /// `api-1`, HTTP/1.1.
    pub api_1: SocketAddr,
    /// `api-2`, HTTP/1.1.
    pub api_2: SocketAddr,
    /// `canary`, HTTP/1.1 and h2c.
    pub canary: SocketAddr,
    /// TCP echo.
    pub echo: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl DemoServices {
    /// Bind and start all demo services on the current tokio runtime.
    pub async fn start() -> Result<DemoServices, LabError> {
        let (api_1, t1) = spawn_http("api-1", HttpVersions::Http1).await?;
        let (api_2, t2) = spawn_http("api-2", HttpVersions::Http1).await?;
        let (canary, t3) = spawn_http("canary", HttpVersions::Http1AndH2c).await?;
        let (echo, t4) = spawn_echo().await?;
        Ok(DemoServices {
            api_1,
            api_2,
            canary,
            echo,
            tasks: vec![t1, t2, t3, t4],
        })
    }
}

impl Drop for DemoServices {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn bind(service: &'static str) -> Result<TcpListener, LabError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .map_err(|source| LabError::Bind { service, source })
}

fn local_addr(service: &'static str, listener: &TcpListener) -> Result<SocketAddr, LabError> {
    listener
        .local_addr()
        .map_err(|source| LabError::Bind { service, source })
}

/// Start one HTTP backend named `name` on 127.0.0.1:0. It answers every request
/// with 200, `x-backend: <name>` and the body `hello from <name>\n`.
pub async fn spawn_http(
    name: &'static str,
    versions: HttpVersions,
) -> Result<(SocketAddr, JoinHandle<()>), LabError> {
    spawn_http_at(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), name, versions).await
}

/// As [`spawn_http`], on a given address.
pub async fn spawn_http_at(
    address: SocketAddr,
    name: &'static str,
    versions: HttpVersions,
) -> Result<(SocketAddr, JoinHandle<()>), LabError> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|source| LabError::Bind {
            service: name,
            source,
        })?;
    let addr = local_addr(name, &listener)?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                // Accept fails transiently (e.g. out of file descriptors); back off
                // instead of spinning, the next accept may succeed.
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            };
            tokio::spawn(serve_http(name, versions, stream));
        }
    });
    Ok((addr, task))
}

async fn serve_http(name: &'static str, versions: HttpVersions, stream: TcpStream) {
    // Small request/response pairs: without NODELAY, Nagle + delayed ACK add ~40 ms.
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(stream);
    let service = service_fn(move |req: Request<Incoming>| answer(name, req));
    // A connection error only ends that connection (the client went away or sent
    // garbage); the demo backend has nothing more useful to do with it.
    let _ = match versions {
        HttpVersions::Http1 => hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await
            .map_err(|e| e.to_string()),
        HttpVersions::Http1AndH2c => {
            hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(io, service)
                .await
                .map_err(|e| e.to_string())
        }
    };
}

async fn answer(
    name: &'static str,
    _req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut response = Response::new(Full::new(Bytes::from(format!("hello from {name}\n"))));
    response
        .headers_mut()
        .insert(BACKEND_HEADER, http::HeaderValue::from_static(name));
    Ok(response)
}

/// Start a TCP echo service on 127.0.0.1:0: every byte read is written back, and
/// the write side is closed when the client closes its side (half-close kept).
pub async fn spawn_echo() -> Result<(SocketAddr, JoinHandle<()>), LabError> {
    let listener = bind("echo").await?;
    let addr = local_addr("echo", &listener)?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            };
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let (mut reader, mut writer) = stream.split();
                if tokio::io::copy(&mut reader, &mut writer).await.is_ok() {
                    let _ = writer.shutdown().await;
                }
            });
        }
    });
    Ok((addr, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn http_backend_names_itself() -> Result<(), Box<dyn std::error::Error>> {
        let (addr, task) = spawn_http("api-1", HttpVersions::Http1).await?;
        let stream = TcpStream::connect(addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let req = Request::get("/x").body(Empty::<Bytes>::new())?;
        let resp = sender.send_request(req).await?;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()[BACKEND_HEADER], "api-1");
        let body = resp.into_body().collect().await?.to_bytes();
        assert_eq!(&body[..], b"hello from api-1\n");
        task.abort();
        Ok(())
    }

    #[tokio::test]
    async fn canary_speaks_h2c() -> Result<(), Box<dyn std::error::Error>> {
        let (addr, task) = spawn_http("canary", HttpVersions::Http1AndH2c).await?;
        let stream = TcpStream::connect(addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await?;
        tokio::spawn(conn);
        let req = Request::get("http://canary/x").body(Empty::<Bytes>::new())?;
        let resp = sender.send_request(req).await?;
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.headers()[BACKEND_HEADER], "canary");
        task.abort();
        Ok(())
    }

    #[tokio::test]
    async fn echo_returns_bytes_and_honours_half_close() -> Result<(), Box<dyn std::error::Error>> {
        let (addr, task) = spawn_echo().await?;
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(b"ping-pong").await?;
        stream.shutdown().await?;
        let mut back = Vec::new();
        stream.read_to_end(&mut back).await?;
        assert_eq!(back, b"ping-pong");
        task.abort();
        Ok(())
    }
}
