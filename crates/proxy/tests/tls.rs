//! TLS on listeners and clusters, with real handshakes over loopback: who is admitted, who is
//! refused and under which reason, that a refused or stalled client leaves its neighbours
//! alone, and that clusters originate mutual TLS to endpoints whose SPIFFE ID they check
//! (HTTP/1.1, HTTP/2 and the L4 relay).

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::backends::{HttpBackend, Proto};
use common::*;
use flatmesh_identity::tls::{self, ClientAuth};
use flatmesh_identity::{Authority, SpiffeId, Svid};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::pki::*;

fn mtls_listener_config(
    pki: &Pki,
    admin: SocketAddr,
    listen: SocketAddr,
    backend: SocketAddr,
) -> String {
    let node = pki.issue("node", NODE);
    let ca = pki.ca_file();
    format!(
        r#"
admin: {admin}
workers: 2
limits: {{ header_read_timeout: 1s }}
listeners:
  - name: web
    address: {listen}
    protocol: http
    tls: {{ cert: {node}.pem, key: {node}.key, client_ca: {ca}, allow: [ {WEB}, "{TD}/ns/ops/*" ] }}
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - name: app
    endpoints: [ {backend} ]
"#
    )
}

/// The node of the listener tests: listener `web` terminates mTLS (allow: web, ops/*) in front
/// of an HTTP/1.1 backend.
struct MtlsWeb {
    pki: Pki,
    backend: HttpBackend,
    listen: SocketAddr,
    node: TestNode,
}

impl MtlsWeb {
    async fn start() -> MtlsWeb {
        let pki = Pki::new();
        let backend = HttpBackend::start("app", Proto::H1).await;
        let (admin, listen) = (free_addr(), free_addr());
        let node = TestNode::start(&mtls_listener_config(&pki, admin, listen, backend.addr));
        MtlsWeb {
            pki,
            backend,
            listen,
            node,
        }
    }
}

async fn metric(node: &TestNode, name: &str, labels: &[&str]) -> f64 {
    metric_samples(&node.metrics().await, name, labels)
        .iter()
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mtls_listener_admits_the_allowed_ids_over_http1_and_http2() {
    let MtlsWeb {
        pki,
        backend,
        listen,
        node,
    } = MtlsWeb::start().await;
    let bundle = pki.bundle();
    let web = pki.svid(WEB);
    let ops = pki.svid("spiffe://td/ns/ops/sa/oncall");

    // HTTP/1.1, chosen by ALPN, for an exact ID.
    let mut h1 = tls_connect(
        listen,
        client_config(&bundle, Some(&web), NODE, tls::ALPN_HTTP11),
    )
    .await
    .unwrap();
    assert_eq!(h1.get_ref().1.alpn_protocol(), Some(tls::ALPN_HTTP11));
    let (status, body) = h1_get(&mut h1, "/a").await.unwrap();
    assert_eq!(status, 200, "{body}");
    // The same connection carries a second request (keep-alive inside TLS).
    assert_eq!(h1_get(&mut h1, "/b").await.unwrap().0, 200);

    // HTTP/2, chosen by ALPN, for an ID under a `/*` pattern.
    let h2 = tls_connect(
        listen,
        client_config(&bundle, Some(&ops), NODE, tls::ALPN_H2),
    )
    .await
    .unwrap();
    assert_eq!(h2.get_ref().1.alpn_protocol(), Some(tls::ALPN_H2));
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(h2),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    for path in ["/c", "/d"] {
        let req = http::Request::get(format!("https://t.local{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let _ = resp.into_body().collect().await.unwrap();
    }
    assert_eq!(backend.hits(), 4);
    assert_eq!(
        metric(
            &node,
            "flatmesh_tls_handshakes_total",
            &["listener=\"web\""]
        )
        .await,
        2.0
    );
    // The certificate the listener presents, and when it expires (issued for an hour).
    let expiry = metric(
        &node,
        "flatmesh_tls_certificate_expiry_timestamp_seconds",
        &["listener=\"web\"", &format!("identity=\"{NODE}\"")],
    )
    .await;
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (now + 3000.0..now + 3700.0).contains(&expiry),
        "expiry {expiry}, now {now}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_stalled_clients_are_counted_by_reason_and_neighbours_do_not_notice() {
    let MtlsWeb {
        pki,
        backend,
        listen,
        node,
    } = MtlsWeb::start().await;
    let bundle = pki.bundle();

    // A neighbour with a request in the middle of its life on a kept-alive connection.
    let web = pki.svid(WEB);
    let mut neighbour = tls_connect(
        listen,
        client_config(&bundle, Some(&web), NODE, tls::ALPN_HTTP11),
    )
    .await
    .unwrap();
    assert_eq!(h1_get(&mut neighbour, "/before").await.unwrap().0, 200);
    // And one stalled in its handshake: connected, silent.
    let mut stalled = TcpStream::connect(listen).await.unwrap();

    // Each refusal: the client learns nothing useful, the node counts a reason.
    let refuse = |me: Option<Svid>| {
        let config = client_config(&bundle, me.as_ref(), NODE, tls::ALPN_HTTP11);
        async move {
            match tls_connect(listen, config).await {
                Err(_) => {}
                Ok(mut s) => {
                    let got =
                        tokio::time::timeout(Duration::from_secs(5), h1_get(&mut s, "/x")).await;
                    assert!(
                        !matches!(got, Ok(Ok((200, _)))),
                        "a refused client got an answer"
                    );
                }
            }
        }
    };
    refuse(None).await; // no certificate
    refuse(Some(pki.svid(CART))).await; // in the trust domain, not in the allow-list
    let stranger = Authority::generate("td").unwrap();
    refuse(Some(svid_of(&stranger, WEB))).await; // the right ID from a CA nobody trusts
    let expired = pki
        .ca
        .issue_valid_between(
            &SpiffeId::parse(WEB).unwrap(),
            SystemTime::now() - Duration::from_secs(7200),
            SystemTime::now() - Duration::from_secs(3600),
        )
        .unwrap();
    refuse(Some(
        Svid::from_pem(&expired.chain_pem, expired.key_pem.as_deref().unwrap()).unwrap(),
    ))
    .await;
    // Plaintext HTTP to the TLS port.
    let mut plain = TcpStream::connect(listen).await.unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut sink)).await;
    assert!(!String::from_utf8_lossy(&sink).contains("200"));

    // The stalled handshake is cut at the header read timeout (1 s).
    let mut byte = [0u8; 1];
    let cut = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut byte)).await;
    assert!(
        matches!(cut, Ok(Ok(0)) | Ok(Err(_))),
        "the stalled handshake was not closed: {cut:?}"
    );

    // The neighbour noticed nothing.
    assert_eq!(h1_get(&mut neighbour, "/after").await.unwrap().0, 200);

    let reasons = [
        "no_client_certificate",
        "not_allowed",
        "unknown_ca",
        "expired",
        "not_tls",
        "timeout",
    ];
    // A refusal is counted when the node's side of the handshake ends, which may be just
    // after the client saw it: wait (bounded) for every count to arrive.
    let count = |text: &str, reason: &str| -> f64 {
        metric_samples(
            text,
            "flatmesh_tls_handshake_failures_total",
            &["listener=\"web\"", &format!("reason=\"{reason}\"")],
        )
        .iter()
        .map(|(_, v)| v)
        .sum()
    };
    eventually(Duration::from_secs(10), || async {
        let text = node.metrics().await;
        reasons.iter().all(|r| count(&text, r) >= 1.0)
    })
    .await;
    let text = node.metrics().await;
    for reason in reasons {
        assert_eq!(count(&text, reason), 1.0, "reason {reason}:\n{text}");
    }
    assert_eq!(
        backend.hits(),
        2,
        "only the neighbour's requests reached the backend"
    );
}

/// A listener's `crl` is read at every reload: after `flatmesh ca revoke` rewrote it, the
/// revoked client's next connection is refused (reason `revoked`), the connection it already
/// had carries on, and a certificate issued afresh for the same identity passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_crl_refuses_the_next_connection_and_spares_the_open_one() {
    let pki = Pki::new();
    let backend = HttpBackend::start("app", Proto::H1).await;
    let (admin, listen) = (free_addr(), free_addr());
    // An empty list to begin with.
    let crl = pki.ca.revoke(&pki.dir.path, &[]).unwrap().path;
    let config = mtls_listener_config(&pki, admin, listen, backend.addr)
        .replace("allow: [", &format!("crl: {}, allow: [", crl.display()));
    assert!(config.contains("crl: "));
    let node = TestNode::start(&config);
    let bundle = pki.bundle();
    let stolen = pki.svid(WEB);
    let connect = |me: Svid| {
        tls_connect(
            listen,
            client_config(&bundle, Some(&me), NODE, tls::ALPN_HTTP11),
        )
    };
    let mut open = connect(stolen.clone()).await.unwrap();
    assert_eq!(h1_get(&mut open, "/before").await.unwrap().0, 200);

    let (_, serial) = pki.ca.issued_by_signer(&stolen.chain[0]).unwrap();
    pki.ca.revoke(&pki.dir.path, &[serial]).unwrap();
    let (status, body) = node.reload().await;
    assert_eq!(status, 200, "{body}");

    match connect(stolen.clone()).await {
        Err(_) => {}
        Ok(mut s) => {
            let got = tokio::time::timeout(Duration::from_secs(5), h1_get(&mut s, "/x")).await;
            assert!(
                !matches!(got, Ok(Ok((200, _)))),
                "a revoked client got an answer"
            );
        }
    }
    let revoked = || async {
        metric(
            &node,
            "flatmesh_tls_handshake_failures_total",
            &["listener=\"web\"", "reason=\"revoked\""],
        )
        .await
    };
    // Counted when the node's side of the handshake ends (bounded wait, as above).
    eventually(Duration::from_secs(10), || async { revoked().await >= 1.0 }).await;
    assert_eq!(revoked().await, 1.0);
    // The connection made before the revocation was not cut.
    assert_eq!(h1_get(&mut open, "/after").await.unwrap().0, 200);
    // The same identity, reissued, is admitted.
    let mut fresh = connect(pki.svid(WEB)).await.unwrap();
    assert_eq!(h1_get(&mut fresh, "/fresh").await.unwrap().0, 200);
    assert_eq!(backend.hits(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_certificate_chain_is_refused_and_costs_the_node_nothing_lasting() {
    let MtlsWeb {
        pki,
        backend: _backend,
        listen,
        node,
    } = MtlsWeb::start().await;
    // The right identity, padded with 1 MiB of extra chain certificates.
    let mut huge = pki.svid(WEB);
    let root = pki.ca.bundle()[0].clone();
    while huge.chain.iter().map(|c| c.len()).sum::<usize>() < 1 << 20 {
        huge.chain.push(root.clone());
    }
    let refused = tls_connect(
        listen,
        client_config(&pki.bundle(), Some(&huge), NODE, tls::ALPN_HTTP11),
    )
    .await;
    if let Ok(mut s) = refused {
        let got = tokio::time::timeout(Duration::from_secs(5), h1_get(&mut s, "/x")).await;
        assert!(
            !matches!(got, Ok(Ok((200, _)))),
            "a 1 MiB chain was accepted"
        );
    }
    // The next caller is served as usual.
    let mut next = tls_connect(
        listen,
        client_config(&pki.bundle(), Some(&pki.svid(WEB)), NODE, tls::ALPN_HTTP11),
    )
    .await
    .unwrap();
    assert_eq!(h1_get(&mut next, "/after").await.unwrap().0, 200);
    let text = node.metrics().await;
    let failures: Vec<_> = metric_samples(
        &text,
        "flatmesh_tls_handshake_failures_total",
        &["listener=\"web\""],
    );
    assert_eq!(failures.len(), 1, "{text}");
    assert!(
        failures[0].0.contains("reason=\"malformed\""),
        "{failures:?}"
    );
}

/// A TLS endpoint: requires a client certificate the `allow` list admits, presents `id`, and
/// answers HTTP (both codecs, by ALPN) or echoes bytes (`http: false`). The echo speaks an
/// ALPN of its own, so a client that offers an HTTP one fails the handshake
/// (`no_application_protocol`): a tcp relay must offer none, the bytes are its client's.
async fn tls_endpoint(pki: &Pki, id: &str, allow: &[&str], http: bool) -> SocketAddr {
    let config = tls::server_config(
        &pki.svid(id),
        Some(ClientAuth {
            bundle: pki.bundle(),
            allow: patterns(allow),
        }),
        if http {
            &[tls::ALPN_H2, tls::ALPN_HTTP11]
        } else {
            &[b"flatmesh-test-echo"]
        },
    )
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let peer = tls::peer_identity(stream.get_ref().1)
                    .map(|p| p.to_string())
                    .unwrap_or_default();
                if !http {
                    let (mut r, mut w) = tokio::io::split(stream);
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                    return;
                }
                let _ = &mut stream;
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let body = format!("{:?} from {peer}", req.version());
                        async move {
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                Bytes::from(body),
                            )))
                        }
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_clusters_originate_mutual_tls_and_check_the_endpoint_id() {
    let pki = Pki::new();
    let node_id = pki.issue("node", NODE);
    let ca = pki.ca_file();
    let good = tls_endpoint(&pki, CART, &[NODE], true).await;
    let impostor = tls_endpoint(&pki, DB, &[NODE], true).await;
    let (admin, listen) = (free_addr(), free_addr());
    let cluster = |name: &str, protocol: &str, endpoint: SocketAddr| {
        format!(
            "  - {{ name: {name}, protocol: {protocol}, endpoints: [ {endpoint} ], tls: {{ ca: {ca}, cert: {node_id}.pem, key: {node_id}.key, server_ids: [ {CART} ] }} }}\n"
        )
    };
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {listen}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /h1 }} }}
        cluster: cart1
      - match: {{ path: {{ prefix: /h2 }} }}
        cluster: cart2
      - match: {{ path: {{ prefix: /impostor }} }}
        cluster: impostor
clusters:
{}{}{}"#,
        cluster("cart1", "http1", good),
        cluster("cart2", "http2", good),
        cluster("impostor", "http1", impostor),
    );
    let node = TestNode::start(&yaml);
    let client = h1_client();
    for _ in 0..3 {
        let r = get(&client, &format!("http://{listen}/h1"), &[]).await;
        assert_eq!(
            (r.status.as_u16(), r.body.as_str()),
            (200, &*format!("HTTP/1.1 from {NODE}"))
        );
        let r = get(&client, &format!("http://{listen}/h2"), &[]).await;
        assert_eq!(
            (r.status.as_u16(), r.body.as_str()),
            (200, &*format!("HTTP/2.0 from {NODE}"))
        );
    }
    // An endpoint with another identity: refused by the node, the caller gets a 503.
    let r = get(&client, &format!("http://{listen}/impostor"), &[]).await;
    assert_eq!(r.status.as_u16(), 503, "{}", r.body);
    let text = node.metrics().await;
    let count = |name: &str, labels: &[&str]| -> f64 {
        metric_samples(&text, name, labels)
            .iter()
            .map(|(_, v)| v)
            .sum()
    };
    // Keep-alive inside TLS: one handshake per cluster, however many requests.
    assert_eq!(
        count(
            "flatmesh_upstream_tls_handshakes_total",
            &["cluster=\"cart1\""]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        count(
            "flatmesh_upstream_tls_handshakes_total",
            &["cluster=\"cart2\""]
        ),
        1.0,
        "{text}"
    );
    assert!(
        count(
            "flatmesh_upstream_tls_handshake_failures_total",
            &["cluster=\"impostor\"", "reason=\"not_allowed\""]
        ) >= 1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_listener_terminates_tls_and_its_cluster_originates_it_again() {
    let pki = Pki::new();
    let node_id = pki.issue("node", NODE);
    let ca = pki.ca_file();
    let echo = tls_endpoint(&pki, DB, &[NODE], false).await;
    let (admin, listen) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: db
    address: {listen}
    protocol: tcp
    cluster: db
    tls: {{ cert: {node_id}.pem, key: {node_id}.key, client_ca: {ca}, allow: [ {WEB} ] }}
clusters:
  - name: db
    endpoints: [ {echo} ]
    tls: {{ ca: {ca}, cert: {node_id}.pem, key: {node_id}.key, server_ids: [ {DB} ] }}
kernel: {{ tcp_splice: true }}
"#
    );
    let node = TestNode::start(&yaml);
    let web = pki.svid(WEB);
    let mut s = tls_connect(listen, client_config(&pki.bundle(), Some(&web), NODE, b"x"))
        .await
        .unwrap();
    let data = common::backends::pattern(1 << 20, 7);
    let (mut r, mut w) = tokio::io::split(&mut s);
    let sent = data.clone();
    let (written, back) = tokio::join!(
        async move {
            w.write_all(&sent).await.unwrap();
            w.shutdown().await.unwrap();
        },
        async move {
            let mut back = Vec::new();
            r.read_to_end(&mut back).await.unwrap();
            back
        }
    );
    let () = written;
    assert!(
        back == data,
        "the echo came back different ({} bytes)",
        back.len()
    );
    let text = node.metrics().await;
    let count = |name: &str, labels: &[&str]| -> f64 {
        metric_samples(&text, name, labels)
            .iter()
            .map(|(_, v)| v)
            .sum()
    };
    assert_eq!(
        count("flatmesh_tls_handshakes_total", &["listener=\"db\""]),
        1.0,
        "{text}"
    );
    assert_eq!(
        count(
            "flatmesh_upstream_tls_handshakes_total",
            &["cluster=\"db\""]
        ),
        1.0,
        "{text}"
    );
    // The kernel never spliced it, though the config asks for splicing.
    assert_eq!(
        count(
            "flatmesh_kernel_spliced_connections_total",
            &["listener=\"db\""]
        ),
        0.0
    );
}

#[tokio::test]
async fn bad_tls_settings_fail_the_load_with_the_file_and_the_fix() {
    let pki = Pki::new();
    let node_id = pki.issue("node", NODE);
    let (admin, listen) = (free_addr(), free_addr());
    let cases = [
        (
            format!("tls: {{ cert: /nonexistent/node.pem, key: {node_id}.key }}"),
            "/nonexistent/node.pem",
        ),
        (
            format!("tls: {{ cert: {node_id}.pem, key: {node_id}.key, client_ca: {}, allow: [ \"spiffe://td/a*\" ] }}", pki.ca_file()),
            "only be the whole last segment",
        ),
    ];
    for (tls, want) in cases {
        let yaml = format!(
            "admin: {admin}\nlisteners:\n  - {{ name: web, address: {listen}, protocol: tcp, cluster: c, {tls} }}\nclusters:\n  - {{ name: c, endpoints: [ 127.0.0.1:9 ] }}\n"
        );
        let dir = TempDir::new();
        let path = dir.write("flatmesh.yaml", &yaml);
        let config = flatmesh_config::load(&path).unwrap();
        let err = flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::File(path))
            .err()
            .unwrap_or_else(|| panic!("a node started with {tls}"))
            .to_string();
        assert!(err.contains(want), "{err}");
    }
}
