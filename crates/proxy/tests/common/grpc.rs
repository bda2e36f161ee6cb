//! A tonic gRPC backend (`test.Echo`) and a client for it, without protoc: the messages are
//! hand-written prost structs and the service is dispatched by path with `tonic::server::Grpc`.
//!
//! Methods:
//! - `Unary`: replies `"<backend>:<message>"`; a message `fail` answers NOT_FOUND with a message.
//! - `ClientStream`: replies with the messages joined by `,` and their count in `index`.
//! - `ServerStream`: sends `count` replies; if the message is `fail-after`, ends with
//!   RESOURCE_EXHAUSTED and trailer metadata `x-trailer: t1` after the replies (real trailers);
//!   if the message is `forever`, streams every 20 ms until the call is cancelled, and counts
//!   the cancellation in `GrpcBackend::cancelled`.
//! - `Bidi`: answers every request as it arrives (`index` = its position), so a proxy that
//!   buffers a request body deadlocks a ping-pong client.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataMap;
use tonic::{Status, Streaming};
use tonic_prost::ProstCodec;

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoRequest {
    #[prost(string, tag = "1")]
    pub message: String,
    #[prost(int32, tag = "2")]
    pub count: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoReply {
    #[prost(string, tag = "1")]
    pub message: String,
    #[prost(int32, tag = "2")]
    pub index: i32,
}

type BoxFut<T> = Pin<Box<dyn Future<Output = Result<tonic::Response<T>, Status>> + Send>>;
type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send>>;

pub struct GrpcBackend {
    pub addr: SocketAddr,
    /// `forever` server streams that ended because the call went away.
    pub cancelled: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl GrpcBackend {
    pub async fn start(name: &str) -> GrpcBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind grpc backend");
        let addr = listener.local_addr().expect("grpc backend addr");
        let name: std::sync::Arc<str> = name.into();
        let cancelled = Arc::new(AtomicU64::new(0));
        let counter = cancelled.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let name = name.clone();
                let counter = counter.clone();
                let service = service_fn(move |req| dispatch(req, name.clone(), counter.clone()));
                conns.spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        GrpcBackend {
            addr,
            cancelled,
            task,
        }
    }
}

impl Drop for GrpcBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn dispatch(
    req: Request<Incoming>,
    name: std::sync::Arc<str>,
    cancelled: Arc<AtomicU64>,
) -> Result<Response<tonic::body::Body>, Infallible> {
    let codec = ProstCodec::<EchoReply, EchoRequest>::default();
    let mut grpc = tonic::server::Grpc::new(codec);
    let name = name.to_string();
    let resp = match req.uri().path() {
        "/test.Echo/Unary" => grpc.unary(Unary(name), req).await,
        "/test.Echo/ClientStream" => grpc.client_streaming(ClientStream, req).await,
        "/test.Echo/ServerStream" => grpc.server_streaming(ServerStream(cancelled), req).await,
        "/test.Echo/Bidi" => grpc.streaming(Bidi, req).await,
        other => Status::unimplemented(format!("no method {other}")).into_http(),
    };
    Ok(resp)
}

struct Unary(String);

impl tower_service::Service<tonic::Request<EchoRequest>> for Unary {
    type Response = tonic::Response<EchoReply>;
    type Error = Status;
    type Future = BoxFut<EchoReply>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<EchoRequest>) -> Self::Future {
        let name = self.0.clone();
        Box::pin(async move {
            let msg = req.into_inner();
            if msg.message == "fail" {
                return Err(Status::not_found("no such thing: fail"));
            }
            let mut resp = tonic::Response::new(EchoReply {
                message: format!("{name}:{}", msg.message),
                index: 0,
            });
            resp.metadata_mut()
                .insert("x-backend", name.parse().expect("ascii name"));
            Ok(resp)
        })
    }
}

struct ClientStream;

impl tower_service::Service<tonic::Request<Streaming<EchoRequest>>> for ClientStream {
    type Response = tonic::Response<EchoReply>;
    type Error = Status;
    type Future = BoxFut<EchoReply>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<Streaming<EchoRequest>>) -> Self::Future {
        Box::pin(async move {
            let mut stream = req.into_inner();
            let mut parts = Vec::new();
            while let Some(msg) = stream.next().await {
                parts.push(msg?.message);
            }
            Ok(tonic::Response::new(EchoReply {
                message: parts.join(","),
                index: parts.len() as i32,
            }))
        })
    }
}

struct ServerStream(Arc<AtomicU64>);

/// Counts a cancellation when the stream holding it is dropped.
struct CountOnDrop(Arc<AtomicU64>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl tower_service::Service<tonic::Request<EchoRequest>> for ServerStream {
    type Response = tonic::Response<ReplyStream>;
    type Error = Status;
    type Future = BoxFut<ReplyStream>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<EchoRequest>) -> Self::Future {
        let cancelled = self.0.clone();
        Box::pin(async move {
            let msg = req.into_inner();
            if msg.message == "forever" {
                let guard = CountOnDrop(cancelled);
                let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
                    std::time::Duration::from_millis(20),
                ));
                let mut index = -1;
                let stream: ReplyStream = Box::pin(ticks.map(move |_| {
                    let _held = &guard;
                    index += 1;
                    Ok(EchoReply {
                        message: "tick".into(),
                        index,
                    })
                }));
                return Ok(tonic::Response::new(stream));
            }
            let fail = msg.message == "fail-after";
            let mut items: Vec<Result<EchoReply, Status>> = (0..msg.count.max(0))
                .map(|i| {
                    Ok(EchoReply {
                        message: format!("{}#{i}", msg.message),
                        index: i,
                    })
                })
                .collect();
            if fail {
                let mut md = MetadataMap::new();
                md.insert("x-trailer", "t1".parse().expect("ascii"));
                items.push(Err(Status::with_metadata(
                    tonic::Code::ResourceExhausted,
                    "stopped on purpose",
                    md,
                )));
            }
            let stream: ReplyStream = Box::pin(tokio_stream::iter(items));
            Ok(tonic::Response::new(stream))
        })
    }
}

struct Bidi;

impl tower_service::Service<tonic::Request<Streaming<EchoRequest>>> for Bidi {
    type Response = tonic::Response<ReplyStream>;
    type Error = Status;
    type Future = BoxFut<ReplyStream>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<Streaming<EchoRequest>>) -> Self::Future {
        Box::pin(async move {
            let inbound = req.into_inner();
            let mut index = -1;
            let replies = inbound.map(move |msg| {
                index += 1;
                msg.map(|m| EchoReply {
                    message: format!("re:{}", m.message),
                    index,
                })
            });
            let stream: ReplyStream = Box::pin(replies);
            Ok(tonic::Response::new(stream))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

pub type GrpcClient = tonic::client::Grpc<tonic::transport::Channel>;

/// Connect a gRPC client to `addr` (h2c with prior knowledge, as tonic does for `http://`).
pub async fn connect(addr: SocketAddr) -> GrpcClient {
    connect_with_window(addr, None).await
}

/// `stream_window`: a small HTTP/2 stream window makes this client push back on the proxy.
pub async fn connect_with_window(addr: SocketAddr, stream_window: Option<u32>) -> GrpcClient {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("valid uri")
        .initial_stream_window_size(stream_window)
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(15))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("gRPC connect to {addr} failed: {e:?}"));
    tonic::client::Grpc::new(channel)
}

fn codec() -> ProstCodec<EchoRequest, EchoReply> {
    ProstCodec::default()
}

async fn ready(client: &mut GrpcClient) {
    client
        .ready()
        .await
        .unwrap_or_else(|e| panic!("gRPC channel not ready: {e:?}"));
}

pub async fn unary(
    client: &mut GrpcClient,
    message: &str,
) -> Result<tonic::Response<EchoReply>, Status> {
    ready(client).await;
    let req = tonic::Request::new(EchoRequest {
        message: message.into(),
        count: 0,
    });
    client
        .unary(req, PathAndQuery::from_static("/test.Echo/Unary"), codec())
        .await
}

pub async fn client_stream(
    client: &mut GrpcClient,
    messages: Vec<String>,
) -> Result<EchoReply, Status> {
    ready(client).await;
    let stream = tokio_stream::iter(messages.into_iter().map(|m| EchoRequest {
        message: m,
        count: 0,
    }));
    let resp = client
        .client_streaming(
            tonic::Request::new(stream),
            PathAndQuery::from_static("/test.Echo/ClientStream"),
            codec(),
        )
        .await?;
    Ok(resp.into_inner())
}

pub async fn server_stream(
    client: &mut GrpcClient,
    message: &str,
    count: i32,
) -> Result<Streaming<EchoReply>, Status> {
    ready(client).await;
    let req = tonic::Request::new(EchoRequest {
        message: message.into(),
        count,
    });
    let resp = client
        .server_streaming(
            req,
            PathAndQuery::from_static("/test.Echo/ServerStream"),
            codec(),
        )
        .await?;
    Ok(resp.into_inner())
}

/// Open a bidi stream; returns the sender for requests and the reply stream.
pub async fn bidi(
    client: &mut GrpcClient,
) -> Result<(tokio::sync::mpsc::Sender<EchoRequest>, Streaming<EchoReply>), Status> {
    ready(client).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<EchoRequest>(4);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let resp = client
        .streaming(
            tonic::Request::new(outbound),
            PathAndQuery::from_static("/test.Echo/Bidi"),
            codec(),
        )
        .await?;
    Ok((tx, resp.into_inner()))
}
