//! The node's side of the certificate API: the certificates of the workload identities this node
//! presents (`flatmesh node --identity ID --identity-dir DIR`), fetched from the control center
//! at start and renewed at half their lifetime.
//!
//! Each identity `spiffe://TD/ns/NS/sa/SA` is kept as `DIR/ns.NS.sa.SA.pem` (leaf, then the
//! signing root) and `DIR/ns.NS.sa.SA.key` (mode 0600, a fresh key per renewal, never sent
//! anywhere), and the trust bundle as `DIR/bundle.pem`. Listeners and clusters name these files
//! in their `tls` like any others. Every file is replaced atomically, key first, and the node
//! reloads after each renewal, so new connections present the new certificate and open ones
//! keep theirs: no connection is dropped.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use flatmesh_identity::svid::{half_life, new_request, pem, spiffe_id_of, CertificateInfo};
use flatmesh_identity::SpiffeId;

use crate::client::Backoff;
use crate::error::{Result, XdsError};
use crate::secure::ChannelSecurity;

/// The trust bundle's file name in the identity directory.
pub const BUNDLE_FILE: &str = "bundle.pem";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A fetch that fails is retried after up to this, doubling (with jitter) up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Where the control center is and what this node asks it for.
#[derive(Debug, Clone)]
pub struct IdentityOptions {
    /// `HOST:PORT` of the control center's gRPC port.
    pub server: String,
    pub security: ChannelSecurity,
    pub ids: Vec<SpiffeId>,
    pub dir: PathBuf,
    /// The lifetime asked for (the control center may give less).
    pub ttl: Duration,
}

/// A certificate the node holds.
#[derive(Debug, Clone)]
pub struct Held {
    pub id: SpiffeId,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl Held {
    pub fn renew_at(&self) -> SystemTime {
        half_life(self.not_before, self.not_after)
    }
}

/// The file name stem of `id`: its path with `/` as `.` (`ns.shop.sa.cart`).
pub fn file_stem(id: &SpiffeId) -> String {
    id.path().trim_start_matches('/').replace('/', ".")
}

/// `DIR/STEM.pem` and `DIR/STEM.key` of `id`.
pub fn files(dir: &Path, id: &SpiffeId) -> (PathBuf, PathBuf) {
    let stem = file_stem(id);
    (
        dir.join(format!("{stem}.pem")),
        dir.join(format!("{stem}.key")),
    )
}

/// Gets a new certificate for `id` and writes it (and the bundle) to the identity directory.
pub async fn fetch(options: &IdentityOptions, id: &SpiffeId) -> Result<Held> {
    let error = |why: String, transient: bool| XdsError::Certificate {
        id: id.to_string(),
        server: options.server.clone(),
        why,
        transient,
    };
    let fail = |why: String| error(why, false);
    let (key_pem, csr_pem) = new_request(id).map_err(|e| fail(e.to_string()))?;
    let channel = crate::secure::connect(&options.server, &options.security, CONNECT_TIMEOUT)
        .await
        .map_err(|why| error(why, true))?;
    let chain = crate::certificates::request(channel, &options.security, csr_pem, options.ttl)
        .await
        .map_err(|status| {
            let transient = matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
            );
            error(
                format!("{:?}: {}", status.code(), status.message()),
                transient,
            )
        })?;
    // The answer is checked like anything else from the network: a leaf for the identity asked
    // for, then at least one root.
    let mut certificates = Vec::with_capacity(chain.len());
    for text in &chain {
        let mut parsed = flatmesh_identity::ca::certificates_from_pem(text.as_bytes())
            .map_err(|why| fail(format!("the answer holds a bad certificate: {why}")))?;
        certificates.append(&mut parsed);
    }
    let [leaf, roots @ ..] = certificates.as_slice() else {
        return Err(fail("the answer holds no certificate".into()));
    };
    if roots.is_empty() {
        return Err(fail(
            "the answer holds no trust bundle after the leaf".into(),
        ));
    }
    let got = spiffe_id_of(leaf).map_err(|why| fail(format!("the leaf: {why}")))?;
    if &got != id {
        return Err(fail(format!(
            "the leaf is for {got}, not the identity asked for"
        )));
    }
    let info = CertificateInfo::parse(leaf).map_err(|why| fail(format!("the leaf: {why}")))?;

    std::fs::create_dir_all(&options.dir).map_err(|e| {
        fail(format!(
            "cannot create the identity directory {}: {e}",
            options.dir.display()
        ))
    })?;
    let (cert_path, key_path) = files(&options.dir, id);
    let write = |path: &Path, text: &str, mode: u32| {
        flatmesh_identity::ca::replace(path, text, mode).map_err(|e| fail(e.to_string()))
    };
    let bundle: String = roots.iter().map(|r| pem("CERTIFICATE", r)).collect();
    write(&options.dir.join(BUNDLE_FILE), &bundle, 0o644)?;
    write(&key_path, &key_pem, 0o600)?;
    write(
        &cert_path,
        &(pem("CERTIFICATE", leaf) + &pem("CERTIFICATE", &roots[0])),
        0o644,
    )?;
    tracing::info!(
        %id,
        cert = %cert_path.display(),
        valid_for_s = info
            .not_after
            .duration_since(SystemTime::now())
            .unwrap_or_default()
            .as_secs(),
        "workload certificate from the control center"
    );
    Ok(Held {
        id: id.clone(),
        not_before: info.not_before,
        not_after: info.not_after,
    })
}

/// Gets every identity's certificate (before the node loads a config that names the files).
/// A control center that cannot be reached yet (it may be starting too) is tried again with
/// backoff for up to `patience`; a refusal ends it at once.
pub async fn fetch_all(options: &IdentityOptions, patience: Duration) -> Result<Vec<Held>> {
    let give_up = tokio::time::Instant::now() + patience;
    let mut held = Vec::with_capacity(options.ids.len());
    for id in &options.ids {
        let mut backoff = Backoff::between(id.as_str(), RETRY_FIRST, RETRY_MAX);
        loop {
            match fetch(options, id).await {
                Ok(one) => {
                    held.push(one);
                    break;
                }
                Err(XdsError::Certificate {
                    transient: true,
                    why,
                    ..
                }) if tokio::time::Instant::now() < give_up => {
                    let retry = backoff.next();
                    tracing::warn!(%id, error = %why, retry_in = ?retry, "control center not reachable yet; trying again");
                    tokio::time::sleep(retry.min(give_up - tokio::time::Instant::now())).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(held)
}

/// Renews each certificate at half its lifetime, forever; `renewed` runs after each renewal
/// (the node reloads). A failed renewal is retried with backoff; the old certificate stays
/// until then (it is still valid for the second half of its life).
pub async fn keep_renewed(
    options: IdentityOptions,
    mut held: Vec<Held>,
    mut renewed: impl FnMut() + Send,
) {
    let mut backoff = Backoff::between(&options.server, RETRY_FIRST, RETRY_MAX);
    loop {
        let Some(next) = held.iter().map(Held::renew_at).min() else {
            return;
        };
        let wait = next.duration_since(SystemTime::now()).unwrap_or_default();
        tokio::time::sleep(wait).await;
        let now = SystemTime::now();
        let mut failed = false;
        let mut changed = false;
        for slot in held.iter_mut().filter(|h| h.renew_at() <= now) {
            match fetch(&options, &slot.id).await {
                Ok(fresh) => {
                    *slot = fresh;
                    changed = true;
                }
                Err(e) => {
                    failed = true;
                    tracing::warn!(error = %e, expires_in_s = slot.not_after.duration_since(now).unwrap_or_default().as_secs(), "workload certificate renewal failed; keeping the current one");
                }
            }
        }
        if changed {
            renewed();
        }
        if failed {
            let retry = backoff.next();
            tracing::info!(retry_in = ?retry, "retrying the failed renewals");
            tokio::time::sleep(retry).await;
        } else {
            backoff.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn files_are_named_after_the_identity_path() {
        let id = SpiffeId::parse("spiffe://td/ns/shop/sa/cart").unwrap();
        assert_eq!(file_stem(&id), "ns.shop.sa.cart");
        let (cert, key) = files(Path::new("/run/id"), &id);
        assert_eq!(cert, Path::new("/run/id/ns.shop.sa.cart.pem"));
        assert_eq!(key, Path::new("/run/id/ns.shop.sa.cart.key"));
    }
}
