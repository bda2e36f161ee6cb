//! The watchers and the publisher: kube-rs reflectors keep Namespaces, Services,
//! EndpointSlices, Pods, HTTPRoutes and GRPCRoutes current; on any change (debounced, so a
//! burst is one push) every node's snapshot is recomputed ([`crate::translate`]) and published
//! to that node's state in the xDS server's store.
//!
//! What survives a restart of the control plane: the xDS server answers no node until the
//! first publish (`Store::serve_per_node`), so a node that reconnects meanwhile keeps its last
//! config, and is then sent the same versions (they are content hashes) as before.
//!
//! What survives an API server restart: a reflector swaps in a new list only once the list is
//! complete, so while the API server is away, and while a watcher re-lists, the stores keep
//! the last objects, nothing is published, and the xDS server keeps serving the last
//! snapshots. Nothing is published before every core kind has been listed once, so a
//! starting control plane never pushes a half-empty cluster either.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::Config;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{self, reflector, Store as Reader};
use kube::runtime::utils::Backoff;
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::error::{K8sError, Result};
use crate::routes::{grpc_route_resource, http_route_resource, MeshRoute, RouteKind};
use crate::translate::{translate, Objects, Translation};

/// The trust domain of pods' SPIFFE IDs unless told otherwise (Istio's default).
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";
/// How long a change waits for more before the push: a burst of changes is one push, and a
/// change reaches the nodes well within a second.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// How long publishing waits for the route kinds' first list before going on without them (a
/// cluster without the Gateway API's CRDs has no mesh routes).
const ROUTES_WAIT: Duration = Duration::from_secs(10);

/// Told every node's pod identities (node name -> SPIFFE IDs; a node without pods is absent)
/// on every publish, before the nodes' configs: the CA's grants (`flatmesh control --ca-dir`).
pub type IdentitySink = Arc<dyn Fn(BTreeMap<String, BTreeSet<String>>) + Send + Sync>;

#[derive(Clone)]
pub struct Options {
    /// `spiffe://TRUST_DOMAIN/ns/NS/sa/SA` of every pod.
    pub trust_domain: String,
    pub debounce: Duration,
    /// Where each node's pod identities go, if anywhere.
    pub identities: Option<IdentitySink>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            trust_domain: DEFAULT_TRUST_DOMAIN.into(),
            debounce: DEBOUNCE,
            identities: None,
        }
    }
}

impl Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("trust_domain", &self.trust_domain)
            .field("debounce", &self.debounce)
            .field("identities", &self.identities.is_some())
            .finish()
    }
}

/// A client of the API server of `kubeconfig`, or, without one, of the cluster this process
/// runs in (a pod: `KUBERNETES_SERVICE_HOST` and the service account's token).
pub async fn connect(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let file =
                kube::config::Kubeconfig::read_from(path).map_err(|e| K8sError::Kubeconfig {
                    path: path.to_path_buf(),
                    why: e.to_string(),
                })?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| K8sError::Kubeconfig {
                    path: path.to_path_buf(),
                    why: e.to_string(),
                })?
        }
        None => {
            kube::Config::incluster().map_err(|e| K8sError::NoCluster { why: e.to_string() })?
        }
    };
    kube::Client::try_from(config).map_err(|e| K8sError::Client(e.to_string()))
}

/// The running watchers and publisher; dropping it stops them (the xDS server keeps serving
/// what was published last).
pub struct Controller {
    served: watch::Receiver<Arc<Translation>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What the publisher reads.
struct Readers {
    namespaces: Reader<Namespace>,
    services: Reader<Service>,
    slices: Reader<EndpointSlice>,
    pods: Reader<Pod>,
    nodes: Reader<Node>,
    http_routes: Reader<DynamicObject>,
    grpc_routes: Reader<DynamicObject>,
}

impl Controller {
    /// Watch the cluster of `client` and publish each node's snapshot to `store` (which from
    /// now on serves per node). Runs on the current tokio runtime.
    pub fn spawn(
        client: kube::Client,
        store: flatmesh_xds::server::Store,
        options: Options,
    ) -> Controller {
        store.serve_per_node();
        let changed = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let namespaces =
            watch_kind::<Namespace>(Api::all(client.clone()), (), &changed, &mut tasks);
        let services = watch_kind::<Service>(Api::all(client.clone()), (), &changed, &mut tasks);
        let slices =
            watch_kind::<EndpointSlice>(Api::all(client.clone()), (), &changed, &mut tasks);
        let pods = watch_kind::<Pod>(Api::all(client.clone()), (), &changed, &mut tasks);
        // For the servers whose node proxy runs on their DPU (`flatmesh.io/node-proxy`).
        let nodes = watch_kind::<Node>(Api::all(client.clone()), (), &changed, &mut tasks);
        let routes = |resource: ApiResource, tasks: &mut Vec<JoinHandle<()>>| {
            watch_kind::<DynamicObject>(
                Api::all_with(client.clone(), &resource),
                resource,
                &changed,
                tasks,
            )
        };
        let http_routes = routes(http_route_resource(), &mut tasks);
        let grpc_routes = routes(grpc_route_resource(), &mut tasks);
        let readers = Readers {
            namespaces,
            services,
            slices,
            pods,
            nodes,
            http_routes,
            grpc_routes,
        };
        let (tx, served) = watch::channel(Arc::new(Translation::default()));
        tasks.push(tokio::spawn(publish(readers, store, options, changed, tx)));
        Controller { served, tasks }
    }

    /// What was published last (empty until the first publish).
    pub fn translation(&self) -> Arc<Translation> {
        self.served.borrow().clone()
    }

    /// Changes with every publish.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Translation>> {
        self.served.clone()
    }
}

/// A reflector of every `K` in the cluster, re-listing after any failure; each event wakes
/// the publisher.
pub(crate) fn watch_kind<K>(
    api: Api<K>,
    dyntype: K::DynamicType,
    changed: &Arc<Notify>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Reader<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync,
{
    let kind = K::kind(&dyntype).to_string();
    let writer = reflector::store::Writer::<K>::new(dyntype);
    let reader = writer.as_reader();
    let changed = changed.clone();
    let stream =
        reflector(writer, watcher(api, watcher::Config::default())).backoff(Retry::default());
    tasks.push(tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut failing = false;
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!(kind, "watching the API server again");
                    }
                    changed.notify_one();
                }
                Err(e) => {
                    // Logged once per outage; the nodes keep their last snapshot meanwhile.
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(kind, error = %e, "lost the watch of the API server; retrying, nodes keep their last config");
                    }
                }
            }
        }
    }));
    reader
}

/// Retries after 100 ms, doubling to 2 s: short, because a node's config is stale until the
/// watch is back, and the watches are few (six per control plane).
struct Retry {
    next: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            next: Duration::from_millis(100),
        }
    }
}

impl Iterator for Retry {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (self.next * 2).min(Duration::from_secs(2));
        Some(now)
    }
}

impl Backoff for Retry {
    fn reset(&mut self) {
        *self = Retry::default();
    }
}

async fn publish(
    readers: Readers,
    store: flatmesh_xds::server::Store,
    options: Options,
    changed: Arc<Notify>,
    served: watch::Sender<Arc<Translation>>,
) {
    wait_listed(&readers).await;
    let mut nodes: BTreeSet<String> = BTreeSet::new();
    let mut warned: BTreeSet<String> = BTreeSet::new();
    loop {
        let mut routes = Vec::new();
        let mut warnings = Vec::new();
        for (kind, reader) in [
            (RouteKind::Http, &readers.http_routes),
            (RouteKind::Grpc, &readers.grpc_routes),
        ] {
            for object in reader.state() {
                match MeshRoute::from_object(kind, &object) {
                    Ok(route) => routes.push(route),
                    Err(e) => warnings.push(e),
                }
            }
        }
        let objects = Objects {
            namespaces: readers.namespaces.state(),
            services: readers.services.state(),
            slices: readers.slices.state(),
            pods: readers.pods.state(),
            nodes: readers.nodes.state(),
            routes,
        };
        let mut translation = translate(&objects, &options.trust_domain);
        warnings.append(&mut translation.warnings);
        for warning in &warnings {
            if !warned.contains(warning) {
                tracing::warn!("{warning}");
            }
        }
        warned = warnings.iter().cloned().collect();
        translation.warnings = warnings;
        // Grants first: a node given a config that needs a pod's identity may hold it by then
        // (and one whose pod is gone loses it before its config changes).
        if let Some(sink) = &options.identities {
            sink(
                translation
                    .nodes
                    .iter()
                    .map(|(node, snapshot)| (node.clone(), snapshot.identities.clone()))
                    .collect(),
            );
        }
        // Nodes that share a config get it translated, packed and held once.
        let mut by_config: BTreeMap<usize, (&Config, Vec<&str>)> = BTreeMap::new();
        for (node, snapshot) in &translation.nodes {
            by_config
                .entry(Arc::as_ptr(&snapshot.config) as usize)
                .or_insert_with(|| (&snapshot.config, Vec::new()))
                .1
                .push(node);
        }
        for (config, nodes) in by_config.into_values() {
            store.publish_config_to(nodes, config);
        }
        // A node whose last pod is gone keeps nothing of the mesh.
        for gone in nodes.iter().filter(|n| !translation.nodes.contains_key(*n)) {
            store
                .node(gone)
                .publish_config(&flatmesh_xds::bootstrap::empty_config());
        }
        nodes = translation.nodes.keys().cloned().collect();
        // From the first publish on, the xDS server answers nodes (until then a node that
        // reconnects to a restarted control plane keeps its config).
        store.nodes_published();
        tracing::debug!(
            nodes = nodes.len(),
            services = objects.services.len(),
            "published every node's snapshot"
        );
        served.send_replace(Arc::new(translation));
        changed.notified().await;
        tokio::time::sleep(options.debounce).await;
    }
}

/// Until every core kind has been listed once (and the route kinds, or [`ROUTES_WAIT`]).
async fn wait_listed(readers: &Readers) {
    async fn listed<K>(what: &str, reader: &Reader<K>, give_up: Option<Duration>) -> bool
    where
        K: kube::runtime::reflector::Lookup + Clone + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        let mut waited = Duration::ZERO;
        let step = Duration::from_secs(10);
        loop {
            let limit = give_up.map_or(step, |g| g.min(step));
            if tokio::time::timeout(limit, reader.wait_until_ready())
                .await
                .is_ok()
            {
                return true;
            }
            waited += limit;
            if give_up.is_some_and(|g| waited >= g) {
                tracing::warn!("no {what} listed after {waited:?}; serving without them (is the Gateway API installed, with the {what} CRD of gateway.networking.k8s.io/v1?)");
                return false;
            }
            tracing::warn!("still waiting for the first list of {what} after {waited:?}; is the API server reachable, and may this account list and watch {what}?");
        }
    }
    listed("Namespaces", &readers.namespaces, None).await;
    listed("Services", &readers.services, None).await;
    listed("EndpointSlices", &readers.slices, None).await;
    listed("Pods", &readers.pods, None).await;
    listed("HTTPRoutes", &readers.http_routes, Some(ROUTES_WAIT)).await;
    listed("GRPCRoutes", &readers.grpc_routes, Some(ROUTES_WAIT)).await;
}
