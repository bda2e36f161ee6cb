//! X.509 SVIDs: what an issued one holds, reading one from disk, and reading the identity out of
//! a peer's certificate.

use crate::error::IdentityError;
use crate::spiffe::SpiffeId;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::time::{Duration, SystemTime};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// A certificate the CA just issued: the leaf then its chain, in PEM, and the private key when
/// the CA made it (`issue`; `sign_csr` leaves the key with the requester).
#[derive(Clone, Debug)]
pub struct IssuedSvid {
    pub id: SpiffeId,
    pub chain_pem: String,
    pub key_pem: Option<String>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl IssuedSvid {
    /// Writes `PREFIX.pem` (leaf then chain) and, if the CA made the key, `PREFIX.key` (0600).
    pub fn write(&self, prefix: &Path) -> Result<(), IdentityError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let with = |extension: &str| {
            let mut name = prefix.as_os_str().to_owned();
            name.push(extension);
            std::path::PathBuf::from(name)
        };
        let write = |path: &Path, text: &str, mode: u32| {
            let _ = std::fs::remove_file(path);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|e| IdentityError::io(path, e))
        };
        if let Some(key) = &self.key_pem {
            write(&with(".key"), key, 0o600)?;
        }
        write(&with(".pem"), &self.chain_pem, 0o644)
    }
}

/// PEM text of one DER object.
pub fn pem(tag: &str, der: &[u8]) -> String {
    ::pem::encode(&::pem::Pem::new(tag, der.to_vec())).replace("\r\n", "\n")
}

/// What flatmesh reads out of a certificate.
#[derive(Clone, Debug)]
pub struct CertificateInfo {
    /// The SPIFFE ID, when the certificate has exactly one URI SAN and it is a valid one.
    pub spiffe_id: Option<SpiffeId>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub is_ca: bool,
    /// The subject public key's bits (for matching a key to its certificate).
    pub public_key: Vec<u8>,
}

fn system_time(t: x509_parser::time::ASN1Time) -> SystemTime {
    let seconds = t.timestamp();
    if seconds >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(seconds as u64)
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_secs(seconds.unsigned_abs())
    }
}

impl CertificateInfo {
    pub fn parse(der: &[u8]) -> Result<CertificateInfo, String> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| format!("not an X.509 certificate ({e})"))?;
        let uris: Vec<&str> = match cert.subject_alternative_name() {
            Ok(Some(san)) => san
                .value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    GeneralName::URI(uri) => Some(*uri),
                    _ => None,
                })
                .collect(),
            Ok(None) => Vec::new(),
            Err(e) => return Err(format!("its subject alternative names do not parse ({e})")),
        };
        let spiffe_id = match uris.as_slice() {
            [one] => SpiffeId::parse(one).ok(),
            _ => None,
        };
        let is_ca = cert
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|c| c.value.ca);
        Ok(CertificateInfo {
            spiffe_id,
            not_before: system_time(cert.validity().not_before),
            not_after: system_time(cert.validity().not_after),
            is_ca,
            public_key: cert.public_key().subject_public_key.data.to_vec(),
        })
    }
}

/// The SPIFFE ID of a peer's leaf certificate. The X.509-SVID rules: exactly one URI SAN, and
/// it is a valid SPIFFE ID.
pub fn spiffe_id_of(der: &[u8]) -> Result<SpiffeId, String> {
    CertificateInfo::parse(der)?
        .spiffe_id
        .ok_or_else(|| "the certificate does not carry exactly one SPIFFE ID (URI SAN)".into())
}

/// A PKCS#10 request for `id`, signed by `key` (what a node sends the control center).
pub fn certificate_request(id: &SpiffeId, key: &rcgen::KeyPair) -> Result<String, IdentityError> {
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.subject_alt_names =
        vec![rcgen::SanType::URI(id.as_str().try_into().map_err(
            |_| IdentityError::Bundle("a SPIFFE ID is ASCII".into()),
        )?)];
    Ok(params.serialize_request(key)?.pem()?)
}

/// A fresh ECDSA P-256 key and a request for `id` signed by it: (key PEM, CSR PEM).
pub fn new_request(id: &SpiffeId) -> Result<(String, String), IdentityError> {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let csr = certificate_request(id, &key)?;
    Ok((key.serialize_pem(), csr))
}

/// When a certificate valid from `not_before` to `not_after` is renewed: half way through.
pub fn half_life(not_before: SystemTime, not_after: SystemTime) -> SystemTime {
    not_before + not_after.duration_since(not_before).unwrap_or_default() / 2
}

/// An identity this node presents: its certificate chain and private key.
#[derive(Debug)]
pub struct Svid {
    pub id: SpiffeId,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub not_after: SystemTime,
}

impl Clone for Svid {
    fn clone(&self) -> Svid {
        Svid {
            id: self.id.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            not_after: self.not_after,
        }
    }
}

impl Svid {
    /// Reads `cert` (leaf then chain, PEM) and `key` (PEM).
    pub fn load(cert: &Path, key: &Path) -> Result<Svid, IdentityError> {
        let chain = crate::ca::load_certificates(cert)?;
        let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| IdentityError::BadPem {
            path: key.to_path_buf(),
            why: format!(
                "no private key in it ({e}); give the .key file that `flatmesh ca issue` wrote"
            ),
        })?;
        Svid::from_parts(chain, key_der).map_err(|why| IdentityError::BadPem {
            path: cert.to_path_buf(),
            why,
        })
    }

    /// From PEM text (what the control center sends a node).
    pub fn from_pem(chain_pem: &str, key_pem: &str) -> Result<Svid, String> {
        let chain = crate::ca::certificates_from_pem(chain_pem.as_bytes())?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| format!("no private key in the PEM text ({e})"))?;
        Svid::from_parts(chain, key)
    }

    fn from_parts(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<Svid, String> {
        let info = CertificateInfo::parse(&chain[0])?;
        let id = info.spiffe_id.ok_or(
            "the first certificate does not carry exactly one SPIFFE ID (URI SAN); it must be an SVID from `flatmesh ca issue`",
        )?;
        Ok(Svid {
            id,
            chain,
            key,
            not_after: info.not_after,
        })
    }
}
