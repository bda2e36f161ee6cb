//! The control center as its nodes' CA, in-process and over real sockets: HCM places `shop/kvs`
//! on the first SmartNIC, the control center serves xDS and the certificate API over TLS to
//! token holders only, and nodes (the identity fetcher and the xDS client that
//! `flatmesh node --identity ... --xds-ca ... --bootstrap-token ...` runs) get exactly what
//! they hold: the identities placed on them or granted to them, and nothing of another node's.
#![allow(clippy::unwrap_used)]

mod common;
use common::{console_state, Scratch, ADDRESSES, APP, CLUSTER};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flatmesh_control::placement::Algorithm;
use flatmesh_control::serve::ca::token_digest_hex;
use flatmesh_control::serve::{CaOptions, ControlCenter, Options, PlacementOptions};
use flatmesh_identity::{Authority, IdPattern, SpiffeId, TrustBundle};
use flatmesh_xds::client::{Apply, Client, Protocol};
use flatmesh_xds::identities::{self, IdentityOptions};
use flatmesh_xds::secure::ChannelSecurity;

const STATE: &str = "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes: [ { cluster: shop/kvs } ]\nclusters:\n  - { name: shop/kvs, endpoints: [] }\n";

/// HCM puts the only KVS instance on the first SmartNIC.
const KVS_NODE: &str = "r0-s0/nic0";
const KVS_ID: &str = "spiffe://mesh.test/ns/shop/sa/kvs";
/// Granted to the first host in the tokens file.
const FRONT_ID: &str = "spiffe://mesh.test/ns/shop/sa/front";

fn token_of(node: &str) -> String {
    format!("token-of-{}", node.replace('/', "-"))
}

/// A control center with a CA, placing shop/kvs; returns it with the CA directory.
fn control_center(dir: &Scratch) -> (ControlCenter, PathBuf) {
    let ca_dir = dir.0.join("ca");
    Authority::init("mesh.test", &ca_dir).unwrap();
    let tokens: String = ["r0-s0/host", "r0-s0/nic0", "r0-s1/host"]
        .iter()
        .map(|node| {
            let grants = if *node == "r0-s0/host" {
                format!(", identities: [ {FRONT_ID} ]")
            } else {
                String::new()
            };
            format!(
                "{node}: {{ token_sha256: {}{grants} }}\n",
                token_digest_hex(&token_of(node))
            )
        })
        .collect();
    let tokens_path = dir.write("node-tokens.yaml", &tokens);
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&tokens_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let options = Options {
        listen: "127.0.0.1:0".parse().unwrap(),
        state: Some(dir.write("state.yaml", STATE)),
        placement: Some(PlacementOptions {
            cluster: dir.write("cluster.yaml", CLUSTER).display().to_string(),
            apps: vec![dir.write("app.yaml", APP).display().to_string()],
            algorithm: Algorithm::Hcm,
            seed: 1,
            addresses: dir.write("addresses.yaml", ADDRESSES),
            orchestrator: None,
        }),
        ca: Some(CaOptions {
            dir: ca_dir.clone(),
            node_tokens: tokens_path,
            ttl: Duration::from_secs(3600),
        }),
        metrics: Some("127.0.0.1:0".parse().unwrap()),
        ui: Some("127.0.0.1:0".parse().unwrap()),
    };
    (ControlCenter::new(&options).unwrap(), ca_dir)
}

/// What `flatmesh node --xds-ca CA --bootstrap-token ...` sets up: TLS trusting `ca_pem`,
/// expecting the control center's SPIFFE ID.
fn security(ca_pem: &Path, token: Option<&str>) -> ChannelSecurity {
    let bundle = TrustBundle::load(ca_pem).unwrap();
    let control = IdPattern::parse("spiffe://mesh.test/flatmesh/control").unwrap();
    ChannelSecurity {
        tls: Some(
            flatmesh_identity::tls::client_config(None, &bundle, vec![control], &[b"h2"]).unwrap(),
        ),
        token: token.map(str::to_owned),
    }
}

fn identity_options(
    server: &str,
    security: ChannelSecurity,
    dir: &Path,
    id: &str,
) -> IdentityOptions {
    IdentityOptions {
        server: server.to_string(),
        security,
        ids: vec![SpiffeId::parse(id).unwrap()],
        dir: dir.to_path_buf(),
        ttl: Duration::from_secs(600),
    }
}

/// A control center serving on its own runtime.
struct Running {
    rt: tokio::runtime::Runtime,
    server: String,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<flatmesh_control::Result<()>>,
}

impl Running {
    fn start(center: ControlCenter) -> Running {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
        let served = rt.spawn(center.run(
            async {
                let _ = stop_rx.await;
            },
            Some(bound_tx),
        ));
        let server = rt.block_on(bound_rx).unwrap().to_string();
        Running {
            rt,
            server,
            stop,
            served,
        }
    }

    /// Stops the server and checks that it ended cleanly.
    fn stop(self) {
        self.stop.send(()).unwrap();
        self.rt.block_on(self.served).unwrap().unwrap();
    }
}

#[derive(Clone, Default)]
struct Recorder(Arc<parking_lot::Mutex<u64>>);

impl Apply for Recorder {
    fn apply(&mut self, _config: flatmesh_config::Config) -> Result<(), String> {
        *self.0.lock() += 1;
        Ok(())
    }
}

fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn nodes_get_certificates_only_for_the_identities_they_hold_over_an_authenticated_tls_channel() {
    let dir = Scratch::new("holds");
    let (center, ca_dir) = control_center(&dir);
    let stats = center.ca_stats().unwrap();
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    let ca_pem = ca_dir.join("ca.pem");
    let out = dir.0.join("identities");

    // The SmartNIC that runs the KVS gets the KVS identity: key 0600, leaf for that ID,
    // chained to the bundle it also gets.
    let nic = security(&ca_pem, Some(&token_of(KVS_NODE)));
    let held = rt
        .block_on(identities::fetch(
            &identity_options(&server, nic.clone(), &out, KVS_ID),
            &SpiffeId::parse(KVS_ID).unwrap(),
        ))
        .unwrap();
    assert_eq!(held.id.as_str(), KVS_ID);
    let lifetime = held.not_after.duration_since(held.not_before).unwrap();
    assert!(
        lifetime <= Duration::from_secs(600 + 60),
        "the node asked for 10 minutes and got {lifetime:?}"
    );
    let (cert, key) = identities::files(&out, &held.id);
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let svid = flatmesh_identity::Svid::load(&cert, &key).unwrap();
    assert_eq!(svid.id.as_str(), KVS_ID);
    let bundle =
        flatmesh_identity::ca::load_certificates(&out.join(identities::BUNDLE_FILE)).unwrap();
    assert_eq!(
        bundle,
        flatmesh_identity::ca::load_certificates(&ca_pem).unwrap()
    );
    // What it got works as a server identity that a peer trusting the bundle accepts.
    flatmesh_identity::tls::server_config(&svid, None, &[b"h2"]).unwrap();

    // A host asking for the KVS identity (placed on another node) is refused, and says why.
    let host = security(&ca_pem, Some(&token_of("r0-s0/host")));
    let refused = rt
        .block_on(identities::fetch(
            &identity_options(&server, host.clone(), &out, KVS_ID),
            &SpiffeId::parse(KVS_ID).unwrap(),
        ))
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("PermissionDenied")
            && refused.contains("not an identity placed on node `r0-s0/host`"),
        "{refused}"
    );
    // What the tokens file grants it outright, it gets.
    rt.block_on(identities::fetch(
        &identity_options(&server, host.clone(), &out, FRONT_ID),
        &SpiffeId::parse(FRONT_ID).unwrap(),
    ))
    .unwrap();
    // Another trust domain is refused as a bad request.
    let foreign = "spiffe://elsewhere.test/ns/shop/sa/kvs";
    let refused = rt
        .block_on(identities::fetch(
            &identity_options(&server, nic.clone(), &out, foreign),
            &SpiffeId::parse(foreign).unwrap(),
        ))
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("InvalidArgument") && refused.contains("trust domain"),
        "{refused}"
    );

    // No token, or a token nobody holds: refused before anything is read.
    for token in [None, Some("guessed")] {
        let refused = rt
            .block_on(identities::fetch(
                &identity_options(&server, security(&ca_pem, token), &out, KVS_ID),
                &SpiffeId::parse(KVS_ID).unwrap(),
            ))
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("Unauthenticated") && refused.contains("bootstrap token"),
            "{token:?}: {refused}"
        );
    }
    // Plaintext to the TLS port, and TLS trusting another CA, never get through.
    let plaintext = ChannelSecurity {
        tls: None,
        token: Some(token_of(KVS_NODE)),
    };
    assert!(rt
        .block_on(identities::fetch(
            &identity_options(&server, plaintext, &out, KVS_ID),
            &SpiffeId::parse(KVS_ID).unwrap(),
        ))
        .is_err());
    let stranger_dir = dir.0.join("stranger");
    Authority::init("mesh.test", &stranger_dir).unwrap();
    let refused = rt
        .block_on(identities::fetch(
            &identity_options(
                &server,
                security(&stranger_dir.join("ca.pem"), Some(&token_of(KVS_NODE))),
                &out,
                KVS_ID,
            ),
            &SpiffeId::parse(KVS_ID).unwrap(),
        ))
        .unwrap_err()
        .to_string();
    assert!(refused.contains("certificate"), "{refused}");

    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(stats.issued.load(Relaxed), 2);
    assert_eq!(stats.not_placed.load(Relaxed), 1);
    assert_eq!(stats.bad_request.load(Relaxed), 1);
    assert_eq!(stats.unauthenticated.load(Relaxed), 2);

    // The xDS stream over the same channel: served to a token holder over TLS; refused
    // without a token.
    let spawn = |security: ChannelSecurity, node: Recorder| {
        rt.block_on(async {
            Client::spawn(
                flatmesh_xds::client::Options {
                    server: server.clone(),
                    node_id: "r0-s0/nic0".into(),
                    node_cluster: "r0-s0/nic0".into(),
                    protocol: Protocol::Sotw,
                    security,
                    sds_dir: None,
                    load_reports: None,
                },
                flatmesh_xds::bootstrap::empty_config(),
                node,
            )
        })
    };
    let served_node = Recorder::default();
    let client = spawn(nic.clone(), served_node.clone());
    until(
        "the TLS xDS client to get a config",
        Duration::from_secs(30),
        || *served_node.0.lock() > 0,
    );
    let tokenless = Recorder::default();
    let refused_client = spawn(security(&ca_pem, None), tokenless.clone());
    until(
        "the tokenless client to be refused",
        Duration::from_secs(30),
        || {
            refused_client
                .status()
                .last_error
                .is_some_and(|e| e.contains("bootstrap token"))
        },
    );
    assert_eq!(
        *tokenless.0.lock(),
        0,
        "nothing reached a node without a token"
    );
    assert!(client.status().connected);

    rt.block_on(client.stop());
    rt.block_on(refused_client.stop());
    running.stop();
}

#[test]
fn after_a_root_rotation_new_certificates_come_from_the_new_root_with_both_roots_trusted() {
    let dir = Scratch::new("rotation");
    let (center, ca_dir) = control_center(&dir);
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    let ca_pem = ca_dir.join("ca.pem");
    let old_roots = flatmesh_identity::ca::load_certificates(&ca_pem).unwrap();
    let out = dir.0.join("identities");
    let nic = security(&ca_pem, Some(&token_of(KVS_NODE)));
    let options = identity_options(&server, nic, &out, KVS_ID);
    let id = SpiffeId::parse(KVS_ID).unwrap();
    rt.block_on(identities::fetch(&options, &id)).unwrap();

    // `flatmesh ca rotate` while the control center runs.
    let mut authority = Authority::load(&ca_dir).unwrap();
    authority.rotate(Some(&ca_dir)).unwrap();
    let new_root = authority.bundle()[0].clone();
    // The control center notices within a poll (1 s); the node, still trusting the old
    // root for the channel, renews and gets a leaf of the new root and both roots.
    let bundle_path = out.join(identities::BUNDLE_FILE);
    until(
        "a certificate of the new root",
        Duration::from_secs(30),
        || {
            rt.block_on(identities::fetch(&options, &id)).unwrap();
            let chain =
                flatmesh_identity::ca::load_certificates(&identities::files(&out, &id).0).unwrap();
            chain[1] == new_root
        },
    );
    let bundle = flatmesh_identity::ca::load_certificates(&bundle_path).unwrap();
    assert_eq!(bundle.len(), 2, "both roots are trusted during the overlap");
    assert_eq!(bundle[0], new_root);
    assert_eq!(bundle[1], old_roots[0]);

    running.stop();
}

// ---- SDS ---------------------------------------------------------------------------------------

/// A TCP echo server on a loopback port.
fn echo_server() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut reader = conn.try_clone().unwrap();
                let _ = std::io::copy(&mut reader, &mut conn);
            });
        }
    });
    addr
}

/// What the control center serves besides its state: a tcp listener on `port`, relaying to
/// `echo`, that presents `KVS_ID` and checks clients against `ROOTCA`, both by SDS over ADS
/// (Istio's shape: the certificate by SPIFFE ID, the roots in a combined validation context).
fn sds_listener(store: &flatmesh_xds::server::Store, port: u16, echo: std::net::SocketAddr) {
    sds_listener_as(store, port, echo, KVS_ID)
}

/// [`sds_listener`], presenting `id`.
fn sds_listener_as(
    store: &flatmesh_xds::server::Store,
    port: u16,
    echo: std::net::SocketAddr,
    id: &str,
) {
    use envoy_types_reexport::*;
    let text = format!(
        "listeners:\n  - name: mtls\n    address: 127.0.0.1:{port}\n    protocol: tcp\n    cluster: echo\n    tls: {{ cert: /unused.pem, key: /unused.key, client_ca: /unused-ca.pem, allow: [ \"spiffe://mesh.test/ns/shop/*\" ] }}\nclusters:\n  - {{ name: echo, endpoints: [ {echo} ] }}\n"
    );
    let config = flatmesh_config::parse(&text, "sds.yaml").unwrap();
    let mut extra = flatmesh_xds::from_model::resources(&config);
    let socket = extra.listeners.get_mut("mtls").unwrap().filter_chains[0]
        .transport_socket
        .as_mut()
        .unwrap();
    let Some(ConfigType::TypedConfig(any)) = &mut socket.config_type else {
        panic!("no typed_config")
    };
    let mut context = DownstreamTlsContext::decode(any.value.as_slice()).unwrap();
    let common = context.common_tls_context.as_mut().unwrap();
    let ads = || {
        Some(ConfigSource {
            config_source_specifier: Some(ConfigSourceSpecifier::Ads(Default::default())),
            ..Default::default()
        })
    };
    common.tls_certificates.clear();
    common.tls_certificate_sds_secret_configs = vec![SdsSecretConfig {
        name: id.into(),
        sds_config: ads(),
    }];
    let Some(ValidationContextType::ValidationContext(mut ids)) =
        common.validation_context_type.take()
    else {
        panic!("no validation context")
    };
    ids.trusted_ca = None;
    common.validation_context_type = Some(ValidationContextType::CombinedValidationContext(
        CombinedCertificateValidationContext {
            default_validation_context: Some(ids),
            validation_context_sds_secret_config: Some(SdsSecretConfig {
                name: flatmesh_xds::sds::ROOTCA.into(),
                sds_config: ads(),
            }),
            ..Default::default()
        },
    ));
    any.value = context.encode_to_vec();
    let mut all = store.resources();
    // Only this listener: every node is served it, and the state's `web` port is one per host.
    all.listeners = extra.listeners;
    all.clusters.extend(extra.clusters);
    all.endpoints.extend(extra.endpoints);
    store.publish(all);
}

/// The envoy-types pieces the SDS test writes (the control crate reaches them through xds).
mod envoy_types_reexport {
    pub use flatmesh_xds::sds::envoy::{
        common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
        config_source::ConfigSourceSpecifier,
        transport_socket::ConfigType,
        ConfigSource, DownstreamTlsContext, Message, SdsSecretConfig,
    };
}

/// A TLS client of the node's mTLS listener, presenting `front`'s certificate and accepting only
/// a server that presents `KVS_ID`; returns the stream and the server's leaf.
fn connect_mtls(
    port: u16,
    client: &flatmesh_identity::Svid,
    bundle: &TrustBundle,
) -> (
    rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
    Vec<u8>,
) {
    connect_mtls_to(port, client, bundle, KVS_ID)
}

/// [`connect_mtls`] to a server that presents `server_id`.
fn connect_mtls_to(
    port: u16,
    client: &flatmesh_identity::Svid,
    bundle: &TrustBundle,
    server_id: &str,
) -> (
    rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
    Vec<u8>,
) {
    use std::io::Write as _;
    let config = flatmesh_identity::tls::client_config(
        Some(client),
        bundle,
        vec![IdPattern::parse(server_id).unwrap()],
        &[],
    )
    .unwrap();
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let name = rustls::pki_types::ServerName::try_from("kvs.mesh.test").unwrap();
    let mut tls =
        rustls::StreamOwned::new(rustls::ClientConnection::new(config, name).unwrap(), tcp);
    tls.write_all(b"hello").unwrap(); // drives the handshake
    let peer = flatmesh_identity::tls::peer_identity(&tls.conn).unwrap();
    assert_eq!(
        peer.as_str(),
        server_id,
        "the listener presents the SDS certificate"
    );
    let leaf = tls.conn.peer_certificates().unwrap()[0].to_vec();
    echo(&mut tls, b"hello");
    (tls, leaf)
}

/// Reads back `sent` (already written) from an echoing stream.
fn echo(stream: &mut impl std::io::Read, sent: &[u8]) {
    let mut back = vec![0u8; sent.len()];
    stream.read_exact(&mut back).unwrap();
    assert_eq!(back, sent);
}

#[test]
fn sds_gives_a_node_its_placed_identity_refuses_another_and_rotates_without_a_drop() {
    use std::io::Write as _;
    let dir = Scratch::new("sds");
    let (center, ca_dir) = control_center(&dir);
    let stats = center.ca_stats().unwrap();
    let store = center.feed().store().clone();
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    until("the placement's endpoints", Duration::from_secs(10), || {
        store.resources().endpoints.contains_key("shop/kvs")
    });
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    sds_listener(&store, port, echo_server());
    let ca_pem = ca_dir.join("ca.pem");
    let node = |id: &str, sds: &Path| {
        let mut base = flatmesh_xds::bootstrap::empty_config();
        base.admin = "127.0.0.1:0".parse().unwrap();
        base.workers = Some(1);
        let (apply, _node) = flatmesh_xds::apply::StartThenReload::new(
            |config| {
                flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline)
                    .map_err(|e| e.to_string())
            },
            |node: &flatmesh_proxy::Node, config| node.reload(config).map_err(|e| e.to_string()),
        );
        rt.block_on(async {
            Client::spawn(
                flatmesh_xds::client::Options {
                    server: server.clone(),
                    node_id: id.into(),
                    node_cluster: id.into(),
                    protocol: Protocol::Sotw,
                    security: security(&ca_pem, Some(&token_of(id))),
                    sds_dir: Some(sds.to_path_buf()),
                    load_reports: None,
                },
                base,
                apply,
            )
        })
    };
    // The node KVS is placed on gets its certificate and the roots, and its listener serves.
    let kvs = node(KVS_NODE, &dir.0.join("sds-nic0"));
    let authority = Authority::load(&ca_dir).unwrap();
    let front = authority
        .issue(
            &SpiffeId::parse(FRONT_ID).unwrap(),
            Duration::from_secs(3600),
        )
        .unwrap();
    let front =
        flatmesh_identity::Svid::from_pem(&front.chain_pem, front.key_pem.as_deref().unwrap())
            .unwrap();
    let bundle = TrustBundle::load(&ca_pem).unwrap();
    until(
        "the listener with its SDS certificate",
        Duration::from_secs(20),
        || {
            kvs.status().waiting_secrets.is_empty()
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        },
    );
    let (mut open, first_leaf) = connect_mtls(port, &front, &bundle);
    assert_eq!(
        stats.not_placed.load(std::sync::atomic::Ordering::Relaxed),
        0
    );

    // Another node is served the same listener but is refused KVS's identity: it waits for the
    // secret (so it does not serve the listener at all), and the refusal is counted.
    let host_dir = dir.0.join("sds-host");
    let host = node("r0-s1/host", &host_dir);
    until("the refusal", Duration::from_secs(20), || {
        host.status().waiting_secrets.contains_key(KVS_ID)
            && stats.not_placed.load(std::sync::atomic::Ordering::Relaxed) >= 1
    });
    let keys = std::fs::read_dir(&host_dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.path().extension().is_some_and(|x| x == "key"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(keys, 0, "no key of another node's identity is written");

    // `flatmesh ca rotate`: a new certificate (from the new root) and the new bundle are pushed;
    // new connections present it while the open one carries on.
    let mut rotating = Authority::load(&ca_dir).unwrap();
    rotating.rotate(Some(&ca_dir)).unwrap();
    let new_root = rotating.bundle()[0].to_vec();
    let both = TrustBundle::load(&ca_pem).unwrap();
    until(
        "a new certificate on new connections",
        Duration::from_secs(30),
        || {
            let (_, leaf) = connect_mtls(port, &front, &both);
            leaf != first_leaf
        },
    );
    let (_, leaf) = connect_mtls(port, &front, &both);
    let chain = kvs_chain(&dir.0.join("sds-nic0"));
    assert_eq!(
        chain[0].to_vec(),
        leaf,
        "the file holds what the listener presents"
    );
    assert_eq!(
        chain.last().unwrap().to_vec(),
        new_root,
        "signed by the new root"
    );
    open.write_all(b"still here").unwrap();
    echo(&mut open, b"still here");

    rt.block_on(async {
        kvs.stop().await;
        host.stop().await;
    });
    running.stop();
}

/// `flatmesh ca revoke`: the control center serves the CA's new CRL with the trust bundle over
/// SDS, and the node's listener refuses the revoked client from then on while another client
/// carries on; a broken `crl.pem` is refused and the last good list stays in force.
#[test]
fn sds_serves_the_crl_and_the_node_refuses_a_revoked_client() {
    let dir = Scratch::new("sds-crl");
    let (center, ca_dir) = control_center(&dir);
    let store = center.feed().store().clone();
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    until("the placement's endpoints", Duration::from_secs(10), || {
        store.resources().endpoints.contains_key("shop/kvs")
    });
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    sds_listener(&store, port, echo_server());
    let ca_pem = ca_dir.join("ca.pem");
    let sds_dir = dir.0.join("sds-crl-nic0");
    let mut base = flatmesh_xds::bootstrap::empty_config();
    base.admin = "127.0.0.1:0".parse().unwrap();
    base.workers = Some(1);
    let (apply, _node) = flatmesh_xds::apply::StartThenReload::new(
        |config| {
            flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline)
                .map_err(|e| e.to_string())
        },
        |node: &flatmesh_proxy::Node, config| node.reload(config).map_err(|e| e.to_string()),
    );
    let kvs = rt.block_on(async {
        Client::spawn(
            flatmesh_xds::client::Options {
                server: server.clone(),
                node_id: KVS_NODE.into(),
                node_cluster: KVS_NODE.into(),
                protocol: Protocol::Delta,
                security: security(&ca_pem, Some(&token_of(KVS_NODE))),
                sds_dir: Some(sds_dir.clone()),
                load_reports: None,
            },
            base,
            apply,
        )
    });
    let authority = Authority::load(&ca_dir).unwrap();
    let issue = |id: &str| {
        let issued = authority
            .issue(&SpiffeId::parse(id).unwrap(), Duration::from_secs(3600))
            .unwrap();
        let svid = flatmesh_identity::Svid::from_pem(
            &issued.chain_pem,
            issued.key_pem.as_deref().unwrap(),
        )
        .unwrap();
        (svid, issued)
    };
    let (front, front_issued) = issue(FRONT_ID);
    let (other, _) = issue("spiffe://mesh.test/ns/shop/sa/cart");
    let bundle = TrustBundle::load(&ca_pem).unwrap();
    until(
        "the listener with its SDS certificate",
        Duration::from_secs(20),
        || {
            kvs.status().waiting_secrets.is_empty()
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        },
    );
    let _ = connect_mtls(port, &front, &bundle);
    // Refused: the handshake fails or the connection is closed before the echo comes back.
    let refused = |client: &flatmesh_identity::Svid| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            connect_mtls(port, client, &bundle);
        }))
        .is_err()
    };

    // `flatmesh ca revoke --dir DIR SERIAL` writes DIR/crl.pem; the control center serves it.
    use rustls::pki_types::pem::PemObject as _;
    let leaf = rustls::pki_types::CertificateDer::from_pem_slice(front_issued.chain_pem.as_bytes())
        .unwrap();
    let (serial, _) = flatmesh_identity::crl::serial_of(leaf.as_ref()).unwrap();
    authority.revoke(&ca_dir, &[serial]).unwrap();
    until(
        "the revoked client is refused",
        Duration::from_secs(30),
        || refused(&front),
    );
    assert!(!refused(&other), "another client of the same CA carries on");
    let crl_files = std::fs::read_dir(&sds_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".crl.pem"))
        .count();
    assert_eq!(crl_files, 1, "the node wrote the CRL that came with ROOTCA");

    // A broken crl.pem is refused: the last good list stays served and in force.
    std::fs::write(
        ca_dir.join("crl.pem"),
        "-----BEGIN X509 CRL-----
AAAA
-----END X509 CRL-----
",
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(refused(&front), "the revoked client stays refused");
    assert!(!refused(&other));

    rt.block_on(async { kvs.stop().await });
    running.stop();
}

/// Real Envoy 1.40, found and run as the xDS crate's interop tests do.
#[allow(dead_code, clippy::unwrap_used)]
#[path = "../../xds/tests/common/envoy.rs"]
mod envoy;

/// Where `envoy` looks for bench/.venv.
fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A real Envoy whose ADS cluster is TLS to `flatmesh control --ca-dir` (verifying the control
/// center's SPIFFE ID) with the node's bootstrap token as gRPC `initial_metadata`, as a flatmesh
/// node sends it, takes its listener's certificate (by SPIFFE ID) and the trust bundle
/// (`ROOTCA`) over SDS, and serves mutual TLS with them.
#[test]
fn envoy_takes_its_certificate_and_roots_from_flatmesh_control_over_sds() {
    const ENVOY_NODE: &str = "r0-s0/host"; // granted FRONT_ID in the tokens file
    let dir = Scratch::new("sds-envoy");
    let (center, ca_dir) = control_center(&dir);
    let store = center.feed().store().clone();
    let running = Running::start(center);
    until("the placement's endpoints", Duration::from_secs(10), || {
        store.resources().endpoints.contains_key("shop/kvs")
    });
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    sds_listener_as(&store, port, echo_server(), FRONT_ID);
    let control: std::net::SocketAddr = running.server.parse().unwrap();
    let ca_pem = ca_dir.join("ca.pem");
    let bootstrap = format!(
        r#"
node: {{ id: "{ENVOY_NODE}", cluster: envoy }}
dynamic_resources:
  ads_config:
    api_type: GRPC
    transport_api_version: V3
    grpc_services:
    - envoy_grpc: {{ cluster_name: flatmesh-control }}
      initial_metadata: [ {{ key: authorization, value: "Bearer {token}" }} ]
  lds_config: {{ ads: {{}}, resource_api_version: V3 }}
  cds_config: {{ ads: {{}}, resource_api_version: V3 }}
static_resources:
  clusters:
  - name: flatmesh-control
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: flatmesh-control
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port_value} }} }} }} }} ] }} ]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: [ h2 ]
          validation_context:
            trusted_ca: {{ filename: {ca} }}
            match_typed_subject_alt_names: [ {{ san_type: URI, matcher: {{ exact: "spiffe://mesh.test/flatmesh/control" }} }} ]
"#,
        token = token_of(ENVOY_NODE),
        ip = control.ip(),
        port_value = control.port(),
        ca = ca_pem.display(),
    );
    let path = dir.0.join("envoy-sds.yaml");
    std::fs::write(&path, &bootstrap).unwrap();
    if let Err(why) = envoy::validate(&path) {
        panic!(
            "Envoy refuses the bootstrap:
{why}"
        );
    }
    let _envoy = envoy::run(&dir.0, "envoy-sds", &bootstrap);
    let authority = Authority::load(&ca_dir).unwrap();
    let client = authority
        .issue(
            &SpiffeId::parse("spiffe://mesh.test/ns/shop/sa/cart").unwrap(),
            Duration::from_secs(3600),
        )
        .unwrap();
    let client =
        flatmesh_identity::Svid::from_pem(&client.chain_pem, client.key_pem.as_deref().unwrap())
            .unwrap();
    let bundle = TrustBundle::load(&ca_pem).unwrap();
    until(
        "Envoy serving mutual TLS with its SDS certificate",
        Duration::from_secs(30),
        || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                connect_mtls_to(port, &client, &bundle, FRONT_ID);
            }))
            .is_ok()
        },
    );
    // One more, checked in full: Envoy presents FRONT_ID from the control center's CA, verifies
    // the client against ROOTCA, and relays the bytes.
    let (mut tls, _) = connect_mtls_to(port, &client, &bundle, FRONT_ID);
    use std::io::Write as _;
    tls.write_all(b"through envoy").unwrap();
    echo(&mut tls, b"through envoy");
    assert!(
        store.nacks().is_empty(),
        "Envoy refused what it was served: {:?}",
        store.nacks()
    );
    running.stop();
}

/// The certificate chain the node wrote for `KVS_ID` in `dir`.
fn kvs_chain(dir: &Path) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    let file = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            name.starts_with("spiffe___mesh.test_ns_shop_sa_kvs") && name.ends_with(".pem")
        })
        .unwrap();
    flatmesh_identity::ca::load_certificates(&file).unwrap()
}

/// `flatmesh ca token --revoke`: the running control center re-reads the tokens file, refuses
/// the node's next CSR and xDS stream with UNAUTHENTICATED "token revoked", and ends the xDS
/// stream the node had open; other nodes carry on.
#[test]
fn a_revoked_token_is_refused_and_its_open_stream_is_ended() {
    let dir = Scratch::new("revoked-token");
    let (center, ca_dir) = control_center(&dir);
    let stats = center.ca_stats().unwrap();
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    let ca_pem = ca_dir.join("ca.pem");
    let out = dir.0.join("identities");
    let nic = security(&ca_pem, Some(&token_of(KVS_NODE)));
    let fetch = |security: &ChannelSecurity, id: &str| {
        rt.block_on(identities::fetch(
            &identity_options(&server, security.clone(), &out, id),
            &SpiffeId::parse(id).unwrap(),
        ))
    };
    fetch(&nic, KVS_ID).unwrap();
    let served = Recorder::default();
    let client = rt.block_on(async {
        Client::spawn(
            flatmesh_xds::client::Options {
                server: server.clone(),
                node_id: KVS_NODE.into(),
                node_cluster: KVS_NODE.into(),
                protocol: Protocol::Sotw,
                security: nic.clone(),
                sds_dir: None,
                load_reports: None,
            },
            flatmesh_xds::bootstrap::empty_config(),
            served.clone(),
        )
    });
    until(
        "the xDS client to get a config",
        Duration::from_secs(30),
        || *served.0.lock() > 0 && client.status().connected,
    );

    let tokens = dir.0.join("node-tokens.yaml");
    assert!(flatmesh_control::serve::ca::revoke_token(&tokens, KVS_NODE).unwrap());
    assert!(
        !flatmesh_control::serve::ca::revoke_token(&tokens, KVS_NODE).unwrap(),
        "revoking twice changes nothing"
    );
    use std::sync::atomic::Ordering::Relaxed;
    until(
        "the open stream to be ended",
        Duration::from_secs(30),
        || {
            stats.streams_cut.load(Relaxed) >= 1
                && client
                    .status()
                    .last_error
                    .is_some_and(|e| e.contains("token revoked"))
        },
    );
    let refused = fetch(&nic, KVS_ID).unwrap_err().to_string();
    assert!(
        refused.contains("Unauthenticated") && refused.contains("token revoked"),
        "{refused}"
    );
    assert!(stats.revoked.load(Relaxed) >= 1);
    // Another node's token still works.
    let host = security(&ca_pem, Some(&token_of("r0-s0/host")));
    fetch(&host, FRONT_ID).unwrap();
    // A revoked tokens file entry that is unknown says what the file names.
    let e = flatmesh_control::serve::ca::revoke_token(&tokens, "nobody")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no node `nobody`") && e.contains("r0-s0/host"),
        "{e}"
    );

    rt.block_on(client.stop());
    running.stop();
}

/// A node's own identity (`spiffe://TD/ns/flatmesh-system/sa/node/NODE_ID`) is issued to that
/// node's token alone, with no grant in the tokens file: another node asking for it is refused.
#[test]
fn only_its_own_node_gets_a_node_identity() {
    let dir = Scratch::new("node-identity");
    let (center, ca_dir) = control_center(&dir);
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    let ca_pem = ca_dir.join("ca.pem");
    let out = dir.0.join("identities");
    let nic_id = SpiffeId::node("mesh.test", KVS_NODE).unwrap();
    assert_eq!(
        nic_id.as_str(),
        "spiffe://mesh.test/ns/flatmesh-system/sa/node/r0-s0/nic0"
    );
    let fetch = |token: &str, id: &SpiffeId| {
        rt.block_on(identities::fetch(
            &identity_options(
                &server,
                security(&ca_pem, Some(&token_of(token))),
                &out,
                id.as_str(),
            ),
            id,
        ))
    };
    let held = fetch(KVS_NODE, &nic_id).unwrap();
    assert_eq!(held.id, nic_id);
    let (cert, key) = identities::files(&out, &nic_id);
    assert!(cert.ends_with("ns.flatmesh-system.sa.node.r0-s0.nic0.pem"));
    assert_eq!(
        flatmesh_identity::Svid::load(&cert, &key).unwrap().id,
        nic_id
    );
    let refused = fetch("r0-s0/host", &nic_id).unwrap_err().to_string();
    assert!(
        refused.contains("PermissionDenied")
            && refused.contains("not an identity placed on node `r0-s0/host`"),
        "{refused}"
    );
    // And its own is there for the host too.
    fetch(
        "r0-s0/host",
        &SpiffeId::node("mesh.test", "r0-s0/host").unwrap(),
    )
    .unwrap();
    running.stop();
}

/// One scrape of `GET /metrics`, over plain HTTP/1.1.
fn scrape(at: std::net::SocketAddr) -> String {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(at).unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: control\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    text
}

/// The value of the sample `name` (with its labels, as written) in a scrape.
fn sample(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
}

/// `flatmesh control --metrics`: the counters move with what the control center does.
#[test]
fn the_control_center_serves_its_metrics_over_http() {
    let dir = Scratch::new("metrics");
    let (center, ca_dir) = control_center(&dir);
    let at = center.metrics_addr().unwrap();
    let ui = center.ui_addr().unwrap();
    let running = Running::start(center);
    let (rt, server) = (&running.rt, running.server.clone());
    let ca_pem = ca_dir.join("ca.pem");
    let out = dir.0.join("identities");
    let before = scrape(at);
    assert_eq!(sample(&before, "flatmesh_control_ca_issued_total"), 0);
    assert_eq!(sample(&before, "flatmesh_control_xds_connected_streams"), 0);
    assert_eq!(sample(&before, "flatmesh_control_placed_instances"), 1);
    let root = sample(
        &before,
        "flatmesh_control_certificate_expiry_timestamp_seconds{certificate=\"root\"}",
    );
    let control = sample(
        &before,
        "flatmesh_control_certificate_expiry_timestamp_seconds{certificate=\"control\"}",
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        control > now && control <= now + 24 * 3600 + 60,
        "{control}"
    );
    assert!(root > now + 9 * 365 * 24 * 3600, "{root}");
    // The web console lists the same two certificates.
    until(
        "the console lists the certificates",
        Duration::from_secs(10),
        || {
            console_state(ui)["certificates"]
                .as_array()
                .is_some_and(|c| c.len() == 2)
        },
    );
    let certificates = console_state(ui)["certificates"].clone();
    assert_eq!(certificates[0]["name"], "signing root");
    assert_eq!(certificates[0]["expires_unix"], root);
    assert_eq!(certificates[1]["expires_unix"], control);

    let nic = security(&ca_pem, Some(&token_of(KVS_NODE)));
    let fetch = |security: ChannelSecurity, id: &str| {
        rt.block_on(identities::fetch(
            &identity_options(&server, security, &out, id),
            &SpiffeId::parse(id).unwrap(),
        ))
    };
    fetch(nic.clone(), KVS_ID).unwrap();
    fetch(security(&ca_pem, Some(&token_of("r0-s0/host"))), KVS_ID).unwrap_err();
    fetch(security(&ca_pem, Some("guessed")), KVS_ID).unwrap_err();
    let served = Recorder::default();
    let client = rt.block_on(async {
        Client::spawn(
            flatmesh_xds::client::Options {
                server: server.clone(),
                node_id: KVS_NODE.into(),
                node_cluster: KVS_NODE.into(),
                protocol: Protocol::Sotw,
                security: nic,
                sds_dir: None,
                load_reports: None,
            },
            flatmesh_xds::bootstrap::empty_config(),
            served.clone(),
        )
    });
    until(
        "the node to ACK its config",
        Duration::from_secs(30),
        || {
            let text = scrape(at);
            sample(&text, "flatmesh_control_xds_acks_total") > 0
                && sample(&text, "flatmesh_control_xds_connected_streams") == 1
        },
    );
    let after = scrape(at);
    assert_eq!(sample(&after, "flatmesh_control_ca_issued_total"), 1);
    for (reason, count) in [
        ("not_placed", 1),
        ("unauthenticated", 1),
        ("bad_request", 0),
    ] {
        assert_eq!(
            sample(
                &after,
                &format!("flatmesh_control_ca_refusals_total{{reason=\"{reason}\"}}")
            ),
            count,
            "{reason}"
        );
    }
    assert!(sample(&after, "flatmesh_control_xds_pushes_total") > 0);
    assert_eq!(sample(&after, "flatmesh_control_xds_nacks_total"), 0);
    rt.block_on(client.stop());
    until("the stream to close", Duration::from_secs(30), || {
        sample(&scrape(at), "flatmesh_control_xds_connected_streams") == 0
    });
    running.stop();
}
