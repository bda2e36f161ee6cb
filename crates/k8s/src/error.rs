//! The one error type of the crate.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error("cannot read kubeconfig {path}: {why}; give --kubeconfig a readable kubeconfig file (kubectl config view --raw > FILE)")]
    Kubeconfig { path: PathBuf, why: String },
    #[error("no Kubernetes API server to talk to: give --kubeconfig FILE, or run in a pod (KUBERNETES_SERVICE_HOST is not set): {why}")]
    NoCluster { why: String },
    #[error("cannot build a Kubernetes client: {0}")]
    Client(String),
}

pub type Result<T> = std::result::Result<T, K8sError>;
