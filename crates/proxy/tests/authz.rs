//! Authorization policies with real mTLS callers: who may do what, on the normalised path,
//! per request on http listeners (403 / gRPC PERMISSION_DENIED) and per connection on tcp
//! listeners (a reset), each decision counted under the policy that made it.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::backends::{HttpBackend, Proto, TcpBackend, TcpMode};
use common::pki::*;
use common::*;
use flatmesh_identity::tls;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn count(text: &str, labels: &[&str]) -> f64 {
    metric_samples(text, "flatmesh_authz_decisions_total", labels)
        .iter()
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_policies_decide_per_request_on_the_normalised_path() {
    let pki = Pki::new();
    let node_id = pki.issue("node", NODE);
    let ca = pki.ca_file();
    let backend = HttpBackend::start("app", Proto::H1).await;
    let (admin, listen) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
access_log: {{ path: {log} }}
listeners:
  - name: web
    address: {listen}
    protocol: http
    tls: {{ cert: {node_id}.pem, key: {node_id}.key, client_ca: {ca}, allow: [ "{TD}/*" ] }}
    authorization:
      default: deny
      policies:
        - name: no-admin
          action: deny
          to: {{ paths: [ "/api/admin*" ] }}
        - name: shop-reads
          action: allow
          from: {{ namespaces: [ shop ] }}
          to: {{ methods: [ GET ], paths: [ "/api/*" ] }}
        - name: db-writes-with-ticket
          action: allow
          from: {{ principals: [ {DB} ] }}
          to: {{ methods: [ POST ] }}
          when: [ {{ header: x-ticket, values: [ "T-*" ] }} ]
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - name: app
    endpoints: [ {backend} ]
"#,
        backend = backend.addr,
        log = pki.dir.path.join("access.log").display()
    );
    let node = TestNode::start(&yaml);
    let bundle = pki.bundle();
    let call = |id: &'static str, req: String| {
        let config = client_config(&bundle, Some(&pki.svid(id)), NODE, tls::ALPN_HTTP11);
        async move {
            let mut s = tls_connect(listen, config).await.unwrap();
            s.write_all(req.as_bytes()).await.unwrap();
            let mut buf = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), read_reply(&mut s, &mut buf))
                .await
                .expect("an answer in time")
                .unwrap()
        }
    };
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: t\r\n\r\n");
    let post = |ticket: &str| {
        format!(
            "POST /api/rows HTTP/1.1\r\nhost: t\r\nx-ticket: {ticket}\r\ncontent-length: 0\r\n\r\n"
        )
    };
    let cases: [(&str, &'static str, String, u16); 8] = [
        ("a shop reader", WEB, get("/api/items"), 200),
        (
            "the deny wins over the allow",
            WEB,
            get("/api/admin/users"),
            403,
        ),
        (
            "an escaped path normalises into the deny",
            WEB,
            get("/api/%61dmin/users"),
            403,
        ),
        (
            "a dot segment normalises into the deny",
            WEB,
            get("/api/x/../admin"),
            403,
        ),
        ("outside the allowed paths", WEB, get("/other"), 403),
        ("another namespace", NODE, get("/api/items"), 403),
        ("a write with its ticket", DB, post("T-42"), 200),
        ("a write with a wrong ticket", DB, post("X-42"), 403),
    ];
    for (what, id, req, want) in cases {
        let (status, body) = call(id, req).await;
        assert_eq!(status, want, "{what}: {body}");
        if want == 403 {
            assert!(body.contains("access denied"), "{what}: {body}");
        }
    }
    assert_eq!(backend.hits(), 2);
    let text = node.metrics().await;
    let at = |policy: &str, decision: &str| {
        count(
            &text,
            &[
                "listener=\"web\"",
                &format!("policy=\"{policy}\""),
                &format!("decision=\"{decision}\""),
            ],
        )
    };
    assert_eq!(at("no-admin", "deny"), 3.0, "{text}");
    assert_eq!(at("shop-reads", "allow"), 1.0, "{text}");
    assert_eq!(at("db-writes-with-ticket", "allow"), 1.0, "{text}");
    assert_eq!(at("(none)", "deny"), 3.0, "{text}");
    // The access log names the caller by its SPIFFE ID.
    let log_path = pki.dir.path.join("access.log");
    let logged = eventually(Duration::from_secs(5), || async {
        std::fs::read_to_string(&log_path)
            .is_ok_and(|t| t.contains(&format!("\"principal\":\"{WEB}\"")))
    })
    .await;
    assert!(logged, "{:?}", std::fs::read_to_string(&log_path));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_caller_is_denied_with_permission_denied() {
    let backend = HttpBackend::start("app", Proto::H1).await;
    let (admin, listen) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
listeners:
  - name: web
    address: {listen}
    protocol: http
    authorization:
      policies:
        - {{ name: no-billing, action: deny, to: {{ paths: [ "/billing.Billing/*" ] }} }}
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - {{ name: app, endpoints: [ {} ] }}
"#,
        backend.addr
    );
    let _node = TestNode::start(&yaml);
    let resp = send(
        &h2c_client(),
        request(
            http::Method::POST,
            &format!("http://{listen}/billing.Billing/Charge"),
            &[("content-type", "application/grpc")],
            "",
        ),
    )
    .await
    .unwrap();
    // gRPC's way: HTTP 200, trailers-only, the status in grpc-status.
    assert_eq!(
        resp.header("grpc-status"),
        Some("7"),
        "PERMISSION_DENIED: {:?}",
        resp.headers
    );
    // With no allow policy and `default: allow`, everything else goes on.
    let resp = send(&h1_client(), get_req(&format!("http://{listen}/ok")))
        .await
        .unwrap();
    assert_eq!(resp.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_policies_decide_at_connection_time() {
    let pki = Pki::new();
    let node_id = pki.issue("node", NODE);
    let ca = pki.ca_file();
    let echo = TcpBackend::start(TcpMode::Echo).await;
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
    tls: {{ cert: {node_id}.pem, key: {node_id}.key, client_ca: {ca}, allow: [ "{TD}/*" ] }}
    authorization:
      policies:
        - {{ name: data-only, action: allow, from: {{ namespaces: [ data ] }} }}
clusters:
  - {{ name: db, endpoints: [ {} ] }}
"#,
        echo.addr
    );
    let node = TestNode::start(&yaml);
    let bundle = pki.bundle();
    let echo_once = |id: &'static str| {
        let config = client_config(&bundle, Some(&pki.svid(id)), NODE, b"x");
        async move {
            let mut s = tls_connect(listen, config).await.unwrap();
            s.write_all(b"ping").await?;
            let mut back = [0u8; 4];
            tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
                .await
                .expect("an answer or a close in time")?;
            Ok::<_, std::io::Error>(back)
        }
    };
    assert_eq!(&echo_once(DB).await.unwrap(), b"ping");
    assert!(
        echo_once(WEB).await.is_err(),
        "a caller no policy allows is cut off"
    );
    let text = node.metrics().await;
    assert_eq!(
        count(&text, &["policy=\"data-only\"", "decision=\"allow\""]),
        1.0,
        "{text}"
    );
    assert_eq!(
        count(&text, &["policy=\"(none)\"", "decision=\"deny\""]),
        1.0,
        "{text}"
    );
}

#[tokio::test]
async fn policies_that_cannot_apply_are_refused_with_the_fix() {
    let (admin, listen): (SocketAddr, SocketAddr) = (free_addr(), free_addr());
    let cases = [
        (
            "protocol: tcp, cluster: c, authorization: { policies: [ { name: p, action: deny, to: { paths: [ /x ] } } ] }",
            "it sees connections, not requests",
        ),
        (
            "protocol: http, authorization: { policies: [ { name: p, action: deny, from: { principals: [ \"spiffe://td/a*b\" ] } } ] }",
            "is not a SPIFFE ID or pattern",
        ),
        (
            "protocol: http, authorization: { policies: [ { name: p, action: deny, to: { paths: [ \"/a*b*\" ] } } ] }",
            "not a path pattern",
        ),
    ];
    for (listener, want) in cases {
        let yaml = format!(
            "admin: {admin}\nlisteners:\n  - {{ name: web, address: {listen}, {listener} }}\nclusters:\n  - {{ name: c, endpoints: [ 127.0.0.1:9 ] }}\n"
        );
        let dir = TempDir::new();
        let path = dir.write("flatmesh.yaml", &yaml);
        let err = flatmesh_config::load(&path)
            .err()
            .unwrap_or_else(|| panic!("accepted: {listener}"));
        assert!(err.to_string().contains(want), "{err}");
    }
}
