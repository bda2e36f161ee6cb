//! Pods' identities over SDS, against a real API server (issue 20, item 1: "the identities of
//! the pods scheduled on it; no node learns another node's secrets"): `flatmesh control
//! --kubeconfig --ca-dir` as the binary wires it (the control center with its CA, and the
//! Kubernetes controller telling the CA each node's pod identities), and nodes asking over
//! their token-authenticated TLS ADS streams for secrets by SPIFFE ID.
//!
//! Needs what k8s_control.rs needs (testenv: go, etcd, openssl, kubectl); fails, never skips.
#![allow(clippy::unwrap_used)]

use crate::common;
use common::{api_server, create};

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{secret, Secret};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use flatmesh_control::serve::ca::token_digest_hex;
use flatmesh_control::serve::{CaOptions, ControlCenter, Options};
use flatmesh_identity::{Authority, IdPattern, TrustBundle};
use flatmesh_xds::resources::SECRET;
use flatmesh_xds::sds::ROOTCA;
use flatmesh_xds::secure::ChannelSecurity;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::Api;
use prost::Message as _;
use serde_json::json;

const WEB_ID: &str = "spiffe://cluster.local/ns/shop/sa/web";
const DB_ID: &str = "spiffe://cluster.local/ns/shop/sa/db";

fn token_of(node: &str) -> String {
    format!("token-of-{node}")
}

/// The control center with a CA for `cluster.local`, node-a's and node-b's tokens, no grants.
fn control_center(dir: &Path) -> ControlCenter {
    let ca_dir = dir.join("ca");
    Authority::init("cluster.local", &ca_dir).unwrap();
    let tokens: String = ["node-a", "node-b"]
        .iter()
        .map(|n| {
            format!(
                "{n}: {{ token_sha256: {} }}\n",
                token_digest_hex(&token_of(n))
            )
        })
        .collect();
    let tokens_path = dir.join("node-tokens.yaml");
    std::fs::write(&tokens_path, tokens).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&tokens_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    ControlCenter::new(&Options {
        listen: "127.0.0.1:0".parse().unwrap(),
        state: None,
        placement: None,
        ca: Some(CaOptions {
            dir: ca_dir,
            node_tokens: tokens_path,
            ttl: Duration::from_secs(3600),
        }),
        metrics: None,
        ui: None,
    })
    .unwrap()
}

/// What `flatmesh node --xds-ca CA --bootstrap-token ...` sets up for `node`.
fn security(ca_pem: &Path, node: &str) -> ChannelSecurity {
    let bundle = TrustBundle::load(ca_pem).unwrap();
    let control = IdPattern::parse("spiffe://cluster.local/flatmesh/control").unwrap();
    ChannelSecurity {
        tls: Some(
            flatmesh_identity::tls::client_config(None, &bundle, vec![control], &[b"h2"]).unwrap(),
        ),
        token: Some(token_of(node)),
    }
}

/// One node's ADS stream subscribed to secrets `names` (SotW).
struct SdsStream {
    responses: tonic::Streaming<DiscoveryResponse>,
    /// Kept open: dropping it ends the stream.
    _requests: tokio::sync::mpsc::Sender<DiscoveryRequest>,
}

impl SdsStream {
    async fn open(server: &str, security: &ChannelSecurity, node: &str, names: &[&str]) -> Self {
        let channel = flatmesh_xds::secure::connect(server, security, Duration::from_secs(5))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(DiscoveryRequest {
            node: Some(Node {
                id: node.into(),
                ..Default::default()
            }),
            type_url: SECRET.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
        let request = flatmesh_xds::secure::with_token(
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            security,
        )
        .unwrap();
        let responses = AggregatedDiscoveryServiceClient::new(channel)
            .stream_aggregated_resources(request)
            .await
            .unwrap()
            .into_inner();
        SdsStream {
            responses,
            _requests: tx,
        }
    }

    /// The names of the secrets of the next response; each workload certificate is checked to
    /// carry the SPIFFE ID it is named by, and a private key.
    async fn next(&mut self) -> BTreeSet<String> {
        let response = tokio::time::timeout(Duration::from_secs(10), self.responses.message())
            .await
            .expect("an SDS response within 10 s")
            .unwrap()
            .expect("the stream is open");
        assert_eq!(response.type_url, SECRET);
        let mut names = BTreeSet::new();
        for any in &response.resources {
            let secret = Secret::decode(any.value.as_slice()).unwrap();
            if let Some(secret::Type::TlsCertificate(tls)) = &secret.r#type {
                let pem = |source: &Option<
                    envoy_types::pb::envoy::config::core::v3::DataSource,
                >| {
                    match source.as_ref().and_then(|s| s.specifier.clone()) {
                        Some(envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineBytes(b)) => b,
                        other => panic!("{}: not inline bytes: {other:?}", secret.name),
                    }
                };
                let chain = pem(&tls.certificate_chain);
                let leaf = flatmesh_identity::ca::certificates_from_pem(&chain).unwrap();
                let id = flatmesh_identity::svid::spiffe_id_of(&leaf[0]).unwrap();
                assert_eq!(id.as_str(), secret.name, "the certificate is of its name");
                assert!(!pem(&tls.private_key).is_empty(), "{}: a key", secret.name);
            }
            names.insert(secret.name);
        }
        names
    }
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

async fn pod(pods: &Api<Pod>, name: &str, node: &str, account: &str) {
    create(
        pods,
        json!({ "metadata": { "name": name },
        "spec": { "nodeName": node, "serviceAccountName": account,
                  "containers": [ { "name": "app", "image": "example.invalid/app" } ] } }),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_gets_its_own_pods_identities_over_sds_and_loses_them_with_the_pod() {
    let (env, client) = api_server().await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    for account in ["web", "db"] {
        create(&accounts, json!({ "metadata": { "name": account } })).await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    pod(&pods, "web-a", "node-a", "web").await;
    pod(&pods, "db-b", "node-b", "db").await;

    // `flatmesh control --kubeconfig K --ca-dir DIR --node-tokens FILE`, wired as the binary
    // does (crates/flatmesh/src/cmd/control.rs).
    let scratch = env.dir.join("control");
    std::fs::create_dir_all(&scratch).unwrap();
    let center = control_center(&scratch);
    let stats = center.ca_stats().unwrap();
    let grants = center.pod_identities();
    let controller = flatmesh_k8s::Controller::spawn(
        client.clone(),
        center.feed().store().clone(),
        flatmesh_k8s::Options {
            trust_domain: center.trust_domain().unwrap(),
            identities: Some(Arc::new(move |by_node| grants.replace(by_node))),
            ..Default::default()
        },
    );
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(center.run(
        async {
            let _ = stop_rx.await;
        },
        Some(bound_tx),
    ));
    let server = bound_rx.await.unwrap().to_string();
    let mut published = controller.subscribe();
    tokio::time::timeout(
        Duration::from_secs(30),
        published.wait_for(|t| t.nodes.contains_key("node-a") && t.nodes.contains_key("node-b")),
    )
    .await
    .expect("both nodes published")
    .unwrap();
    let ca_pem = scratch.join("ca/ca.pem");

    // Node A gets the identity of its pod and the roots; not node B's pod's.
    let a = security(&ca_pem, "node-a");
    let mut a_stream = SdsStream::open(&server, &a, "node-a", &[WEB_ID, DB_ID, ROOTCA]).await;
    assert_eq!(a_stream.next().await, set(&[ROOTCA, WEB_ID]));
    let refused_before = stats.not_placed.load(std::sync::atomic::Ordering::Relaxed);
    assert!(refused_before >= 1, "node-a's ask for {DB_ID} is counted");
    // Claiming to be node B in the request changes nothing: the token says who asks.
    let mut claims_b = SdsStream::open(&server, &a, "node-b", &[DB_ID]).await;
    assert_eq!(claims_b.next().await, set(&[]));
    // Node B gets its own.
    let b = security(&ca_pem, "node-b");
    let mut b_stream = SdsStream::open(&server, &b, "node-b", &[DB_ID, WEB_ID]).await;
    assert_eq!(b_stream.next().await, set(&[DB_ID]));

    // The pod is deleted: node A's open stream is pushed the secrets without it, and a new ask
    // is refused.
    pods.delete("web-a", &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let mut pushes = 0;
    loop {
        pushes += 1;
        assert!(pushes <= 5, "node-a keeps {WEB_ID} after its pod is gone");
        if a_stream.next().await == set(&[ROOTCA]) {
            break;
        }
    }
    let mut again = SdsStream::open(&server, &a, "node-a", &[WEB_ID]).await;
    assert_eq!(
        again.next().await,
        set(&[]),
        "refused after the pod is gone"
    );

    // The pod comes back on node B (a move): node B's stream is given it, node A still not.
    pod(&pods, "web-b", "node-b", "web").await;
    let mut pushes = 0;
    loop {
        pushes += 1;
        assert!(
            pushes <= 5,
            "node-b is not given {WEB_ID} once its pod runs there"
        );
        if b_stream.next().await == set(&[DB_ID, WEB_ID]) {
            break;
        }
    }
    let mut again = SdsStream::open(&server, &a, "node-a", &[WEB_ID]).await;
    assert_eq!(again.next().await, set(&[]), "node-a never gets node-b's");

    drop((a_stream, claims_b, b_stream, again));
    drop(controller);
    let _ = stop_tx.send(());
    served.await.unwrap().unwrap();
    drop(env);
}
