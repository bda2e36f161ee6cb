//! The ADS server of `flatmesh control`: serves a [`Store`] of resources to flatmesh nodes and
//! to Envoy, state-of-the-world and delta, and pushes every change to every stream.
//!
//! Versions are content hashes (per type for SotW, per resource for delta), so a restarted
//! server gives the same versions for the same state and a reconnecting delta client that
//! already holds them is sent nothing new.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash as _, Hasher as _};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    Resource as DeltaResource,
};
use envoy_types::pb::google::protobuf::Any;
use flatmesh_config::Config;
use futures_core::Stream;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{Result, XdsError};
use crate::resources::{self, Resources, ORDER, SECRET};
use crate::sds::SecretSource;

const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// One type's resources, packed: name -> (Any, version). Names and versions are shared
/// (`Arc<str>`) with every stream that holds them and with the next publish that keeps them:
/// a thousand delta streams each tracking 8,000 names held 1.2 GB of copies of the same
/// strings (BENCHMARKS.md, "Kubernetes control plane at scale").
pub type Packed = BTreeMap<Arc<str>, (Any, Arc<str>)>;

/// One resource of a [`Packed`] set, by reference: (name, (Any, version)).
type PackedRef<'a> = (&'a Arc<str>, &'a (Any, Arc<str>));

/// One published state: every resource, packed, with its version.
#[derive(Debug, Default)]
pub struct Published {
    /// type URL -> name -> (Any, version). A type whose set is the same as in the previous
    /// publish keeps its map (the same `Arc`): a delta stream that diffed it already skips it.
    pub by_type: BTreeMap<&'static str, Arc<Packed>>,
    /// type URL -> version of the whole set (SotW).
    pub versions: BTreeMap<&'static str, String>,
    /// type URL -> what changed since the set this one was built from: a delta stream that
    /// diffed that set looks at these names only. A thousand nodes, one endpoint move: a
    /// thousand lookups of one name, not a thousand diffs of every assignment.
    changes: BTreeMap<&'static str, Changes>,
}

/// The names of one type that differ between two published sets.
#[derive(Debug)]
struct Changes {
    /// The set these are relative to. Weak: it is only compared with the set a stream holds
    /// (which keeps it alive while the stream needs it), never read.
    since: std::sync::Weak<Packed>,
    /// New, or of another version.
    changed: Vec<Arc<str>>,
    removed: Vec<Arc<str>>,
}

impl Published {
    fn build(resources: &Resources) -> Published {
        Published::build_from(resources, None)
    }

    /// Like [`Published::build`], reusing the encoding and version of every resource that is
    /// the same as in `previous` (resources, what was published for them): an endpoint move
    /// re-encodes one assignment, not ten thousand endpoints.
    fn build_from(resources: &Resources, previous: Option<(&Resources, &Published)>) -> Published {
        let mut out = Published::default();
        let (before, published) = match previous {
            Some((r, p)) => (Some(r), Some(p)),
            None => (None, None),
        };
        out.add(
            resources::LISTENER,
            &resources.listeners,
            before.map(|r| &r.listeners),
            published,
        );
        out.add(
            resources::ROUTE,
            &resources.routes,
            before.map(|r| &r.routes),
            published,
        );
        out.add(
            resources::CLUSTER,
            &resources.clusters,
            before.map(|r| &r.clusters),
            published,
        );
        out.add(
            resources::ENDPOINT,
            &resources.endpoints,
            before.map(|r| &r.endpoints),
            published,
        );
        out
    }

    fn add<M: prost::Message + prost::Name + PartialEq>(
        &mut self,
        type_url: &'static str,
        now: &BTreeMap<String, M>,
        before: Option<&BTreeMap<String, M>>,
        published: Option<&Published>,
    ) {
        let old = published.and_then(|p| p.resources(type_url));
        let mut all = std::collections::hash_map::DefaultHasher::new();
        let mut named = BTreeMap::new();
        for (name, r) in now {
            let sent = old.and_then(|o| o.get_key_value(name.as_str()));
            let reused = match (before.and_then(|b| b.get(name)), sent) {
                (Some(was), Some((_, sent))) if was == r => Some(sent.clone()),
                _ => None,
            };
            let (any, version) = reused.unwrap_or_else(|| {
                let any = crate::resources::pack(r);
                let version: Arc<str> = hash_hex(&any.value).into();
                (any, version)
            });
            name.hash(&mut all);
            version.hash(&mut all);
            // The previous publish's name when it had one: the streams hold that one.
            let name = sent.map_or_else(|| Arc::from(name.as_str()), |(kept, _)| kept.clone());
            named.insert(name, (any, version));
        }
        let version = format!("{:016x}", all.finish());
        // The same set as before (the version hashes every name and version): share its map.
        let named = match published
            .and_then(|p| Some((p.by_type.get(type_url)?, p.versions.get(type_url)?)))
        {
            Some((same, was)) if *was == version => same.clone(),
            _ => {
                if let Some(old) = old {
                    self.changes.insert(type_url, Changes::between(old, &named));
                }
                Arc::new(named)
            }
        };
        self.versions.insert(type_url, version);
        self.by_type.insert(type_url, named);
    }

    fn version(&self, type_url: &str) -> String {
        self.versions.get(type_url).cloned().unwrap_or_default()
    }

    fn resources(&self, type_url: &str) -> Option<&Arc<Packed>> {
        self.by_type.get(type_url)
    }
}

impl Changes {
    fn between(old: &Arc<Packed>, now: &Packed) -> Changes {
        let changed = now
            .iter()
            // The version is the hash of the encoding: what a stream compares too.
            .filter(|(name, (_, version))| old.get(*name).is_none_or(|(_, was)| was != version))
            .map(|(name, _)| name.clone())
            .collect();
        let removed = old
            .keys()
            .filter(|name| !now.contains_key(*name))
            .cloned()
            .collect();
        Changes {
            since: Arc::downgrade(old),
            changed,
            removed,
        }
    }
}

/// Serves `resources` to every store of `stores` (not empty), packed once and held once.
/// Resources that did not change keep their packed form and version, reused from the first
/// store's last state (the stores of one config had the same one before, as a rule); its lock
/// is held throughout, so two publishes to it do not interleave.
fn publish_to(stores: &[Store], resources: Resources) {
    let first = &stores[0];
    let mut current = first.current.lock();
    let previous = first.tx.borrow().clone();
    let published = Arc::new(Published::build_from(
        &resources,
        Some((&current, &previous)),
    ));
    let resources = Arc::new(resources);
    for store in &stores[1..] {
        *store.current.lock() = resources.clone();
        store.tx.send_replace(published.clone());
    }
    *current = resources;
    first.tx.send_replace(published);
}

fn hash_hex(bytes: &[u8]) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// What the control center serves. Cheap to clone; every clone publishes to the same streams.
#[derive(Clone)]
pub struct Store {
    tx: Arc<watch::Sender<Arc<Published>>>,
    /// Shared with the other nodes' stores a config was published to at once
    /// ([`Store::publish_config_to`]): a thousand nodes with one config hold it once.
    current: Arc<Mutex<Arc<Resources>>>,
    nacks: Arc<Mutex<Vec<String>>>,
    stats: Arc<StreamStats>,
    /// Set by [`Store::node`]: each node's streams serve that node's own state from then on.
    nodes: Arc<Mutex<Option<BTreeMap<String, Store>>>>,
    /// Whether streams are answered: false from [`Store::serve_per_node`] until
    /// [`Store::nodes_published`], so that a node reconnecting to a control plane that has just
    /// started keeps its config instead of being handed an empty one.
    answering: Arc<watch::Sender<bool>>,
}

/// What the streams of a [`Store`] did (the control center's `/metrics`).
#[derive(Debug, Default)]
pub struct StreamStats {
    /// Streams open now (SotW and delta).
    pub open: std::sync::atomic::AtomicU64,
    /// Updates sent: a SotW response, or one delta however many responses carry it (a large
    /// delta goes out in pieces of [`DELTA_PIECE`] resources, each ACKed on its own, so `acks`
    /// can exceed this).
    pub pushes: std::sync::atomic::AtomicU64,
    /// Requests that acknowledged a response (its nonce, no error).
    pub acks: std::sync::atomic::AtomicU64,
    /// Requests that refused one (an error detail).
    pub nacks: std::sync::atomic::AtomicU64,
}

impl StreamStats {
    fn count(counter: &std::sync::atomic::AtomicU64) {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts a stream open until the guard drops.
    fn opened(self: &Arc<Self>) -> OpenStream {
        Self::count(&self.open);
        OpenStream(self.clone())
    }

    /// An ACK or a NACK, by the request's nonce and error detail.
    fn reply(&self, nonce: &str, nacked: bool) {
        if nacked {
            Self::count(&self.nacks);
        } else if !nonce.is_empty() {
            Self::count(&self.acks);
        }
    }
}

struct OpenStream(Arc<StreamStats>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl Store {
    pub fn new() -> Store {
        let (tx, _) = watch::channel(Arc::new(Published::build(&Resources::default())));
        Store {
            tx: Arc::new(tx),
            current: Arc::new(Mutex::new(Arc::new(Resources::default()))),
            nacks: Arc::new(Mutex::new(Vec::new())),
            stats: Arc::default(),
            nodes: Arc::default(),
            answering: Arc::new(watch::channel(true).0),
        }
    }

    /// Serve per node from now on (see [`Store::node`]), and answer no stream until
    /// [`Store::nodes_published`]: then a node nothing was published for is served an empty
    /// state.
    pub fn serve_per_node(&self) {
        self.nodes.lock().get_or_insert_with(BTreeMap::new);
        self.answering.send_replace(false);
    }

    /// Every node's state has been published once: streams are answered from now on.
    pub fn nodes_published(&self) {
        self.answering
            .send_if_modified(|answering| !std::mem::replace(answering, true));
    }

    /// The state served to node `id` alone (created empty the first time). Once any node's
    /// state is asked for, the store serves per node: each stream serves the state of the node
    /// its requests name, and this store's own state is served to no one (a Kubernetes
    /// control plane gives each node only what its pods need).
    pub fn node(&self, id: &str) -> Store {
        let mut nodes = self.nodes.lock();
        let nodes = nodes.get_or_insert_with(BTreeMap::new);
        nodes
            .entry(id.to_string())
            .or_insert_with(|| {
                let mut own = Store::new();
                own.nacks = self.nacks.clone();
                own.stats = self.stats.clone();
                own
            })
            .clone()
    }

    /// What a stream of `node` watches: its own state when the store serves per node.
    fn watch_for(&self, node: &str) -> watch::Receiver<Arc<Published>> {
        if self.nodes.lock().is_some() {
            self.node(node).tx.subscribe()
        } else {
            self.tx.subscribe()
        }
    }

    /// What its streams did.
    pub fn stream_stats(&self) -> Arc<StreamStats> {
        self.stats.clone()
    }

    /// Serve exactly `resources` from now on.
    pub fn publish(&self, resources: Resources) {
        publish_to(std::slice::from_ref(self), resources);
    }

    /// Serve one flatmesh config to each of `nodes` (see [`Store::node`]): translated and
    /// packed once, and held once however many nodes get it.
    pub fn publish_config_to<'a>(&self, nodes: impl IntoIterator<Item = &'a str>, config: &Config) {
        let stores: Vec<Store> = nodes.into_iter().map(|id| self.node(id)).collect();
        if !stores.is_empty() {
            publish_to(&stores, crate::from_model::resources(config));
        }
    }

    /// Serve a flatmesh config (validated by the caller).
    pub fn publish_config(&self, config: &Config) {
        self.publish(crate::from_model::resources(config));
    }

    /// Replace the endpoints of one cluster (the control center's endpoint feed). Unknown
    /// clusters get an assignment too, which is harmless until a cluster uses it.
    pub fn set_endpoints(&self, cluster: &str, endpoints: &[SocketAddr]) {
        let mut resources = Resources::clone(&self.current.lock());
        resources.endpoints.insert(
            cluster.to_string(),
            crate::from_model::assignment(cluster, endpoints),
        );
        self.publish(resources);
    }

    /// The published form of the current state (tests and diagnostics).
    pub fn published(&self) -> Arc<Published> {
        self.tx.borrow().clone()
    }

    pub fn resources(&self) -> Resources {
        Resources::clone(&self.current.lock())
    }

    /// NACKs received from clients (error details), oldest first.
    pub fn nacks(&self) -> Vec<String> {
        self.nacks.lock().clone()
    }

    fn record_nack(&self, node: &str, type_url: &str, message: &str) {
        tracing::warn!(
            node,
            type_url = resources::short(type_url),
            error = message,
            "client NACKed an update"
        );
        let mut nacks = self.nacks.lock();
        if nacks.len() >= 100 {
            nacks.remove(0);
        }
        nacks.push(format!("{node}: {message}"));
    }
}

/// What protects the server and what it serves besides ADS.
#[derive(Clone, Default)]
pub struct ServeOptions {
    /// TLS on the port (the control center's certificate); `None` = plaintext.
    pub tls: Option<crate::secure::ServerTls>,
    /// With tokens, every call must carry a known bootstrap token.
    pub tokens: Option<Arc<dyn crate::secure::Tokens>>,
    /// The certificate API ([`crate::certificates`]), when the control center is a CA.
    pub certificates: Option<crate::certificates::CertificateServer>,
    /// SDS: each node's secrets. Needs `tls` and `tokens` (a secret may carry a private key).
    pub secrets: Option<Arc<dyn crate::sds::SecretSource>>,
    /// LRS: the nodes' load reports (`crate::lrs`).
    pub load_reports: Option<crate::lrs::LoadReportServer>,
}

/// Serve ADS on `address`, plaintext and open to any caller, until `shutdown` resolves.
/// Returns the bound address through `bound` as soon as it listens (useful with port 0).
pub async fn serve(
    address: SocketAddr,
    store: Store,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    serve_with(address, store, ServeOptions::default(), bound, shutdown).await
}

/// Serve ADS (and, with `options`, the certificate API, over TLS, to token holders only) on
/// `address` until `shutdown` resolves.
pub async fn serve_with(
    address: SocketAddr,
    store: Store,
    options: ServeOptions,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let err = |why: String| XdsError::Serve {
        address: address.to_string(),
        why,
    };
    if options.secrets.is_some() && (options.tls.is_none() || options.tokens.is_none()) {
        return Err(err(
            "SDS serves private keys, so only over TLS to nodes known by their bootstrap token; give the control center --ca-dir and --node-tokens".into(),
        ));
    }
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| err(e.to_string()))?;
    let actual = listener.local_addr().map_err(|e| err(e.to_string()))?;
    tracing::info!(
        address = %actual,
        tls = options.tls.is_some(),
        tokens = options.tokens.is_some(),
        certificates = options.certificates.is_some(),
        sds = options.secrets.is_some(),
        "serving xDS (ADS: state of the world and delta)"
    );
    if let Some(bound) = bound {
        let _ = bound.send(actual);
    }
    // xDS streams never end by themselves, so on shutdown every stream is ended with
    // UNAVAILABLE (clients reconnect, here or elsewhere), then the server stops; if a
    // connection still lingers after a second, it is dropped.
    let (fired_tx, mut fired_rx) = watch::channel(false);
    let ads = AggregatedDiscoveryServiceServer::new(Ads {
        store,
        closing: fired_rx.clone(),
        secrets: options.secrets.clone(),
        tokens: options.tokens.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE)
    .max_encoding_message_size(MAX_MESSAGE);
    // Without tokens every call passes; with them, ADS and the certificate API alike need one.
    let check = {
        let tokens = options.tokens.clone();
        move |request: tonic::Request<()>| match &tokens {
            Some(tokens) => crate::secure::require_token(tokens.clone())(request),
            None => Ok(request),
        }
    };
    let routes = tonic::service::Routes::new(tonic::service::interceptor::InterceptedService::new(
        ads,
        check.clone(),
    ));
    let routes = match options.load_reports {
        Some(server) => routes.add_service(tonic::service::interceptor::InterceptedService::new(
            envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_server::LoadReportingServiceServer::new(
                crate::lrs::Served {
                    server,
                    tokens: options.tokens.clone(),
                    closing: fired_rx.clone(),
                },
            )
            .max_decoding_message_size(crate::lrs::MAX_MESSAGE),
            check.clone(),
        )),
        None => routes,
    };
    let routes = match options.certificates {
        Some(certificates) => routes.add_service(
            tonic::service::interceptor::InterceptedService::new(certificates, check),
        ),
        None => routes,
    };
    let signal = async move {
        shutdown.await;
        let _ = fired_tx.send(true);
    };
    let mut builder = tonic::transport::Server::builder();
    let server: Pin<Box<dyn std::future::Future<Output = _> + Send>> = match options.tls {
        Some(tls) => Box::pin(
            builder
                .add_routes(routes)
                .serve_with_incoming_shutdown(crate::secure::accept_tls(listener, tls), signal),
        ),
        None => Box::pin(builder.add_routes(routes).serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            signal,
        )),
    };
    tokio::select! {
        result = server => result.map_err(|e| err(e.to_string())),
        _ = async {
            let _ = fired_rx.wait_for(|fired| *fired).await;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        } => Ok(()),
    }
}

struct Ads {
    store: Store,
    /// Becomes true when the server shuts down.
    closing: watch::Receiver<bool>,
    /// SDS (served only with tokens, which say which node a stream is).
    secrets: Option<Arc<dyn SecretSource>>,
    /// With tokens: a stream ends when its token is revoked.
    tokens: Option<Arc<dyn crate::secure::Tokens>>,
}

impl Ads {
    /// The secret source and the node it answers for, known by the stream's bootstrap token
    /// (never by the node id the client claims in its requests).
    fn secrets_for<T>(&self, request: &tonic::Request<T>) -> Option<NodeSecrets> {
        let (source, tokens) = (self.secrets.as_ref()?, self.tokens.as_ref()?);
        let token = crate::certificates::bearer_token(request.metadata())?;
        Some(NodeSecrets {
            source: source.clone(),
            node: tokens.node_of(token)?,
        })
    }
}

/// What one stream's node may be given over SDS.
#[derive(Clone)]
struct NodeSecrets {
    source: Arc<dyn SecretSource>,
    node: String,
}

impl NodeSecrets {
    /// Secrets `names`, packed, each with its content hash as version; those refused are left
    /// out (the source logged and counted the refusal).
    fn get(&self, names: &BTreeSet<String>) -> (Packed, String) {
        let mut all = std::collections::hash_map::DefaultHasher::new();
        let mut out = BTreeMap::new();
        for name in names {
            if let Ok(secret) = self.source.secret(&self.node, name) {
                let any = crate::resources::pack(&secret);
                let version: Arc<str> = hash_hex(&any.value).into();
                name.hash(&mut all);
                version.hash(&mut all);
                out.insert(Arc::from(name.as_str()), (any, version));
            }
        }
        (out, format!("{:016x}", all.finish()))
    }
}

/// Resolves when `changes` moves (never without a source).
async fn secrets_changed(changes: &mut Option<watch::Receiver<u64>>) -> bool {
    match changes {
        Some(rx) => rx.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Resolves when the token a stream was opened with is revoked (never without tokens).
type CutOff = Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl Ads {
    fn cut_off(&self, metadata: &tonic::metadata::MetadataMap) -> CutOff {
        match (&self.tokens, crate::certificates::bearer_token(metadata)) {
            (Some(tokens), Some(token)) => tokens.cut_off(token),
            _ => Box::pin(std::future::pending()),
        }
    }
}

/// Resolves when the server shuts down (at once if it already has).
async fn closed(mut closing: watch::Receiver<bool>) {
    let _ = closing.wait_for(|closing| *closing).await;
}

fn shutting_down() -> tonic::Status {
    tonic::Status::unavailable("the xDS server is shutting down; reconnect")
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = std::result::Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> std::result::Result<tonic::Response<Self::StreamAggregatedResourcesStream>, tonic::Status>
    {
        let secrets = self.secrets_for(&request);
        let cut_off = self.cut_off(request.metadata());
        let requests = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(sotw_stream(
            self.store.clone(),
            requests,
            tx,
            self.closing.clone(),
            secrets,
            cut_off,
        ));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> std::result::Result<tonic::Response<Self::DeltaAggregatedResourcesStream>, tonic::Status>
    {
        let secrets = self.secrets_for(&request);
        let cut_off = self.cut_off(request.metadata());
        let requests = request.into_inner();
        let (tx, rx) = mpsc::channel(DELTA_QUEUE);
        tokio::spawn(delta_stream(
            self.store.clone(),
            requests,
            tx,
            self.closing.clone(),
            secrets,
            cut_off,
        ));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// `None` = wildcard (everything of the type).
type Names = Option<BTreeSet<String>>;

/// What a SotW request subscribes to. An empty list is the (legacy) wildcard only for LDS and
/// CDS; for RDS and EDS it means "none of them", as in Envoy. `*` is the wildcard for any type.
fn names_of(type_url: &str, list: &[String]) -> Names {
    let wildcard_type = type_url == resources::LISTENER || type_url == resources::CLUSTER;
    if (list.is_empty() && wildcard_type) || list.iter().any(|n| n == "*") {
        None
    } else {
        Some(list.iter().cloned().collect())
    }
}

/// Per type, on one SotW stream.
struct SotwType {
    names: Names,
    sent_version: Option<String>,
    nonce: String,
}

async fn sotw_stream(
    store: Store,
    mut requests: tonic::Streaming<DiscoveryRequest>,
    tx: mpsc::Sender<std::result::Result<DiscoveryResponse, tonic::Status>>,
    closing: watch::Receiver<bool>,
    secrets: Option<NodeSecrets>,
    mut cut_off: CutOff,
) {
    let _open = store.stats.opened();
    let mut watch = store.tx.subscribe();
    // Until a request names the node (its first one does), the shared state.
    let mut watching_node = false;
    let mut types: BTreeMap<String, SotwType> = BTreeMap::new();
    let mut node = String::new();
    let mut nonce = 0u64;
    let mut secret_changes = secrets.as_ref().map(|s| s.source.changes());
    let mut secrets_stale = false;
    let mut answering = store.answering.subscribe();
    loop {
        let published = watch.borrow_and_update().clone();
        let answer = *answering.borrow_and_update();
        // Secrets first (a listener's secret before the listener), then CDS, EDS, LDS, RDS.
        if let (Some(source), Some(t)) = (&secrets, types.get_mut(SECRET)) {
            if secrets_stale || t.sent_version.is_none() {
                secrets_stale = false;
                let names = t.names.clone().unwrap_or_default();
                let (all, version) = source.get(&names);
                if t.sent_version.as_deref() != Some(&version) {
                    nonce += 1;
                    let response = sotw_response_of(Some(&all), version, SECRET, &None, nonce);
                    t.sent_version = Some(response.version_info.clone());
                    t.nonce = response.nonce.clone();
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
            }
        }
        for type_url in ORDER.iter().filter(|_| answer) {
            if let Some(t) = types.get_mut(*type_url) {
                if t.sent_version.as_deref() != Some(&published.version(type_url)) {
                    nonce += 1;
                    let response = sotw_response(&published, type_url, &t.names, nonce);
                    t.sent_version = Some(response.version_info.clone());
                    t.nonce = response.nonce.clone();
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                    StreamStats::count(&store.stats.pushes);
                }
            }
        }
        tokio::select! {
            _ = closed(closing.clone()) => {
                let _ = tx.send(Err(shutting_down())).await;
                return;
            }
            () = &mut cut_off => {
                tracing::warn!(node, "xDS stream ended: its bootstrap token was revoked");
                let _ = tx.send(Err(crate::secure::token_revoked())).await;
                return;
            }
            changed = watch.changed() => if changed.is_err() { return },
            Ok(()) = answering.changed() => {}
            true = secrets_changed(&mut secret_changes) => secrets_stale = true,
            request = requests.message() => {
                let request = match request {
                    Ok(Some(r)) => r,
                    Ok(None) | Err(_) => return,
                };
                if let Some(n) = &request.node {
                    if n.id != node || !watching_node {
                        watch = store.watch_for(&n.id);
                        watching_node = true;
                    }
                    node = n.id.clone();
                }
                let type_url = request.type_url.clone();
                if !served(&type_url, secrets.is_some()) {
                    tracing::debug!(type_url, "request for a type flatmesh does not serve; ignored");
                    continue;
                }
                let t = types.entry(type_url.clone()).or_insert(SotwType {
                    names: names_of(&type_url, &request.resource_names),
                    sent_version: None,
                    nonce: String::new(),
                });
                if !request.response_nonce.is_empty() && request.response_nonce != t.nonce {
                    continue; // a reply to an older response; the newer one is in flight
                }
                store.stats.reply(&request.response_nonce, request.error_detail.is_some());
                if let Some(error) = &request.error_detail {
                    store.record_nack(&node, &type_url, &error.message);
                }
                let names = names_of(&type_url, &request.resource_names);
                if names != t.names {
                    t.names = names;
                    t.sent_version = None; // a new subscription gets an answer even if nothing changed
                }
            }
        }
    }
}

/// Whether this server answers `type_url` (SDS only with a secret source).
fn served(type_url: &str, sds: bool) -> bool {
    ORDER.contains(&type_url) || (sds && type_url == SECRET)
}

fn sotw_response(
    published: &Published,
    type_url: &str,
    names: &Names,
    nonce: u64,
) -> DiscoveryResponse {
    sotw_response_of(
        published.resources(type_url).map(|all| &**all),
        published.version(type_url),
        type_url,
        names,
        nonce,
    )
}

/// A SotW response of the resources in `all` that `names` subscribes to.
fn sotw_response_of(
    all: Option<&Packed>,
    version: String,
    type_url: &str,
    names: &Names,
    nonce: u64,
) -> DiscoveryResponse {
    let resources = all
        .map(|all| {
            all.iter()
                .filter(|(name, _)| names.as_ref().is_none_or(|n| n.contains(&***name)))
                .map(|(_, (any, _))| any.clone())
                .collect()
        })
        .unwrap_or_default();
    DiscoveryResponse {
        version_info: version,
        resources,
        type_url: type_url.to_string(),
        nonce: nonce.to_string(),
        ..Default::default()
    }
}

/// Per type, on one delta stream.
struct DeltaType {
    wildcard: bool,
    names: BTreeSet<String>,
    /// What the client holds: name -> version (shared with the published set).
    held: BTreeMap<Arc<str>, Arc<str>>,
    /// The first request always gets a response, even an empty one (it ends Envoy's warming).
    answered: bool,
    /// The set last diffed, while the stream's subscription stayed as it was: a publish that
    /// left this type's set as it was (the same `Arc`) has nothing to send here, without a
    /// diff, and one whose [`Changes`] are relative to it is diffed on the changed names only.
    /// A thousand nodes, an endpoint change: one name looked up per stream.
    diffed: Option<Arc<Packed>>,
}

async fn delta_stream(
    store: Store,
    mut requests: tonic::Streaming<DeltaDiscoveryRequest>,
    tx: mpsc::Sender<std::result::Result<DeltaDiscoveryResponse, tonic::Status>>,
    closing: watch::Receiver<bool>,
    secrets: Option<NodeSecrets>,
    mut cut_off: CutOff,
) {
    let _open = store.stats.opened();
    let mut watch = store.tx.subscribe();
    // Until a request names the node (its first one does), the shared state.
    let mut watching_node = false;
    let mut types: BTreeMap<String, DeltaType> = BTreeMap::new();
    let mut node = String::new();
    let mut nonce = 0u64;
    let mut secret_changes = secrets.as_ref().map(|s| s.source.changes());
    let mut secrets_stale = true;
    let mut answering = store.answering.subscribe();
    loop {
        let published = watch.borrow_and_update().clone();
        let answer = *answering.borrow_and_update();
        if let (Some(source), Some(t)) = (&secrets, types.get_mut(SECRET)) {
            if std::mem::take(&mut secrets_stale) || !t.answered {
                let (all, version) = source.get(&t.names);
                if let Some(delta) = delta_of(&all, version, SECRET, t) {
                    if !send_delta(&tx, delta, &mut nonce).await {
                        return;
                    }
                }
            }
        }
        for type_url in ORDER.iter().filter(|_| answer) {
            if let Some(t) = types.get_mut(*type_url) {
                if let Some(delta) = delta_response(&published, type_url, t) {
                    if !send_delta(&tx, delta, &mut nonce).await {
                        return;
                    }
                    StreamStats::count(&store.stats.pushes);
                }
            }
        }
        tokio::select! {
            _ = closed(closing.clone()) => {
                let _ = tx.send(Err(shutting_down())).await;
                return;
            }
            () = &mut cut_off => {
                tracing::warn!(node, "xDS stream ended: its bootstrap token was revoked");
                let _ = tx.send(Err(crate::secure::token_revoked())).await;
                return;
            }
            changed = watch.changed() => if changed.is_err() { return },
            Ok(()) = answering.changed() => {}
            true = secrets_changed(&mut secret_changes) => secrets_stale = true,
            request = requests.message() => {
                let request = match request {
                    Ok(Some(r)) => r,
                    Ok(None) | Err(_) => return,
                };
                if let Some(n) = &request.node {
                    if n.id != node || !watching_node {
                        watch = store.watch_for(&n.id);
                        watching_node = true;
                    }
                    node = n.id.clone();
                }
                let type_url = request.type_url.clone();
                if !served(&type_url, secrets.is_some()) {
                    continue;
                }
                // A changed SDS subscription is answered from fresh secrets.
                secrets_stale |= type_url == SECRET;
                store.stats.reply(&request.response_nonce, request.error_detail.is_some());
                if let Some(error) = &request.error_detail {
                    store.record_nack(&node, &type_url, &error.message);
                }
                let first = !types.contains_key(&type_url);
                let t = types.entry(type_url.clone()).or_insert_with(|| DeltaType {
                    // An empty first subscription to LDS/CDS is the legacy wildcard.
                    wildcard: request.resource_names_subscribe.is_empty()
                        && (type_url == resources::LISTENER || type_url == resources::CLUSTER),
                    names: BTreeSet::new(),
                    held: held_from(&request.initial_resource_versions),
                    answered: false,
                    diffed: None,
                });
                // A request that changes what the stream wants makes the next diff a full one;
                // an ACK or a NACK changes nothing of it (and every push gets one).
                if first
                    || !request.resource_names_subscribe.is_empty()
                    || !request.resource_names_unsubscribe.is_empty()
                {
                    t.diffed = None;
                }
                if first && !request.initial_resource_versions.is_empty() {
                    t.held = held_from(&request.initial_resource_versions);
                }
                for name in &request.resource_names_subscribe {
                    if name == "*" {
                        t.wildcard = true;
                    } else {
                        t.names.insert(name.clone());
                        // A (re)subscription must be answered even if the client holds it.
                        t.held.remove(name.as_str());
                    }
                }
                for name in &request.resource_names_unsubscribe {
                    if name == "*" {
                        t.wildcard = false;
                    } else {
                        t.names.remove(name);
                        t.held.remove(name.as_str());
                    }
                }
            }
        }
    }
}

/// Resources per delta response at most. A node's first push of 2,000 clusters goes out in
/// pieces, each packed when the stream's channel has room for it, so a thousand streams syncing
/// at once hold a piece or two each instead of every resource twice (the response and its
/// encoding, waiting on flow control). Delta xDS allows any split; SotW does not (an LDS or CDS
/// response is the whole set).
const DELTA_PIECE: usize = 256;

/// Responses a delta stream has packed and not yet handed to the connection: with the piece
/// size, the bound on what a slow client makes the server hold.
const DELTA_QUEUE: usize = 2;

/// What one delta diff decided to tell a client: resources of a published set (by reference)
/// and names to remove. The stream's state already counts it as held.
struct Delta<'a> {
    system_version: String,
    type_url: &'a str,
    send: Vec<PackedRef<'a>>,
    removed: Vec<Arc<str>>,
}

impl<'a> Delta<'a> {
    /// The responses that carry it, [`DELTA_PIECE`] resources each (the removals ride in the
    /// first), each packed when asked for; without nonces.
    fn responses(mut self) -> impl Iterator<Item = DeltaDiscoveryResponse> + 'a {
        let pieces = self.send.len().div_ceil(DELTA_PIECE).max(1);
        (0..pieces).map(move |i| {
            let piece = &self.send[i * DELTA_PIECE..((i + 1) * DELTA_PIECE).min(self.send.len())];
            DeltaDiscoveryResponse {
                system_version_info: self.system_version.clone(),
                resources: piece
                    .iter()
                    .map(|(name, (any, version))| DeltaResource {
                        name: name.to_string(),
                        version: version.to_string(),
                        resource: Some(any.clone()),
                        ..Default::default()
                    })
                    .collect(),
                type_url: self.type_url.to_string(),
                removed_resources: std::mem::take(&mut self.removed)
                    .iter()
                    .map(|name| name.to_string())
                    .collect(),
                ..Default::default()
            }
        })
    }
}

/// Sends a delta's responses in order, each with the next nonce; false once the client is gone.
async fn send_delta(
    tx: &mpsc::Sender<std::result::Result<DeltaDiscoveryResponse, tonic::Status>>,
    delta: Delta<'_>,
    nonce: &mut u64,
) -> bool {
    for mut response in delta.responses() {
        *nonce += 1;
        response.nonce = nonce.to_string();
        if tx.send(Ok(response)).await.is_err() {
            return false;
        }
    }
    true
}

fn delta_response<'a>(
    published: &'a Published,
    type_url: &'a str,
    t: &mut DeltaType,
) -> Option<Delta<'a>> {
    let all = published.resources(type_url)?;
    let version = published.version(type_url);
    let delta = match (&t.diffed, published.changes.get(type_url)) {
        (Some(diffed), _) if Arc::ptr_eq(diffed, all) => return None,
        // The stream diffed the set these changes are relative to, and no request of this
        // type came since: only the changed names can differ from what the client holds.
        (Some(diffed), Some(changes))
            if std::ptr::eq(changes.since.as_ptr(), Arc::as_ptr(diffed)) =>
        {
            let candidates = changes
                .changed
                .iter()
                .filter_map(|name| all.get_key_value(name));
            let removed = changes
                .removed
                .iter()
                .filter(|name| t.held.contains_key(*name))
                .cloned()
                .collect();
            decide(candidates, removed, version, type_url, t)
        }
        _ => delta_of(all, version, type_url, t),
    };
    t.diffed = Some(all.clone());
    delta
}

/// What in `all` the client wants and does not hold, and what it holds that is gone; `None` if
/// there is nothing to say.
fn delta_of<'a>(
    all: &'a Packed,
    system_version: String,
    type_url: &'a str,
    t: &mut DeltaType,
) -> Option<Delta<'a>> {
    let removed: Vec<Arc<str>> = t
        .held
        .keys()
        .filter(|name| !all.contains_key(*name))
        .cloned()
        .collect();
    decide(all.iter(), removed, system_version, type_url, t)
}

/// A client's `initial_resource_versions`, as a stream holds them.
fn held_from(versions: &std::collections::HashMap<String, String>) -> BTreeMap<Arc<str>, Arc<str>> {
    versions
        .iter()
        .map(|(name, version)| (Arc::from(name.as_str()), Arc::from(version.as_str())))
        .collect()
}

/// What of `candidates` the client wants and does not hold, and the removal of `removed`
/// (names it holds), counted as held from now on; `None` if there is nothing to say.
fn decide<'a>(
    candidates: impl Iterator<Item = PackedRef<'a>>,
    removed: Vec<Arc<str>>,
    system_version: String,
    type_url: &'a str,
    t: &mut DeltaType,
) -> Option<Delta<'a>> {
    let wanted = |name: &str| t.wildcard || t.names.contains(name);
    let send: Vec<_> = candidates
        .filter(|(name, (_, version))| wanted(name) && t.held.get(*name) != Some(version))
        .collect();
    if send.is_empty() && removed.is_empty() && t.answered {
        return None;
    }
    t.answered = true;
    for (name, (_, version)) in &send {
        t.held.insert((*name).clone(), version.clone());
    }
    for name in &removed {
        t.held.remove(name);
    }
    Some(Delta {
        system_version,
        type_url,
        send,
        removed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::ENDPOINT;

    fn config(clusters: &[(&str, &str)]) -> flatmesh_config::Config {
        let mut text = String::from(
            "listeners: [ { name: t, address: 127.0.0.1:9000, protocol: tcp, cluster: c } ]\nclusters:\n",
        );
        for (name, endpoint) in clusters {
            text += &format!("  - {{ name: {name}, endpoints: [ {endpoint} ] }}\n");
        }
        flatmesh_config::parse(&text, "t.yaml").unwrap()
    }

    fn stream(wildcard: bool, names: &[&str]) -> DeltaType {
        DeltaType {
            wildcard,
            names: names.iter().map(|n| n.to_string()).collect(),
            held: BTreeMap::new(),
            answered: false,
            diffed: None,
        }
    }

    /// What a delta's responses say: (name, version) sent, and names removed.
    type Said = (Vec<(String, String)>, Vec<String>);

    fn said(delta: Option<Delta<'_>>) -> Option<Said> {
        delta.map(|d| {
            let (mut sent, mut removed) = (Vec::new(), Vec::new());
            for r in d.responses() {
                sent.extend(r.resources.into_iter().map(|d| (d.name, d.version)));
                removed.extend(r.removed_resources);
            }
            (sent, removed)
        })
    }

    #[test]
    fn a_large_delta_goes_out_in_pieces_with_the_removals_in_the_first() {
        let all: Packed = (0..600)
            .map(|i| {
                (
                    format!("r{i:03}").into(),
                    (Any::default(), format!("v{i}").into()),
                )
            })
            .collect();
        let mut t = stream(true, &[]);
        t.held.insert("gone".into(), "v".into());
        let delta = delta_of(&all, "sys".into(), ENDPOINT, &mut t).unwrap();
        let responses: Vec<_> = delta.responses().collect();
        let sizes: Vec<usize> = responses.iter().map(|r| r.resources.len()).collect();
        assert_eq!(sizes, [DELTA_PIECE, DELTA_PIECE, 600 - 2 * DELTA_PIECE]);
        let removed: Vec<&Vec<String>> = responses.iter().map(|r| &r.removed_resources).collect();
        assert_eq!(removed, [&vec!["gone".to_string()], &vec![], &vec![]]);
        let names: Vec<&str> = responses
            .iter()
            .flat_map(|r| &r.resources)
            .map(|r| r.name.as_str())
            .collect();
        let expected: Vec<&str> = all.keys().map(|name| &**name).collect();
        assert_eq!(names, expected, "every resource once, in order");
        assert_eq!(t.held.len(), 600);
        // Nothing new: nothing to say.
        assert!(delta_of(&all, "sys".into(), ENDPOINT, &mut t).is_none());
    }

    #[test]
    fn a_stream_that_diffed_the_last_set_sends_what_a_full_diff_would() {
        let store = Store::new();
        store.publish_config(&config(&[
            ("a", "127.0.0.1:1"),
            ("b", "127.0.0.1:2"),
            ("c", "127.0.0.1:3"),
        ]));
        let first = store.published();
        // Publishes that change a, remove b, add d, keep c; then one that changes nothing of
        // the endpoints but a's again.
        let next = [
            config(&[
                ("a", "127.0.0.1:9"),
                ("c", "127.0.0.1:3"),
                ("d", "127.0.0.1:4"),
            ]),
            config(&[
                ("a", "127.0.0.1:8"),
                ("c", "127.0.0.1:3"),
                ("d", "127.0.0.1:4"),
            ]),
        ];
        for (wildcard, names) in [(true, &[][..]), (false, &["a", "b", "d"][..])] {
            let mut fast = stream(wildcard, names);
            assert!(delta_response(&first, ENDPOINT, &mut fast).is_some());
            for (i, config) in next.iter().enumerate() {
                store.publish_config(config);
                let published = store.published();
                assert!(
                    published.changes.contains_key(ENDPOINT),
                    "built from the last set"
                );
                // The same stream state, diffed in full.
                let mut full = DeltaType {
                    wildcard: fast.wildcard,
                    names: fast.names.clone(),
                    held: fast.held.clone(),
                    answered: fast.answered,
                    diffed: None,
                };
                let expected = said(delta_response(&published, ENDPOINT, &mut full));
                let got = said(delta_response(&published, ENDPOINT, &mut fast));
                assert_eq!(got, expected);
                assert_eq!(fast.held, full.held);
                let (sent, removed) = got.expect("a changed every time");
                let sent: Vec<&str> = sent.iter().map(|(n, _)| n.as_str()).collect();
                if i == 0 {
                    assert_eq!((sent, removed), (vec!["a", "d"], vec!["b".to_string()]));
                } else {
                    assert_eq!((sent, removed), (vec!["a"], vec![]));
                }
            }
        }
    }
}
