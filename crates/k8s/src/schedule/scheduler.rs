//! The running scheduler: reflectors keep Nodes and Pods current; on a change (debounced, so
//! one app's pods are placed together) and every [`Options::resync`], a round plans
//! ([`super::plan`]), binds, and labels the nodes with where each server's node proxy runs
//! ([`super::proxy_labels`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::reflector::Store as Reader;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use super::app::PodKey;
use super::bind::{bind, is_settled, recorder, warn_pod};
use super::plan::{plan, Binding, Plan};
use super::proxy::ProxyPu;
use super::proxy_labels::{label_changes, label_of, node_proxy_labels, patch_label, LabelChange};
use crate::controller::watch_kind;

#[derive(Debug, Clone)]
pub struct Options {
    /// How long a change waits for more before a round: the pods of an app, created one
    /// after another, are placed in one round.
    pub debounce: Duration,
    /// A round also runs this often without changes (bindings that failed are retried).
    pub resync: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            debounce: Duration::from_millis(500),
            resync: Duration::from_secs(10),
        }
    }
}

/// What a round did.
#[derive(Debug, Clone)]
pub struct Round {
    pub plan: Plan,
    /// The bindings the API server took.
    pub bound: Vec<Binding>,
    /// The bindings it refused, and why.
    pub failed: Vec<(Binding, String)>,
    /// The node-proxy labels it wrote ([`super::proxy_labels`]).
    pub labelled: Vec<LabelChange>,
    /// The label writes the API server refused, and why (retried next round).
    pub label_failures: Vec<(LabelChange, String)>,
}

/// The running scheduler; dropping it stops it.
pub struct Scheduler {
    rounds: watch::Receiver<Option<Arc<Round>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Scheduler {
    /// Watches the cluster of `client` and binds its pending pods of `schedulerName: flatmesh`.
    /// Runs on the current tokio runtime.
    pub fn spawn(client: kube::Client, options: Options) -> Scheduler {
        let changed = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let nodes = watch_kind::<Node>(Api::all(client.clone()), (), &changed, &mut tasks);
        let pods = watch_kind::<Pod>(Api::all(client.clone()), (), &changed, &mut tasks);
        let (tx, rounds) = watch::channel(None);
        tasks.push(tokio::spawn(run(client, nodes, pods, options, changed, tx)));
        Scheduler { rounds, tasks }
    }

    /// Changes with every round (None before the first).
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Round>>> {
        self.rounds.clone()
    }
}

async fn run(
    client: kube::Client,
    nodes: Reader<Node>,
    pods: Reader<Pod>,
    options: Options,
    changed: Arc<Notify>,
    rounds: watch::Sender<Option<Arc<Round>>>,
) {
    for (what, ready) in [
        ("Nodes", nodes.wait_until_ready().await),
        ("Pods", pods.wait_until_ready().await),
    ] {
        if ready.is_err() {
            tracing::error!("the watch of {what} stopped; the scheduler stops");
            return;
        }
    }
    let recorder = recorder(&client);
    // Bindings made that the pod watch may not show yet: pod uid -> node.
    let mut made: HashMap<String, String> = HashMap::new();
    // What was said already (log and events once per pod and reason).
    let mut said: BTreeSet<(String, String)> = BTreeSet::new();
    let mut warned: BTreeSet<String> = BTreeSet::new();
    // Node-proxy labels written that the node watch may not show yet: node -> value.
    let mut written: HashMap<String, Option<String>> = HashMap::new();
    // Label writes refused, as said (node -> error), so each is logged once until it changes.
    let mut refused: HashMap<String, String> = HashMap::new();
    loop {
        let nodes: Vec<Node> = nodes.state().iter().map(|n| (**n).clone()).collect();
        let pods: Vec<Pod> = pods.state().iter().map(|p| (**p).clone()).collect();
        let pending: BTreeSet<&str> = pods
            .iter()
            .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect();
        // Once the watch shows a pod bound (or gone), it speaks for itself.
        made.retain(|uid, _| pending.contains(uid.as_str()));
        said.retain(|(uid, _)| pending.contains(uid.as_str()));
        let plan = plan(&nodes, &pods, &made);
        for warning in &plan.cluster.warnings {
            if !warned.contains(warning) {
                tracing::warn!("{warning}");
            }
        }
        warned = plan.cluster.warnings.iter().cloned().collect();
        let mut round = Round {
            plan: plan.clone(),
            bound: Vec::new(),
            failed: Vec::new(),
            labelled: Vec::new(),
            label_failures: Vec::new(),
        };
        for binding in &plan.bindings {
            match bind(&client, binding).await {
                Ok(()) => {
                    let proxy = plan.proxies.iter().find(|p| {
                        p.host == binding.node || p.dpu.as_deref() == Some(binding.node.as_str())
                    });
                    tracing::info!(
                        pod = %binding.pod,
                        node = %binding.node,
                        instance = %binding.instance,
                        pu = ?super::plan::pu_of(&plan.cluster, &binding.node),
                        proxy_pu = ?proxy.map(|p| p.pu).unwrap_or(ProxyPu::Host),
                        "bound"
                    );
                    made.insert(binding.pod.uid.clone(), binding.node.clone());
                    round.bound.push(binding.clone());
                }
                Err(e) if is_settled(&e) => {
                    tracing::debug!(pod = %binding.pod, "not bound: {e} (bound already, or gone)");
                }
                Err(e) => {
                    let why = format!("binding to node {} failed: {e}", binding.node);
                    report(&recorder, &mut said, &binding.pod, &why).await;
                    round.failed.push((binding.clone(), why));
                }
            }
        }
        for (pod, why) in &plan.unplaced {
            report(&recorder, &mut said, pod, why).await;
        }
        for proxy in &plan.proxies {
            tracing::debug!(host = %proxy.host, pu = ?proxy.pu, dpu = ?proxy.dpu, "node proxy: {}", proxy.reason);
        }
        // Once the watch shows a write (or the node is gone), the node speaks for itself.
        written.retain(|name, value| {
            nodes
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(name.as_str()))
                .is_some_and(|n| label_of(n) != *value)
        });
        refused.retain(|name, _| {
            nodes
                .iter()
                .any(|n| n.metadata.name.as_deref() == Some(name.as_str()))
        });
        let desired = node_proxy_labels(&nodes, &plan.proxies);
        for change in label_changes(&nodes, &desired, &written) {
            match patch_label(&client, &change).await {
                Ok(()) => {
                    refused.remove(&change.node);
                    say_label(&plan, &change);
                    written.insert(change.node.clone(), change.value.map(str::to_string));
                    round.labelled.push(change);
                }
                Err(e) => {
                    let why = e.to_string();
                    if refused.get(&change.node) != Some(&why) {
                        tracing::warn!(node = %change.node, error = %e, "cannot label the node; retried next round");
                        refused.insert(change.node.clone(), why.clone());
                    }
                    round.label_failures.push((change, why));
                }
            }
        }
        rounds.send_replace(Some(Arc::new(round)));
        tokio::select! {
            _ = changed.notified() => {}
            _ = tokio::time::sleep(options.resync) => {}
        }
        tokio::time::sleep(options.debounce).await;
    }
}

/// The log line of a label written: info when a server's node proxy moves to the node (or is
/// placed there first), debug for the rest.
fn say_label(plan: &Plan, change: &LabelChange) {
    let server = change.server.as_deref().unwrap_or("-");
    if change.value == Some(super::proxy_labels::ON) {
        let reason = plan
            .proxies
            .iter()
            .find(|p| Some(p.host.as_str()) == change.server.as_deref())
            .map(|p| p.reason.as_str())
            .unwrap_or("no pod of ours on the server: the host CPU");
        let pu = super::plan::pu_of(&plan.cluster, &change.node);
        tracing::info!(
            server,
            node = %change.node,
            pu = ?pu,
            was = change.was.as_deref().unwrap_or("unlabelled"),
            "the server's node proxy moves to this node: {reason}"
        );
    } else {
        tracing::debug!(
            server,
            node = %change.node,
            label = change.value.unwrap_or("(removed)"),
            was = change.was.as_deref().unwrap_or("unlabelled"),
            "node-proxy label"
        );
    }
}

/// A pod that stays pending: a log line and a Warning event `FailedScheduling`, once per
/// reason.
async fn report(
    recorder: &kube::runtime::events::Recorder,
    said: &mut BTreeSet<(String, String)>,
    pod: &PodKey,
    why: &str,
) {
    if !said.insert((pod.uid.clone(), why.to_string())) {
        return;
    }
    tracing::warn!(pod = %pod, "cannot place: {why}");
    if let Err(e) = warn_pod(recorder, pod, "FailedScheduling", why).await {
        tracing::warn!(pod = %pod, "cannot record the event: {e}");
    }
}
