//! flatmesh workload identity.
//!
//! - [`spiffe`]: SPIFFE IDs and the allow-list patterns that admit them;
//! - [`ca`]: the mesh CA, a root per trust domain that issues X.509 SVIDs (from scratch or from
//!   a node's CSR), with root rotation through an overlap of both bundles;
//! - [`crl`]: the CA's certificate revocation list and reading CRL files;
//! - [`svid`]: issued and loaded SVIDs, and reading the identity out of a certificate;
//! - [`tls`]: rustls configurations (ring) that authenticate peers by SPIFFE ID, and the
//!   bounded failure reasons the node counts.
//!
//! See docs/security.md.
#![forbid(unsafe_code)]

pub mod ca;
pub mod crl;
mod error;
pub mod spiffe;
pub mod svid;
pub mod tls;

pub use ca::Authority;
pub use error::IdentityError;
pub use spiffe::{IdPattern, SpiffeId};
pub use svid::{IssuedSvid, Svid};
pub use tls::{ClientAuth, TrustBundle};
