//! TLS between the config model and Envoy's API, both ways: a listener's `tls` is its filter
//! chain's transport socket with a `DownstreamTlsContext`, a cluster's `tls` the cluster's
//! transport socket with an `UpstreamTlsContext` (docs/security.md, "TLS over xDS and Envoy
//! import").
//!
//! One shape is accepted, the one [`downstream`] and [`upstream`] write: certificates, keys and
//! CAs as file names, peers matched by URI SAN (a SPIFFE ID exactly, or a `/`-ending prefix for a
//! `/*` pattern), ALPN the codecs flatmesh speaks. Anything else in the contexts is an error that
//! names the field, so a secure Envoy listener never turns into a flatmesh listener that checks
//! less.
//!
//! Secrets may also come by name (SDS): `tls_certificate_sds_secret_configs` and a
//! `combined_validation_context` whose roots are a secret, over ADS (`sds_config: { ads: {} }`)
//! or from a bootstrap's `static_resources.secrets`. Translation writes such a reference as a
//! stand-in path ([`SecretRef`]) that [`resolve_secrets`] replaces with the files the secret was
//! written to (the xDS client, [`crate::sds`]) or names (a bootstrap's static secrets).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::config::core::v3::TransportSocket;
use envoy_types::pb::envoy::config::core::v3::{
    config_source, data_source, transport_socket, ApiVersion, DataSource,
};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, subject_alt_name_matcher, tls_parameters, CertificateValidationContext,
    CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, SubjectAltNameMatcher, TlsCertificate,
    UpstreamTlsContext,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
use envoy_types::pb::google::protobuf::BoolValue;
use flatmesh_config as model;
use prost::Name;

use crate::error::{Result, XdsError};
use crate::resources::pack;
use crate::to_model::{reject_rest, unpack};

/// The transport socket Envoy knows TLS by.
pub const TLS_SOCKET_NAME: &str = "envoy.transport_sockets.tls";

const ALPN_H2: &str = "h2";
const ALPN_HTTP11: &str = "http/1.1";

/// The part of a SPIFFE ID every ID and pattern starts with.
const SPIFFE_SCHEME: &str = "spiffe://";

// ---- model -> Envoy ----

/// The ALPN protocols a listener offers: an `http` listener `h2` and `http/1.1` (its codecs
/// serve both), an `hbone` listener `h2` (HBONE is HTTP/2), a `tcp` listener none.
fn listener_alpn(protocol: model::ListenerProtocol) -> &'static [&'static str] {
    match protocol {
        model::ListenerProtocol::Http => &[ALPN_H2, ALPN_HTTP11],
        model::ListenerProtocol::Hbone => &[ALPN_H2],
        model::ListenerProtocol::Tcp | model::ListenerProtocol::Qnp => &[],
    }
}

/// A listener's `tls` as its filter chain's transport socket, offering [`listener_alpn`].
pub fn downstream(tls: &model::ListenerTls, protocol: model::ListenerProtocol) -> TransportSocket {
    let context = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![certificate(&tls.cert, &tls.key)],
            validation_context_type: tls.client_ca.as_ref().map(|ca| {
                common_tls_context::ValidationContextType::ValidationContext(validation(
                    ca,
                    &tls.allow,
                    tls.crl.as_deref(),
                ))
            }),
            alpn_protocols: listener_alpn(protocol)
                .iter()
                .map(|p| p.to_string())
                .collect(),
            ..Default::default()
        }),
        // flatmesh requires the client certificate it verifies.
        require_client_certificate: tls.client_ca.as_ref().map(|_| BoolValue { value: true }),
        ..Default::default()
    };
    socket(pack(&context))
}

/// A cluster's `tls` as the cluster's transport socket; ALPN is the cluster's protocol.
pub fn upstream(tls: &model::ClusterTls, protocol: model::UpstreamProtocol) -> TransportSocket {
    let context = UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: match (&tls.cert, &tls.key) {
                (Some(cert), Some(key)) => vec![certificate(cert, key)],
                _ => Vec::new(),
            },
            validation_context_type: Some(
                common_tls_context::ValidationContextType::ValidationContext(validation(
                    &tls.ca,
                    &tls.server_ids,
                    tls.crl.as_deref(),
                )),
            ),
            alpn_protocols: vec![alpn_of(protocol).into()],
            ..Default::default()
        }),
        sni: tls.sni.clone().unwrap_or_default(),
        ..Default::default()
    };
    socket(pack(&context))
}

fn socket(context: envoy_types::pb::google::protobuf::Any) -> TransportSocket {
    TransportSocket {
        name: TLS_SOCKET_NAME.into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(context)),
    }
}

fn alpn_of(protocol: model::UpstreamProtocol) -> &'static str {
    match protocol {
        model::UpstreamProtocol::Http1 => ALPN_HTTP11,
        model::UpstreamProtocol::Http2 => ALPN_H2,
    }
}

fn file(path: &std::path::Path) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::Filename(
            path.to_string_lossy().into_owned(),
        )),
        ..Default::default()
    })
}

fn certificate(cert: &std::path::Path, key: &std::path::Path) -> TlsCertificate {
    TlsCertificate {
        certificate_chain: file(cert),
        private_key: file(key),
        ..Default::default()
    }
}

/// The roots in `ca`, the SPIFFE IDs (or `/*` patterns) a peer must present, and the
/// revocation lists its certificate is checked against.
fn validation(
    ca: &std::path::Path,
    ids: &[String],
    crl: Option<&std::path::Path>,
) -> CertificateValidationContext {
    CertificateValidationContext {
        trusted_ca: file(ca),
        crl: crl.and_then(file),
        match_typed_subject_alt_names: ids.iter().map(|id| uri_matcher(id)).collect(),
        ..Default::default()
    }
}

fn uri_matcher(id: &str) -> SubjectAltNameMatcher {
    SubjectAltNameMatcher {
        san_type: subject_alt_name_matcher::SanType::Uri as i32,
        matcher: Some(spiffe_matcher(id)),
        oid: String::new(),
    }
}

/// An ID matches exactly; a pattern `spiffe://TD/ns/NS/*` matches the URIs under
/// `spiffe://TD/ns/NS/`, which is Envoy's prefix match on the text before the `*`. The RBAC
/// principals ([`crate::rbac`]) are written the same way.
pub(crate) fn spiffe_matcher(id: &str) -> StringMatcher {
    let pattern = match id.strip_suffix('*').filter(|base| base.ends_with('/')) {
        Some(base) => string_matcher::MatchPattern::Prefix(base.into()),
        None => string_matcher::MatchPattern::Exact(id.into()),
    };
    StringMatcher {
        match_pattern: Some(pattern),
        ignore_case: false,
    }
}

// ---- Envoy -> model ----

/// The TLS context a transport socket carries (`at` names the socket); `None` for Envoy's
/// plaintext `raw_buffer` socket.
fn context<M: prost::Message + Name + Default>(
    socket: &TransportSocket,
    at: &str,
) -> Result<Option<M>> {
    // Envoy picks the socket by its typed_config's type; the name is a label.
    let Some(transport_socket::ConfigType::TypedConfig(any)) = &socket.config_type else {
        return Err(XdsError::resource(
            format!("{at}.typed_config"),
            format!(
                "is missing; write `{TLS_SOCKET_NAME}` with a typed_config of type {}",
                M::type_url()
            ),
        ));
    };
    if any.type_url == RawBuffer::type_url() {
        return Ok(None); // plaintext, as without a transport socket
    }
    if any.type_url != M::type_url() {
        return Err(XdsError::resource(
            format!("{at}.typed_config"),
            format!(
                "`{}` is not supported here; flatmesh speaks TLS ({}) or plaintext (raw_buffer)",
                any.type_url,
                M::type_url()
            ),
        ));
    }
    unpack(any, &format!("{at}.typed_config")).map(Some)
}

/// A listener filter chain's `transport_socket` (named by `at`) as the listener's `tls`.
pub(crate) fn listener_tls(
    socket: &TransportSocket,
    protocol: model::ListenerProtocol,
    at: &str,
) -> Result<Option<model::ListenerTls>> {
    let Some(mut ctx) = context::<DownstreamTlsContext>(socket, at)? else {
        return Ok(None);
    };
    let at = format!("{at}.typed_config");
    let require = ctx.require_client_certificate.take().map(|b| b.value);
    let mut common = ctx.common_tls_context.take().ok_or_else(|| {
        XdsError::resource(
            format!("{at}.common_tls_context"),
            "is missing; it holds the listener's certificate (tls_certificates)",
        )
    })?;
    reject_rest(&ctx, &at)?;
    let at_common = format!("{at}.common_tls_context");
    no_certificate_provider(&common, &at_common)?;
    let (cert, key) = match take_certificates(&mut common, &at_common)? {
        Some(pair) => pair,
        None => {
            return Err(XdsError::resource(
                format!("{at_common}.tls_certificates"),
                "is empty; a TLS listener needs its certificate and key (the PREFIX.pem and PREFIX.key of `flatmesh ca issue`)",
            ))
        }
    };
    let validation = take_validation(&mut common, &at_common)?;
    check_alpn(
        &take_alpn(&mut common),
        listener_alpn(protocol),
        &format!("{at_common}.alpn_protocols"),
        match protocol {
            model::ListenerProtocol::Http => {
                "flatmesh's http listeners speak h2 and http/1.1 and offer both"
            }
            model::ListenerProtocol::Hbone => "an hbone listener speaks h2 and offers only it",
            model::ListenerProtocol::Tcp | model::ListenerProtocol::Qnp => {
                "a tcp listener offers no application protocol in flatmesh; remove alpn_protocols"
            }
        },
    )?;
    take_tls_params(&mut common, &at_common)?;
    reject_rest(&common, &at_common)?;
    let (client_ca, allow, crl) = match (validation, require) {
        (Some((ca, ids, crl)), Some(true)) => (Some(ca), ids, crl),
        (Some(_), _) => {
            return Err(XdsError::resource(
                format!("{at}.require_client_certificate"),
                "is not true, but a validation_context is given: flatmesh requires every client certificate it verifies; set require_client_certificate: true, or remove validation_context to accept any client",
            ))
        }
        (None, Some(true)) => {
            return Err(XdsError::resource(
                format!("{at_common}.validation_context"),
                "is missing: require_client_certificate needs the CA client certificates chain to (trusted_ca) and the SPIFFE IDs to admit (match_typed_subject_alt_names)",
            ))
        }
        (None, _) => (None, Vec::new(), None),
    };
    Ok(Some(model::ListenerTls {
        cert,
        key,
        client_ca,
        allow,
        crl,
    }))
}

/// A cluster's `transport_socket` (named by `at`) as the cluster's `tls`; `protocol` is the
/// cluster's, which decides the ALPN it offers.
pub(crate) fn cluster_tls(
    socket: &TransportSocket,
    protocol: model::UpstreamProtocol,
    at: &str,
) -> Result<Option<model::ClusterTls>> {
    let Some(mut ctx) = context::<UpstreamTlsContext>(socket, at)? else {
        return Ok(None);
    };
    let at = format!("{at}.typed_config");
    let sni = std::mem::take(&mut ctx.sni);
    let mut common = ctx.common_tls_context.take().ok_or_else(|| {
        XdsError::resource(
            format!("{at}.common_tls_context"),
            "is missing; it holds the CA and the SPIFFE IDs the endpoints must present (validation_context)",
        )
    })?;
    reject_rest(&ctx, &at)?;
    let at_common = format!("{at}.common_tls_context");
    no_certificate_provider(&common, &at_common)?;
    let certificate = take_certificates(&mut common, &at_common)?;
    let Some((ca, server_ids, crl)) = take_validation(&mut common, &at_common)? else {
        return Err(XdsError::resource(
            format!("{at_common}.validation_context"),
            "is missing: flatmesh verifies every TLS endpoint; give trusted_ca and the endpoints' SPIFFE IDs (match_typed_subject_alt_names)",
        ));
    };
    let own = alpn_of(protocol);
    check_alpn(
        &take_alpn(&mut common),
        &[own],
        &format!("{at_common}.alpn_protocols"),
        &format!("flatmesh offers the cluster's own protocol, `{own}`; list only it, or nothing"),
    )?;
    take_tls_params(&mut common, &at_common)?;
    reject_rest(&common, &at_common)?;
    let (cert, key) = certificate.unzip();
    Ok(Some(model::ClusterTls {
        ca,
        cert,
        key,
        server_ids,
        sni: (!sni.is_empty()).then_some(sni),
        crl,
    }))
}

/// Certificate providers (Envoy's plugin mechanism): refused with what to write instead.
fn no_certificate_provider(common: &CommonTlsContext, at: &str) -> Result<()> {
    let provider = |field: &str| {
        XdsError::resource(
            format!("{at}.{field}"),
            "certificate providers are not supported: give the files (tls_certificates, validation_context.trusted_ca as `filename`) or an SDS secret (sds_config: { ads: {} })",
        )
    };
    if common.tls_certificate_provider_instance.is_some() {
        return Err(provider("tls_certificate_provider_instance"));
    }
    if common.tls_certificate_certificate_provider.is_some() {
        return Err(provider("tls_certificate_certificate_provider"));
    }
    if common
        .tls_certificate_certificate_provider_instance
        .is_some()
    {
        return Err(provider("tls_certificate_certificate_provider_instance"));
    }
    use common_tls_context::ValidationContextType as V;
    match &common.validation_context_type {
        Some(V::ValidationContextCertificateProvider(_)) => {
            Err(provider("validation_context_certificate_provider"))
        }
        Some(V::ValidationContextCertificateProviderInstance(_)) => {
            Err(provider("validation_context_certificate_provider_instance"))
        }
        _ => Ok(()),
    }
}

/// The one certificate and key, if any, as file names, or as an SDS secret's stand-ins.
fn take_certificates(
    common: &mut CommonTlsContext,
    at: &str,
) -> Result<Option<(PathBuf, PathBuf)>> {
    let mut secrets = std::mem::take(&mut common.tls_certificate_sds_secret_configs);
    let mut certificates = std::mem::take(&mut common.tls_certificates);
    let count = secrets.len() + certificates.len();
    if count > 1 {
        return Err(XdsError::resource(
            format!("{at}.tls_certificates"),
            format!(
                "has {count} certificates (tls_certificates and tls_certificate_sds_secret_configs together); flatmesh presents one (no selection by SNI or key type)"
            ),
        ));
    }
    if let Some(secret) = secrets.pop() {
        let name = sds_name(
            secret,
            &format!("{at}.tls_certificate_sds_secret_configs[0]"),
        )?;
        return Ok(Some((
            SecretRef::path(&name, SecretPart::Cert),
            SecretRef::path(&name, SecretPart::Key),
        )));
    }
    let Some(mut c) = certificates.pop() else {
        return Ok(None);
    };
    let at = format!("{at}.tls_certificates[0]");
    let cert = file_name(
        c.certificate_chain.take(),
        &format!("{at}.certificate_chain"),
    )?;
    let key = file_name(c.private_key.take(), &format!("{at}.private_key"))?;
    reject_rest(&c, &at)?;
    Ok(Some((cert, key)))
}

/// The name of a secret to be had over ADS (`sds_config: { ads: {} }`) or from the bootstrap's
/// `static_resources.secrets` (no `sds_config`); other sources are refused.
fn sds_name(mut secret: SdsSecretConfig, at: &str) -> Result<String> {
    let name = std::mem::take(&mut secret.name);
    if name.is_empty() {
        return Err(XdsError::resource(
            format!("{at}.name"),
            "is empty; name the secret (a SPIFFE ID for a certificate from flatmesh control, ROOTCA for its trust bundle)",
        ));
    }
    if let Some(mut source) = secret.sds_config.take() {
        let at = format!("{at}.sds_config");
        if !matches!(
            source.config_source_specifier.take(),
            Some(config_source::ConfigSourceSpecifier::Ads(_))
        ) {
            return Err(XdsError::resource(
                &at,
                "only `ads: {}` is supported (the secret comes on the node's ADS stream), or no sds_config for a static secret of the bootstrap",
            ));
        }
        source.initial_fetch_timeout = None; // flatmesh warms until the secret arrives
        if source.resource_api_version == ApiVersion::V3 as i32 {
            source.resource_api_version = 0;
        }
        reject_rest(&source, &at)?;
    }
    reject_rest(&secret, at)?;
    Ok(name)
}

/// Which file of a secret a stand-in path is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretPart {
    /// The certificate chain of a `tls_certificate` secret.
    Cert,
    /// Its private key.
    Key,
    /// The roots of a `validation_context` secret.
    Ca,
}

impl SecretPart {
    fn tag(self) -> &'static str {
        match self {
            SecretPart::Cert => "cert",
            SecretPart::Key => "key",
            SecretPart::Ca => "ca",
        }
    }
}

/// An SDS secret named where a file path goes, until [`resolve_secrets`] puts in the file.
/// The stand-in starts with a NUL byte, which no file path can hold, so it never names a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRef {
    pub name: String,
    pub part: SecretPart,
}

const SECRET_MARK: &str = "\0sds\0";

impl SecretRef {
    fn path(name: &str, part: SecretPart) -> PathBuf {
        PathBuf::from(format!("{SECRET_MARK}{}\0{name}", part.tag()))
    }

    /// The secret a path stands in for, if it does.
    pub fn of(path: &Path) -> Option<SecretRef> {
        let rest = path.to_str()?.strip_prefix(SECRET_MARK)?;
        let (tag, name) = rest.split_once('\0')?;
        let part = [SecretPart::Cert, SecretPart::Key, SecretPart::Ca]
            .into_iter()
            .find(|p| p.tag() == tag)?;
        Some(SecretRef {
            name: name.to_string(),
            part,
        })
    }
}

/// Where the secrets' files are.
pub trait SecretFiles {
    /// The certificate chain and key files of `tls_certificate` secret `name`, if held.
    fn certificate(&self, name: &str) -> Option<(PathBuf, PathBuf)>;
    /// The roots file of `validation_context` secret `name`, if held.
    fn trusted_ca(&self, name: &str) -> Option<PathBuf>;
    /// The CRL file that came with `validation_context` secret `name`, if it had one.
    fn crl(&self, _name: &str) -> Option<PathBuf> {
        None
    }
}

/// No secrets at all: every SDS reference waits.
pub struct NoSecrets;

impl SecretFiles for NoSecrets {
    fn certificate(&self, _: &str) -> Option<(PathBuf, PathBuf)> {
        None
    }
    fn trusted_ca(&self, _: &str) -> Option<PathBuf> {
        None
    }
}

/// The CRL file of the validation secret `ca` stands in for, if it came with one (a TLS
/// context's own `crl` file wins).
fn secret_crl(ca: &Path, files: &dyn SecretFiles) -> Option<PathBuf> {
    SecretRef::of(ca)
        .filter(|s| s.part == SecretPart::Ca)
        .and_then(|s| files.crl(&s.name))
}

/// Listeners and clusters that wait for secrets not held yet: secret name -> who waits.
pub type Waiting = BTreeMap<String, BTreeSet<String>>;

/// Puts the secrets' files in for their stand-ins in every listener's and cluster's `tls`.
/// A listener that names a secret not held is left out, and a cluster that does is left
/// without endpoints and TLS (it answers 503), until the secret arrives: neither is ever served
/// with part of its TLS. Returns who waits for what.
pub fn resolve_secrets(config: &mut model::Config, files: &dyn SecretFiles) -> Waiting {
    let mut waiting = Waiting::new();
    let mut resolve = |path: &mut PathBuf, who: &str| -> bool {
        let Some(secret) = SecretRef::of(path) else {
            return true;
        };
        let found = match secret.part {
            SecretPart::Cert => files.certificate(&secret.name).map(|(cert, _)| cert),
            SecretPart::Key => files.certificate(&secret.name).map(|(_, key)| key),
            SecretPart::Ca => files.trusted_ca(&secret.name),
        };
        match found {
            Some(file) => {
                *path = file;
                true
            }
            None => {
                waiting
                    .entry(secret.name)
                    .or_default()
                    .insert(who.to_string());
                false
            }
        }
    };
    config.listeners.retain_mut(|l| {
        let who = format!("Listener \"{}\"", l.name);
        match &mut l.tls {
            Some(tls) => {
                let mut ok = resolve(&mut tls.cert, &who);
                ok &= resolve(&mut tls.key, &who);
                if let Some(ca) = &mut tls.client_ca {
                    let crl = secret_crl(ca, files);
                    ok &= resolve(ca, &who);
                    tls.crl = tls.crl.take().or(crl);
                }
                ok
            }
            None => true,
        }
    });
    for c in &mut config.clusters {
        let who = format!("Cluster \"{}\"", c.name);
        let Some(tls) = &mut c.tls else { continue };
        let crl = secret_crl(&tls.ca, files);
        let mut ok = resolve(&mut tls.ca, &who);
        tls.crl = tls.crl.take().or(crl);
        for path in [&mut tls.cert, &mut tls.key].into_iter().flatten() {
            ok &= resolve(path, &who);
        }
        if !ok {
            c.tls = None;
            c.tunnel = None;
            c.tunnel_port = None;
            c.endpoints = Default::default();
            c.health_check = None;
        }
    }
    waiting
}

/// A validation context: the CA file, the SPIFFE IDs or patterns it admits, the CRL file.
type Validation = (PathBuf, Vec<String>, Option<PathBuf>);

/// The validation context's CA file (or roots secret), the SPIFFE IDs or patterns it admits,
/// and its CRL file. A `combined_validation_context` takes the IDs from its `default_validation_context`
/// and the roots from its secret, as Istio writes it; a bare `validation_context_sds_secret_config`
/// is refused, since the secret would carry the IDs too and flatmesh takes those from the config.
fn take_validation(common: &mut CommonTlsContext, at: &str) -> Result<Option<Validation>> {
    use common_tls_context::ValidationContextType as V;
    let (mut v, at, roots) = match common.validation_context_type.take() {
        None => return Ok(None),
        Some(V::ValidationContext(v)) => (v, format!("{at}.validation_context"), None),
        Some(V::CombinedValidationContext(mut combined)) => {
            let at = format!("{at}.combined_validation_context");
            let Some(secret) = combined.validation_context_sds_secret_config.take() else {
                return Err(XdsError::resource(
                    format!("{at}.validation_context_sds_secret_config"),
                    "is missing; it names the secret holding the roots (ROOTCA from flatmesh control)",
                ));
            };
            let name = sds_name(secret, &format!("{at}.validation_context_sds_secret_config"))?;
            let default = combined.default_validation_context.take().unwrap_or_default();
            reject_rest(&combined, &at)?;
            (
                default,
                format!("{at}.default_validation_context"),
                Some(SecretRef::path(&name, SecretPart::Ca)),
            )
        }
        Some(V::ValidationContextSdsSecretConfig(_)) => {
            return Err(XdsError::resource(
                format!("{at}.validation_context_sds_secret_config"),
                "is not supported alone: flatmesh takes the SPIFFE IDs a peer must present from the config, not from a secret; write combined_validation_context { default_validation_context: { match_typed_subject_alt_names }, validation_context_sds_secret_config: { name: ROOTCA, sds_config: { ads: {} } } }",
            ))
        }
        Some(_) => return Ok(None), // certificate providers: refused by no_certificate_provider
    };
    let ca = match roots {
        Some(secret) => {
            if v.trusted_ca.is_some() {
                return Err(XdsError::resource(
                    format!("{at}.trusted_ca"),
                    "is given besides the roots secret; give the roots once",
                ));
            }
            secret
        }
        None => file_name(v.trusted_ca.take(), &format!("{at}.trusted_ca"))?,
    };
    if !v.match_subject_alt_names.is_empty() {
        return Err(XdsError::resource(
            format!("{at}.match_subject_alt_names"),
            "is not supported (Envoy deprecates it); write match_typed_subject_alt_names with san_type: URI",
        ));
    }
    let matchers = std::mem::take(&mut v.match_typed_subject_alt_names);
    if matchers.is_empty() {
        return Err(XdsError::resource(
            format!("{at}.match_typed_subject_alt_names"),
            "is empty: Envoy would accept any peer the CA signed, flatmesh accepts only listed SPIFFE IDs; add a URI matcher, e.g. { san_type: URI, matcher: { prefix: \"spiffe://example.org/ns/shop/\" } }",
        ));
    }
    let ids = matchers
        .iter()
        .enumerate()
        .map(|(i, m)| spiffe_pattern(m, &format!("{at}.match_typed_subject_alt_names[{i}]")))
        .collect::<Result<Vec<_>>>()?;
    let crl = v
        .crl
        .take()
        .map(|crl| file_name(Some(crl), &format!("{at}.crl")))
        .transpose()?;
    reject_rest(&v, &at)?;
    Ok(Some((ca, ids, crl)))
}

/// A URI SAN matcher as a SPIFFE ID (exact) or a `/*` pattern (a prefix that ends at `/`).
fn spiffe_pattern(m: &SubjectAltNameMatcher, at: &str) -> Result<String> {
    let mut rest = m.clone();
    if rest.san_type != subject_alt_name_matcher::SanType::Uri as i32 {
        let kind = subject_alt_name_matcher::SanType::try_from(rest.san_type)
            .map(|t| t.as_str_name())
            .unwrap_or("unknown");
        return Err(XdsError::resource(
            format!("{at}.san_type"),
            format!("{kind} is not supported: flatmesh checks peers by SPIFFE ID, a URI SAN; write san_type: URI"),
        ));
    }
    rest.san_type = 0;
    let Some(matcher) = rest.matcher.take() else {
        return Err(XdsError::resource(
            format!("{at}.matcher"),
            "is missing; write { exact: SPIFFE_ID } or { prefix: \"spiffe://TD/ns/NS/\" }",
        ));
    };
    reject_rest(&rest, at)?;
    spiffe_text(matcher, &format!("{at}.matcher"))
}

/// A string matcher on a SPIFFE ID (named by `at`) as the ID (exact) or a `/*` pattern (a
/// prefix that ends at `/`), the inverse of [`spiffe_matcher`].
pub(crate) fn spiffe_text(matcher: StringMatcher, at: &str) -> Result<String> {
    if matcher.ignore_case {
        return Err(XdsError::resource(
            format!("{at}.ignore_case"),
            "is not supported: SPIFFE IDs are compared exactly",
        ));
    }
    let spiffe = |text: &str| {
        if text.starts_with(SPIFFE_SCHEME) && !text.contains('*') {
            Ok(())
        } else {
            Err(format!(
                "`{text}` is not a SPIFFE ID (spiffe://TRUST_DOMAIN/PATH, without `*`)"
            ))
        }
    };
    match matcher.match_pattern {
        Some(string_matcher::MatchPattern::Exact(id)) => {
            spiffe(&id).map_err(|why| XdsError::resource(format!("{at}.exact"), why))?;
            Ok(id)
        }
        Some(string_matcher::MatchPattern::Prefix(prefix)) => {
            spiffe(&prefix).map_err(|why| XdsError::resource(format!("{at}.prefix"), why))?;
            if !prefix.ends_with('/') {
                return Err(XdsError::resource(
                    format!("{at}.prefix"),
                    format!("`{prefix}` does not end with `/`: flatmesh admits whole path segments (`{prefix}/` admits every ID under it)"),
                ));
            }
            Ok(format!("{prefix}*"))
        }
        _ => Err(XdsError::resource(
            at,
            "only exact (one SPIFFE ID) and prefix (every ID under a path ending in `/`) are supported",
        )),
    }
}

fn take_alpn(common: &mut CommonTlsContext) -> Vec<String> {
    std::mem::take(&mut common.alpn_protocols)
}

/// `alpn` may name only protocols in `offered`; `why` says what flatmesh offers.
fn check_alpn(alpn: &[String], offered: &[&str], at: &str, why: &str) -> Result<()> {
    match alpn.iter().find(|p| !offered.contains(&p.as_str())) {
        Some(p) => Err(XdsError::resource(
            at,
            format!("`{p}` is not supported: {why}"),
        )),
        None => Ok(()),
    }
}

/// TLS parameters flatmesh can honour: versions from TLS 1.2 to 1.3, its own cipher suites.
fn take_tls_params(common: &mut CommonTlsContext, at: &str) -> Result<()> {
    use tls_parameters::TlsProtocol;
    let Some(mut params) = common.tls_params.take() else {
        return Ok(());
    };
    let at = format!("{at}.tls_params");
    let version = |v: i32| {
        TlsProtocol::try_from(v)
            .map(|t| t.as_str_name())
            .unwrap_or("unknown")
    };
    let min = std::mem::take(&mut params.tls_minimum_protocol_version);
    if ![TlsProtocol::TlsAuto as i32, TlsProtocol::TlSv12 as i32].contains(&min) {
        return Err(XdsError::resource(
            format!("{at}.tls_minimum_protocol_version"),
            format!("{} is not supported: flatmesh speaks TLS 1.2 and 1.3; write TLSv1_2 or leave it out", version(min)),
        ));
    }
    let max = std::mem::take(&mut params.tls_maximum_protocol_version);
    if ![TlsProtocol::TlsAuto as i32, TlsProtocol::TlSv13 as i32].contains(&max) {
        return Err(XdsError::resource(
            format!("{at}.tls_maximum_protocol_version"),
            format!("{} is not supported: flatmesh speaks TLS 1.2 and 1.3; write TLSv1_3 or leave it out", version(max)),
        ));
    }
    if !params.cipher_suites.is_empty() {
        return Err(XdsError::resource(
            format!("{at}.cipher_suites"),
            "is not supported: flatmesh negotiates its own AEAD suites (TLS 1.3 AES-GCM and ChaCha20-Poly1305, TLS 1.2 ECDHE with AES-GCM); remove it",
        ));
    }
    reject_rest(&params, &at)
}

/// A certificate, key or CA given as a file, the only kind flatmesh reads (and re-reads on
/// reload).
fn file_name(source: Option<DataSource>, at: &str) -> Result<PathBuf> {
    let Some(mut source) = source else {
        return Err(XdsError::resource(
            at,
            "is missing; give the PEM file as { filename: PATH }",
        ));
    };
    let name = match source.specifier.take() {
        Some(data_source::Specifier::Filename(name)) if !name.is_empty() => name,
        Some(data_source::Specifier::Filename(_)) | None => {
            return Err(XdsError::resource(
                format!("{at}.filename"),
                "is empty; give the path of a PEM file",
            ))
        }
        Some(
            data_source::Specifier::InlineString(_) | data_source::Specifier::InlineBytes(_),
        ) => {
            return Err(XdsError::resource(
                at,
                "inline certificates and keys are not supported: write the PEM to a file and give { filename: PATH }",
            ))
        }
        Some(data_source::Specifier::EnvironmentVariable(_)) => {
            return Err(XdsError::resource(
                at,
                "environment_variable is not supported: write the PEM to a file and give { filename: PATH }",
            ))
        }
    };
    reject_rest(&source, at)?;
    Ok(PathBuf::from(name))
}

/// The names of the SDS secrets a listener's or cluster's transport socket refers to (none for
/// a socket that does not decode: translation reports that).
pub(crate) fn secret_names(socket: &TransportSocket) -> Vec<String> {
    let Some(transport_socket::ConfigType::TypedConfig(any)) = &socket.config_type else {
        return Vec::new();
    };
    let common = if any.type_url == DownstreamTlsContext::type_url() {
        <DownstreamTlsContext as prost::Message>::decode(any.value.as_slice())
            .ok()
            .and_then(|c| c.common_tls_context)
    } else if any.type_url == UpstreamTlsContext::type_url() {
        <UpstreamTlsContext as prost::Message>::decode(any.value.as_slice())
            .ok()
            .and_then(|c| c.common_tls_context)
    } else {
        None
    };
    let Some(common) = common else {
        return Vec::new();
    };
    use common_tls_context::ValidationContextType as V;
    let mut names: Vec<String> = common
        .tls_certificate_sds_secret_configs
        .iter()
        .map(|s| s.name.clone())
        .collect();
    match &common.validation_context_type {
        Some(V::CombinedValidationContext(c)) => names.extend(
            c.validation_context_sds_secret_config
                .iter()
                .map(|s| s.name.clone()),
        ),
        Some(V::ValidationContextSdsSecretConfig(s)) => names.push(s.name.clone()),
        _ => {}
    }
    names.retain(|n| !n.is_empty());
    names
}
