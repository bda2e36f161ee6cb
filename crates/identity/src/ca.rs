//! The mesh's certificate authority: a root per trust domain that issues X.509 SVIDs.
//!
//! On disk (`flatmesh ca init --dir DIR`): `DIR/ca.pem`, the trust bundle (the signing root
//! first, then roots kept from before a rotation), and `DIR/ca.key`, the signing root's private
//! key (PKCS#8, mode 0600). The root carries the trust domain as its own SPIFFE ID
//! (`spiffe://TD`, a URI SAN), so loading the directory needs nothing else.
//!
//! SVIDs are ECDSA P-256 leaves with exactly one URI SAN (the workload's SPIFFE ID), key
//! usage `digitalSignature`, extended key usage server and client auth, and a short lifetime
//! (24 h by default). They start a minute in the past, so a peer whose clock is a little behind
//! accepts them at once.
//!
//! Rotation keeps both roots in the bundle for an overlap: `rotate` makes a new root the signer
//! and keeps the old one as trusted; `retire_old_roots` drops it once every certificate it signed
//! has been replaced (after one leaf lifetime). A peer that trusts the bundle accepts leaves of
//! both roots throughout, so no connection fails over it.

use crate::error::IdentityError;
use crate::spiffe::SpiffeId;
use crate::svid::{self, IssuedSvid};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// Lifetime of a root.
pub const ROOT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Default lifetime of an SVID.
pub const DEFAULT_SVID_TTL: Duration = Duration::from_secs(24 * 3600);
/// Shortest and longest SVID lifetimes `issue` accepts.
pub const MIN_TTL: Duration = Duration::from_secs(60);
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// How far in the past a new certificate starts (clock skew between nodes).
const BACKDATE: Duration = Duration::from_secs(60);

pub const CERT_FILE: &str = "ca.pem";
pub const KEY_FILE: &str = "ca.key";

/// A root that signs SVIDs for one trust domain, with the bundle of roots peers must trust.
pub struct Authority {
    trust_domain: String,
    issuer: Issuer<'static, KeyPair>,
    /// The signing root first, then roots kept from before a rotation.
    bundle: Vec<CertificateDer<'static>>,
    /// The signing root's validity end: no SVID outlives it.
    root_not_after: SystemTime,
}

impl std::fmt::Debug for Authority {
    /// The key stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("trust_domain", &self.trust_domain)
            .field("roots", &self.bundle.len())
            .finish()
    }
}

fn random_serial() -> Result<SerialNumber, IdentityError> {
    let mut bytes = [0u8; 16];
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| IdentityError::Bundle("the system's random source failed".into()))?;
    // A positive INTEGER: clear the sign bit.
    bytes[0] &= 0x7f;
    Ok(SerialNumber::from_slice(&bytes))
}

fn to_offset(time: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from(time)
}

fn root_params(trust_domain: &str) -> Result<CertificateParams, IdentityError> {
    let domain_id = SpiffeId::parse(&format!("spiffe://{trust_domain}"))?;
    let now = SystemTime::now();
    let serial = random_serial()?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "flatmesh");
    // A name of its own per root (the serial's first bytes): chain building matches issuers by
    // name, so two roots of one trust domain (a rotation, or a stranger's CA) stay apart and a
    // stranger's leaf is refused as "unknown CA" rather than as a bad signature.
    let tag: String = serial.to_bytes()[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    name.push(
        DnType::CommonName,
        format!("flatmesh root CA {trust_domain} {tag}"),
    );
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.subject_alt_names =
        vec![SanType::URI(domain_id.as_str().try_into().map_err(
            |_| IdentityError::Bundle("trust domain is not ASCII".into()),
        )?)];
    params.not_before = to_offset(now - BACKDATE);
    params.not_after = to_offset(now + ROOT_LIFETIME);
    params.serial_number = Some(serial);
    Ok(params)
}

fn leaf_params(
    id: &SpiffeId,
    not_before: SystemTime,
    not_after: SystemTime,
) -> Result<CertificateParams, IdentityError> {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "flatmesh");
    params.distinguished_name = name;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.subject_alt_names =
        vec![SanType::URI(id.as_str().try_into().map_err(|_| {
            IdentityError::Bundle("a SPIFFE ID is ASCII".into())
        })?)];
    params.use_authority_key_identifier_extension = true;
    params.not_before = to_offset(not_before);
    params.not_after = to_offset(not_after);
    params.serial_number = Some(random_serial()?);
    Ok(params)
}

fn write_new(path: &Path, contents: &str, mode: u32) -> Result<(), IdentityError> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                IdentityError::CaExists {
                    path: path.to_path_buf(),
                }
            } else {
                IdentityError::io(path, e)
            }
        })?;
    file.write_all(contents.as_bytes())
        .and_then(|_| file.sync_all())
        .map_err(|e| IdentityError::io(path, e))
}

/// Replaces `path` atomically (write a temporary file, then rename), with `mode`: a reader
/// sees the old file or the new one, never half of one.
pub fn replace(path: &Path, contents: &str, mode: u32) -> Result<(), IdentityError> {
    let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&temporary);
    write_new(&temporary, contents, mode).map_err(|e| match e {
        IdentityError::CaExists { path } => IdentityError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::AlreadyExists, "temporary file exists"),
        ),
        other => other,
    })?;
    std::fs::rename(&temporary, path).map_err(|e| IdentityError::io(path, e))
}

fn check_ttl(ttl: Duration) -> Result<(), IdentityError> {
    if (MIN_TTL..=MAX_TTL).contains(&ttl) {
        Ok(())
    } else {
        Err(IdentityError::BadTtl {
            ttl_secs: ttl.as_secs(),
        })
    }
}

impl Authority {
    /// A new root for `trust_domain`, in memory.
    pub fn generate(trust_domain: &str) -> Result<Authority, IdentityError> {
        crate::spiffe::check_trust_domain(trust_domain).map_err(|why| {
            IdentityError::BadSpiffeId {
                id: format!("spiffe://{trust_domain}"),
                why,
            }
        })?;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let params = root_params(trust_domain)?;
        let root = params.self_signed(&key)?;
        let root_not_after = SystemTime::now() + ROOT_LIFETIME;
        Ok(Authority {
            trust_domain: trust_domain.to_string(),
            issuer: Issuer::new(params, key),
            bundle: vec![root.der().clone()],
            root_not_after,
        })
    }

    /// A new root written to `dir` (created if missing). Refuses to overwrite an existing CA.
    pub fn init(trust_domain: &str, dir: &Path) -> Result<Authority, IdentityError> {
        std::fs::create_dir_all(dir).map_err(|e| IdentityError::io(dir, e))?;
        let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        for path in [&cert_path, &key_path] {
            if path.exists() {
                return Err(IdentityError::CaExists { path: path.clone() });
            }
        }
        let authority = Authority::generate(trust_domain)?;
        write_new(&key_path, &authority.issuer.key().serialize_pem(), 0o600)?;
        write_new(&cert_path, &authority.bundle_pem(), 0o644)?;
        Ok(authority)
    }

    /// The CA in `dir`, as `init` (or `rotate`) wrote it.
    pub fn load(dir: &Path) -> Result<Authority, IdentityError> {
        let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        let key_text =
            std::fs::read_to_string(&key_path).map_err(|e| IdentityError::io(&key_path, e))?;
        let key = KeyPair::from_pem(&key_text).map_err(|e| IdentityError::BadPem {
            path: key_path.clone(),
            why: format!("not a PKCS#8 private key ({e}); it must be the ca.key that `flatmesh ca init` wrote"),
        })?;
        let bundle = load_certificates(&cert_path)?;
        let root = &bundle[0];
        let info = svid::CertificateInfo::parse(root).map_err(|why| IdentityError::BadPem {
            path: cert_path.clone(),
            why,
        })?;
        if info.public_key != key.public_key_raw() {
            return Err(IdentityError::KeyMismatch {
                cert: cert_path,
                key: key_path,
            });
        }
        let id = info.spiffe_id.ok_or_else(|| IdentityError::BadPem {
            path: cert_path.clone(),
            why: "the first certificate carries no trust domain (URI SAN spiffe://TD); it must be the ca.pem that `flatmesh ca init` wrote".into(),
        })?;
        let issuer = Issuer::from_ca_cert_der(root, key)?;
        Ok(Authority {
            trust_domain: id.trust_domain().to_string(),
            issuer,
            bundle,
            root_not_after: info.not_after,
        })
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// When the signing root expires.
    pub fn root_not_after(&self) -> SystemTime {
        self.root_not_after
    }

    /// The signing root's issuer (for the CRL, crate::crl).
    pub(crate) fn signer(&self) -> &Issuer<'static, KeyPair> {
        &self.issuer
    }

    /// Every root peers must trust, the signing one first.
    pub fn bundle(&self) -> &[CertificateDer<'static>] {
        &self.bundle
    }

    pub fn bundle_pem(&self) -> String {
        self.bundle
            .iter()
            .map(|der| svid::pem("CERTIFICATE", der))
            .collect()
    }

    /// Issues an SVID for `id` with a fresh key.
    pub fn issue(&self, id: &SpiffeId, ttl: Duration) -> Result<IssuedSvid, IdentityError> {
        self.check_domain(id)?;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut issued = self.sign(id, &key, ttl)?;
        issued.key_pem = Some(key.serialize_pem());
        Ok(issued)
    }

    /// Signs a CSR (PEM or DER). Only the requested key and its single URI SAN are taken from
    /// the request: lifetime, usages and everything else are the CA's. `may_have` decides
    /// whether the requester may hold the requested identity (the control center's placement).
    pub fn sign_csr(
        &self,
        csr: &[u8],
        ttl: Duration,
        may_have: impl FnOnce(&SpiffeId) -> Result<(), IdentityError>,
    ) -> Result<IssuedSvid, IdentityError> {
        if csr.len() > 64 * 1024 {
            return Err(IdentityError::BadCsr {
                why: format!(
                    "it is {} bytes long; at most 64 KiB are accepted",
                    csr.len()
                ),
            });
        }
        let request = match std::str::from_utf8(csr) {
            Ok(text) if text.trim_start().starts_with("-----BEGIN") => {
                CertificateSigningRequestParams::from_pem(text)
            }
            _ => CertificateSigningRequestParams::from_der(&csr.to_vec().into()),
        }
        .map_err(|e| IdentityError::BadCsr {
            why: format!("{e} (send a PKCS#10 request signed by the key it names)"),
        })?;
        let uris: Vec<&str> = request
            .params
            .subject_alt_names
            .iter()
            .filter_map(|san| match san {
                SanType::URI(uri) => Some(uri.as_str()),
                _ => None,
            })
            .collect();
        let [uri] = uris.as_slice() else {
            return Err(IdentityError::BadCsr {
                why: format!(
                    "it names {} URI SANs; an SVID request names exactly one, the SPIFFE ID",
                    uris.len()
                ),
            });
        };
        let id = SpiffeId::parse(uri)?;
        self.check_domain(&id)?;
        may_have(&id)?;
        self.sign(&id, &request.public_key, ttl)
    }

    fn check_domain(&self, id: &SpiffeId) -> Result<(), IdentityError> {
        if id.trust_domain() == self.trust_domain {
            Ok(())
        } else {
            Err(IdentityError::WrongTrustDomain {
                ca: self.trust_domain.clone(),
                requested: id.trust_domain().to_string(),
                id: id.to_string(),
            })
        }
    }

    /// Issues an SVID for `id` with a fresh key, valid exactly from `not_before` to
    /// `not_after` (which may lie in the past or the future: for tests of expiry handling, and
    /// for certificates that must start later).
    pub fn issue_valid_between(
        &self,
        id: &SpiffeId,
        not_before: SystemTime,
        not_after: SystemTime,
    ) -> Result<IssuedSvid, IdentityError> {
        self.check_domain(id)?;
        if not_after <= not_before {
            return Err(IdentityError::BadTtl { ttl_secs: 0 });
        }
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut issued = self.sign_between(id, &key, not_before, not_after)?;
        issued.key_pem = Some(key.serialize_pem());
        Ok(issued)
    }

    fn sign(
        &self,
        id: &SpiffeId,
        public_key: &impl rcgen::PublicKeyData,
        ttl: Duration,
    ) -> Result<IssuedSvid, IdentityError> {
        check_ttl(ttl)?;
        let now = SystemTime::now();
        self.sign_between(
            id,
            public_key,
            now - BACKDATE,
            (now + ttl).min(self.root_not_after),
        )
    }

    fn sign_between(
        &self,
        id: &SpiffeId,
        public_key: &impl rcgen::PublicKeyData,
        not_before: SystemTime,
        not_after: SystemTime,
    ) -> Result<IssuedSvid, IdentityError> {
        let leaf = leaf_params(id, not_before, not_after)?.signed_by(public_key, &self.issuer)?;
        let chain_pem =
            svid::pem("CERTIFICATE", leaf.der()) + &svid::pem("CERTIFICATE", &self.bundle[0]);
        Ok(IssuedSvid {
            id: id.clone(),
            chain_pem,
            key_pem: None,
            not_before,
            not_after,
        })
    }

    /// Makes a new root the signer and keeps the old ones trusted (the overlap), writing the
    /// new bundle and key to `dir` when given.
    pub fn rotate(&mut self, dir: Option<&Path>) -> Result<(), IdentityError> {
        let next = Authority::generate(&self.trust_domain)?;
        let mut bundle = next.bundle.clone();
        bundle.extend(self.bundle.iter().cloned());
        self.issuer = next.issuer;
        self.bundle = bundle;
        self.root_not_after = next.root_not_after;
        self.save(dir)
    }

    /// Drops every root but the signing one (once no certificate signed by them is in use).
    pub fn retire_old_roots(&mut self, dir: Option<&Path>) -> Result<(), IdentityError> {
        self.bundle.truncate(1);
        self.save(dir)
    }

    fn save(&self, dir: Option<&Path>) -> Result<(), IdentityError> {
        let Some(dir) = dir else { return Ok(()) };
        // Key first: a crash between the two leaves a key whose root is not yet in ca.pem,
        // which `load` reports (KeyMismatch) instead of signing with a root peers do not trust.
        replace(
            &dir.join(KEY_FILE),
            &self.issuer.key().serialize_pem(),
            0o600,
        )?;
        replace(&dir.join(CERT_FILE), &self.bundle_pem(), 0o644)
    }
}

/// Every certificate in a PEM file, in order (at least one).
pub fn load_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, IdentityError> {
    let text = std::fs::read(path).map_err(|e| IdentityError::io(path, e))?;
    certificates_from_pem(&text).map_err(|why| IdentityError::BadPem {
        path: PathBuf::from(path),
        why,
    })
}

/// Every certificate in PEM text, in order (at least one).
pub fn certificates_from_pem(text: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(text)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("not valid PEM ({e})"))?;
    if certificates.is_empty() {
        return Err("holds no `-----BEGIN CERTIFICATE-----` block".into());
    }
    Ok(certificates)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::svid::CertificateInfo;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "flatmesh-identity-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn init_writes_a_root_and_a_private_key_and_refuses_to_overwrite() {
        let dir = temp_dir("init");
        let ca = Authority::init("example.org", &dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let loaded = Authority::load(&dir).unwrap();
        assert_eq!(loaded.trust_domain(), "example.org");
        assert_eq!(loaded.bundle(), ca.bundle());
        let again = Authority::init("example.org", &dir)
            .unwrap_err()
            .to_string();
        assert!(again.contains("already exists"), "{again}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_svid_names_exactly_its_id_and_lives_as_long_as_asked() {
        let ca = Authority::generate("example.org").unwrap();
        let id = SpiffeId::parse("spiffe://example.org/ns/shop/sa/cart").unwrap();
        let issued = ca.issue(&id, Duration::from_secs(3600)).unwrap();
        let chain = certificates_from_pem(issued.chain_pem.as_bytes()).unwrap();
        assert_eq!(chain.len(), 2, "leaf then the signing root");
        let leaf = CertificateInfo::parse(&chain[0]).unwrap();
        assert_eq!(leaf.spiffe_id, Some(id));
        let lifetime = leaf.not_after.duration_since(leaf.not_before).unwrap();
        assert!(
            lifetime >= Duration::from_secs(3600) && lifetime <= Duration::from_secs(3600 + 120),
            "{lifetime:?}"
        );
        assert!(!leaf.is_ca);
        assert!(issued.key_pem.unwrap().contains("PRIVATE KEY"));
    }

    #[test]
    fn ids_of_another_trust_domain_and_absurd_lifetimes_are_refused() {
        let ca = Authority::generate("example.org").unwrap();
        let foreign = SpiffeId::parse("spiffe://evil.org/ns/a/sa/b").unwrap();
        let err = ca
            .issue(&foreign, DEFAULT_SVID_TTL)
            .unwrap_err()
            .to_string();
        assert!(err.contains("trust domain is `example.org`"), "{err}");
        let id = SpiffeId::parse("spiffe://example.org/ns/a/sa/b").unwrap();
        assert!(ca.issue(&id, Duration::from_secs(1)).is_err());
        assert!(ca
            .issue(&id, Duration::from_secs(10 * 365 * 86400))
            .is_err());
    }

    #[test]
    fn a_csr_gets_only_its_own_key_and_an_allowed_id() {
        let ca = Authority::generate("example.org").unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let csr = svid::certificate_request(
            &SpiffeId::parse("spiffe://example.org/ns/a/sa/b").unwrap(),
            &key,
        )
        .unwrap();
        let issued = ca
            .sign_csr(csr.as_bytes(), DEFAULT_SVID_TTL, |_| Ok(()))
            .unwrap();
        let leaf = certificates_from_pem(issued.chain_pem.as_bytes()).unwrap();
        let info = CertificateInfo::parse(&leaf[0]).unwrap();
        assert_eq!(info.public_key, key.public_key_raw());
        let refused = ca
            .sign_csr(csr.as_bytes(), DEFAULT_SVID_TTL, |id| {
                Err(IdentityError::NotPlaced {
                    id: id.to_string(),
                    node: "n2".into(),
                })
            })
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("not an identity placed on node `n2`"),
            "{refused}"
        );
        let garbage = ca
            .sign_csr(b"not a csr", DEFAULT_SVID_TTL, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(garbage.contains("not usable"), "{garbage}");
    }

    #[test]
    fn rotation_keeps_the_old_root_trusted_until_it_is_retired() {
        let dir = temp_dir("rotate");
        let mut ca = Authority::init("example.org", &dir).unwrap();
        let old_root = ca.bundle()[0].clone();
        ca.rotate(Some(&dir)).unwrap();
        let loaded = Authority::load(&dir).unwrap();
        assert_eq!(loaded.bundle().len(), 2);
        assert_ne!(loaded.bundle()[0], old_root);
        assert_eq!(loaded.bundle()[1], old_root);
        ca.retire_old_roots(Some(&dir)).unwrap();
        assert_eq!(Authority::load(&dir).unwrap().bundle().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_key_that_is_not_the_roots_is_refused_at_load() {
        let dir = temp_dir("mismatch");
        Authority::init("example.org", &dir).unwrap();
        let other = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        std::fs::write(dir.join(KEY_FILE), other.serialize_pem()).unwrap();
        let err = Authority::load(&dir).err().unwrap().to_string();
        assert!(err.contains("does not belong"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
