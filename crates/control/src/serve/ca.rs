//! The control center as its nodes' CA (`flatmesh control --ca-dir DIR --node-tokens FILE`).
//!
//! A node proves itself with its bootstrap token and sends CSRs over the TLS control channel
//! ([`flatmesh_xds::certificates`]); it gets a certificate only for an identity it holds:
//! one granted to it in the node tokens file, that of a service the placement put on it
//! (service `APP/STAGE` is `spiffe://TD/ns/APP/sa/STAGE`), or its own node identity
//! (`spiffe://TD/ns/flatmesh-system/sa/node/NODE_ID`, [`SpiffeId::node`]), which its HBONE
//! listener and tunnels present when no workload identity applies. So a node cannot obtain another
//! node's workload identity. The control center presents a certificate of the same CA
//! (`spiffe://TD/flatmesh/control`), renewed at half its lifetime, and re-reads the CA
//! directory when it changes (`flatmesh ca rotate` while it runs): new certificates are signed
//! by the new root and carry the bundle with both roots.
//!
//! The node tokens file (mode 0600):
//!
//! ```yaml
//! # node id -> the SHA-256 of its bootstrap token (`flatmesh ca token --node ID` makes both),
//! # and identities granted to it outright, besides those of the services placed on it
//! r0-s0/host:
//!   token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//!   identities: [ spiffe://cluster.local/ns/shop/sa/frontend ]
//! # a node cut off (`flatmesh ca token --revoke --node ID --tokens FILE`)
//! r0-s1/host: { token_sha256: ..., revoked: true }
//! ```
//!
//! The control center re-reads the file when it changes (checked every second): a token that
//! is revoked (or no longer listed) is refused from then on (`UNAUTHENTICATED`, "token
//! revoked"), and the xDS streams it opened are ended.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use flatmesh_identity::svid::half_life;
use flatmesh_identity::{Authority, IdentityError, SpiffeId};
use flatmesh_xds::certificates::{CertificateRequest, CertificateResponse, Signer};
use flatmesh_xds::secure::{ServerTls, Tokens};
use parking_lot::RwLock;
use serde::Deserialize;

use crate::endpoints::EndpointSnapshot;
use crate::error::{ControlError, Result};
use crate::heartbeat::{bytes_from_hex, hex, read_secret};

/// The path of the control center's own identity, under the trust domain.
pub const CONTROL_PATH: &str = "/flatmesh/control";
/// How often the CA directory is checked for a rotation, and the control certificate for its
/// renewal time.
const CA_POLL: Duration = Duration::from_secs(1);
/// Lifetime of the control center's own certificate.
const CONTROL_TTL: Duration = Duration::from_secs(24 * 3600);

/// The control center's SPIFFE ID in `trust_domain`.
pub fn control_id(trust_domain: &str) -> std::result::Result<SpiffeId, IdentityError> {
    SpiffeId::parse(&format!("spiffe://{trust_domain}{CONTROL_PATH}"))
}

/// The identity of placed service `APP/STAGE`: `spiffe://TD/ns/APP/sa/STAGE`.
pub fn service_identity(trust_domain: &str, service: &str) -> Option<SpiffeId> {
    let (app, stage) = service.split_once('/')?;
    SpiffeId::workload(trust_domain, app, stage).ok()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeEntry {
    token_sha256: String,
    #[serde(default)]
    identities: Vec<String>,
    /// Cut off: the token opens nothing any more.
    #[serde(default)]
    revoked: bool,
}

/// Who holds which token, and what each node was granted outright.
#[derive(Debug, Clone, Default)]
pub struct NodeTokens {
    /// SHA-256 of the token -> node id.
    by_digest: BTreeMap<[u8; 32], String>,
    granted: BTreeMap<String, BTreeSet<String>>,
    /// Digests of revoked tokens (also in `by_digest`, so a refusal can say "revoked").
    revoked: BTreeSet<[u8; 32]>,
}

impl NodeTokens {
    /// Reads the file; it must be readable by its owner only.
    pub fn load(path: &Path) -> Result<NodeTokens> {
        NodeTokens::parse(&read_secret(path)?, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<NodeTokens> {
        let fail = |why: String| ControlError::Invalid {
            what: "node tokens file",
            message: format!("{origin}: {why}"),
        };
        let raw: BTreeMap<String, NodeEntry> = serde_norway::from_str(text).map_err(|e| {
            fail(format!(
                "{e}; write `NODE: {{ token_sha256: 64 hex digits, identities: [SPIFFE IDs] }}` per node (`flatmesh ca token --node NODE` prints one)"
            ))
        })?;
        let mut tokens = NodeTokens::default();
        for (node, entry) in raw {
            let digest = parse_digest(&entry.token_sha256)
                .map_err(|why| fail(format!("`{node}`: token_sha256 {why}")))?;
            if let Some(other) = tokens.by_digest.insert(digest, node.clone()) {
                return Err(fail(format!(
                    "`{node}` and `{other}` have the same token; give every node its own"
                )));
            }
            let mut ids = BTreeSet::new();
            for id in entry.identities {
                let parsed = SpiffeId::parse(&id)
                    .map_err(|e| fail(format!("`{node}`: identity `{id}`: {e}")))?;
                ids.insert(parsed.as_str().to_string());
            }
            if entry.revoked {
                tokens.revoked.insert(digest);
            }
            tokens.granted.insert(node, ids);
        }
        Ok(tokens)
    }

    /// Whether `token` belongs to a node that was cut off.
    pub fn is_revoked(&self, token: &str) -> bool {
        self.revoked.contains(&sha256(token.as_bytes()))
    }

    /// The ids of the nodes whose tokens are revoked.
    pub fn revoked_nodes(&self) -> impl Iterator<Item = &String> {
        self.revoked.iter().filter_map(|d| self.by_digest.get(d))
    }

    /// Node ids the file names.
    pub fn nodes(&self) -> impl Iterator<Item = &String> + Clone {
        self.granted.keys()
    }
}

impl Tokens for NodeTokens {
    /// The holder of a token that is not revoked.
    fn node_of(&self, token: &str) -> Option<String> {
        let digest = sha256(token.as_bytes());
        if self.revoked.contains(&digest) {
            return None;
        }
        self.by_digest.get(&digest).cloned()
    }

    fn revoked(&self, token: &str) -> bool {
        self.is_revoked(token)
    }
}

/// Marks `node`'s token revoked in the node tokens file at `path` (rewritten atomically, mode
/// 0600; comments in it are not kept). Revoking twice changes nothing. Returns false if the
/// token was revoked already.
pub fn revoke_token(path: &Path, node: &str) -> Result<bool> {
    let text = read_secret(path)?;
    // Checked first, so a file the control center would refuse is not made worse.
    NodeTokens::parse(&text, &path.display().to_string())?;
    let invalid = |message: String| ControlError::Invalid {
        what: "node tokens file",
        message,
    };
    let mut raw: serde_norway::Mapping =
        serde_norway::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    let known: Vec<String> = raw
        .keys()
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    let entry = raw
        .get_mut(node)
        .and_then(|e| e.as_mapping_mut())
        .ok_or_else(|| {
            invalid(format!(
                "{}: no node `{node}` (it names: {}); give the node id as the file writes it",
                path.display(),
                known.join(", ")
            ))
        })?;
    let was = entry.get("revoked").and_then(|v| v.as_bool()) == Some(true);
    if was {
        return Ok(false);
    }
    entry.insert("revoked".into(), true.into());
    let written = serde_norway::to_string(&raw).map_err(|e| invalid(e.to_string()))?;
    flatmesh_identity::ca::replace(path, &written, 0o600).map_err(identity_error)?;
    Ok(true)
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// The hex SHA-256 of a token, as the node tokens file holds it.
pub fn token_digest_hex(token: &str) -> String {
    hex(&sha256(token.as_bytes()))
}

fn parse_digest(text: &str) -> std::result::Result<[u8; 32], String> {
    bytes_from_hex(text).ok_or_else(|| {
        format!(
            "must be 64 hex digits (a SHA-256), not {} characters",
            text.trim().len()
        )
    })
}

/// A fresh random bootstrap token: 32 random bytes in hex (printable in any header or file).
pub fn new_token() -> Result<String> {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| ControlError::Invalid {
            what: "token",
            message: "the system's random source failed".into(),
        })?;
    Ok(hex(&bytes))
}

/// The workload identities each node holds by where its workloads are, replaced whole with
/// every update. Two sources fill one each: the placement (every placement snapshot) and, with
/// `flatmesh control --kubeconfig`, the pods scheduled on each node (every translation of the
/// cluster, [`Placements::replace`]).
#[derive(Debug, Clone, Default)]
pub struct Placements {
    by_node: Arc<RwLock<BTreeMap<String, BTreeSet<String>>>>,
    /// Bumped whenever `by_node` changes, so that SDS drops and pushes at once.
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Placements {
    /// Records where `snapshot` placed every service.
    pub fn update(&self, trust_domain: &str, snapshot: &EndpointSnapshot) {
        let mut by_node: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (service, endpoints) in &snapshot.services {
            let Some(id) = service_identity(trust_domain, service) else {
                continue;
            };
            for endpoint in endpoints {
                by_node
                    .entry(endpoint.node.clone())
                    .or_default()
                    .insert(id.as_str().to_string());
            }
        }
        self.set(by_node);
    }

    /// Replaces every node's identities with `by_node` (node id -> SPIFFE IDs). An identity
    /// that is not a SPIFFE ID is left out with a warning: it could never be issued.
    pub fn replace(&self, by_node: BTreeMap<String, BTreeSet<String>>) {
        let checked = by_node
            .into_iter()
            .map(|(node, ids)| {
                let ids = ids
                    .into_iter()
                    .filter_map(|id| match SpiffeId::parse(&id) {
                        Ok(parsed) => Some(parsed.as_str().to_string()),
                        Err(e) => {
                            tracing::warn!(%node, %id, error = %e, "CA: not a SPIFFE ID; left out");
                            None
                        }
                    })
                    .collect();
                (node, ids)
            })
            .collect();
        self.set(checked);
    }

    fn set(&self, by_node: BTreeMap<String, BTreeSet<String>>) {
        let mut held = self.by_node.write();
        if *held != by_node {
            *held = by_node;
            drop(held);
            self.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Changes whenever the identities do.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn holds(&self, node: &str, id: &str) -> bool {
        self.by_node
            .read()
            .get(node)
            .is_some_and(|ids| ids.contains(id))
    }
}

/// What the CA did, by outcome (for logs, tests and `flatmesh control`'s summary).
#[derive(Debug, Default)]
pub struct CaStats {
    pub issued: AtomicU64,
    /// No token, or one nobody holds.
    pub unauthenticated: AtomicU64,
    /// An identity not placed on (nor granted to) the asking node.
    pub not_placed: AtomicU64,
    /// A CSR that does not parse, names another trust domain or no single SPIFFE ID.
    pub bad_request: AtomicU64,
    /// A call with a revoked token (not counted in `unauthenticated`).
    pub revoked: AtomicU64,
    /// xDS streams ended because their token was revoked.
    pub streams_cut: AtomicU64,
}

/// Signs nodes' CSRs with the CA of `dir`, within what each node holds.
pub struct NodeCa {
    dir: PathBuf,
    authority: RwLock<Authority>,
    /// The tokens in force; every reload of the file publishes them anew (ending the streams
    /// of tokens it revoked).
    tokens: tokio::sync::watch::Sender<Arc<NodeTokens>>,
    /// The node tokens file, re-read when it changes.
    tokens_path: Option<PathBuf>,
    placements: Placements,
    /// The identities of each node's Kubernetes pods (empty unless `--kubeconfig`).
    pods: Placements,
    ttl: Duration,
    pub stats: Arc<CaStats>,
    /// When the control channel's current certificate expires (Unix seconds; 0: none yet).
    control_not_after: AtomicU64,
}

impl NodeCa {
    pub fn new(
        dir: &Path,
        tokens: Arc<NodeTokens>,
        placements: Placements,
        ttl: Duration,
    ) -> Result<NodeCa> {
        let authority = Authority::load(dir).map_err(identity_error)?;
        Ok(NodeCa {
            dir: dir.to_path_buf(),
            authority: RwLock::new(authority),
            tokens: tokio::sync::watch::Sender::new(tokens),
            tokens_path: None,
            placements,
            pods: Placements::default(),
            ttl,
            stats: Arc::default(),
            control_not_after: AtomicU64::new(0),
        })
    }

    /// Re-reads the tokens from `path` whenever it changes ([`keep_fresh`]).
    pub fn with_tokens_file(mut self, path: &Path) -> NodeCa {
        self.tokens_path = Some(path.to_path_buf());
        self
    }

    /// Grants each node the identities of its Kubernetes pods, as `pods` holds them from now on.
    pub fn with_pod_identities(mut self, pods: Placements) -> NodeCa {
        self.pods = pods;
        self
    }

    /// Changes whenever an identity is placed on or taken from a node (placement or pods).
    pub fn grant_changes(&self) -> [tokio::sync::watch::Receiver<u64>; 2] {
        [self.placements.subscribe(), self.pods.subscribe()]
    }

    /// Re-reads the node tokens file; a file that does not parse leaves the tokens as they were.
    fn reload_tokens(&self) {
        let Some(path) = &self.tokens_path else {
            return;
        };
        match NodeTokens::load(path) {
            Ok(tokens) => {
                let revoked: Vec<&String> = tokens.revoked_nodes().collect();
                tracing::info!(file = %path.display(), nodes = tokens.granted.len(), ?revoked, "node tokens file changed: re-read (revoked tokens are refused and their streams ended)");
                self.tokens.send_replace(Arc::new(tokens));
            }
            Err(e) => {
                tracing::error!(error = %e, "node tokens file changed but is refused; the previous tokens stay in force")
            }
        }
    }

    /// The CA directory (its `crl.pem` is served over SDS).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn trust_domain(&self) -> String {
        self.authority.read().trust_domain().to_string()
    }

    /// A server configuration for the control channel, presenting a fresh certificate of the
    /// control center's own identity; also returns when that certificate should be renewed.
    pub fn control_tls(&self) -> Result<(Arc<rustls::ServerConfig>, SystemTime)> {
        let authority = self.authority.read();
        let id = control_id(authority.trust_domain()).map_err(identity_error)?;
        let issued = authority.issue(&id, CONTROL_TTL).map_err(identity_error)?;
        let key = issued.key_pem.as_deref().unwrap_or_default();
        let svid =
            flatmesh_identity::Svid::from_pem(&issued.chain_pem, key).map_err(|message| {
                ControlError::Invalid {
                    what: "control center certificate",
                    message,
                }
            })?;
        let config =
            flatmesh_identity::tls::server_config(&svid, None, &[b"h2"]).map_err(identity_error)?;
        let expiry = issued
            .not_after
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        self.control_not_after.store(expiry, Ordering::Relaxed);
        Ok((config, half_life(issued.not_before, issued.not_after)))
    }

    /// When the signing root expires, and the control channel's certificate if it has one.
    pub fn expiries(&self) -> (SystemTime, Option<SystemTime>) {
        let root = self.authority.read().root_not_after();
        let control = match self.control_not_after.load(Ordering::Relaxed) {
            0 => None,
            seconds => Some(SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)),
        };
        (root, control)
    }

    /// Re-reads the CA directory (after `flatmesh ca rotate` or `retire`).
    fn reload(&self) -> Result<()> {
        let authority = Authority::load(&self.dir).map_err(identity_error)?;
        tracing::info!(
            dir = %self.dir.display(),
            roots = authority.bundle().len(),
            "CA directory changed: signing with its current root from now on"
        );
        *self.authority.write() = authority;
        Ok(())
    }

    /// Whether `node` may hold `id`: granted to it in the tokens file, its own node identity,
    /// placed on it, or that of a Kubernetes pod scheduled on it. The one rule for CSRs and
    /// for SDS.
    pub fn may_hold(&self, node: &str, id: &SpiffeId) -> std::result::Result<(), IdentityError> {
        let granted = self
            .tokens
            .borrow()
            .granted
            .get(node)
            .is_some_and(|ids| ids.contains(id.as_str()));
        // The node's own identity is its alone: it is named after the token's node.
        let own = SpiffeId::node(id.trust_domain(), node).is_ok_and(|own| own == *id);
        if granted
            || own
            || self.placements.holds(node, id.as_str())
            || self.pods.holds(node, id.as_str())
        {
            Ok(())
        } else {
            Err(IdentityError::NotPlaced {
                id: id.to_string(),
                node: node.to_string(),
            })
        }
    }

    /// Logs a refusal for an identity `node` does not hold; returns its text.
    pub fn refused_identity(&self, node: &str, e: &IdentityError) -> String {
        tracing::warn!(%node, error = %e, "CA: refused");
        e.to_string()
    }

    /// A certificate and a fresh key for `id`, which `node` must hold (SDS, where the key
    /// travels to the node over the channel); counted like a CSR's outcome.
    pub fn issue_for(
        &self,
        node: &str,
        id: &SpiffeId,
    ) -> std::result::Result<flatmesh_identity::IssuedSvid, IdentityError> {
        if let Err(e) = self.may_hold(node, id) {
            self.refused_identity(node, &e);
            self.stats.not_placed.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        let issued = self.authority.read().issue(id, self.ttl)?;
        self.stats.issued.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%node, %id, ttl = ?self.ttl, "CA: issued (SDS)");
        Ok(issued)
    }

    /// The trust bundle (every root), PEM.
    pub fn bundle_pem(&self) -> String {
        self.authority.read().bundle_pem()
    }

    fn refuse(counter: &AtomicU64, status: tonic::Status) -> tonic::Status {
        counter.fetch_add(1, Ordering::Relaxed);
        status
    }
}

fn identity_error(e: IdentityError) -> ControlError {
    ControlError::Invalid {
        what: "certificate authority",
        message: e.to_string(),
    }
}

/// The channel's token check (every call, before any handler): counts the refusals.
impl Tokens for NodeCa {
    fn node_of(&self, token: &str) -> Option<String> {
        self.tokens.borrow().node_of(token)
    }

    fn revoked(&self, token: &str) -> bool {
        let revoked = self.tokens.borrow().is_revoked(token);
        if revoked {
            self.stats.revoked.fetch_add(1, Ordering::Relaxed);
        }
        revoked
    }

    fn refused(&self) {
        self.stats.unauthenticated.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("control channel: a call without a known bootstrap token, refused");
    }

    /// Resolves once a reload of the tokens file leaves `token` opening nothing.
    fn cut_off(
        &self,
        token: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>> {
        let mut tokens = self.tokens.subscribe();
        let token = token.to_string();
        let stats = self.stats.clone();
        Box::pin(async move {
            let _ = tokens
                .wait_for(|now| Tokens::node_of(now.as_ref(), &token).is_none())
                .await;
            stats.streams_cut.fetch_add(1, Ordering::Relaxed);
        })
    }
}

impl Signer for NodeCa {
    fn sign(
        &self,
        token: Option<&str>,
        request: &CertificateRequest,
    ) -> std::result::Result<CertificateResponse, tonic::Status> {
        // The channel's check has already passed (an unknown token never gets here); this
        // finds which node is asking.
        let Some(node) = token.and_then(|t| Tokens::node_of(self, t)) else {
            if token.is_some_and(|t| self.tokens.borrow().is_revoked(t)) {
                return Err(flatmesh_xds::secure::token_revoked());
            }
            return Err(tonic::Status::unauthenticated(
                "no known bootstrap token; give the node its own (flatmesh node --bootstrap-token FILE)",
            ));
        };
        let asked = u64::try_from(request.validity_duration).unwrap_or(0);
        let ttl = match asked {
            0 => self.ttl,
            seconds => Duration::from_secs(seconds).clamp(flatmesh_identity::ca::MIN_TTL, self.ttl),
        };
        let authority = self.authority.read();
        let signed = authority.sign_csr(request.csr.as_bytes(), ttl, |id| self.may_hold(&node, id));
        let issued = match signed {
            Ok(issued) => issued,
            Err(e @ IdentityError::NotPlaced { .. }) => {
                return Err(Self::refuse(
                    &self.stats.not_placed,
                    tonic::Status::permission_denied(self.refused_identity(&node, &e)),
                ));
            }
            Err(e) => {
                tracing::warn!(%node, error = %e, "CA: bad certificate request, refused");
                return Err(Self::refuse(
                    &self.stats.bad_request,
                    tonic::Status::invalid_argument(e.to_string()),
                ));
            }
        };
        // The leaf, then the whole bundle (not just the signing root): a node trusts what it
        // is given, and during a rotation that is both roots.
        let leaf = flatmesh_identity::ca::certificates_from_pem(issued.chain_pem.as_bytes())
            .ok()
            .and_then(|chain| chain.into_iter().next())
            .ok_or_else(|| tonic::Status::internal("the CA produced no certificate"))?;
        let mut cert_chain = vec![flatmesh_identity::svid::pem("CERTIFICATE", &leaf)];
        cert_chain.extend(
            authority
                .bundle()
                .iter()
                .map(|root| flatmesh_identity::svid::pem("CERTIFICATE", root)),
        );
        self.stats.issued.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%node, id = %issued.id, ttl = ?ttl, "CA: issued");
        Ok(CertificateResponse { cert_chain })
    }
}

/// Keeps the control channel's certificate fresh: renews it at half its lifetime, and re-reads
/// the CA directory when it changes. A rotation does not renew the channel's certificate at
/// once: nodes that still trust only the old root keep reaching the control center until its
/// next renewal (half of [`CONTROL_TTL`]), which is the time operators have to hand nodes the
/// new `ca.pem` (it holds both roots).
pub async fn keep_fresh(ca: Arc<NodeCa>, tls: ServerTls, mut renew_at: SystemTime) {
    let stamp = |dir: &Path| {
        [
            flatmesh_identity::ca::CERT_FILE,
            flatmesh_identity::ca::KEY_FILE,
        ]
        .map(|f| {
            std::fs::metadata(dir.join(f))
                .and_then(|m| m.modified())
                .ok()
        })
    };
    let mut seen = stamp(&ca.dir);
    let tokens_stamp = |ca: &NodeCa| {
        ca.tokens_path
            .as_ref()
            .and_then(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
    };
    let mut tokens_seen = tokens_stamp(&ca);
    let mut tick = tokio::time::interval(CA_POLL);
    loop {
        tick.tick().await;
        let tokens_now = tokens_stamp(&ca);
        if tokens_now != tokens_seen {
            tokens_seen = tokens_now;
            ca.reload_tokens();
        }
        let now = stamp(&ca.dir);
        let rotated = now != seen;
        if rotated {
            seen = now;
            if let Err(e) = ca.reload() {
                tracing::error!(error = %e, "CA directory changed but cannot be read; still signing with the previous root");
                continue;
            }
        }
        if SystemTime::now() >= renew_at {
            match ca.control_tls() {
                Ok((config, next)) => {
                    tls.set(config);
                    renew_at = next;
                    tracing::info!("control channel certificate renewed");
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot renew the control channel certificate; retrying")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_tokens_file_is_checked() {
        let digest = token_digest_hex("s3cret");
        let tokens = NodeTokens::parse(
            &format!("n1: {{ token_sha256: {digest}, identities: [spiffe://td/ns/a/sa/b] }}\n"),
            "t.yaml",
        )
        .unwrap();
        assert_eq!(tokens.node_of("s3cret").as_deref(), Some("n1"));
        assert_eq!(tokens.node_of("s3cret2"), None);
        for (bad, says) in [
            ("n1: { token_sha256: abc }", "64 hex digits"),
            (
                &format!("n1: {{ token_sha256: {digest} }}\nn2: {{ token_sha256: {digest} }}"),
                "same token",
            ),
            (
                &format!("n1: {{ token_sha256: {digest}, identities: [http://x] }}"),
                "identity `http://x`",
            ),
            (
                &format!("n1: {{ token_sha256: {digest}, roles: [] }}"),
                "unknown field",
            ),
        ] {
            let e = NodeTokens::parse(bad, "t.yaml").unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn renewal_is_at_half_life() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        assert_eq!(
            half_life(start, start + Duration::from_secs(3600)),
            start + Duration::from_secs(1800)
        );
        assert_eq!(
            half_life(start, start),
            start,
            "an empty lifetime renews at once"
        );
    }

    #[test]
    fn placed_services_map_to_workload_identities() {
        assert_eq!(
            service_identity("td", "shop/cart").unwrap().as_str(),
            "spiffe://td/ns/shop/sa/cart"
        );
        assert!(service_identity("td", "nostage").is_none());
    }
}
