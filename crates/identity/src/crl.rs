//! Certificate revocation: the CA's revocation list (`DIR/crl.pem`, `flatmesh ca revoke`) and
//! reading CRL files for the verifiers ([`crate::TrustBundle::with_crls`]).
//!
//! `crl.pem` holds one CRL per root: the signing root's, which `revoke` re-signs with every
//! change (a fresh CRL number, `nextUpdate` [`CRL_LIFETIME`] ahead), and those of roots kept
//! from before a rotation, carried over verbatim (only the signing root's key is at hand, and a
//! CRL must be signed by its certificates' issuer). A peer checks a leaf against the CRL of the
//! leaf's issuer; a leaf whose issuer has no CRL is accepted (unknown status is not revoked).
//!
//! The list is bounded ([`MAX_REVOKED`] entries): certificates are short-lived (24 h by
//! default), so a list that fills up means a root that should be rotated, not a longer list.

use crate::ca::Authority;
use crate::error::IdentityError;
use rcgen::{CertificateRevocationListParams, KeyIdMethod, RevokedCertParams, SerialNumber};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateRevocationListDer;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use x509_parser::prelude::{CertificateRevocationList, FromDer, X509Certificate};

pub const CRL_FILE: &str = "crl.pem";
/// The most certificates one CRL lists.
pub const MAX_REVOKED: usize = 10_000;
/// How far ahead a CRL's `nextUpdate` is: run `flatmesh ca revoke --dir DIR` (no serial) to
/// re-sign it before then. Peers keep using a CRL past its `nextUpdate` (a stale list still
/// revokes what it lists).
pub const CRL_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// The largest CRL file the node reads (10 000 entries are about 400 KB).
pub const MAX_CRL_FILE: u64 = 4 * 1024 * 1024;

/// What `revoke` did.
#[derive(Debug, Clone)]
pub struct Revoked {
    /// Serials listed now that were not before.
    pub added: usize,
    /// Every serial the signing root's CRL lists.
    pub listed: usize,
    pub next_update: SystemTime,
    pub path: PathBuf,
}

/// A serial number written as hex (`0a1b...`, colons and a `0x` allowed), minimal (no leading
/// zero bytes).
pub fn parse_serial(text: &str) -> Result<Vec<u8>, IdentityError> {
    let digits: String = text
        .trim()
        .trim_start_matches("0x")
        .chars()
        .filter(|c| *c != ':')
        .collect();
    let bad = |why: &str| IdentityError::BadSerial {
        serial: text.to_string(),
        why: why.to_string(),
    };
    if digits.is_empty() || digits.len() > 40 {
        return Err(bad("give 1 to 20 bytes in hex"));
    }
    let padded = if digits.len() % 2 == 1 {
        format!("0{digits}")
    } else {
        digits
    };
    let bytes = (0..padded.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&padded[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| bad("not hex digits"))?;
    Ok(minimal(&bytes))
}

/// `bytes` without leading zero bytes (at least one byte).
fn minimal(bytes: &[u8]) -> Vec<u8> {
    let first = bytes
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(bytes.len().saturating_sub(1));
    bytes[first..].to_vec()
}

/// The serial of a certificate (minimal) and its issuer's name (DER).
pub fn serial_of(der: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not an X.509 certificate ({e})"))?;
    Ok((
        minimal(cert.raw_serial()),
        cert.tbs_certificate.issuer.as_raw().to_vec(),
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every CRL in PEM text (`-----BEGIN X509 CRL-----` blocks), in order.
pub fn crls_from_pem(text: &[u8]) -> Result<Vec<CertificateRevocationListDer<'static>>, String> {
    let crls: Vec<CertificateRevocationListDer<'static>> =
        CertificateRevocationListDer::pem_slice_iter(text)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("not valid PEM ({e})"))?;
    if crls.is_empty() {
        return Err("holds no `-----BEGIN X509 CRL-----` block".into());
    }
    Ok(crls)
}

/// Every CRL in a PEM file (at least one; the file at most [`MAX_CRL_FILE`] bytes).
pub fn load_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, IdentityError> {
    let size = std::fs::metadata(path)
        .map_err(|e| IdentityError::io(path, e))?
        .len();
    if size > MAX_CRL_FILE {
        return Err(IdentityError::BadPem {
            path: path.to_path_buf(),
            why: format!(
                "it is {size} bytes; a CRL file may be at most {MAX_CRL_FILE} bytes (rotate the root rather than list more certificates)"
            ),
        });
    }
    let text = std::fs::read(path).map_err(|e| IdentityError::io(path, e))?;
    crls_from_pem(&text).map_err(|why| IdentityError::BadPem {
        path: path.to_path_buf(),
        why,
    })
}

/// The CA directory's revocation list as PEM text, to hand to peers (the control center's
/// SDS): None when there is none. Bounded like [`load_crls`], and every block must parse as a
/// CRL, so a half-written or foreign file is refused rather than passed on.
pub fn read_crl_text(path: &Path) -> Result<Option<String>, IdentityError> {
    if !path.exists() {
        return Ok(None);
    }
    let bad = |why: String| IdentityError::BadPem {
        path: path.to_path_buf(),
        why,
    };
    for crl in load_crls(path)? {
        read_listed(crl.as_ref()).map_err(bad)?;
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(format!("not UTF-8 PEM text ({e})")))?;
    Ok(Some(text))
}

/// One CRL as `revoke` reads it back: its issuer, and the serials it lists with their dates.
struct Listed {
    issuer: Vec<u8>,
    entries: Vec<(Vec<u8>, time::OffsetDateTime)>,
}

fn read_listed(der: &[u8]) -> Result<Listed, String> {
    let (_, crl) = CertificateRevocationList::from_der(der)
        .map_err(|e| format!("a CRL does not parse ({e})"))?;
    let entries = crl
        .iter_revoked_certificates()
        .map(|entry| {
            (
                minimal(entry.raw_serial()),
                entry.revocation_date.to_datetime(),
            )
        })
        .collect();
    Ok(Listed {
        issuer: crl.tbs_cert_list.issuer.as_raw().to_vec(),
        entries,
    })
}

impl Authority {
    /// Adds `serials` to the signing root's CRL in `dir/crl.pem` and signs it anew (with no
    /// serials: only re-signs it, moving `nextUpdate` on). Listing a serial twice changes
    /// nothing. Refuses to list more than [`MAX_REVOKED`].
    pub fn revoke(&self, dir: &Path, serials: &[Vec<u8>]) -> Result<Revoked, IdentityError> {
        let path = dir.join(CRL_FILE);
        let root_subject = subject_of(&self.bundle()[0]).map_err(IdentityError::Bundle)?;
        // The CRLs of other roots are kept as they are; the signing root's entries are merged.
        let mut kept = Vec::new();
        let mut entries: Vec<(Vec<u8>, time::OffsetDateTime)> = Vec::new();
        if path.exists() {
            for der in load_crls(&path)? {
                let listed = read_listed(&der).map_err(|why| IdentityError::BadPem {
                    path: path.clone(),
                    why,
                })?;
                if listed.issuer == root_subject {
                    entries.extend(listed.entries);
                } else {
                    kept.push(der);
                }
            }
        }
        let now = SystemTime::now();
        let mut added = 0;
        for serial in serials {
            let serial = minimal(serial);
            if entries.iter().all(|(listed, _)| *listed != serial) {
                entries.push((serial, time::OffsetDateTime::from(now)));
                added += 1;
            }
        }
        if entries.len() > MAX_REVOKED {
            return Err(IdentityError::CrlFull {
                max: MAX_REVOKED,
                path,
            });
        }
        let next_update = now + CRL_LIFETIME;
        let number = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64;
        let params = CertificateRevocationListParams {
            this_update: time::OffsetDateTime::from(now - Duration::from_secs(60)),
            next_update: time::OffsetDateTime::from(next_update),
            // Increases with every signing: a newer list has a larger number.
            crl_number: SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs: entries
                .iter()
                .map(|(serial, when)| RevokedCertParams {
                    serial_number: SerialNumber::from_slice(serial),
                    revocation_time: *when,
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let crl = params.signed_by(self.signer())?;
        let mut text = crate::svid::pem("X509 CRL", crl.der());
        for der in &kept {
            text.push_str(&crate::svid::pem("X509 CRL", der));
        }
        crate::ca::replace(&path, &text, 0o644)?;
        Ok(Revoked {
            added,
            listed: entries.len(),
            next_update,
            path,
        })
    }

    /// Whether the signing root issued the certificate `der`; its serial either way.
    pub fn issued_by_signer(&self, der: &[u8]) -> Result<(bool, Vec<u8>), IdentityError> {
        let (serial, issuer) = serial_of(der).map_err(IdentityError::Bundle)?;
        let root = subject_of(&self.bundle()[0]).map_err(IdentityError::Bundle)?;
        Ok((issuer == root, serial))
    }
}

fn subject_of(der: &[u8]) -> Result<Vec<u8>, String> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not an X.509 certificate ({e})"))?;
    Ok(cert.tbs_certificate.subject.as_raw().to_vec())
}

/// A serial in the hex form `flatmesh ca revoke --serial` takes.
pub fn serial_hex(serial: &[u8]) -> String {
    hex(serial)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::spiffe::SpiffeId;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "flatmesh-crl-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn serials_parse_in_hex_and_are_minimal() {
        assert_eq!(parse_serial("0a:1B").unwrap(), vec![0x0a, 0x1b]);
        assert_eq!(parse_serial("0x00ff").unwrap(), vec![0xff]);
        assert_eq!(parse_serial("abc").unwrap(), vec![0x0a, 0xbc]);
        assert_eq!(parse_serial("00").unwrap(), vec![0]);
        for bad in ["", "xyz", &"a".repeat(41)] {
            let e = parse_serial(bad).unwrap_err().to_string();
            assert!(e.contains("serial"), "{bad}: {e}");
        }
    }

    #[test]
    fn revoking_is_idempotent_and_keeps_other_roots_lists() {
        let dir = temp_dir("revoke");
        let mut ca = Authority::init("example.org", &dir).unwrap();
        let id = SpiffeId::parse("spiffe://example.org/ns/a/sa/b").unwrap();
        let leaf = |ca: &Authority| {
            let issued = ca.issue(&id, Duration::from_secs(3600)).unwrap();
            crate::ca::certificates_from_pem(issued.chain_pem.as_bytes()).unwrap()[0].clone()
        };
        let first = ca.issued_by_signer(&leaf(&ca)).unwrap();
        assert!(first.0);
        let done = ca.revoke(&dir, std::slice::from_ref(&first.1)).unwrap();
        assert_eq!((done.added, done.listed), (1, 1));
        let again = ca.revoke(&dir, std::slice::from_ref(&first.1)).unwrap();
        assert_eq!(
            (again.added, again.listed),
            (0, 1),
            "listing twice changes nothing"
        );
        let crls = load_crls(&dir.join(CRL_FILE)).unwrap();
        assert_eq!(crls.len(), 1);
        assert_eq!(read_listed(&crls[0]).unwrap().entries[0].0, first.1);

        // After a rotation the old root's list stays, and the new root gets its own.
        let old_leaf = leaf(&ca);
        ca.rotate(Some(&dir)).unwrap();
        let (by_signer, _) = ca.issued_by_signer(&old_leaf).unwrap();
        assert!(!by_signer, "the old root's leaf is not the new signer's");
        let second = ca.issued_by_signer(&leaf(&ca)).unwrap().1;
        let done = ca.revoke(&dir, &[second]).unwrap();
        assert_eq!((done.added, done.listed), (1, 1));
        let crls = load_crls(&dir.join(CRL_FILE)).unwrap();
        assert_eq!(crls.len(), 2, "the old root's CRL is carried over");
        assert_eq!(read_listed(&crls[1]).unwrap().entries[0].0, first.1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_crl_file_that_is_not_one_is_refused_with_its_path() {
        let dir = temp_dir("bad");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("crl.pem");
        std::fs::write(&path, "nothing here").unwrap();
        let e = load_crls(&path).unwrap_err().to_string();
        assert!(e.contains("X509 CRL") && e.contains("crl.pem"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
