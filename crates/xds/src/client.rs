//! The ADS client of `flatmesh node --xds`: one gRPC stream to the control plane carrying LDS,
//! RDS, CDS and EDS, in state-of-the-world or delta form.
//!
//! Every response is applied to a copy of the node's resources, translated and validated as a
//! whole ([`crate::to_model::translate`]) and handed to the node (a zero-drop swap, the same one a
//! file reload uses). Only then is it ACKed; otherwise it is NACKed with the reason and the node
//! keeps what it had. When the stream breaks the node keeps serving its last good config and the
//! client reconnects with exponential backoff, telling the server what it already holds.

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
use crate::resources::{self, Resource, Resources, CLUSTER, ENDPOINT, LISTENER, ROUTE};

/// Responses up to this size are accepted (10,000 endpoints take well under 1 MB).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

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
}

/// Where translated configs go: the node proxy in production, anything in tests.
pub trait Apply: Send + 'static {
    fn apply(&mut self, config: Config) -> std::result::Result<(), String>;
}

/// What the client has done so far, for logs, the CLI and tests.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub connected: bool,
    /// Streams opened so far (1 + reconnects).
    pub streams: u64,
    /// The last version ACKed per type URL.
    pub acked: BTreeMap<String, String>,
    /// Every NACK's error_detail, oldest first (bounded).
    pub nacks: Vec<String>,
    /// Configs handed to the node.
    pub applied: u64,
}

/// A running client; dropping it stops it.
pub struct Client {
    status: Arc<Mutex<Status>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Client {
    /// Start the client on the current tokio runtime.
    pub fn spawn(options: Options, base: Config, apply: impl Apply) -> Client {
        let status = Arc::new(Mutex::new(Status::default()));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let session = Session {
            options,
            base,
            apply: Box::new(apply),
            status: status.clone(),
            state: Resources::default(),
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
        }
    }

    pub fn status(&self) -> Status {
        self.status.lock().clone()
    }

    /// Stop the client and wait for it.
    pub async fn stop(mut self) {
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
    }
}

struct Session {
    options: Options,
    base: Config,
    apply: Box<dyn Apply>,
    status: Arc<Mutex<Status>>,
    /// The resources of the last good (applied) state.
    state: Resources,
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
        let mut backoff = BACKOFF_FIRST;
        loop {
            let outcome = tokio::select! {
                _ = &mut stop => return,
                outcome = self.stream() => outcome,
            };
            self.status.lock().connected = false;
            self.nonces.clear();
            let made_progress = match &outcome {
                Ok(progress) => *progress,
                Err((progress, _)) => *progress,
            };
            if made_progress {
                backoff = BACKOFF_FIRST;
            }
            match outcome {
                Ok(_) => {
                    tracing::warn!(server = %self.options.server, "xDS stream closed by the server; reconnecting, the node keeps its last good config")
                }
                Err((_, e)) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "xDS stream failed; the node keeps its last good config")
                }
            }
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// One stream, until it ends. The bool says whether any response arrived (resets backoff).
    async fn stream(&mut self) -> std::result::Result<bool, (bool, XdsError)> {
        let address = self.options.server.clone();
        let endpoint = format!("http://{address}");
        let channel = tonic::transport::Endpoint::from_shared(endpoint)
            .map_err(|e| {
                (
                    false,
                    XdsError::Connect {
                        address: address.clone(),
                        why: e.to_string(),
                    },
                )
            })?
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .map_err(|e| {
                (
                    false,
                    XdsError::Connect {
                        address: address.clone(),
                        why: source_chain(&e),
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

    /// The names to ask for per type: wildcard (empty) for LDS/CDS, what the others reference for RDS/EDS.
    fn subscriptions(state: &Resources) -> [(&'static str, Vec<String>); 4] {
        [
            (CLUSTER, Vec::new()),
            (ENDPOINT, state.wanted_endpoints().into_iter().collect()),
            (LISTENER, Vec::new()),
            (ROUTE, state.wanted_routes().into_iter().collect()),
        ]
    }

    /// Translate `candidate` and hand it to the node. On success it becomes the state.
    fn try_apply(&mut self, candidate: Resources) -> Result<()> {
        let config = crate::to_model::translate(&candidate, &self.base)?;
        if self.applied.as_ref() != Some(&config) {
            self.apply.apply(config.clone()).map_err(XdsError::Apply)?;
            self.applied = Some(config);
            self.status.lock().applied += 1;
        }
        self.state = candidate;
        Ok(())
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
            .stream_aggregated_resources(ReceiverStream::new(rx))
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
                    self.sotw_request(static_type(&type_url), names, None)
                }
                Err(e) => {
                    let detail = e.to_string();
                    self.record_nack(&type_url, &detail);
                    let names = sent.get(type_url.as_str()).cloned().unwrap_or_default();
                    self.sotw_request(static_type(&type_url), names, Some(detail))
                }
            };
            if tx.send(reply).await.is_err() {
                return Ok(progress);
            }
            // New listeners or clusters may reference route configs or assignments not asked for yet.
            for (type_url, names) in Self::subscriptions(&self.state) {
                if type_url == ROUTE || type_url == ENDPOINT {
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
        let type_url = response.type_url.as_str();
        let mut candidate = self.state.clone();
        let mut decoded = Vec::with_capacity(response.resources.len());
        for any in &response.resources {
            decoded.push(Resource::decode(any, type_url)?);
        }
        match type_url {
            // LDS and CDS responses are the whole set: anything missing is removed.
            LISTENER | CLUSTER => candidate.clear(type_url),
            _ => {}
        }
        let wanted = match type_url {
            ROUTE => Some(self.state.wanted_routes()),
            ENDPOINT => Some(self.state.wanted_endpoints()),
            _ => None,
        };
        for resource in decoded {
            if wanted.as_ref().is_none_or(|w| w.contains(resource.name())) {
                candidate.insert(resource);
            }
        }
        prune(&mut candidate);
        self.try_apply(candidate)
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
            .delta_aggregated_resources(ReceiverStream::new(rx))
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
                if type_url != ROUTE && type_url != ENDPOINT {
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
        let type_url = response.type_url.as_str();
        let mut candidate = self.state.clone();
        let mut versions = self.versions.get(type_url).cloned().unwrap_or_default();
        for r in &response.resources {
            let Some(any) = &r.resource else {
                return Err(XdsError::resource(
                    format!("{} resource \"{}\"", resources::short(type_url), r.name),
                    "has no `resource` body",
                ));
            };
            let resource = Resource::decode(any, type_url)?;
            versions.insert(resource.name().to_string(), r.version.clone());
            candidate.insert(resource);
        }
        for name in &response.removed_resources {
            candidate.remove(type_url, name);
            versions.remove(name);
        }
        prune(&mut candidate);
        self.try_apply(candidate)?;
        self.versions.insert(type_url.to_string(), versions);
        // Drop versions of resources pruned away (unsubscribed route configs / assignments).
        for t in [ROUTE, ENDPOINT] {
            let held: BTreeSet<String> = self.state.names(t).into_iter().collect();
            if let Some(v) = self.versions.get_mut(t) {
                v.retain(|name, _| held.contains(name));
            }
        }
        Ok(())
    }
}

/// Route configs and assignments nobody references any more are dropped (unsubscribed).
fn prune(resources: &mut Resources) {
    let routes = resources.wanted_routes();
    resources.routes.retain(|name, _| routes.contains(name));
    let endpoints = resources.wanted_endpoints();
    resources
        .endpoints
        .retain(|name, _| endpoints.contains(name));
}

fn static_type(type_url: &str) -> &'static str {
    match type_url {
        LISTENER => LISTENER,
        ROUTE => ROUTE,
        CLUSTER => CLUSTER,
        ENDPOINT => ENDPOINT,
        _ => "",
    }
}

/// tonic's transport errors hide the useful part (connection refused) in their sources.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
