//! E3 as a Kubernetes scheduler (issue 20, item 3; HeteroK8s, papers/004 §5): pods of
//! `schedulerName: flatmesh` are placed by E3's HCM on nodes labelled with their processing
//! unit, and bound through the Binding API.
//!
//! - [`quantity`]: Kubernetes quantities (`3500m`, `64Gi`) as numbers.
//! - [`cluster`]: Nodes -> E3's cluster (hosts and their SmartNICs/DPUs as servers). Pure.
//! - [`app`]: Pods -> E3 applications (the DAG from annotations). Pure.
//! - [`proxy`]: HeteroK8s-Mesh's choice of where a server's node proxy runs. Pure.
//! - [`proxy_labels`]: the choice applied: the node label the node proxies' DaemonSets follow.
//! - [`plan`]: Nodes and Pods -> the bindings, by HCM. Pure.
//! - [`bind`]: the writes: Bindings, Events, a migration as a re-creation of the pod.
//! - [`scheduler`]: the watches and the rounds.
//! - [`orchestrate`]: E3's orchestrator on the rounds: heartbeats in, pods re-created out.
//!
//! docs/kubernetes.md, "Scheduler", lists the labels and annotations.

pub mod app;
pub mod bind;
pub mod cluster;
pub mod orchestrate;
pub mod plan;
pub mod proxy;
pub mod proxy_labels;
pub mod quantity;
pub mod scheduler;

pub use app::{apps_from_pods, App, PodKey, SCHEDULER_NAME};
pub use bind::{recreate_on, Migrator, ScheduleError};
pub use cluster::{cluster_from_nodes, Cluster, Pu};
pub use orchestrate::{Orchestrator, OrchestratorOptions};
pub use plan::{plan, Binding, Plan};
pub use proxy_labels::{LabelChange, NODE_PROXY_LABEL};
pub use scheduler::{Options, Round, Scheduler};
