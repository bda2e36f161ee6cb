//! SDS from the control center (`flatmesh control --ca-dir DIR --node-tokens FILE`): each node
//! is given, over its ADS stream, the trust bundle as secret [`ROOTCA`] and a certificate with a
//! fresh key for every workload identity it holds, named by the SPIFFE ID, under the one rule
//! of the certificate API ([`NodeCa::may_hold`]). A node asking for another node's identity gets
//! no secret; the refusal is logged and counted like a CSR's.
//!
//! A certificate is kept per node and identity until half its lifetime, then issued anew; a
//! rotated root (the CA directory changed) re-issues every certificate from the new root and
//! changes the bundle. Either way the streams are told ([`SecretSource::changes`]) and push the
//! new versions.
//!
//! The [`ROOTCA`] secret also carries the CA directory's revocation list (`crl.pem`, written by
//! `flatmesh ca revoke`) as its `crl`, re-read when the file changes, so a revoked leaf is
//! refused by every node's verifiers within a poll and a reload. The file is bounded
//! (`flatmesh_identity::crl::MAX_CRL_FILE`) and must parse; a bad one is refused with an error
//! in the log and the last good list stays served.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use flatmesh_identity::svid::half_life;
use flatmesh_identity::SpiffeId;
use flatmesh_xds::sds::{certificate_secret, roots_secret, Secret, SecretSource, ROOTCA};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::ca::NodeCa;

/// How often renewals and the root are checked.
const POLL: Duration = Duration::from_secs(1);

/// One issued certificate and when to issue the next.
struct Held {
    secret: Secret,
    renew_at: SystemTime,
}

/// The control center's [`SecretSource`].
pub struct NodeSecrets {
    ca: Arc<NodeCa>,
    /// (node, SPIFFE ID) -> its current certificate.
    held: Mutex<HashMap<(String, String), Held>>,
    /// The bundle the held certificates were issued under.
    bundle: Mutex<String>,
    /// The CA directory's CRLs (PEM) served with the bundle, and the last refusal logged.
    crl: Mutex<Crl>,
    changes: watch::Sender<u64>,
}

#[derive(Default)]
struct Crl {
    served: Option<String>,
    /// The error of a refused file, so that it is logged once, not every poll.
    refused: Option<String>,
    /// The file's modification time and size when last read: unchanged, it is not read again.
    seen: Option<(SystemTime, u64)>,
}

impl NodeSecrets {
    pub fn new(ca: Arc<NodeCa>) -> Arc<NodeSecrets> {
        let bundle = ca.bundle_pem();
        let secrets = NodeSecrets {
            ca,
            held: Mutex::default(),
            bundle: Mutex::new(bundle),
            crl: Mutex::default(),
            changes: watch::channel(0).0,
        };
        secrets.reread_crl();
        Arc::new(secrets)
    }

    /// Re-reads `crl.pem` of the CA directory; says whether what is served changed. A file that
    /// is too large or does not parse is refused (logged once) and the served list stays.
    fn reread_crl(&self) -> bool {
        let path = self.ca.dir().join(flatmesh_identity::crl::CRL_FILE);
        let mut crl = self.crl.lock();
        let seen = std::fs::metadata(&path)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())));
        if seen.is_some() && seen == crl.seen {
            return false;
        }
        crl.seen = seen;
        match flatmesh_identity::crl::read_crl_text(&path) {
            Ok(text) => {
                crl.refused = None;
                if crl.served == text {
                    return false;
                }
                tracing::info!(file = %path.display(), present = text.is_some(), "SDS: the CA's revocation list changed; pushing it with the trust bundle");
                crl.served = text;
                true
            }
            Err(e) => {
                let why = e.to_string();
                if crl.refused.as_ref() != Some(&why) {
                    tracing::error!(error = %why, "SDS: the CA's revocation list is refused; the previous one stays served");
                    crl.refused = Some(why);
                }
                false
            }
        }
    }

    /// Drops what is due (certificates past half their life; all of them after a rotation)
    /// and tells the streams, which ask again and are given new versions.
    pub fn refresh(&self) {
        let bundle = self.ca.bundle_pem();
        let rotated = {
            let mut current = self.bundle.lock();
            let rotated = *current != bundle;
            *current = bundle;
            rotated
        };
        let now = SystemTime::now();
        let due = {
            let mut held = self.held.lock();
            let before = held.len();
            held.retain(|_, h| !rotated && h.renew_at > now);
            held.len() != before
        };
        let crl_changed = self.reread_crl();
        if rotated || due || crl_changed {
            tracing::info!(rotated, crl_changed, "SDS: pushing new secrets");
            self.changes.send_modify(|n| *n += 1);
        }
    }

    /// An identity was placed on or taken from a node (a placement, a pod scheduled, moved or
    /// deleted): drops the certificates their nodes no longer hold and tells the streams, which
    /// ask again, so a taken identity is pushed away and a new one is given at once.
    pub fn regrant(&self) {
        self.held
            .lock()
            .retain(|(node, id), _| match SpiffeId::parse(id) {
                Ok(id) => self.ca.may_hold(node, &id).is_ok(),
                Err(_) => false,
            });
        self.changes.send_modify(|n| *n += 1);
    }

    /// Calls [`NodeSecrets::refresh`] every second, and [`NodeSecrets::regrant`] on every
    /// change of what nodes hold, for as long as the control center runs.
    pub async fn keep_current(self: Arc<Self>) {
        let mut tick = tokio::time::interval(POLL);
        let [mut placed, mut pods] = self.ca.grant_changes();
        loop {
            tokio::select! {
                _ = tick.tick() => self.refresh(),
                Ok(()) = placed.changed() => self.regrant(),
                Ok(()) = pods.changed() => self.regrant(),
            }
        }
    }
}

impl SecretSource for NodeSecrets {
    fn secret(&self, node: &str, name: &str) -> Result<Secret, String> {
        if name == ROOTCA {
            let crl = self.crl.lock().served.clone();
            return Ok(roots_secret(ROOTCA, &self.bundle.lock(), crl.as_deref()));
        }
        let id = SpiffeId::parse(name).map_err(|e| {
            tracing::warn!(%node, secret = name, error = %e, "SDS: a secret flatmesh control does not have (it serves ROOTCA and SPIFFE IDs)");
            e.to_string()
        })?;
        let key = (node.to_string(), id.as_str().to_string());
        if let Some(h) = self.held.lock().get(&key) {
            // Still placed? A move takes the identity away at the next renewal at the latest;
            // checking here stops serving it at once.
            self.ca.may_hold(node, &id).map_err(|e| e.to_string())?;
            return Ok(h.secret.clone());
        }
        let issued = self.ca.issue_for(node, &id).map_err(|e| e.to_string())?;
        let secret = certificate_secret(
            name,
            &issued.chain_pem,
            issued.key_pem.as_deref().unwrap_or_default(),
        );
        self.held.lock().insert(
            key,
            Held {
                secret: secret.clone(),
                renew_at: half_life(issued.not_before, issued.not_after),
            },
        );
        Ok(secret)
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}
