//! The ADS client of `flatmesh node --xds`: one gRPC stream to the control plane carrying LDS,
//! RDS, CDS and EDS, in state-of-the-world or delta form.
//!
//! Every response is applied to the node's resources (recording how to undo it), translated and
//! validated as a whole ([`crate::to_model::Translator`], which re-translates only the resources
//! that changed) and handed to the node (a zero-drop swap, the same one a file reload uses). Only
//! then is it ACKed; otherwise it is undone and NACKed with the reason, and the node keeps what it
//! had. When the stream breaks the node keeps serving its last good config and the client
//! reconnects with jittered exponential backoff, telling the server what it already holds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node as NodeId;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use flatmesh_config::Config;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{Result, XdsError};
use crate::resources::{self, Resource, Resources, CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
use crate::sds::SecretDir;
use crate::to_model::Translator;

/// Responses up to this size are accepted (10,000 endpoints take well under 1 MB).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Which ADS form to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// State of the world: every LDS/CDS response lists all resources.
    Sotw,
    /// Incremental: responses carry changes and removals.
    Delta,
}

#[derive(Debug, Clone)]
pub struct Options {
    /// `HOST:PORT` of the control plane's gRPC port.
    pub server: String,
    pub node_id: String,
    /// Sent as the node's `cluster` (some control planes key on it); defaults to the node id.
    pub node_cluster: String,
    pub protocol: Protocol,
    /// TLS and the bootstrap token, when the control center asks for them.
    pub security: crate::secure::ChannelSecurity,
    /// Where SDS secrets are written (`--sds-dir`); without it a pushed secret is NACKed.
    pub sds_dir: Option<std::path::PathBuf>,
    /// With a source, the node reports its load to the server over LRS (`crate::lrs`).
    pub load_reports: Option<crate::lrs::LoadSource>,
}

/// Where translated configs go: the node proxy in production, anything in tests.
pub trait Apply: Send + 'static {
    fn apply(&mut self, config: Config) -> std::result::Result<(), String>;
}

/// What the client has done so far, for logs, the CLI and tests.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub connected: bool,
    /// Connection attempts so far, successful or not.
    pub attempts: u64,
    /// Streams opened so far (1 + reconnects).
    pub streams: u64,
    /// Why the last stream or connection attempt ended, if it failed.
    pub last_error: Option<String>,
    /// The last version ACKed per type URL.
    pub acked: BTreeMap<String, String>,
    /// Every NACK's error_detail, oldest first (bounded).
    pub nacks: Vec<String>,
    /// Configs handed to the node.
    pub applied: u64,
    /// SDS secrets named by held listeners or clusters but not received yet, with who waits
    /// (those listeners are not served, those clusters answer 503, until the secret arrives).
    pub waiting_secrets: BTreeMap<String, Vec<String>>,
}

/// A running client; dropping it stops it.
pub struct Client {
    status: Arc<Mutex<Status>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// The load reports' stream, when the node reports load.
    reporting: Option<tokio::task::JoinHandle<()>>,
}

impl Client {
    /// Start the client on the current tokio runtime.
    pub fn spawn(options: Options, base: Config, apply: impl Apply) -> Client {
        let status = Arc::new(Mutex::new(Status::default()));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let secrets = options.sds_dir.clone().map(SecretDir::new);
        let reporting = options
            .load_reports
            .clone()
            .map(|source| tokio::spawn(crate::lrs::report(options.clone(), source)));
        let session = Session {
            secrets,
            written: BTreeMap::new(),
            options,
            base,
            apply: Box::new(apply),
            status: status.clone(),
            state: Resources::default(),
            translator: Translator::default(),
            applied: None,
            acked: BTreeMap::new(),
            nonces: BTreeMap::new(),
            versions: BTreeMap::new(),
        };
        let task = tokio::spawn(session.run(stop_rx));
        Client {
            status,
            stop: Some(stop_tx),
            task: Some(task),
            reporting,
        }
    }

    pub fn status(&self) -> Status {
        self.status.lock().clone()
    }

    /// Stop the client and wait for it.
    pub async fn stop(mut self) {
        if let Some(reporting) = self.reporting.take() {
            reporting.abort();
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        if let Some(reporting) = &self.reporting {
            reporting.abort();
        }
    }
}

struct Session {
    options: Options,
    /// Where received secrets are written, if the node takes SDS.
    secrets: Option<SecretDir>,
    /// The secrets written to `secrets`, as they were written.
    written:
        BTreeMap<String, envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret>,
    base: Config,
    apply: Box<dyn Apply>,
    status: Arc<Mutex<Status>>,
    /// The resources of the last good (applied) state.
    state: Resources,
    /// Remembers each resource's translation, so an update re-translates only what it changed.
    translator: Translator,
    applied: Option<Config>,
    /// SotW: last ACKed version per type; kept across reconnects.
    acked: BTreeMap<String, String>,
    /// Last nonce seen per type on the current stream.
    nonces: BTreeMap<String, String>,
    /// Delta: the version of every resource held, per type.
    versions: BTreeMap<String, BTreeMap<String, String>>,
}

impl Session {
    async fn run(mut self, mut stop: tokio::sync::oneshot::Receiver<()>) {
        let mut backoff = Backoff::new(&self.options.node_id);
        loop {
            let outcome = tokio::select! {
                _ = &mut stop => return,
                outcome = self.stream() => outcome,
            };
            self.nonces.clear();
            let made_progress = match &outcome {
                Ok(progress) => *progress,
                Err((progress, _)) => *progress,
            };
            if made_progress {
                backoff.reset();
            }
            let wait = backoff.next();
            {
                let mut status = self.status.lock();
                status.connected = false;
                status.last_error = outcome.as_ref().err().map(|(_, e)| e.to_string());
            }
            match outcome {
                Ok(_) => {
                    tracing::warn!(server = %self.options.server, retry_in = ?wait, "xDS stream closed by the server; reconnecting, the node keeps its last good config")
                }
                Err((_, e)) => {
                    tracing::warn!(error = %e, retry_in = ?wait, "xDS stream failed; the node keeps its last good config")
                }
            }
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One stream, until it ends. The bool says whether any response arrived (resets backoff).
    async fn stream(&mut self) -> std::result::Result<bool, (bool, XdsError)> {
        let address = self.options.server.clone();
        self.status.lock().attempts += 1;
        let channel = crate::secure::connect(&address, &self.options.security, CONNECT_TIMEOUT)
            .await
            .map_err(|why| {
                (
                    false,
                    XdsError::Connect {
                        address: address.clone(),
                        why,
                    },
                )
            })?;
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        {
            let mut status = self.status.lock();
            status.connected = true;
            status.streams += 1;
        }
        tracing::info!(%address, protocol = ?self.options.protocol, "xDS stream open");
        match self.options.protocol {
            Protocol::Sotw => self.sotw(&mut client).await,
            Protocol::Delta => self.delta(&mut client).await,
        }
    }

    fn node(&self) -> NodeId {
        NodeId {
            id: self.options.node_id.clone(),
            cluster: self.options.node_cluster.clone(),
            user_agent_name: "flatmesh".into(),
            ..Default::default()
        }
    }

    fn stream_error(&self, progress: bool, e: impl std::fmt::Display) -> (bool, XdsError) {
        (
            progress,
            XdsError::Stream {
                address: self.options.server.clone(),
                why: e.to_string(),
            },
        )
    }

    /// The names to ask for per type: wildcard (empty) for LDS/CDS, what the others reference
    /// for RDS/EDS/SDS. SDS comes first: a secret is written before the listener that names it
    /// is translated.
    fn subscriptions(state: &Resources) -> [(&'static str, Vec<String>); 5] {
        [
            (SECRET, state.wanted_secrets().into_iter().collect()),
            (CLUSTER, Vec::new()),
            (ENDPOINT, state.wanted_endpoints().into_iter().collect()),
            (LISTENER, Vec::new()),
            (ROUTE, state.wanted_routes().into_iter().collect()),
        ]
    }

    /// The types whose subscriptions follow what the others reference.
    fn referenced(type_url: &str) -> bool {
        type_url == ROUTE || type_url == ENDPOINT || type_url == SECRET
    }

    /// Translate the held resources and hand the config to the node (if it changed, or if a
    /// secret's files did: the reload re-reads them).
    fn apply_state(&mut self) -> Result<()> {
        let rewritten = self.write_secrets()?;
        let files: &dyn crate::tls::SecretFiles = match &self.secrets {
            Some(dir) => dir,
            None => &crate::tls::NoSecrets,
        };
        let (config, waiting) = self
            .translator
            .translate_with(&self.state, &self.base, files)?;
        let waiting: BTreeMap<String, Vec<String>> = waiting
            .into_iter()
            .map(|(secret, who)| (secret, who.into_iter().collect()))
            .collect();
        if waiting != self.status.lock().waiting_secrets {
            for (secret, who) in &waiting {
                tracing::warn!(secret, waiting = ?who, "SDS: waiting for a secret; those listeners are not served and those clusters answer 503 until it arrives (is the identity placed on this node?)");
            }
            self.status.lock().waiting_secrets = waiting;
        }
        if rewritten || self.applied.as_ref() != Some(&config) {
            self.apply.apply(config.clone()).map_err(XdsError::Apply)?;
            self.applied = Some(config);
            self.status.lock().applied += 1;
        }
        Ok(())
    }

    /// Writes the held secrets that are new or changed to their files; says whether any was.
    fn write_secrets(&mut self) -> Result<bool> {
        let mut rewritten = false;
        for (name, secret) in &self.state.secrets {
            if self.written.get(name) == Some(secret) {
                continue;
            }
            let Some(dir) = self.secrets.as_mut() else {
                return Err(XdsError::resource(
                    format!("Secret \"{name}\""),
                    "arrived, but this node keeps no secrets: start it with --sds-dir DIR",
                ));
            };
            dir.write(secret)?;
            tracing::info!(secret = %name, "SDS: secret written; the node reloads (new connections present it, open ones keep theirs)");
            self.written.insert(name.clone(), secret.clone());
            rewritten = true;
        }
        let gone: Vec<String> = self
            .written
            .keys()
            .filter(|name| !self.state.secrets.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            self.written.remove(&name);
            if let Some(dir) = self.secrets.as_mut() {
                dir.forget(&name);
            }
        }
        Ok(rewritten)
    }

    /// Apply one response's `changes` (already made to the held resources): drop what nobody
    /// references any more, translate, hand to the node. If any of it fails, undo the changes,
    /// so the held resources are again exactly the last good state.
    fn commit(&mut self, mut changes: Changes) -> Result<()> {
        self.prune(&mut changes);
        let result = self.apply_state();
        if result.is_err() {
            for (type_url, name, previous) in changes.0.into_iter().rev() {
                match previous {
                    Some(resource) => drop(self.state.put(resource)),
                    None => drop(self.state.take(type_url, &name)),
                }
            }
        }
        result
    }

    fn put(&mut self, changes: &mut Changes, resource: Resource) {
        let (type_url, name) = (resource.type_url(), resource.name().to_string());
        let previous = self.state.put(resource);
        changes.0.push((type_url, name, previous));
    }

    fn take(&mut self, changes: &mut Changes, type_url: &'static str, name: &str) {
        if let Some(previous) = self.state.take(type_url, name) {
            changes.0.push((type_url, name.to_string(), Some(previous)));
        }
    }

    /// Route configs and assignments that no listener or cluster references any more go
    /// (they are unsubscribed).
    fn prune(&mut self, changes: &mut Changes) {
        let routes = self.state.wanted_routes();
        for name in self.state.names(ROUTE) {
            if !routes.contains(&name) {
                self.take(changes, ROUTE, &name);
            }
        }
        let endpoints = self.state.wanted_endpoints();
        for name in self.state.names(ENDPOINT) {
            if !endpoints.contains(&name) {
                self.take(changes, ENDPOINT, &name);
            }
        }
        let secrets = self.state.wanted_secrets();
        for name in self.state.names(SECRET) {
            if !secrets.contains(&name) {
                self.take(changes, SECRET, &name);
            }
        }
    }

    fn record_nack(&self, type_url: &str, detail: &str) {
        tracing::warn!(type_url = resources::short(type_url), error = %detail, "NACK: the update is refused, the node keeps its last good config");
        let mut status = self.status.lock();
        if status.nacks.len() >= 100 {
            status.nacks.remove(0);
        }
        status.nacks.push(detail.to_string());
    }

    // ---- state of the world ------------------------------------------------------------------

    async fn sotw(
        &mut self,
        client: &mut AggregatedDiscoveryServiceClient<tonic::transport::Channel>,
    ) -> std::result::Result<bool, (bool, XdsError)> {
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(64);
        let mut sent: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
        for (type_url, names) in Self::subscriptions(&self.state) {
            if type_url == CLUSTER || type_url == LISTENER || !names.is_empty() {
                let _ = tx
                    .send(self.sotw_request(type_url, names.clone(), None))
                    .await;
                sent.insert(type_url, names);
            }
        }
        let mut responses = client
            .stream_aggregated_resources(
                crate::secure::with_token(
                    tonic::Request::new(ReceiverStream::new(rx)),
                    &self.options.security,
                )
                .map_err(|e| self.stream_error(false, e))?,
            )
            .await
            .map_err(|e| self.stream_error(false, e))?
            .into_inner();
        let mut progress = false;
        loop {
            let response = match responses.message().await {
                Ok(Some(r)) => r,
                Ok(None) => return Ok(progress),
                Err(e) => return Err(self.stream_error(progress, e)),
            };
            progress = true;
            let type_url = response.type_url.clone();
            self.nonces.insert(type_url.clone(), response.nonce.clone());
            let reply = match self.sotw_response(&response) {
                Ok(()) => {
                    self.acked
                        .insert(type_url.clone(), response.version_info.clone());
                    self.status
                        .lock()
                        .acked
                        .insert(type_url.clone(), response.version_info.clone());
                    tracing::debug!(type_url = resources::short(&type_url), version = %response.version_info, "ACK");
                    let names = sent.get(type_url.as_str()).cloned().unwrap_or_default();
                    self.sotw_request(&type_url, names, None)
                }
                Err(e) => {
                    let detail = e.to_string();
                    self.record_nack(&type_url, &detail);
                    let names = sent.get(type_url.as_str()).cloned().unwrap_or_default();
                    self.sotw_request(&type_url, names, Some(detail))
                }
            };
            if tx.send(reply).await.is_err() {
                return Ok(progress);
            }
            // New listeners or clusters may reference route configs or assignments not asked for yet.
            for (type_url, names) in Self::subscriptions(&self.state) {
                if Self::referenced(type_url) {
                    let previous = sent.get(type_url).cloned().unwrap_or_default();
                    if previous != names {
                        let _ = tx
                            .send(self.sotw_request(type_url, names.clone(), None))
                            .await;
                        sent.insert(type_url, names);
                    }
                }
            }
        }
    }

    fn sotw_request(
        &self,
        type_url: &str,
        names: Vec<String>,
        error: Option<String>,
    ) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: self.acked.get(type_url).cloned().unwrap_or_default(),
            node: Some(self.node()),
            resource_names: names,
            type_url: type_url.to_string(),
            response_nonce: self.nonces.get(type_url).cloned().unwrap_or_default(),
            error_detail: error.map(|message| RpcStatus {
                code: tonic::Code::InvalidArgument as i32,
                message,
                details: Vec::new(),
            }),
            ..Default::default()
        }
    }

    fn sotw_response(&mut self, response: &DiscoveryResponse) -> Result<()> {
        let type_url = static_type(&response.type_url);
        let mut decoded = Vec::with_capacity(response.resources.len());
        let mut names = BTreeSet::new();
        for any in &response.resources {
            let resource = Resource::decode(any, &response.type_url)?;
            if !names.insert(resource.name().to_string()) {
                return Err(XdsError::resource(
                    format!("{} response", resources::short(type_url)),
                    format!(
                        "lists the resource `{}` twice; a response names each resource once",
                        resource.name()
                    ),
                ));
            }
            decoded.push(resource);
        }
        let mut changes = Changes::default();
        // LDS and CDS responses are the whole set: anything missing is removed.
        if type_url == LISTENER || type_url == CLUSTER {
            for name in self.state.names(type_url) {
                if !names.contains(&name) {
                    self.take(&mut changes, type_url, &name);
                }
            }
        }
        // RDS and EDS responses carry what was asked for; anything else is not ours to hold.
        let wanted = match type_url {
            ROUTE => Some(self.state.wanted_routes()),
            ENDPOINT => Some(self.state.wanted_endpoints()),
            SECRET => Some(self.state.wanted_secrets()),
            _ => None,
        };
        for resource in decoded {
            if wanted.as_ref().is_none_or(|w| w.contains(resource.name())) {
                self.put(&mut changes, resource);
            }
        }
        self.commit(changes)
    }

    // ---- delta -------------------------------------------------------------------------------

    async fn delta(
        &mut self,
        client: &mut AggregatedDiscoveryServiceClient<tonic::transport::Channel>,
    ) -> std::result::Result<bool, (bool, XdsError)> {
        let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(64);
        let mut subscribed: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
        for (type_url, names) in Self::subscriptions(&self.state) {
            if type_url == CLUSTER || type_url == LISTENER || !names.is_empty() {
                let request = DeltaDiscoveryRequest {
                    node: Some(self.node()),
                    type_url: type_url.to_string(),
                    resource_names_subscribe: names.clone(),
                    // On a reconnect, say what is held so the server sends only what changed.
                    initial_resource_versions: self
                        .versions
                        .get(type_url)
                        .cloned()
                        .unwrap_or_default()
                        .into_iter()
                        .collect(),
                    ..Default::default()
                };
                let _ = tx.send(request).await;
                subscribed.insert(type_url, names.into_iter().collect());
            }
        }
        let mut responses = client
            .delta_aggregated_resources(
                crate::secure::with_token(
                    tonic::Request::new(ReceiverStream::new(rx)),
                    &self.options.security,
                )
                .map_err(|e| self.stream_error(false, e))?,
            )
            .await
            .map_err(|e| self.stream_error(false, e))?
            .into_inner();
        let mut progress = false;
        loop {
            let response = match responses.message().await {
                Ok(Some(r)) => r,
                Ok(None) => return Ok(progress),
                Err(e) => return Err(self.stream_error(progress, e)),
            };
            progress = true;
            let type_url = response.type_url.clone();
            let error = match self.delta_response(&response) {
                Ok(()) => {
                    self.status
                        .lock()
                        .acked
                        .insert(type_url.clone(), response.system_version_info.clone());
                    None
                }
                Err(e) => {
                    let detail = e.to_string();
                    self.record_nack(&type_url, &detail);
                    Some(RpcStatus {
                        code: tonic::Code::InvalidArgument as i32,
                        message: detail,
                        details: Vec::new(),
                    })
                }
            };
            let ack = DeltaDiscoveryRequest {
                type_url: type_url.clone(),
                response_nonce: response.nonce.clone(),
                error_detail: error,
                ..Default::default()
            };
            if tx.send(ack).await.is_err() {
                return Ok(progress);
            }
            for (type_url, names) in Self::subscriptions(&self.state) {
                if !Self::referenced(type_url) {
                    continue;
                }
                let names: BTreeSet<String> = names.into_iter().collect();
                let previous = subscribed.get(type_url).cloned().unwrap_or_default();
                if previous == names {
                    continue;
                }
                let request = DeltaDiscoveryRequest {
                    node: Some(self.node()),
                    type_url: type_url.to_string(),
                    resource_names_subscribe: names.difference(&previous).cloned().collect(),
                    resource_names_unsubscribe: previous.difference(&names).cloned().collect(),
                    ..Default::default()
                };
                let _ = tx.send(request).await;
                subscribed.insert(type_url, names);
            }
        }
    }

    fn delta_response(&mut self, response: &DeltaDiscoveryResponse) -> Result<()> {
        let type_url = static_type(&response.type_url);
        let mut decoded = Vec::with_capacity(response.resources.len());
        let mut versions = self.versions.get(type_url).cloned().unwrap_or_default();
        for r in &response.resources {
            let Some(any) = &r.resource else {
                return Err(XdsError::resource(
                    format!("{} resource \"{}\"", resources::short(type_url), r.name),
                    "has no `resource` body",
                ));
            };
            let resource = Resource::decode(any, &response.type_url)?;
            versions.insert(resource.name().to_string(), r.version.clone());
            decoded.push(resource);
        }
        let mut changes = Changes::default();
        for resource in decoded {
            self.put(&mut changes, resource);
        }
        for name in &response.removed_resources {
            self.take(&mut changes, type_url, name);
            versions.remove(name);
        }
        self.commit(changes)?;
        self.versions.insert(type_url.to_string(), versions);
        // Drop versions of resources pruned away (unsubscribed route configs, assignments, secrets).
        for t in [ROUTE, ENDPOINT, SECRET] {
            let held: BTreeSet<String> = self.state.names(t).into_iter().collect();
            if let Some(v) = self.versions.get_mut(t) {
                v.retain(|name, _| held.contains(name));
            }
        }
        Ok(())
    }
}

/// What one response changed in the held resources: (type, name, what was there before), in
/// order, so that a refused response can be undone.
#[derive(Default)]
struct Changes(Vec<(&'static str, String, Option<Resource>)>);

/// Reconnect delays: 100 ms doubling up to 5 s, each drawn at random from its upper half so that
/// many nodes cut off together do not all come back at the same instant; back to the start once
/// a stream has delivered a response.
#[derive(Debug)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    ceiling: Duration,
    seed: u64,
}

impl Backoff {
    /// The xDS stream's: 100 ms doubling to 5 s.
    pub(crate) fn new(node_id: &str) -> Backoff {
        Backoff::between(node_id, BACKOFF_FIRST, BACKOFF_MAX)
    }

    /// A ceiling of `first` doubling to `max`; `seed_name` (the node id) spreads the waits of
    /// nodes that fail together.
    pub(crate) fn between(seed_name: &str, first: Duration, max: Duration) -> Backoff {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        seed_name.hash(&mut h);
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
            .hash(&mut h);
        Backoff {
            first,
            max,
            ceiling: first,
            seed: h.finish() | 1,
        }
    }

    pub(crate) fn reset(&mut self) {
        self.ceiling = self.first;
    }

    /// The next delay: between half the ceiling and the ceiling; the ceiling then doubles.
    pub(crate) fn next(&mut self) -> Duration {
        // xorshift64: a few bits of spread, no need for a random number crate.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let ceiling = self.ceiling;
        let half = ceiling / 2;
        let spread = half.as_micros() as u64;
        let wait = half + Duration::from_micros(self.seed % spread.max(1));
        self.ceiling = (ceiling * 2).min(self.max);
        wait
    }
}

fn static_type(type_url: &str) -> &'static str {
    match type_url {
        LISTENER => LISTENER,
        ROUTE => ROUTE,
        CLUSTER => CLUSTER,
        ENDPOINT => ENDPOINT,
        SECRET => SECRET,
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_five_seconds_with_jitter_and_resets() {
        let mut b = Backoff::new("node-1");
        let mut ceiling = BACKOFF_FIRST;
        for _ in 0..10 {
            let wait = b.next();
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{wait:?} not within [{:?}, {ceiling:?}]",
                ceiling / 2
            );
            ceiling = (ceiling * 2).min(BACKOFF_MAX);
        }
        assert_eq!(ceiling, BACKOFF_MAX, "the ceiling stops at 5 s");
        b.reset();
        assert!(b.next() <= BACKOFF_FIRST, "a reset starts over at 100 ms");
        // Two nodes cut off together do not retry in lockstep.
        let (mut x, mut y) = (Backoff::new("node-a"), Backoff::new("node-b"));
        let xs: Vec<Duration> = (0..6).map(|_| x.next()).collect();
        let ys: Vec<Duration> = (0..6).map(|_| y.next()).collect();
        assert_ne!(xs, ys);
    }
}
