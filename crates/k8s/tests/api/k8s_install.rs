//! The install manifests (deploy/kubernetes, issue 20 item 2) against a real API server:
//! `kubectl apply -k` (server-side), every object there, the RBAC of both service accounts
//! (SubjectAccessReviews), the two node-proxy DaemonSets' node affinities against the
//! scheduler's `flatmesh.io/node-proxy` labels, and the programs as the manifests run them: `flatmesh control`
//! with the Deployment's arguments, as the control plane's service account (a TokenRequest
//! token), lists and watches the cluster and serves a node; `flatmesh node` with the
//! DaemonSet's arguments and ConfigMap becomes ready on its readiness probe's path and stops
//! on its preStop command.
//!
//! Needs testenv (as k8s_control.rs), kubectl, and the release binary (`cargo build --release
//! -p flatmesh`, or $FLATMESH_BIN); fails, never skips, without them.
#![allow(clippy::unwrap_used)]

use crate::common;
use common::{api_server, create, flatmesh_bin, free_port};

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use std::collections::BTreeMap;

use flatmesh_k8s::schedule::proxy::{ProxyChoice, ProxyPu};
use flatmesh_k8s::schedule::proxy_labels::node_proxy_labels;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Node, NodeSelector, Pod, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::Api;
use serde_json::json;
use tokio::sync::watch;

const NS: &str = "flatmesh-system";
const CONTROL_SA: &str = "system:serviceaccount:flatmesh-system:flatmesh-control";
const NODE_SA: &str = "system:serviceaccount:flatmesh-system:flatmesh-node";

fn manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

fn kubectl(kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    // kubectl caches an API server's discovery under ~/.kube/cache by host and port, for hours;
    // test API servers reuse ports, so another run's server (one without the Gateway API CRDs)
    // would answer for this one ("no" to a granted verb on httproutes). Each server gets its own
    // cache, next to its kubeconfig.
    let cache = kubeconfig
        .parent()
        .expect("a kubeconfig in the test server's directory")
        .join("kubectl-cache");
    Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .output()
        .expect("run kubectl (apt-get install kubectl, or see scripts/setup)")
}

/// Whether `account` (a service account's user name) may `verb` `resource` in `namespace`
/// (`None`: cluster-wide), as the API server's authorizer answers a SubjectAccessReview.
/// `RESOURCE[.GROUP][/SUBRESOURCE]`, as kubectl spells it. Asked through the API with the
/// group spelled out, not `kubectl auth can-i`: kubectl resolves the resource through discovery,
/// and a CRD that discovery does not list yet (the Gateway API's, just applied) turns into a
/// resource named `httproutes.gateway.networking.k8s.io` in the core group, which is denied.
async fn can_i(
    client: &kube::Client,
    account: &str,
    verb: &str,
    resource: &str,
    namespace: Option<&str>,
) -> bool {
    let (resource, subresource) = match resource.split_once('/') {
        Some((resource, sub)) => (resource, Some(sub.to_string())),
        None => (resource, None),
    };
    let (resource, group) = resource.split_once('.').unwrap_or((resource, ""));
    // The groups the service-account authenticator gives a token of `account`.
    let sa_namespace = account
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split(':').next())
        .expect("a service account's user name");
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(account.to_string()),
            groups: Some(vec![
                "system:serviceaccounts".to_string(),
                format!("system:serviceaccounts:{sa_namespace}"),
                "system:authenticated".to_string(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.to_string()),
                group: Some(group.to_string()),
                resource: Some(resource.to_string()),
                subresource,
                namespace: namespace.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&Default::default(), &review)
        .await
        .unwrap_or_else(|e| panic!("SubjectAccessReview {verb} {resource}: {e}"));
    answer.status.is_some_and(|status| status.allowed)
}

/// `can_i` for a right that must be granted: asked again for up to 10 s, since the RBAC
/// authorizer reads roles and bindings through its own watch, a moment behind `kubectl apply`.
async fn granted(
    client: &kube::Client,
    account: &str,
    verb: &str,
    resource: &str,
    namespace: Option<&str>,
) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if can_i(client, account, verb, resource, namespace).await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The required node affinity of a DaemonSet's pods.
fn required_affinity(daemonset: &DaemonSet) -> NodeSelector {
    let spec = daemonset.spec.as_ref().unwrap().template.spec.as_ref();
    spec.and_then(|s| s.affinity.as_ref()?.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .clone()
        })
        .expect("a required node affinity")
}

/// Whether a node with `labels` matches `selector`, as the DaemonSet controller decides it
/// (any term; every expression of a term). Only the operators of these manifests.
fn selects(selector: &NodeSelector, labels: &BTreeMap<String, String>) -> bool {
    selector.node_selector_terms.iter().any(|term| {
        assert!(term.match_fields.is_none(), "{term:?}");
        term.match_expressions.iter().flatten().all(|e| {
            let values = e.values.clone().unwrap_or_default();
            let value = labels.get(&e.key);
            match e.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                other => panic!("operator {other} in {e:?}"),
            }
        })
    })
}

/// A child process killed on drop, its stderr in a file.
struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    fn spawn(what: &str, dir: &Path, args: &[String], env: &[(&str, &str)]) -> Running {
        let log = dir.join(format!("{what}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(flatmesh_bin());
        command
            .args(args)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file);
        for (k, v) in env {
            command.env(k, v);
        }
        Running {
            child: command.spawn().unwrap(),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The one container of a pod template.
fn container(spec: Option<&k8s_openapi::api::core::v1::PodSpec>) -> Container {
    let spec = spec.expect("a pod template spec");
    assert_eq!(spec.containers.len(), 1, "one container");
    spec.containers[0].clone()
}

/// `GET /ready` of a node's admin endpoint: its status code.
fn ready(admin: SocketAddr) -> Option<u16> {
    let mut stream = std::net::TcpStream::connect_timeout(&admin, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET /ready HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.split_whitespace().nth(1)?.parse().ok()
}

/// The configs an xDS client hands its node, latest last.
struct Applied(watch::Sender<Option<flatmesh_config::Config>>);

impl flatmesh_xds::client::Apply for Applied {
    fn apply(&mut self, config: flatmesh_config::Config) -> Result<(), String> {
        self.0.send_replace(Some(config));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manifests_apply_grant_least_privilege_and_run() {
    let bin = flatmesh_bin();
    let (env, client) = api_server().await;
    let kubeconfig = env.kubeconfig();

    // Applied as a user would, server-side (kubectl's kustomize).
    let dir = manifests();
    let applied = kubectl(
        &kubeconfig,
        &[
            "apply",
            "--server-side",
            "--field-manager=flatmesh-install",
            "-k",
            dir.to_str().unwrap(),
        ],
    );
    assert!(
        applied.status.success(),
        "kubectl apply -k {}: {}\n{}",
        dir.display(),
        String::from_utf8_lossy(&applied.stdout),
        String::from_utf8_lossy(&applied.stderr)
    );

    // Every object is there, and nothing else was in the kustomization.
    let listed = kubectl(
        &kubeconfig,
        &["get", "-k", dir.to_str().unwrap(), "-o", "name"],
    );
    assert!(listed.status.success(), "{listed:?}");
    let mut names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "clusterrole.rbac.authorization.k8s.io/flatmesh-control",
            "clusterrolebinding.rbac.authorization.k8s.io/flatmesh-control",
            "configmap/flatmesh-node",
            "daemonset.apps/flatmesh-node",
            "daemonset.apps/flatmesh-node-dpu",
            "deployment.apps/flatmesh-control",
            "namespace/flatmesh-system",
            "service/flatmesh-control",
            "serviceaccount/flatmesh-control",
            "serviceaccount/flatmesh-node",
        ]
    );
    Api::<Namespace>::all(client.clone()).get(NS).await.unwrap();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    accounts.get("flatmesh-control").await.unwrap();
    let node_account = accounts.get("flatmesh-node").await.unwrap();
    assert_eq!(node_account.automount_service_account_token, Some(false));
    Api::<ClusterRole>::all(client.clone())
        .get("flatmesh-control")
        .await
        .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .get("flatmesh-control")
        .await
        .unwrap();
    let deployment = Api::<Deployment>::namespaced(client.clone(), NS)
        .get("flatmesh-control")
        .await
        .unwrap();
    let service = Api::<Service>::namespaced(client.clone(), NS)
        .get("flatmesh-control")
        .await
        .unwrap();
    let daemonset = Api::<DaemonSet>::namespaced(client.clone(), NS)
        .get("flatmesh-node")
        .await
        .unwrap();
    let dpu_daemonset = Api::<DaemonSet>::namespaced(client.clone(), NS)
        .get("flatmesh-node-dpu")
        .await
        .unwrap();
    let node_config = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("flatmesh-node")
        .await
        .unwrap();

    // RBAC. The control plane's account: every verb the controller and the scheduler use,
    // cluster-wide (asked first: once these grants are seen, the authorizer has caught up with
    // the apply, so a denial further down is a real one) ...
    let all = None;
    for resource in [
        "namespaces",
        "services",
        "pods",
        "endpointslices.discovery.k8s.io",
        "httproutes.gateway.networking.k8s.io",
        "grpcroutes.gateway.networking.k8s.io",
        "nodes",
    ] {
        for verb in ["get", "list", "watch"] {
            assert!(
                granted(&client, CONTROL_SA, verb, resource, all).await,
                "the control plane's account may not {verb} {resource}"
            );
        }
    }
    for (verb, resource) in [
        ("create", "pods/binding"),
        ("create", "bindings"),
        ("create", "pods"),
        ("delete", "pods"),
        ("patch", "nodes"),
        ("create", "events.events.k8s.io"),
        ("patch", "events.events.k8s.io"),
    ] {
        assert!(
            granted(&client, CONTROL_SA, verb, resource, all).await,
            "the control plane's account may not {verb} {resource}"
        );
    }
    // ... and nothing more.
    for (verb, resource) in [
        ("get", "secrets"),
        ("list", "secrets"),
        ("get", "configmaps"),
        ("update", "services"),
        ("patch", "pods"),
        ("delete", "namespaces"),
        ("create", "endpointslices.discovery.k8s.io"),
        ("update", "httproutes.gateway.networking.k8s.io"),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("update", "nodes"),
        ("create", "nodes"),
        ("delete", "nodes"),
        ("patch", "nodes/status"),
    ] {
        assert!(
            !can_i(&client, CONTROL_SA, verb, resource, all).await,
            "the control plane's account may {verb} {resource}"
        );
    }

    // The node's account: no Secrets anywhere, no pods, nothing of the cluster.
    for verb in ["get", "list", "watch"] {
        for scope in [all, Some(NS), Some("default"), Some("kube-system")] {
            assert!(
                !can_i(&client, NODE_SA, verb, "secrets", scope).await,
                "the node's account may {verb} secrets ({scope:?})"
            );
        }
    }
    for (verb, resource) in [
        ("list", "pods"),
        ("watch", "pods"),
        ("list", "services"),
        ("list", "endpointslices.discovery.k8s.io"),
        ("list", "nodes"),
        ("create", "pods"),
        ("create", "pods/binding"),
        ("patch", "nodes"),
    ] {
        assert!(
            !can_i(&client, NODE_SA, verb, resource, all).await,
            "the node's account may {verb} {resource}"
        );
    }

    // The node proxies: the DPU's DaemonSet runs the same proxy as the host's (same container,
    // volumes, account, network), only elsewhere.
    let pod_of = |ds: &DaemonSet| ds.spec.as_ref().unwrap().template.spec.clone().unwrap();
    let (host_pod, dpu_pod) = (pod_of(&daemonset), pod_of(&dpu_daemonset));
    assert_eq!(dpu_pod.containers, host_pod.containers);
    assert_eq!(dpu_pod.volumes, host_pod.volumes);
    assert_eq!(
        (
            &dpu_pod.service_account_name,
            dpu_pod.host_network,
            &dpu_pod.tolerations
        ),
        (
            &host_pod.service_account_name,
            host_pod.host_network,
            &host_pod.tolerations
        )
    );
    // Where each runs, with the labels the scheduler writes: server a offloads its proxy to
    // its DPU, server b keeps it on the host (its SmartNIC unused), server c has no pods (no
    // choice) and no DPU; a node that is not the scheduler's; and server d before the
    // scheduler labelled anything. Each server runs exactly one proxy, where the choice says.
    let node = |name: &str, pu: Option<&str>, host: Option<&str>| -> Node {
        serde_json::from_value(json!({ "metadata": {
            "name": name,
            "labels": pu.map(|pu| json!({ "flatmesh.io/pu": pu })).unwrap_or(json!({})),
            "annotations": host.map(|h| json!({ "flatmesh.io/host": h })).unwrap_or(json!({})),
        } }))
        .unwrap()
    };
    let nodes = [
        node("host-a", Some("host"), None),
        node("a-dpu", Some("dpu"), Some("host-a")),
        node("host-b", Some("host"), None),
        node("b-nic", Some("smartnic"), Some("host-b")),
        node("host-c", Some("host"), None),
        node("plain", None, None),
    ];
    let choices = [
        ProxyChoice {
            host: "host-a".into(),
            pu: ProxyPu::Dpu,
            dpu: Some("a-dpu".into()),
            reason: String::new(),
        },
        ProxyChoice {
            host: "host-b".into(),
            pu: ProxyPu::Host,
            dpu: None,
            reason: String::new(),
        },
    ];
    let written = node_proxy_labels(&nodes, &choices);
    let mut labelled: Vec<(String, BTreeMap<String, String>)> = nodes
        .iter()
        .map(|n| {
            let name = n.metadata.name.clone().unwrap();
            let mut labels = n.metadata.labels.clone().unwrap_or_default();
            if let Some(Some(value)) = written.get(&name) {
                labels.insert("flatmesh.io/node-proxy".into(), value.to_string());
            }
            (name, labels)
        })
        .collect();
    // Server d, unlabelled yet.
    for (name, pu) in [("host-d", "host"), ("d-dpu", "dpu")] {
        labelled.push((
            name.into(),
            BTreeMap::from([("flatmesh.io/pu".to_string(), pu.to_string())]),
        ));
    }
    let (on_host, on_dpu) = (
        required_affinity(&daemonset),
        required_affinity(&dpu_daemonset),
    );
    let runs: BTreeMap<&str, Vec<&str>> = labelled
        .iter()
        .map(|(name, labels)| {
            let mut runs = Vec::new();
            if selects(&on_host, labels) {
                runs.push("flatmesh-node");
            }
            if selects(&on_dpu, labels) {
                runs.push("flatmesh-node-dpu");
            }
            (name.as_str(), runs)
        })
        .collect();
    let expected: BTreeMap<&str, Vec<&str>> = BTreeMap::from([
        ("host-a", vec![]),
        ("a-dpu", vec!["flatmesh-node-dpu"]),
        ("host-b", vec!["flatmesh-node"]),
        ("b-nic", vec![]),
        ("host-c", vec!["flatmesh-node"]),
        ("plain", vec!["flatmesh-node"]),
        ("host-d", vec!["flatmesh-node"]),
        ("d-dpu", vec![]),
    ]);
    assert_eq!(runs, expected, "the labels: {labelled:?}");

    // What the workloads look like: the node's pods take the node's account, the host network
    // and NODE_NAME from the downward API; the control plane's its own account.
    let pod_spec = daemonset.spec.as_ref().unwrap().template.spec.as_ref();
    let spec = pod_spec.unwrap();
    assert_eq!(spec.service_account_name.as_deref(), Some("flatmesh-node"));
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let node_container = container(pod_spec);
    let node_name = node_container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(node_name.as_deref(), Some("spec.nodeName"));
    let control_spec = deployment.spec.as_ref().unwrap().template.spec.as_ref();
    assert_eq!(
        control_spec.unwrap().service_account_name.as_deref(),
        Some("flatmesh-control")
    );
    let control_container = container(control_spec);
    // The Service sends the xDS port to the Deployment's pods.
    let service_spec = service.spec.as_ref().unwrap();
    let pod_labels = deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap_or_default();
    let selector = service_spec.selector.clone().unwrap_or_default();
    assert!(
        !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the Service's selector {selector:?} must select the Deployment's pods {pod_labels:?}"
    );
    let xds_port = service_spec.ports.as_ref().unwrap()[0].port;
    let node_args = node_container.args.clone().unwrap();
    assert!(
        node_args
            .windows(2)
            .any(|w| w[0] == "--xds" && w[1] == format!("flatmesh-control.{NS}:{xds_port}")),
        "the DaemonSet dials the Service: {node_args:?}"
    );

    // Something to serve: a Service and a pod on node-1.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    let web = create(
        &services,
        json!({ "metadata": { "name": "web" },
                "spec": { "ports": [ { "name": "http", "port": 80 } ] } }),
    )
    .await;
    let web_vip = web.spec.unwrap().cluster_ip.unwrap();
    // No controller-manager runs here to create a namespace's `default` account.
    let shop_accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    create(&shop_accounts, json!({ "metadata": { "name": "default" } })).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    create(
        &pods,
        json!({ "metadata": { "name": "web-1" },
                "spec": { "nodeName": "node-1",
                          "containers": [ { "name": "app", "image": "example.invalid/app" } ] } }),
    )
    .await;

    // `flatmesh control` as the Deployment runs it, as its service account: a token from the
    // TokenRequest API, in a kubeconfig instead of the pod's mounted one.
    let token = kubectl(
        &kubeconfig,
        &[
            "create",
            "token",
            "flatmesh-control",
            "-n",
            NS,
            "--duration=1h",
        ],
    );
    assert!(token.status.success(), "{token:?}");
    let token = String::from_utf8(token.stdout).unwrap().trim().to_string();
    let mut as_control = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
    as_control.auth_infos[0].auth_info = Some(kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    });
    // JSON is YAML: kube-rs reads it as a kubeconfig.
    let control_kubeconfig = env.dir.join("control-kubeconfig");
    std::fs::write(
        &control_kubeconfig,
        serde_json::to_string(&as_control).unwrap(),
    )
    .unwrap();
    let xds: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let metrics = free_port();
    let control_args: Vec<String> = control_container
        .args
        .clone()
        .unwrap()
        .into_iter()
        .map(|a| match a.as_str() {
            "--in-cluster" => format!("--kubeconfig={}", control_kubeconfig.display()),
            _ if a.starts_with("--listen=") => format!("--listen={xds}"),
            _ if a.starts_with("--metrics=") => format!("--metrics=127.0.0.1:{metrics}"),
            _ => a,
        })
        .collect();
    assert!(
        control_args.iter().any(|a| a.starts_with("--kubeconfig=")),
        "the Deployment runs `control --in-cluster`: {control_args:?}"
    );
    let control = Running::spawn("control", &env.dir, &control_args, &[]);

    // A node with a pod is served the Service: the control plane listed and watched.
    let (tx, mut served) = watch::channel(None);
    let node_1 = flatmesh_xds::client::Client::spawn(
        flatmesh_xds::client::Options {
            server: xds.to_string(),
            node_id: "node-1".into(),
            node_cluster: "node-1".into(),
            protocol: flatmesh_xds::client::Protocol::Sotw,
            security: Default::default(),
            sds_dir: None,
            load_reports: None,
        },
        flatmesh_xds::bootstrap::empty_config(),
        Applied(tx),
    );
    let listener_at = |vip: &str| {
        let vip: SocketAddr = format!("{vip}:80").parse().unwrap();
        move |c: &Option<flatmesh_config::Config>| {
            c.as_ref()
                .is_some_and(|c| c.listeners.iter().any(|l| l.address == vip))
        }
    };
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        served.wait_for(listener_at(&web_vip)),
    )
    .await
    .is_ok();
    assert!(
        got,
        "node-1 is not served shop/web by `flatmesh control` as flatmesh-control; its log:\n{}",
        control.log()
    );
    // A change arrives too (the watch works with this account).
    let api = create(
        &services,
        json!({ "metadata": { "name": "api" },
                "spec": { "ports": [ { "name": "http", "port": 80 } ] } }),
    )
    .await;
    let api_vip = api.spec.unwrap().cluster_ip.unwrap();
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        served.wait_for(listener_at(&api_vip)),
    )
    .await
    .is_ok();
    assert!(got, "a new Service did not arrive; log:\n{}", control.log());
    let log = control.log();
    for refusal in ["Forbidden", "forbidden"] {
        assert!(
            !log.contains(refusal),
            "`flatmesh control` as flatmesh-control was refused something:\n{log}"
        );
    }

    // `flatmesh node` as the DaemonSet runs it, with its ConfigMap, for a node without pods
    // (a node with pods would bind the ClusterIPs, which are not local here).
    let node_yaml = &node_config.data.as_ref().unwrap()["node.yaml"];
    let probe = node_container.readiness_probe.clone().unwrap();
    let get = probe.http_get.unwrap();
    assert_eq!(get.path.as_deref(), Some("/ready"));
    let probe_admin = format!(
        "{}:{}",
        get.host.as_deref().unwrap_or("POD_IP"),
        match get.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => p.to_string(),
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(p) => p,
        }
    );
    assert!(
        node_yaml.contains(&format!("admin: {probe_admin}")),
        "the readiness probe reads the admin port node.yaml sets ({probe_admin}):\n{node_yaml}"
    );
    let pre_stop = node_container
        .lifecycle
        .clone()
        .and_then(|l| l.pre_stop?.exec?.command)
        .unwrap();
    assert!(
        pre_stop.iter().any(|a| a == &probe_admin) && pre_stop.iter().any(|a| a == "drain"),
        "the preStop hook drains the admin port: {pre_stop:?}"
    );
    // The same, on a free port of this machine.
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let config_dir = env.dir.join("etc-flatmesh");
    std::fs::create_dir_all(&config_dir).unwrap();
    std::fs::write(
        config_dir.join("node.yaml"),
        node_yaml.replace(&probe_admin, &admin.to_string()),
    )
    .unwrap();
    let mount = node_container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "config")
        .unwrap()
        .mount_path
        .clone();
    let node_args: Vec<String> = node_args
        .into_iter()
        .map(|a| {
            a.replace("$(NODE_NAME)", "node-empty")
                .replace(
                    &format!("flatmesh-control.{NS}:{xds_port}"),
                    &xds.to_string(),
                )
                .replace(&mount, config_dir.to_str().unwrap())
        })
        .collect();
    let mut node = Running::spawn("node", &env.dir, &node_args, &[]);
    let start = Instant::now();
    while ready(admin) != Some(200) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the node is not ready on {admin}/ready; its log:\n{}",
            node.log()
        );
        if let Some(status) = node.child.try_wait().unwrap() {
            panic!("the node exited ({status}); its log:\n{}", node.log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // preStop: the drain returns once the node has stopped.
    assert!(pre_stop[0].ends_with("/flatmesh"), "{pre_stop:?}");
    let drain = Command::new(&bin)
        .args(
            pre_stop[1..]
                .iter()
                .map(|a| a.replace(&probe_admin, &admin.to_string())),
        )
        .output()
        .unwrap();
    assert!(
        drain.status.success(),
        "the preStop hook failed: {}\n{}",
        String::from_utf8_lossy(&drain.stdout),
        String::from_utf8_lossy(&drain.stderr)
    );
    let start = Instant::now();
    let status = loop {
        if let Some(status) = node.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the node did not stop after the drain; its log:\n{}",
            node.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        status.success(),
        "the node exited with {status}:\n{}",
        node.log()
    );

    node_1.stop().await;
    drop(control);
    drop(env);
}
