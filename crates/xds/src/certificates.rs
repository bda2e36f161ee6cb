//! The certificate API of the control channel: a node sends a CSR and gets an SVID back.
//!
//! It is Istio's CA API (`istio.v1.auth.IstioCertificateService/CreateCertificate`, the one
//! istiod serves and ztunnel calls), so the wire form is one a platform team already knows:
//! a PEM CSR and a requested lifetime in; `cert_chain` out. flatmesh fills `cert_chain` with
//! the leaf first, then the trust bundle (the signing root first, then roots kept from before a
//! rotation), so one answer gives a node both what it presents and what it trusts.
//!
//! The caller proves who it is with its bootstrap token in the `authorization: Bearer TOKEN`
//! header; the service decides what that node may hold ([`Signer`]). The messages are written
//! out here (three fields) rather than generated, so the crate needs no protobuf compiler.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::codegen::{http, Body, BoxFuture, Service, StdError};

/// The RPC's path.
pub const PATH: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";
/// The service name, as gRPC reflection and routers know it.
pub const SERVICE: &str = "istio.v1.auth.IstioCertificateService";
/// A request bigger than this is refused before it is decoded (a CSR is about 1 KB).
pub const MAX_REQUEST: usize = 64 * 1024;
/// An answer bigger than this is refused by the client (a leaf and a few roots are a few KB).
pub const MAX_RESPONSE: usize = 1024 * 1024;

/// `istio.v1.auth.IstioCertificateRequest` (field 4, `metadata`, is not used and is skipped).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CertificateRequest {
    /// The PKCS#10 request, PEM.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// The lifetime asked for, in seconds; 0 = the CA's default.
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
}

/// `istio.v1.auth.IstioCertificateResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CertificateResponse {
    /// PEM certificates: the leaf, then the trust bundle.
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

/// What signs: the control center, which knows which node holds which token and which
/// identities are placed on it.
pub trait Signer: Send + Sync + 'static {
    /// Signs `request` for the caller whose bearer token is `token` (`None`: none was sent).
    /// Errors are gRPC statuses with a message that says what to do.
    fn sign(
        &self,
        token: Option<&str>,
        request: &CertificateRequest,
    ) -> Result<CertificateResponse, tonic::Status>;
}

/// The bearer token of a request's `authorization` header, if it has one.
pub fn bearer_token(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    let value = metadata.get("authorization")?.to_str().ok()?;
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

/// The gRPC service around a [`Signer`], to add to the control center's server.
pub struct CertificateServer {
    signer: Arc<dyn Signer>,
}

impl CertificateServer {
    pub fn new(signer: Arc<dyn Signer>) -> CertificateServer {
        CertificateServer { signer }
    }
}

impl Clone for CertificateServer {
    fn clone(&self) -> Self {
        CertificateServer {
            signer: self.signer.clone(),
        }
    }
}

impl tonic::server::NamedService for CertificateServer {
    const NAME: &'static str = SERVICE;
}

/// The one unary method, in the shape tonic's server expects.
struct CreateCertificate(Arc<dyn Signer>);

impl tonic::server::UnaryService<CertificateRequest> for CreateCertificate {
    type Response = CertificateResponse;
    type Future = BoxFuture<tonic::Response<CertificateResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<CertificateRequest>) -> Self::Future {
        let signer = self.0.clone();
        Box::pin(async move {
            let token = bearer_token(request.metadata()).map(str::to_owned);
            // Signing is a few hundred microseconds of ECDSA: not worth a blocking thread.
            signer
                .sign(token.as_deref(), request.get_ref())
                .map(tonic::Response::new)
        })
    }
}

impl<B> Service<http::Request<B>> for CertificateServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != PATH {
            let status = tonic::Status::unimplemented(format!(
                "{} is not served here; the certificate API is {PATH}",
                request.uri().path()
            ));
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let method = CreateCertificate(self.signer.clone());
        Box::pin(async move {
            let codec =
                tonic_prost::ProstCodec::<CertificateResponse, CertificateRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec)
                .max_decoding_message_size(MAX_REQUEST)
                .max_encoding_message_size(MAX_RESPONSE);
            Ok(grpc.unary(method, request).await)
        })
    }
}

/// Asks the control center at the other end of `channel` to sign `csr_pem`, proving the node
/// with the bootstrap token of `security`. Returns the PEM certificates (leaf, then the trust
/// bundle).
pub async fn request(
    channel: tonic::transport::Channel,
    security: &crate::secure::ChannelSecurity,
    csr_pem: String,
    ttl: Duration,
) -> Result<Vec<String>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(MAX_RESPONSE)
        .max_encoding_message_size(MAX_REQUEST);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("the control center is not ready: {e}")))?;
    let request = tonic::Request::new(CertificateRequest {
        csr: csr_pem,
        validity_duration: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
    });
    let request =
        crate::secure::with_token(request, security).map_err(tonic::Status::invalid_argument)?;
    let codec = tonic_prost::ProstCodec::<CertificateRequest, CertificateResponse>::default();
    let path = http::uri::PathAndQuery::from_static(PATH);
    let response = grpc.unary(request, path, codec).await?;
    Ok(response.into_inner().cert_chain)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_header() {
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert_eq!(bearer_token(&metadata), None);
        metadata.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer_token(&metadata), None, "only bearer tokens count");
        metadata.insert("authorization", "Bearer s3cret ".parse().unwrap());
        assert_eq!(bearer_token(&metadata), Some("s3cret"));
    }

    #[test]
    fn the_messages_keep_istios_field_numbers() {
        use prost::Message;
        let request = CertificateRequest {
            csr: "x".into(),
            validity_duration: 60,
        };
        // Field 1 (string, wire type 2) then field 3 (varint, wire type 0).
        assert_eq!(request.encode_to_vec(), [0x0a, 1, b'x', 0x18, 60]);
        let response = CertificateResponse {
            cert_chain: vec!["a".into(), "b".into()],
        };
        assert_eq!(
            response.encode_to_vec(),
            [0x0a, 1, b'a', 0x0a, 1, b'b'],
            "field 1, repeated"
        );
    }
}
