//! The scheduler's writes to the API server: a Binding per placed pod, an Event per pod that
//! cannot be placed, and a migration as a re-creation of the pod on its new node.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Binding as K8sBinding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use super::app::PodKey;
use super::plan::Binding;

/// How long a re-creation waits for the old pod to be gone.
const DELETE_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("the API server refused to {what} pod {pod}: {source}; may this account create pods/binding, and delete and create pods, in that namespace?")]
    Api {
        what: &'static str,
        pod: String,
        source: kube::Error,
    },
    #[error("pod {pod} was not gone {DELETE_WAIT:?} after its deletion; a finalizer may hold it (kubectl get pod -o yaml)")]
    NotDeleted { pod: String },
    #[error("lost the watch of pod {pod} while waiting for its deletion: {why}; is the API server reachable?")]
    Watch { pod: String, why: String },
    #[error("instance {instance} is not a pod this scheduler knows; was it created with schedulerName flatmesh?")]
    UnknownInstance { instance: String },
    #[error("node {node} of the E3 cluster is not a Kubernetes node this scheduler knows")]
    UnknownNode { node: String },
    #[error("the API server refused to label node {node} flatmesh.io/node-proxy={value}: {source}; may this account patch nodes (deploy/kubernetes/rbac.yaml)? Retried next round")]
    Label {
        node: String,
        value: &'static str,
        source: kube::Error,
    },
}

/// Binds the pod to its node through the Binding API (`pods/binding`), as kube-scheduler
/// does. The pod's uid is a precondition: a pod re-created under the same name meanwhile is
/// not bound by mistake. A pod bound already is a conflict (`is_conflict`).
pub async fn bind(client: &kube::Client, binding: &Binding) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &binding.pod.namespace);
    let body = K8sBinding {
        metadata: ObjectMeta {
            name: Some(binding.pod.name.clone()),
            namespace: Some(binding.pod.namespace.clone()),
            uid: Some(binding.pod.uid.clone()).filter(|u| !u.is_empty()),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(binding.node.clone()),
            ..Default::default()
        },
    };
    // The answer is a Status; only whether it succeeded matters.
    let _: serde_json::Value = api
        .create_subresource("binding", &binding.pod.name, &PostParams::default(), &body)
        .await?;
    Ok(())
}

/// Whether a bind error says the pod is bound already (or gone, or re-created): nothing to
/// retry.
pub fn is_settled(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if s.is_conflict() || s.is_not_found())
}

/// The recorder of the scheduler's Events (events.k8s.io/v1, reason `FailedScheduling` as
/// kube-scheduler's).
pub fn recorder(client: &kube::Client) -> Recorder {
    Recorder::new(
        client.clone(),
        Reporter {
            controller: "flatmesh-scheduler".into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    )
}

/// A Warning event on the pod, `kubectl describe pod` shows it.
pub async fn warn_pod(
    recorder: &Recorder,
    pod: &PodKey,
    reason: &str,
    note: &str,
) -> Result<(), kube::Error> {
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        uid: Some(pod.uid.clone()).filter(|u| !u.is_empty()),
        ..Default::default()
    };
    // The API caps a note at 1 kB.
    let note: String = note.chars().take(1000).collect();
    recorder
        .publish(
            &Event {
                type_: EventType::Warning,
                reason: reason.into(),
                note: Some(note),
                action: "Scheduling".into(),
                secondary: None,
            },
            &reference,
        )
        .await
}

/// Moves a pod to `node` the only way Kubernetes can: deletes it and creates a copy (the same
/// name, labels, annotations, owners and spec) bound to `node`. The copy is created with
/// `spec.nodeName` set, which is what a Binding writes, so no scheduler can take it meanwhile.
/// The old pod is deleted at once (grace period 0, with its uid as a precondition) and awaited:
/// the name must be free for the copy. Returns the new pod.
pub async fn recreate_on(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    node: &str,
) -> Result<Pod, ScheduleError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod_name = format!("{namespace}/{name}");
    let api_error = |what| {
        let pod = pod_name.clone();
        move |source| ScheduleError::Api { what, pod, source }
    };
    let old = api.get(name).await.map_err(api_error("read"))?;
    let uid = old.metadata.uid.clone().unwrap_or_default();
    let mut spec = old.spec.clone().unwrap_or_default();
    spec.node_name = Some(node.to_string());
    let copy = Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: old.metadata.labels.clone(),
            annotations: old.metadata.annotations.clone(),
            owner_references: old.metadata.owner_references.clone(),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    };
    let delete = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: Some(uid.clone()),
            resource_version: None,
        }),
        ..Default::default()
    };
    api.delete(name, &delete)
        .await
        .map_err(api_error("delete"))?;
    let gone = kube::runtime::wait::await_condition(
        api.clone(),
        name,
        kube::runtime::wait::conditions::is_deleted(&uid),
    );
    match tokio::time::timeout(DELETE_WAIT, gone).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return Err(ScheduleError::Watch {
                pod: pod_name,
                why: e.to_string(),
            })
        }
        Err(_) => return Err(ScheduleError::NotDeleted { pod: pod_name }),
    }
    api.create(&PostParams::default(), &copy)
        .await
        .map_err(api_error("create the copy of"))
}

/// The orchestrator's node runtime on Kubernetes (`flatmesh_control::orchestrator::Runtime`):
/// a migration's restart on the new node is a re-creation of the instance's pod there; the
/// other steps (push binary, remove, clean up, migrate state) are the kubelet's and the
/// application's business and pass.
#[derive(Clone)]
pub struct Migrator {
    pub client: kube::Client,
    /// E3 instance id -> pod.
    pub pods: BTreeMap<String, PodKey>,
    /// E3 node id -> Kubernetes node name.
    pub nodes: BTreeMap<String, String>,
}

impl Migrator {
    /// Re-creates the pod of `instance` on the Kubernetes node of E3 node `to`.
    pub async fn migrate(&self, instance: &str, to: &str) -> Result<Pod, ScheduleError> {
        let pod = self
            .pods
            .get(instance)
            .ok_or_else(|| ScheduleError::UnknownInstance {
                instance: instance.to_string(),
            })?;
        let node = self
            .nodes
            .get(to)
            .ok_or_else(|| ScheduleError::UnknownNode {
                node: to.to_string(),
            })?;
        recreate_on(&self.client, &pod.namespace, &pod.name, node).await
    }
}

impl flatmesh_control::orchestrator::Runtime for Migrator {
    fn step(
        &self,
        step: flatmesh_control::orchestrator::Step,
        instance: &str,
        from: &str,
        to: &str,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send {
        let this = self.clone();
        let (instance, moved, to) = (instance.to_string(), from != to, to.to_string());
        async move {
            match step {
                flatmesh_control::orchestrator::Step::Restart if moved => this
                    .migrate(&instance, &to)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                _ => Ok(()),
            }
        }
    }
}
