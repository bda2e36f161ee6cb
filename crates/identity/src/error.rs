//! The identity crate's errors. Each message says what is wrong and what to do about it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("`{id}` is not a valid SPIFFE ID: {why}")]
    BadSpiffeId { id: String, why: String },

    #[error("{path}: cannot use it (check the path and that this user may read and write it)")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} already exists: a CA is already set up in {dir}; use it, or pick another --dir (flatmesh never overwrites a CA key)", dir = path.parent().map(|p| p.display().to_string()).unwrap_or_default())]
    CaExists { path: PathBuf },

    #[error("{path}: {why}")]
    BadPem { path: PathBuf, why: String },

    #[error("the CA key in {key} does not belong to the certificate in {cert}: restore the pair that `flatmesh ca init` wrote")]
    KeyMismatch { cert: PathBuf, key: PathBuf },

    #[error("the CA's trust domain is `{ca}`, but `{id}` is in `{requested}`: issue IDs of the CA's own trust domain")]
    WrongTrustDomain {
        ca: String,
        requested: String,
        id: String,
    },

    #[error("the lifetime {ttl_secs} s is out of range: give a TTL between 1 minute and 1 year, like `24h`")]
    BadTtl { ttl_secs: u64 },

    #[error("the certificate signing request is not usable: {why}")]
    BadCsr { why: String },

    #[error("`{id}` is not an identity placed on node `{node}`: a node may only obtain the identities of workloads that run on it")]
    NotPlaced { id: String, node: String },

    #[error("`{serial}` is not a certificate serial number: {why} (`flatmesh ca revoke --cert FILE` reads it from the certificate)")]
    BadSerial { serial: String, why: String },

    #[error("{path} would list more than {max} certificates: rotate the root (`flatmesh ca rotate`, then `retire` once the old leaves expired) instead of growing the list")]
    CrlFull { max: usize, path: PathBuf },

    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),

    #[error("the TLS configuration is not usable: {0}")]
    Tls(#[from] rustls::Error),

    #[error("the trust bundle is not usable: {0}")]
    Bundle(String),
}

impl IdentityError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> IdentityError {
        IdentityError::Io {
            path: path.into(),
            source,
        }
    }
}
