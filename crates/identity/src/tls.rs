//! rustls configurations that authenticate peers by SPIFFE ID.
//!
//! A peer is accepted when its chain leads to a root of the trust bundle (standard X.509 path
//! validation by webpki: signatures, validity times, CA constraints, extended key usage) and its
//! leaf names exactly one SPIFFE ID that an allow-list pattern admits. DNS names play no part,
//! as in every SPIFFE mesh: the server's identity is checked against `server_ids`, not against
//! the SNI.
//!
//! Crypto runs in rustls with the `ring` provider, which uses the CPU's AES and carry-less
//! multiply instructions. TLS 1.3 and 1.2 (Envoy's client default is 1.2), AEAD suites only.

use crate::error::IdentityError;
use crate::spiffe::{IdPattern, SpiffeId};
use crate::svid::{spiffe_id_of, Svid};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, Error, RootCertStore,
    ServerConfig, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, CertificateRevocationListDer, ServerName, UnixTime};
use std::sync::Arc;

/// ALPN of the codecs the node speaks over TLS.
pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// The crypto the node uses: ring, AEAD suites only.
pub fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.retain(|suite| {
        matches!(
            suite.suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
                | rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
                | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
                | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384
        )
    });
    // AES-128-GCM first, as BoringSSL (Envoy) and Go order them: with the CPU's AES
    // instructions it is the cheapest suite per byte, and a rustls server takes the client's
    // order, so the order here is what two flatmesh nodes negotiate.
    provider
        .cipher_suites
        .sort_by_key(|suite| suite_preference(suite.suite()));
    Arc::new(provider)
}

/// Lower is preferred: AES-128-GCM, then AES-256-GCM, then ChaCha20-Poly1305.
fn suite_preference(suite: rustls::CipherSuite) -> u8 {
    match suite {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
        | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
        | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => 1,
        _ => 2,
    }
}

/// The roots a node trusts, one or more per trust domain (more during a root rotation), and
/// the revocation lists peers' certificates are checked against (`tls.crl`).
#[derive(Clone, Debug)]
pub struct TrustBundle {
    roots: Arc<RootCertStore>,
    /// As read (for rustls's client verifier) and parsed (for the server verifier); empty: no
    /// revocation check.
    crls: Vec<CertificateRevocationListDer<'static>>,
    parsed_crls: Arc<Vec<webpki::CertRevocationList<'static>>>,
}

impl TrustBundle {
    pub fn new(certificates: &[CertificateDer<'static>]) -> Result<TrustBundle, IdentityError> {
        let mut roots = RootCertStore::empty();
        for certificate in certificates {
            roots
                .add(certificate.clone())
                .map_err(|e| IdentityError::Bundle(format!("a root does not parse: {e}")))?;
        }
        if roots.is_empty() {
            return Err(IdentityError::Bundle(
                "it holds no certificate; give the ca.pem of `flatmesh ca init`".into(),
            ));
        }
        Ok(TrustBundle {
            roots: Arc::new(roots),
            crls: Vec::new(),
            parsed_crls: Arc::default(),
        })
    }

    pub fn load(path: &std::path::Path) -> Result<TrustBundle, IdentityError> {
        TrustBundle::new(&crate::ca::load_certificates(path)?)
    }

    /// Checks peers' leaves against `crls` too: a leaf a CRL of its issuer lists is refused
    /// (reason `revoked`); a leaf whose issuer has no CRL here is not.
    pub fn with_crls(
        mut self,
        crls: Vec<CertificateRevocationListDer<'static>>,
    ) -> Result<TrustBundle, IdentityError> {
        let parsed = crls
            .iter()
            .map(|der| {
                webpki::OwnedCertRevocationList::from_der(der)
                    .map(webpki::CertRevocationList::from)
                    .map_err(|e| IdentityError::Bundle(format!("a CRL does not parse: {e:?}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.crls = crls;
        self.parsed_crls = Arc::new(parsed);
        Ok(self)
    }

    /// [`with_crls`](Self::with_crls) with the CRLs of a PEM file (`flatmesh ca revoke` writes one).
    pub fn with_crl_file(self, path: &std::path::Path) -> Result<TrustBundle, IdentityError> {
        let crls = crate::crl::load_crls(path)?;
        self.with_crls(crls).map_err(|e| IdentityError::BadPem {
            path: path.to_path_buf(),
            why: e.to_string(),
        })
    }
}

/// Why a peer's certificate was refused after its chain verified.
#[derive(Debug)]
pub struct IdentityRefused {
    pub id: Option<SpiffeId>,
    pub reason: &'static str,
    pub detail: String,
}

impl std::fmt::Display for IdentityRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl std::error::Error for IdentityRefused {}

fn refused(id: Option<SpiffeId>, reason: &'static str, detail: String) -> Error {
    Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
        IdentityRefused { id, reason, detail },
    ))))
}

/// Checks a verified leaf's SPIFFE ID against the allow-list.
fn check_identity(end_entity: &CertificateDer<'_>, allow: &[IdPattern]) -> Result<(), Error> {
    let id = spiffe_id_of(end_entity).map_err(|detail| refused(None, "no_spiffe_id", detail))?;
    if crate::spiffe::allowed(allow, &id) {
        return Ok(());
    }
    let known_domain = allow.iter().any(|p| p.trust_domain() == id.trust_domain());
    let (reason, detail) = if known_domain {
        (
            "not_allowed",
            format!("`{id}` is not in the allow-list ({})", list(allow)),
        )
    } else {
        (
            "wrong_trust_domain",
            format!(
                "`{id}` is in trust domain `{}`, which no allow-list entry names ({})",
                id.trust_domain(),
                list(allow)
            ),
        )
    };
    Err(refused(Some(id), reason, detail))
}

fn list(allow: &[IdPattern]) -> String {
    if allow.is_empty() {
        return "empty".into();
    }
    allow
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A short, bounded label for a failed handshake, for logs and the `reason` label of metrics.
pub fn failure_reason(error: &Error) -> &'static str {
    match error {
        Error::InvalidCertificate(certificate) => match certificate {
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => "expired",
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "not_yet_valid"
            }
            CertificateError::UnknownIssuer => "unknown_ca",
            CertificateError::Revoked => "revoked",
            CertificateError::UnknownRevocationStatus => "revocation_unknown",
            CertificateError::ExpiredRevocationList
            | CertificateError::ExpiredRevocationListContext { .. } => "crl_expired",
            CertificateError::BadSignature => "bad_signature",
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                "wrong_usage"
            }
            CertificateError::Other(other) => other
                .0
                .downcast_ref::<IdentityRefused>()
                .map(|r| r.reason)
                .unwrap_or("bad_certificate"),
            _ => "bad_certificate",
        },
        Error::NoCertificatesPresented => "no_client_certificate",
        // The first bytes were no TLS record at all: a plaintext client on a TLS port.
        Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType) => "not_tls",
        Error::InvalidMessage(_) => "malformed",
        Error::AlertReceived(_) => "peer_alert",
        Error::PeerIncompatible(_) => "incompatible",
        Error::NoApplicationProtocol => "alpn",
        _ => "handshake",
    }
}

/// Verifies client certificates: the chain (webpki), then the SPIFFE ID.
#[derive(Debug)]
struct SpiffeClientVerifier {
    chain: Arc<dyn ClientCertVerifier>,
    allow: Vec<IdPattern>,
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        self.chain
            .verify_client_cert(end_entity, intermediates, now)?;
        check_identity(end_entity, &self.allow)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

/// Verifies server certificates: the chain without a DNS name check, then the SPIFFE ID.
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: Arc<RootCertStore>,
    crls: Arc<Vec<webpki::CertRevocationList<'static>>>,
    allow: Vec<IdPattern>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl SpiffeServerVerifier {
    /// The leaf against the CRLs of its issuer (rustls's own server verifier would also match
    /// the server's DNS name, which SPIFFE peers do not carry). Only the leaf is checked, and
    /// a leaf whose issuer has no CRL passes, as with the client verifier.
    fn check_revocation(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<(), Error> {
        let crls: Vec<&webpki::CertRevocationList<'_>> = self.crls.iter().collect();
        let Ok(options) = webpki::RevocationOptionsBuilder::new(&crls) else {
            return Ok(()); // no CRL configured
        };
        let options = options
            .with_depth(webpki::RevocationCheckDepth::EndEntity)
            .with_status_policy(webpki::UnknownStatusPolicy::Allow)
            .build();
        let leaf = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|_| Error::InvalidCertificate(CertificateError::BadEncoding))?;
        leaf.verify_for_usage(
            self.algorithms.all,
            &self.roots.roots,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            Some(options),
            None,
        )
        .map(|_| ())
        .map_err(|e| match e {
            webpki::Error::CertRevoked => Error::InvalidCertificate(CertificateError::Revoked),
            webpki::Error::UnknownRevocationStatus => {
                Error::InvalidCertificate(CertificateError::UnknownRevocationStatus)
            }
            webpki::Error::CrlExpired { .. } => {
                Error::InvalidCertificate(CertificateError::ExpiredRevocationList)
            }
            other => refused(
                None,
                "bad_crl",
                format!("the revocation check failed: {other}"),
            ),
        })
    }
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        self.check_revocation(end_entity, intermediates, now)?;
        check_identity(end_entity, &self.allow)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Who may connect to a TLS listener.
#[derive(Clone, Debug)]
pub struct ClientAuth {
    pub bundle: TrustBundle,
    /// SPIFFE IDs (or `/*` patterns) that may connect; a verified client outside it is refused.
    pub allow: Vec<IdPattern>,
}

/// A server configuration presenting `svid`. With `client_auth`, a client certificate is
/// required, verified and matched against the allow-list.
pub fn server_config(
    svid: &Svid,
    client_auth: Option<ClientAuth>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, IdentityError> {
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_auth {
        Some(auth) => {
            let mut chain =
                WebPkiClientVerifier::builder_with_provider(auth.bundle.roots, provider);
            if !auth.bundle.crls.is_empty() {
                // Only the leaf, and a leaf of a root without a CRL passes (see `crl`).
                chain = chain
                    .with_crls(auth.bundle.crls)
                    .only_check_end_entity_revocation()
                    .allow_unknown_revocation_status();
            }
            let chain = chain
                .build()
                .map_err(|e| IdentityError::Bundle(e.to_string()))?;
            builder.with_client_cert_verifier(Arc::new(SpiffeClientVerifier {
                chain,
                allow: auth.allow,
            }))
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(svid.chain.clone(), svid.key.clone_key())?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // Stateless resumption tickets (Envoy's default too), so a client resumes whenever it
    // holds a ticket, instead of when its entry survived a 256-entry server cache. The
    // ticket key is this config's own: a reload (new certificate, allow-list or bundle)
    // builds a new config, and every earlier ticket then falls back to a full handshake.
    config.ticketer = rustls::crypto::ring::Ticketer::new()?;
    Ok(Arc::new(config))
}

/// A client configuration that accepts servers whose SPIFFE ID `server_ids` admits, presenting
/// `svid` when the server asks for a client certificate.
pub fn client_config(
    svid: Option<&Svid>,
    bundle: &TrustBundle,
    server_ids: Vec<IdPattern>,
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>, IdentityError> {
    let provider = provider();
    let verifier = Arc::new(SpiffeServerVerifier {
        roots: bundle.roots.clone(),
        crls: bundle.parsed_crls.clone(),
        allow: server_ids,
        algorithms: provider.signature_verification_algorithms,
    });
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match svid {
        Some(svid) => builder.with_client_auth_cert(svid.chain.clone(), svid.key.clone_key())?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A server verifier over the bundle in a file, re-read when the file changes (looked at once
/// per handshake: one `stat`). So a node's `--xds-ca` follows a root rotation on disk without
/// a restart: the next connection trusts the new `ca.pem`. A file that cannot be read or does
/// not parse leaves the previous bundle in force.
#[derive(Debug)]
struct BundleFileVerifier {
    path: std::path::PathBuf,
    allow: Vec<IdPattern>,
    /// The file's modification time and size when read, and the verifier built from it.
    current: parking_lot::RwLock<(FileStamp, Arc<SpiffeServerVerifier>)>,
}

type FileStamp = Option<(std::time::SystemTime, u64)>;

fn stamp(path: &std::path::Path) -> FileStamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

impl BundleFileVerifier {
    fn verifier_for(bundle: &TrustBundle, allow: Vec<IdPattern>) -> SpiffeServerVerifier {
        SpiffeServerVerifier {
            roots: bundle.roots.clone(),
            crls: bundle.parsed_crls.clone(),
            allow,
            algorithms: provider().signature_verification_algorithms,
        }
    }

    /// The verifier of the file as it is now.
    fn current(&self) -> Arc<SpiffeServerVerifier> {
        let now = stamp(&self.path);
        {
            let current = self.current.read();
            if current.0 == now {
                return current.1.clone();
            }
        }
        let mut current = self.current.write();
        if let Ok(bundle) = TrustBundle::load(&self.path) {
            current.1 = Arc::new(Self::verifier_for(&bundle, self.allow.clone()));
        }
        // A bad file is not retried on every handshake, only when it changes again.
        current.0 = now;
        current.1.clone()
    }
}

impl ServerCertVerifier for BundleFileVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        self.current().verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}

/// Like [`client_config`] without a client certificate, trusting the bundle in `bundle_file`
/// as it is at each handshake (re-read when it changes): a root rotation on disk reaches
/// the next connection. The file must be usable now.
pub fn client_config_following(
    bundle_file: &std::path::Path,
    server_ids: Vec<IdPattern>,
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>, IdentityError> {
    let stamped = stamp(bundle_file);
    let bundle = TrustBundle::load(bundle_file)?;
    let verifier = Arc::new(BundleFileVerifier {
        path: bundle_file.to_path_buf(),
        current: parking_lot::RwLock::new((
            stamped,
            Arc::new(BundleFileVerifier::verifier_for(
                &bundle,
                server_ids.clone(),
            )),
        )),
        allow: server_ids,
    });
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The SPIFFE ID of the peer of a finished handshake (already verified by the config's
/// verifier), if it presented a certificate.
pub fn peer_identity(connection: &rustls::CommonState) -> Option<SpiffeId> {
    let leaf = connection.peer_certificates()?.first()?;
    spiffe_id_of(leaf).ok()
}
