//! Real TLS handshakes over loopback TCP between configurations built by this crate: who is
//! accepted, who is refused, and the reason a refusal is counted under.
#![allow(clippy::unwrap_used)]

use flatmesh_identity::tls::{self, failure_reason};
use flatmesh_identity::{Authority, ClientAuth, IdPattern, SpiffeId, Svid, TrustBundle};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

fn svid(ca: &Authority, id: &str) -> Svid {
    let issued = ca
        .issue(&SpiffeId::parse(id).unwrap(), Duration::from_secs(3600))
        .unwrap();
    Svid::from_pem(&issued.chain_pem, issued.key_pem.as_deref().unwrap()).unwrap()
}

fn patterns(list: &[&str]) -> Vec<IdPattern> {
    list.iter().map(|p| IdPattern::parse(p).unwrap()).collect()
}

struct Outcome {
    /// The server's view: the client's identity, or the reason it refused.
    server: Result<Option<SpiffeId>, &'static str>,
    /// The client's view: the server's identity, or the reason it refused.
    client: Result<Option<SpiffeId>, &'static str>,
}

/// One handshake and one echoed message over loopback.
async fn handshake(
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
) -> Outcome {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let serving = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        match TlsAcceptor::from(server).accept(socket).await {
            Ok(mut stream) => {
                let peer = tls::peer_identity(stream.get_ref().1);
                let mut buffer = [0u8; 5];
                if stream.read_exact(&mut buffer).await.is_ok() {
                    let _ = stream.write_all(&buffer).await;
                    let _ = stream.flush().await;
                }
                Ok(peer)
            }
            Err(e) => Err(e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                .map(failure_reason)
                .unwrap_or("io")),
        }
    });
    let socket = TcpStream::connect(address).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("mesh.invalid").unwrap();
    let client = match TlsConnector::from(client).connect(name, socket).await {
        Ok(mut stream) => {
            let peer = tls::peer_identity(stream.get_ref().1);
            // TLS 1.3 reports a refused client certificate only on the first read.
            stream.write_all(b"hello").await.unwrap();
            let mut buffer = [0u8; 5];
            match stream.read_exact(&mut buffer).await {
                Ok(_) => Ok(peer),
                Err(e) => Err(e
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                    .map(failure_reason)
                    .unwrap_or("closed")),
            }
        }
        Err(e) => Err(e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .map(failure_reason)
            .unwrap_or("io")),
    };
    let server = tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("the server hung")
        .unwrap();
    Outcome { server, client }
}

fn mtls_server(ca: &Authority, id: &str, allow: &[&str]) -> Arc<rustls::ServerConfig> {
    tls::server_config(
        &svid(ca, id),
        Some(ClientAuth {
            bundle: TrustBundle::new(ca.bundle()).unwrap(),
            allow: patterns(allow),
        }),
        &[tls::ALPN_HTTP11],
    )
    .unwrap()
}

fn client(ca: &Authority, me: Option<&Svid>, server_ids: &[&str]) -> Arc<rustls::ClientConfig> {
    tls::client_config(
        me,
        &TrustBundle::new(ca.bundle()).unwrap(),
        patterns(server_ids),
        &[tls::ALPN_HTTP11],
    )
    .unwrap()
}

const SERVER: &str = "spiffe://td/ns/shop/sa/cart";
const CLIENT: &str = "spiffe://td/ns/shop/sa/web";

#[tokio::test]
async fn both_sides_learn_the_others_spiffe_id() {
    let ca = Authority::generate("td").unwrap();
    let me = svid(&ca, CLIENT);
    let outcome = handshake(
        mtls_server(&ca, SERVER, &["spiffe://td/ns/shop/*"]),
        client(&ca, Some(&me), &[SERVER]),
    )
    .await;
    assert_eq!(outcome.server, Ok(Some(SpiffeId::parse(CLIENT).unwrap())));
    assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));
}

#[tokio::test]
async fn a_client_outside_the_allow_list_is_refused() {
    let ca = Authority::generate("td").unwrap();
    let me = svid(&ca, "spiffe://td/ns/other/sa/web");
    let outcome = handshake(
        mtls_server(&ca, SERVER, &["spiffe://td/ns/shop/*"]),
        client(&ca, Some(&me), &[SERVER]),
    )
    .await;
    assert_eq!(outcome.server, Err("not_allowed"));
    assert!(outcome.client.is_err());
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let ca = Authority::generate("td").unwrap();
    let outcome = handshake(
        mtls_server(&ca, SERVER, &["spiffe://td/*"]),
        client(&ca, None, &[SERVER]),
    )
    .await;
    assert_eq!(outcome.server, Err("no_client_certificate"));
}

#[tokio::test]
async fn a_client_of_an_unknown_ca_is_refused() {
    let ca = Authority::generate("td").unwrap();
    let stranger = Authority::generate("td").unwrap();
    let me = svid(&stranger, CLIENT);
    let outcome = handshake(
        mtls_server(&ca, SERVER, &["spiffe://td/*"]),
        client(&ca, Some(&me), &[SERVER]),
    )
    .await;
    assert_eq!(outcome.server, Err("unknown_ca"));
}

#[tokio::test]
async fn a_client_of_another_trust_domain_is_refused_even_when_its_root_is_trusted() {
    let ca = Authority::generate("td").unwrap();
    let other = Authority::generate("evil.org").unwrap();
    let mut roots = ca.bundle().to_vec();
    roots.extend(other.bundle().iter().cloned());
    let server = tls::server_config(
        &svid(&ca, SERVER),
        Some(ClientAuth {
            bundle: TrustBundle::new(&roots).unwrap(),
            allow: patterns(&["spiffe://td/*"]),
        }),
        &[],
    )
    .unwrap();
    let me = svid(&other, "spiffe://evil.org/ns/shop/sa/web");
    let outcome = handshake(server, client(&ca, Some(&me), &[SERVER])).await;
    assert_eq!(outcome.server, Err("wrong_trust_domain"));
}

#[tokio::test]
async fn expired_and_not_yet_valid_certificates_are_refused() {
    let ca = Authority::generate("td").unwrap();
    let id = SpiffeId::parse(CLIENT).unwrap();
    let now = SystemTime::now();
    for (from, to, reason) in [
        (
            now - Duration::from_secs(7200),
            now - Duration::from_secs(3600),
            "expired",
        ),
        (
            now + Duration::from_secs(3600),
            now + Duration::from_secs(7200),
            "not_yet_valid",
        ),
    ] {
        let issued = ca.issue_valid_between(&id, from, to).unwrap();
        let me = Svid::from_pem(&issued.chain_pem, issued.key_pem.as_deref().unwrap()).unwrap();
        let outcome = handshake(
            mtls_server(&ca, SERVER, &["spiffe://td/*"]),
            client(&ca, Some(&me), &[SERVER]),
        )
        .await;
        assert_eq!(outcome.server, Err(reason));
    }
}

#[tokio::test]
async fn a_server_with_the_wrong_identity_is_refused_by_the_client() {
    let ca = Authority::generate("td").unwrap();
    let me = svid(&ca, CLIENT);
    let outcome = handshake(
        mtls_server(&ca, "spiffe://td/ns/shop/sa/impostor", &["spiffe://td/*"]),
        client(&ca, Some(&me), &[SERVER]),
    )
    .await;
    assert_eq!(outcome.client, Err("not_allowed"));
}

#[tokio::test]
async fn during_a_root_rotation_leaves_of_both_roots_are_accepted() {
    let mut ca = Authority::generate("td").unwrap();
    let old_leaf = svid(&ca, CLIENT);
    ca.rotate(None).unwrap();
    let new_leaf = svid(&ca, CLIENT);
    for me in [&old_leaf, &new_leaf] {
        let outcome = handshake(
            mtls_server(&ca, SERVER, &["spiffe://td/*"]),
            client(&ca, Some(me), &[SERVER]),
        )
        .await;
        assert_eq!(outcome.server, Ok(Some(SpiffeId::parse(CLIENT).unwrap())));
    }
    ca.retire_old_roots(None).unwrap();
    let outcome = handshake(
        mtls_server(&ca, SERVER, &["spiffe://td/*"]),
        client(&ca, Some(&old_leaf), &[SERVER]),
    )
    .await;
    assert_eq!(outcome.server, Err("unknown_ca"));
}

/// What the server saw of one connection: the client's identity, the suite, and whether the
/// handshake was a resumption.
async fn accept_once(
    listener: &TcpListener,
    server: Arc<rustls::ServerConfig>,
) -> (Option<SpiffeId>, rustls::CipherSuite, bool) {
    let (socket, _) = listener.accept().await.unwrap();
    let mut stream = TlsAcceptor::from(server).accept(socket).await.unwrap();
    let state = stream.get_ref().1;
    let seen = (
        tls::peer_identity(state),
        state.negotiated_cipher_suite().unwrap().suite(),
        state.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
    );
    let mut buffer = [0u8; 5];
    stream.read_exact(&mut buffer).await.unwrap();
    stream.write_all(&buffer).await.unwrap();
    stream.flush().await.unwrap();
    seen
}

/// Two nodes negotiate AES-128-GCM (the suite Envoy picks, and the cheapest per byte with
/// AES instructions), and a second connection resumes from a stateless ticket, still knowing
/// the client's SPIFFE ID.
#[tokio::test]
async fn nodes_agree_on_aes_128_gcm_and_resume_with_the_client_identity() {
    let ca = Authority::generate("td").unwrap();
    let me = svid(&ca, CLIENT);
    let server = mtls_server(&ca, SERVER, &[CLIENT]);
    let client = client(&ca, Some(&me), &[SERVER]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let connecting = {
            let client = client.clone();
            tokio::spawn(async move {
                let socket = TcpStream::connect(address).await.unwrap();
                let name = rustls::pki_types::ServerName::try_from("mesh.invalid").unwrap();
                let mut stream = TlsConnector::from(client)
                    .connect(name, socket)
                    .await
                    .unwrap();
                stream.write_all(b"hello").await.unwrap();
                let mut buffer = [0u8; 5];
                // The tickets arrive after the handshake: read them before closing.
                stream.read_exact(&mut buffer).await.unwrap();
            })
        };
        seen.push(accept_once(&listener, server.clone()).await);
        connecting.await.unwrap();
    }
    let client_id = SpiffeId::parse(CLIENT).unwrap();
    for (i, (peer, suite, resumed)) in seen.iter().enumerate() {
        assert_eq!(peer.as_ref(), Some(&client_id), "connection {i}");
        assert_eq!(*suite, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert_eq!(*resumed, i > 0, "connection {i}: resumed = {resumed}");
    }
    // A new server config (a reload) has a new ticket key: the next connection is a full
    // handshake again.
    let reloaded = mtls_server(&ca, SERVER, &[CLIENT]);
    let connecting = tokio::spawn(async move {
        let socket = TcpStream::connect(address).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("mesh.invalid").unwrap();
        let mut stream = TlsConnector::from(client)
            .connect(name, socket)
            .await
            .unwrap();
        stream.write_all(b"hello").await.unwrap();
        let mut buffer = [0u8; 5];
        stream.read_exact(&mut buffer).await.unwrap();
    });
    let (_, _, resumed) = accept_once(&listener, reloaded).await;
    connecting.await.unwrap();
    assert!(
        !resumed,
        "a ticket of the old config was accepted by the new one"
    );
}

/// A CA on disk with the CRL `revoke` wrote after listing `revoked` (the serial of its leaf).
fn revoking_ca(name: &str) -> (Authority, std::path::PathBuf) {
    let dir =
        std::env::temp_dir().join(format!("flatmesh-handshake-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    (Authority::init("td", &dir).unwrap(), dir)
}

fn revoke(ca: &Authority, dir: &std::path::Path, svid: &Svid) -> TrustBundle {
    let (by_signer, serial) = ca.issued_by_signer(&svid.chain[0]).unwrap();
    assert!(by_signer);
    ca.revoke(dir, &[serial]).unwrap();
    TrustBundle::new(ca.bundle())
        .unwrap()
        .with_crl_file(&dir.join(flatmesh_identity::crl::CRL_FILE))
        .unwrap()
}

#[tokio::test]
async fn a_revoked_client_certificate_is_refused_and_a_fresh_one_passes() {
    let (ca, dir) = revoking_ca("revoked-client");
    let stolen = svid(&ca, CLIENT);
    let bundle = revoke(&ca, &dir, &stolen);
    let server = |bundle: &TrustBundle| {
        tls::server_config(
            &svid(&ca, SERVER),
            Some(ClientAuth {
                bundle: bundle.clone(),
                allow: patterns(&["spiffe://td/*"]),
            }),
            &[tls::ALPN_HTTP11],
        )
        .unwrap()
    };
    let outcome = handshake(server(&bundle), client(&ca, Some(&stolen), &[SERVER])).await;
    assert_eq!(outcome.server, Err("revoked"));
    // The same identity, reissued (a new serial), passes the same CRL.
    let fresh = svid(&ca, CLIENT);
    let outcome = handshake(server(&bundle), client(&ca, Some(&fresh), &[SERVER])).await;
    assert_eq!(outcome.server, Ok(Some(SpiffeId::parse(CLIENT).unwrap())));
    // Without the CRL the revoked certificate would have passed: the CRL is what refused it.
    let plain = TrustBundle::new(ca.bundle()).unwrap();
    let outcome = handshake(server(&plain), client(&ca, Some(&stolen), &[SERVER])).await;
    assert_eq!(outcome.server, Ok(Some(SpiffeId::parse(CLIENT).unwrap())));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_client_refuses_a_server_with_a_revoked_certificate() {
    let (ca, dir) = revoking_ca("revoked-server");
    let stolen = svid(&ca, SERVER);
    let bundle = revoke(&ca, &dir, &stolen);
    let server = tls::server_config(&stolen, None, &[tls::ALPN_HTTP11]).unwrap();
    let client_config = |bundle: &TrustBundle| {
        tls::client_config(None, bundle, patterns(&[SERVER]), &[tls::ALPN_HTTP11]).unwrap()
    };
    let outcome = handshake(server.clone(), client_config(&bundle)).await;
    assert_eq!(outcome.client, Err("revoked"));
    let fresh = tls::server_config(&svid(&ca, SERVER), None, &[tls::ALPN_HTTP11]).unwrap();
    let outcome = handshake(fresh, client_config(&bundle)).await;
    assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));
    // Leaves of a root without a CRL here (the old root after a rotation) are not refused.
    let other = Authority::generate("td").unwrap();
    let mut both = ca.bundle().to_vec();
    both.extend(other.bundle().iter().cloned());
    let bundle = TrustBundle::new(&both)
        .unwrap()
        .with_crl_file(&dir.join(flatmesh_identity::crl::CRL_FILE))
        .unwrap();
    let outcome = handshake(
        tls::server_config(&svid(&other, SERVER), None, &[tls::ALPN_HTTP11]).unwrap(),
        client_config(&bundle),
    )
    .await;
    assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A node's `--xds-ca`: the client re-reads the bundle file when it changes, so after a real
/// rotation on disk (`rotate`, then `retire`) the next handshake trusts the new root and no
/// longer the old one, with no new configuration.
#[tokio::test]
async fn a_client_following_a_bundle_file_picks_up_a_root_rotation() {
    let (mut ca, dir) = revoking_ca("follow");
    let ca_pem = dir.join(flatmesh_identity::ca::CERT_FILE);
    let following =
        tls::client_config_following(&ca_pem, patterns(&[SERVER]), &[tls::ALPN_HTTP11]).unwrap();
    let old_server = svid(&ca, SERVER);
    let serve = |me: &Svid| tls::server_config(me, None, &[tls::ALPN_HTTP11]).unwrap();
    let outcome = handshake(serve(&old_server), following.clone()).await;
    assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));

    ca.rotate(Some(&dir)).unwrap();
    let new_server = svid(&ca, SERVER);
    // During the overlap both roots are trusted.
    for me in [&old_server, &new_server] {
        let outcome = handshake(serve(me), following.clone()).await;
        assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));
    }
    ca.retire_old_roots(Some(&dir)).unwrap();
    let outcome = handshake(serve(&new_server), following.clone()).await;
    assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));
    let outcome = handshake(serve(&old_server), following.clone()).await;
    assert_eq!(
        outcome.client,
        Err("unknown_ca"),
        "the retired root is no longer trusted"
    );
    // A file that stops parsing leaves the last good bundle in force.
    std::fs::write(&ca_pem, "garbage").unwrap();
    let outcome = handshake(serve(&new_server), following).await;
    assert_eq!(outcome.client, Ok(Some(SpiffeId::parse(SERVER).unwrap())));
    std::fs::remove_dir_all(&dir).unwrap();
}
