//! The demo's mutual TLS part: the node's `secure` listener presents the `web` identity of the
//! demo's own CA, requires a client certificate of that CA from the `shop` namespace, and its
//! authorization policy lets only `frontend` through. Four callers knock, and the report shows
//! what each got:
//!
//! | caller | presents | expected |
//! |---|---|---|
//! | frontend | `spiffe://demo.local/ns/shop/sa/frontend` | 200 from the api cluster |
//! | intruder | `spiffe://demo.local/ns/shop/sa/intruder` | 403, denied by policy `frontend-only` |
//! | stranger | `frontend`'s ID from another CA | refused in the handshake (unknown CA) |
//! | anonymous | no certificate | refused in the handshake |
//!
//! The CA, the certificates and the keys are made fresh for each run, in a directory of the
//! run's own that is removed afterwards.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flatmesh_identity::{Authority, IdPattern, SpiffeId, Svid, TrustBundle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::LabError;

/// Name of the mTLS listener in the demo config.
pub const SECURE_LISTENER: &str = "secure";
const TRUST_DOMAIN: &str = "demo.local";
const SERVER_ID: &str = "spiffe://demo.local/ns/shop/sa/web";
const FRONTEND_ID: &str = "spiffe://demo.local/ns/shop/sa/frontend";
const INTRUDER_ID: &str = "spiffe://demo.local/ns/shop/sa/intruder";
/// Each call's bound: connect, handshake, request and answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The demo's PKI: files the node reads, and the callers' identities.
pub struct Pki {
    dir: PathBuf,
    bundle: TrustBundle,
    callers: Vec<Caller>,
}

struct Caller {
    name: &'static str,
    presents: String,
    svid: Option<Svid>,
    expected: Expected,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expected {
    Status(u16),
    Refused,
}

impl std::fmt::Display for Expected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expected::Status(200) => write!(f, "200 (allowed)"),
            Expected::Status(403) => write!(f, "403 (denied by policy)"),
            Expected::Status(other) => write!(f, "{other}"),
            Expected::Refused => write!(f, "refused in the handshake"),
        }
    }
}

fn pki_error(e: impl std::fmt::Display) -> LabError {
    LabError::NodeStart(format!("demo PKI: {e}"))
}

impl Pki {
    /// A fresh CA and certificates, written to a directory of this run's own.
    pub fn create() -> Result<Pki, LabError> {
        let dir = std::env::temp_dir().join(format!("flatmesh-demo-pki-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Authority::init(TRUST_DOMAIN, &dir).map_err(pki_error)?;
        let ttl = Duration::from_secs(3600);
        let id = |text: &str| SpiffeId::parse(text).map_err(pki_error);
        ca.issue(&id(SERVER_ID)?, ttl)
            .and_then(|issued| issued.write(&dir.join("web")))
            .map_err(pki_error)?;
        let svid_of = |authority: &Authority, text: &str| -> Result<Svid, LabError> {
            let issued = authority.issue(&id(text)?, ttl).map_err(pki_error)?;
            Svid::from_pem(
                &issued.chain_pem,
                issued.key_pem.as_deref().unwrap_or_default(),
            )
            .map_err(pki_error)
        };
        let stranger_ca = Authority::generate(TRUST_DOMAIN).map_err(pki_error)?;
        let callers = vec![
            Caller {
                name: "frontend",
                presents: FRONTEND_ID.into(),
                svid: Some(svid_of(&ca, FRONTEND_ID)?),
                expected: Expected::Status(200),
            },
            Caller {
                name: "intruder",
                presents: INTRUDER_ID.into(),
                svid: Some(svid_of(&ca, INTRUDER_ID)?),
                expected: Expected::Status(403),
            },
            Caller {
                name: "stranger",
                presents: format!("{FRONTEND_ID} (another CA)"),
                svid: Some(svid_of(&stranger_ca, FRONTEND_ID)?),
                expected: Expected::Refused,
            },
            Caller {
                name: "anonymous",
                presents: "no certificate".into(),
                svid: None,
                expected: Expected::Refused,
            },
        ];
        let bundle = TrustBundle::new(ca.bundle()).map_err(pki_error)?;
        Ok(Pki {
            dir,
            bundle,
            callers,
        })
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The `secure` listener, in the demo config's YAML (indented as a list item of
    /// `listeners:`), routing to `cluster`. It binds 127.0.0.2: the node keys its bound
    /// sockets by address and protocol, so a second `http` listener on 127.0.0.1:0 would be
    /// taken for `web` (a known bug, in the closing notes).
    pub fn listener_yaml(&self, cluster: &str) -> String {
        format!(
            r#"  - name: {SECURE_LISTENER}
    address: 127.0.0.2:0
    protocol: http
    tls: {{ cert: "{cert}", key: "{key}", client_ca: "{ca}", allow: [ "spiffe://{TRUST_DOMAIN}/ns/shop/*" ] }}
    authorization:
      default: deny
      policies:
        - {{ name: frontend-only, action: allow, from: {{ principals: [ "{FRONTEND_ID}" ] }} }}
    routes:
      - name: secure-api
        cluster: {cluster}
"#,
            cert = self.path("web.pem"),
            key = self.path("web.key"),
            ca = self.path("ca.pem"),
        )
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Each caller calls `GET /api/secure` once on the listener at `addr`.
    pub async fn calls(&self, addr: SocketAddr) -> Vec<MtlsRow> {
        let mut rows = Vec::with_capacity(self.callers.len());
        for caller in &self.callers {
            let outcome =
                match tokio::time::timeout(CALL_TIMEOUT, self.call(addr, caller.svid.as_ref()))
                    .await
                {
                    Ok(outcome) => outcome,
                    Err(_) => Outcome::Failed(format!("no answer within {CALL_TIMEOUT:?}")),
                };
            let ok = match (caller.expected, &outcome) {
                (Expected::Status(want), Outcome::Status(got)) => want == *got,
                (Expected::Refused, Outcome::Refused(_)) => true,
                _ => false,
            };
            rows.push(MtlsRow {
                caller: caller.name,
                presents: caller.presents.clone(),
                expected: caller.expected.to_string(),
                got: outcome.to_string(),
                ok,
            });
        }
        rows
    }

    async fn call(&self, addr: SocketAddr, svid: Option<&Svid>) -> Outcome {
        let server = match IdPattern::parse(SERVER_ID) {
            Ok(p) => p,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let config = match flatmesh_identity::tls::client_config(
            svid,
            &self.bundle,
            vec![server],
            &[b"http/1.1"],
        ) {
            Ok(config) => config,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let tcp = match TcpStream::connect(addr).await {
            Ok(tcp) => tcp,
            Err(e) => return Outcome::Failed(format!("connect: {e}")),
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&config));
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        let mut tls = match connector.connect(name, tcp).await {
            Ok(tls) => tls,
            Err(e) => return Outcome::Refused(e.to_string()),
        };
        let request = b"GET /api/secure HTTP/1.1\r\nhost: shop.local\r\nconnection: close\r\n\r\n";
        if let Err(e) = tls.write_all(request).await {
            // TLS 1.3: the server checks the client's certificate after the client has
            // finished its side, so a refusal shows up at the first write or read.
            return Outcome::Refused(e.to_string());
        }
        let mut answer = Vec::new();
        let read = tls.read_to_end(&mut answer).await;
        let text = String::from_utf8_lossy(&answer);
        match text.split(' ').nth(1).and_then(|s| s.parse().ok()) {
            Some(status) => Outcome::Status(status),
            None => match read {
                Err(e) => Outcome::Refused(e.to_string()),
                Ok(_) => Outcome::Failed("no HTTP answer".into()),
            },
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

enum Outcome {
    Status(u16),
    Refused(String),
    Failed(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Status(status) => write!(f, "{status}"),
            Outcome::Refused(why) => write!(f, "refused: {}", short_reason(why)),
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// The useful end of a TLS error ("received fatal alert: UnknownCA" -> "UnknownCA").
fn short_reason(why: &str) -> &str {
    why.rsplit(": ").next().unwrap_or(why)
}

/// One caller's outcome, for the report.
#[derive(Debug, Clone, PartialEq)]
pub struct MtlsRow {
    pub caller: &'static str,
    pub presents: String,
    pub expected: String,
    pub got: String,
    pub ok: bool,
}
