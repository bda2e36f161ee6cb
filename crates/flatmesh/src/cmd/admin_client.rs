//! The CLI's client for a node's admin endpoint (`check --admin`, `drain`): one plain
//! HTTP/1.0 exchange over a std socket. The CLI needs one response per command and no async
//! runtime or client crate for it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::Context as _;
use flatmesh_config::AdminAddress;

/// How long one exchange may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer read: `/config` and `/rules` of a 10,000-route node fit many times over.
const MAX_ANSWER_BYTES: u64 = 64 << 20;

/// An admin endpoint's answer.
pub struct Answer {
    pub status: u16,
    /// The status line, for messages.
    pub status_line: String,
    pub body: String,
}

impl Answer {
    /// Why an answer other than success is one, as a message that says what to do.
    pub fn refusal(&self, admin: &AdminAddress, token: Option<&str>, path: &str) -> String {
        match self.status {
            401 if token.is_none() => format!(
                "{admin} needs the admin token; pass --admin-token-file FILE (the node's admin.token_file)"
            ),
            401 => format!(
                "{admin} refused the admin token; check that --admin-token-file holds the node's current token"
            ),
            _ => format!(
                "{admin} answered `{}` to {path}; is that the node's admin address?",
                self.status_line
            ),
        }
    }
}

/// Opens a connection to the node's admin endpoint, or says why it cannot.
fn connect(admin: &AdminAddress) -> std::io::Result<(Box<dyn ReadWrite>, String)> {
    Ok(match admin {
        AdminAddress::Tcp(addr) => {
            let conn = TcpStream::connect_timeout(addr, TIMEOUT)?;
            conn.set_read_timeout(Some(TIMEOUT))?;
            conn.set_write_timeout(Some(TIMEOUT))?;
            (Box::new(conn), addr.to_string())
        }
        AdminAddress::Unix(path) => {
            let conn = UnixStream::connect(path)?;
            conn.set_read_timeout(Some(TIMEOUT))?;
            conn.set_write_timeout(Some(TIMEOUT))?;
            (Box::new(conn), "localhost".to_string())
        }
    })
}

/// Whether anything answers at the admin address: false once the node has exited.
pub fn reachable(admin: &AdminAddress) -> bool {
    connect(admin).is_ok()
}

/// Sends `METHOD PATH` (with the token, when given) and reads the whole answer.
pub fn request(
    admin: &AdminAddress,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<Answer> {
    let what =
        || format!("asking the node at {admin} for {path}; is it running with `admin: {admin}`?");
    let (mut conn, host) = connect(admin).with_context(what)?;
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        conn,
        "{method} {path} HTTP/1.0\r\nHost: {host}\r\n{authorization}Content-Length: 0\r\n\r\n"
    )
    .with_context(what)?;
    let mut response = Vec::new();
    conn.take(MAX_ANSWER_BYTES + 1)
        .read_to_end(&mut response)
        .with_context(what)?;
    if response.len() as u64 > MAX_ANSWER_BYTES {
        anyhow::bail!(
            "{admin} sent more than {} MiB for {path}; is that the node's admin address?",
            MAX_ANSWER_BYTES >> 20
        );
    }
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n").with_context(|| {
        format!("{admin} sent no HTTP response; is that the node's admin address?")
    })?;
    let status_line = head.lines().next().unwrap_or_default().to_string();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{admin} answered `{status_line}`, not HTTP"))?;
    Ok(Answer {
        status,
        status_line,
        body: body.to_string(),
    })
}

/// A connected byte stream, TCP or Unix.
trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}
