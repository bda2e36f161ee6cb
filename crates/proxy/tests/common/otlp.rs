//! A real OTLP/gRPC trace receiver: tonic's gRPC server (`tonic::server::Grpc`) serving
//! `opentelemetry.proto.collector.trace.v1.TraceService/Export` over HTTP/2, decoding what the
//! node exports with the node's own OTLP messages and keeping every span with the
//! `service.name` of its resource.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;
use std::task::{Context, Poll};

use flatmesh_proxy::otlp::{
    ExportTraceServiceRequest, ExportTraceServiceResponse, Span, Value, EXPORT_PATH,
};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::Status;
use tonic_prost::ProstCodec;

/// One span as received, with the exporting node's `service.name`.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub span: Span,
}

impl Received {
    /// The string (or integer, as text) value of attribute `key`.
    pub fn attr(&self, key: &str) -> Option<String> {
        let kv = self.span.attributes.iter().find(|kv| kv.key == key)?;
        match kv.value.as_ref()?.value.as_ref()? {
            Value::String(s) => Some(s.clone()),
            Value::Int(i) => Some(i.to_string()),
        }
    }
}

pub struct OtlpReceiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    task: JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind otlp");
        let addr = listener.local_addr().expect("otlp addr");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let kept = kept.clone();
                let service = service_fn(move |req| dispatch(req, kept.clone()));
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        OtlpReceiver { addr, spans, task }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().clone()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn dispatch(
    req: Request<Incoming>,
    kept: Arc<Mutex<Vec<Received>>>,
) -> Result<Response<tonic::body::Body>, Infallible> {
    let codec = ProstCodec::<ExportTraceServiceResponse, ExportTraceServiceRequest>::default();
    let mut grpc = tonic::server::Grpc::new(codec);
    let resp = if req.uri().path() == EXPORT_PATH {
        grpc.unary(Export(kept), req).await
    } else {
        Status::unimplemented(format!("no method {}", req.uri().path())).into_http()
    };
    Ok(resp)
}

struct Export(Arc<Mutex<Vec<Received>>>);

type BoxFut<T> = Pin<Box<dyn Future<Output = Result<tonic::Response<T>, Status>> + Send>>;

impl tower_service::Service<tonic::Request<ExportTraceServiceRequest>> for Export {
    type Response = tonic::Response<ExportTraceServiceResponse>;
    type Error = Status;
    type Future = BoxFut<ExportTraceServiceResponse>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<ExportTraceServiceRequest>) -> Self::Future {
        let kept = self.0.clone();
        Box::pin(async move {
            let mut kept = kept.lock();
            for rs in req.into_inner().resource_spans {
                let service = rs
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                        Value::String(s) => Some(s.clone()),
                        Value::Int(_) => None,
                    })
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for span in ss.spans {
                        kept.push(Received {
                            service: service.clone(),
                            span,
                        });
                    }
                }
            }
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        })
    }
}
