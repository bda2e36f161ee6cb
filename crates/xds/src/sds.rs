//! SDS, Envoy's secret discovery, both sides (docs/security.md, "SDS").
//!
//! - The server side is a [`SecretSource`]: `flatmesh control` answers each node with the
//!   secrets it may hold (its workload certificates, by SPIFFE ID, and the trust bundle,
//!   [`ROOTCA`]); [`crate::server`] serves them over ADS, only on a TLS channel whose caller is
//!   known by its bootstrap token, since a `tls_certificate` secret carries a private key.
//! - The client side is a [`SecretDir`]: the xDS client writes every secret it receives to files
//!   (keys mode 0600, each file replaced atomically, key first) and the listeners and clusters
//!   that name the secret read those files ([`crate::tls::resolve_secrets`]). A new version is
//!   written over the old and the node reloads: new connections present it, open ones keep
//!   theirs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
/// Envoy's SDS resource.
pub use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, CertificateValidationContext, TlsCertificate,
};

/// The Envoy messages an SDS reference is written with, for crates without envoy-types.
pub mod envoy {
    pub use envoy_types::pb::envoy::config::core::v3::{
        config_source, transport_socket, ConfigSource,
    };
    pub use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        common_tls_context, DownstreamTlsContext, SdsSecretConfig,
    };
    pub use prost::Message;
}
use tokio::sync::watch;

use crate::error::{Result, XdsError};
use crate::to_model::reject_rest;

/// The name of the trust bundle's secret, as Istio names it.
pub const ROOTCA: &str = "ROOTCA";

/// What `flatmesh control` gives each node over SDS.
pub trait SecretSource: Send + Sync + 'static {
    /// Secret `name` for `node` (known by its bootstrap token), or why not: a refusal is logged
    /// and counted by the source.
    fn secret(&self, node: &str, name: &str) -> std::result::Result<Secret, String>;
    /// Changes whenever a secret may have changed (a certificate is due for renewal, the root
    /// rotated), so that the streams ask again.
    fn changes(&self) -> watch::Receiver<u64>;
}

/// A `tls_certificate` secret: the chain and the private key, inline (the secret is the file).
pub fn certificate_secret(name: &str, chain_pem: &str, key_pem: &str) -> Secret {
    Secret {
        name: name.to_string(),
        r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: Some(inline(chain_pem)),
            private_key: Some(inline(key_pem)),
            ..Default::default()
        })),
    }
}

/// A `validation_context` secret holding the roots and, when the CA has revoked certificates,
/// its CRLs (the peer IDs stay in the TLS contexts).
pub fn roots_secret(name: &str, bundle_pem: &str, crl_pem: Option<&str>) -> Secret {
    Secret {
        name: name.to_string(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: Some(inline(bundle_pem)),
                crl: crl_pem.map(inline),
                ..Default::default()
            },
        )),
    }
}

fn inline(pem: &str) -> DataSource {
    DataSource {
        specifier: Some(data_source::Specifier::InlineBytes(pem.as_bytes().to_vec())),
        ..Default::default()
    }
}

/// What kind of secret a name holds in a [`SecretDir`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Certificate,
    /// Roots, and whether a CRL came with them.
    Roots {
        crl: bool,
    },
}

/// The directory the xDS client writes received secrets to (`flatmesh node --sds-dir DIR`).
#[derive(Debug)]
pub struct SecretDir {
    dir: PathBuf,
    held: BTreeMap<String, Kind>,
}

impl SecretDir {
    pub fn new(dir: PathBuf) -> SecretDir {
        SecretDir {
            dir,
            held: BTreeMap::new(),
        }
    }

    /// `DIR/STEM.pem`, `DIR/STEM.key` (certificates) or `DIR/STEM.roots.pem`: the name with
    /// every character but letters, digits, `.`, `-` and `_` as `_`, and a hash of the whole
    /// name so that two names never share files.
    fn stem(&self, name: &str) -> PathBuf {
        use std::hash::{Hash, Hasher};
        let clean: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        self.dir.join(format!("{clean}.{:08x}", h.finish() as u32))
    }

    fn files(&self, name: &str) -> (PathBuf, PathBuf, PathBuf) {
        (
            self.file(name, ".pem"),
            self.file(name, ".key"),
            self.file(name, ".roots.pem"),
        )
    }

    /// `DIR/STEM.crl.pem`: the CRLs that came with roots.
    fn crl_file(&self, name: &str) -> PathBuf {
        self.file(name, ".crl.pem")
    }

    fn file(&self, name: &str, suffix: &str) -> PathBuf {
        let mut path = self.stem(name).into_os_string();
        path.push(suffix);
        PathBuf::from(path)
    }

    /// Checks `secret` and writes its files. Only what flatmesh uses is taken: a certificate
    /// chain and key, or roots, inline; anything else is an error naming the field.
    pub fn write(&mut self, secret: &Secret) -> Result<()> {
        let at = format!("Secret \"{}\"", secret.name);
        let mut rest = secret.clone();
        rest.name.clear();
        let (cert, key, roots) = self.files(&secret.name);
        let kind = match rest.r#type.take() {
            Some(secret::Type::TlsCertificate(mut t)) => {
                let chain = pem(
                    t.certificate_chain.take(),
                    &format!("{at}: certificate_chain"),
                )?;
                let private = pem(t.private_key.take(), &format!("{at}: private_key"))?;
                reject_rest(&t, &format!("{at}: tls_certificate"))?;
                self.create_dir()?;
                self.replace(&key, &private, 0o600)?;
                self.replace(&cert, &chain, 0o644)?;
                Kind::Certificate
            }
            Some(secret::Type::ValidationContext(mut v)) => {
                let bundle = pem(v.trusted_ca.take(), &format!("{at}: trusted_ca"))?;
                let crl = match v.crl.take() {
                    Some(crl) => Some(crl_pem(crl, &format!("{at}: crl"))?),
                    None => None,
                };
                reject_rest(
                    &v,
                    &format!("{at}: validation_context (only trusted_ca and crl: the peer IDs are the TLS context's)"),
                )?;
                self.create_dir()?;
                if let Some(crl) = &crl {
                    self.replace(&self.crl_file(&secret.name), crl, 0o644)?;
                }
                self.replace(&roots, &bundle, 0o644)?;
                Kind::Roots { crl: crl.is_some() }
            }
            _ => return Err(XdsError::resource(
                at,
                "is neither a tls_certificate nor a validation_context; flatmesh takes only those",
            )),
        };
        reject_rest(&rest, &at)?;
        self.held.insert(secret.name.clone(), kind);
        Ok(())
    }

    /// Forgets `name` (its files stay until overwritten: an open connection may still use them).
    pub fn forget(&mut self, name: &str) {
        self.held.remove(name);
    }

    fn create_dir(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|source| XdsError::Read {
            path: self.dir.clone(),
            source,
        })
    }

    fn replace(&self, path: &Path, text: &str, mode: u32) -> Result<()> {
        flatmesh_identity::ca::replace(path, text, mode).map_err(|e| {
            XdsError::Apply(format!(
                "cannot write the secret file {}: {e}",
                path.display()
            ))
        })
    }
}

impl crate::tls::SecretFiles for SecretDir {
    fn certificate(&self, name: &str) -> Option<(PathBuf, PathBuf)> {
        (self.held.get(name) == Some(&Kind::Certificate)).then(|| {
            let (cert, key, _) = self.files(name);
            (cert, key)
        })
    }

    fn trusted_ca(&self, name: &str) -> Option<PathBuf> {
        matches!(self.held.get(name), Some(Kind::Roots { .. })).then(|| self.files(name).2)
    }

    fn crl(&self, name: &str) -> Option<PathBuf> {
        (self.held.get(name) == Some(&Kind::Roots { crl: true })).then(|| self.crl_file(name))
    }
}

/// The CRL PEM of a validation secret: bounded, and every block a CRL (the node's verifiers
/// read the file at the reload the secret triggers; a bad one is refused here, by name, and
/// the node keeps the secret it had).
fn crl_pem(source: DataSource, at: &str) -> Result<String> {
    let text = pem(Some(source), at)?;
    if text.len() as u64 > flatmesh_identity::crl::MAX_CRL_FILE {
        return Err(XdsError::resource(
            at,
            format!(
                "is {} bytes; a CRL may be at most {} bytes",
                text.len(),
                flatmesh_identity::crl::MAX_CRL_FILE
            ),
        ));
    }
    flatmesh_identity::crl::crls_from_pem(text.as_bytes())
        .map_err(|why| XdsError::resource(at, why))?;
    Ok(text)
}

/// The PEM text of an inline data source.
fn pem(source: Option<DataSource>, at: &str) -> Result<String> {
    let text = match source.and_then(|s| s.specifier) {
        Some(data_source::Specifier::InlineBytes(bytes)) => String::from_utf8(bytes)
            .map_err(|_| XdsError::resource(at, "is not PEM text (not UTF-8)"))?,
        Some(data_source::Specifier::InlineString(text)) => text,
        _ => {
            return Err(XdsError::resource(
                at,
                "must be inline (inline_bytes or inline_string): a secret carries its PEM",
            ))
        }
    };
    if !text.contains("-----BEGIN ") {
        return Err(XdsError::resource(at, "holds no PEM block"));
    }
    Ok(text)
}
