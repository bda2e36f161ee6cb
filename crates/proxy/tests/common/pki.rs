//! A mesh CA for tests, the files a node's config names, and TLS clients that speak to the
//! node's listeners.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use flatmesh_identity::tls;
use flatmesh_identity::{Authority, IdPattern, SpiffeId, Svid, TrustBundle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::TempDir;

pub const TD: &str = "spiffe://td";
pub const NODE: &str = "spiffe://td/ns/mesh/sa/node";
pub const WEB: &str = "spiffe://td/ns/shop/sa/web";
pub const CART: &str = "spiffe://td/ns/shop/sa/cart";
pub const DB: &str = "spiffe://td/ns/data/sa/db";

/// A CA and the files a node's config names: `ca.pem`, and `NAME.pem`/`NAME.key` per identity.
pub struct Pki {
    pub ca: Authority,
    pub dir: TempDir,
}

impl Pki {
    pub fn new() -> Pki {
        Pki {
            ca: Authority::generate("td").unwrap(),
            dir: TempDir::new(),
        }
    }

    pub fn ca_file(&self) -> String {
        let pem: String = self.ca.bundle_pem();
        self.dir.write("ca.pem", &pem).display().to_string()
    }

    /// Issues `id` and writes it as `NAME.pem` and `NAME.key`; returns the path prefix.
    pub fn issue(&self, name: &str, id: &str) -> String {
        let issued = self
            .ca
            .issue(&SpiffeId::parse(id).unwrap(), Duration::from_secs(3600))
            .unwrap();
        self.dir.write(&format!("{name}.pem"), &issued.chain_pem);
        let key = self
            .dir
            .write(&format!("{name}.key"), issued.key_pem.as_deref().unwrap());
        key.with_extension("").display().to_string()
    }

    pub fn svid(&self, id: &str) -> Svid {
        svid_of(&self.ca, id)
    }

    pub fn bundle(&self) -> TrustBundle {
        TrustBundle::new(self.ca.bundle()).unwrap()
    }
}

pub fn svid_of(ca: &Authority, id: &str) -> Svid {
    let issued = ca
        .issue(&SpiffeId::parse(id).unwrap(), Duration::from_secs(3600))
        .unwrap();
    Svid::from_pem(&issued.chain_pem, issued.key_pem.as_deref().unwrap()).unwrap()
}

pub fn patterns(list: &[&str]) -> Vec<IdPattern> {
    list.iter().map(|p| IdPattern::parse(p).unwrap()).collect()
}

/// A client that checks the server is `server_id` and presents `me`.
pub fn client_config(
    bundle: &TrustBundle,
    me: Option<&Svid>,
    server_id: &str,
    alpn: &[u8],
) -> Arc<rustls::ClientConfig> {
    tls::client_config(me, bundle, patterns(&[server_id]), &[alpn]).unwrap()
}

pub async fn tls_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("mesh.invalid").unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await?;
    // TLS 1.3: a refused client certificate shows on the client's first read, not in the
    // handshake. A zero-length write flushes nothing; read with a short bound instead.
    stream.flush().await?;
    Ok(stream)
}

/// One HTTP/1.1 GET over an open stream; returns (status, body).
pub async fn h1_get<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    path: &str,
) -> std::io::Result<(u16, String)> {
    let req = format!("GET {path} HTTP/1.1\r\nhost: t.local\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let reply = read_reply(stream, &mut buf).await?;
    Ok((reply.0, reply.1))
}

/// Reads one HTTP/1.1 response with a content-length body.
pub async fn read_reply<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
) -> std::io::Result<(u16, String)> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let status: u16 = head[9..12].parse().unwrap();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).to_string();
            buf.drain(..end + 4 + len);
            return Ok((status, body));
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}
