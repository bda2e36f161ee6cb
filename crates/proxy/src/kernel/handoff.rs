//! The first request of a connection on the L7 `http` listener, while tier K decides it: the
//! proxy reads until the kernel's verdict is known, then either hands the connection to the
//! kernel for the decided cluster or hands every byte it read to the user L7 path.

use std::time::Duration;

use flatmesh_kernel::L7Decision;
use tokio::net::TcpStream;

use super::path::{peer_is_local, KernelPath};
use super::settings_ack::{settings_ack_at, H2_EMPTY_SETTINGS};
use super::{KernelBinding, FIRST_REQUEST_MAX};
use crate::sniff::{sniff, Protocol};

/// The outcome of waiting for the kernel's decision on a connection's first request.
pub enum FirstRequest {
    /// The kernel matched a route that forwards to this cluster. `buffered` is what to send
    /// the backend first; `consumed` is how many bytes were read from the client (more than
    /// `buffered` when the proxy took the client's ACK of its own HTTP/2 SETTINGS out).
    Decided {
        cluster: usize,
        cookie: u64,
        buffered: Vec<u8>,
        consumed: usize,
    },
    /// The user tier decides: run the L7 path over these bytes, then the socket. With
    /// `strip_settings_ack`, the proxy sent an HTTP/2 SETTINGS frame of its own and the
    /// client's ACK of it must not reach the user tier ([`StripSettingsAck`]).
    UserTier {
        buffered: Vec<u8>,
        strip_settings_ack: bool,
    },
    /// The client went away (or sent nothing in time) before a decision.
    Closed,
}

/// Reads what `client` has (at least one byte, waiting until `deadline`) onto `buffered`.
/// `false` when the client closed, failed or stayed silent.
async fn read_more(
    client: &TcpStream,
    buffered: &mut Vec<u8>,
    deadline: tokio::time::Instant,
) -> bool {
    loop {
        match tokio::time::timeout_at(deadline, client.readable()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => return false,
        }
        let start = buffered.len();
        buffered.resize(start + 4096, 0);
        match client.try_read(&mut buffered[start..]) {
            Ok(0) => {
                buffered.truncate(start);
                return false;
            }
            Ok(n) => {
                buffered.truncate(start + n);
                return true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => buffered.truncate(start),
            Err(_) => {
                buffered.truncate(start);
                return false;
            }
        }
    }
}

/// Writes all of `bytes` to `client` (a few bytes: one frame), waiting until `deadline`.
async fn write_now(
    client: &TcpStream,
    mut bytes: &[u8],
    deadline: tokio::time::Instant,
) -> std::io::Result<()> {
    while !bytes.is_empty() {
        tokio::time::timeout_at(deadline, client.writable())
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        match client.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl KernelBinding {
    /// Reads from `client` until the kernel has decided its first request, and says who
    /// handles the connection. Every byte read is returned, so nothing is lost on fallback.
    ///
    /// HTTP/2: a gRPC client (grpc-go) sends its first HEADERS only after the server's
    /// SETTINGS, so while the decision waits for HEADERS the proxy answers the client's
    /// preface with an empty SETTINGS frame of its own. The client's ACK of it belongs to
    /// neither the backend (which sends its own SETTINGS once spliced, and may treat an ACK
    /// for settings it never sent as a protocol error) nor the user tier: it is taken out.
    pub async fn first_request(&self, client: &TcpStream, timeout: Duration) -> FirstRequest {
        let Ok(cookie) = flatmesh_kernel::socket_cookie(client) else {
            return FirstRequest::UserTier {
                buffered: Vec::new(),
                strip_settings_ack: false,
            };
        };
        let mut buffered = Vec::with_capacity(4096);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut sent_settings = false;
        let decided = loop {
            match self.tier.l7_decision(cookie) {
                Ok(L7Decision::Backend { backend, .. }) => break backend as usize,
                Ok(L7Decision::Pending) if buffered.len() < FIRST_REQUEST_MAX => {}
                // Fallback, a connection the kernel never registered, or too much unread.
                _ => {
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::UserTier {
                        buffered,
                        strip_settings_ack: sent_settings,
                    };
                }
            }
            if !sent_settings && sniff(&buffered) == Some(Protocol::Http2) {
                if write_now(client, &H2_EMPTY_SETTINGS, deadline)
                    .await
                    .is_err()
                {
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::Closed;
                }
                sent_settings = true;
            }
            // The verdict runs before bytes reach the socket's queue, so the decision is
            // final for everything read so far; read more only while it is pending.
            if !read_more(client, &mut buffered, deadline).await {
                let _ = self.tier.l7_forget(cookie);
                return FirstRequest::Closed;
            }
        };
        let consumed = loop {
            if !sent_settings {
                break buffered.len();
            }
            match settings_ack_at(&buffered) {
                Ok(at) => {
                    let consumed = buffered.len();
                    buffered.drain(at..at + 9);
                    break consumed;
                }
                // The ACK is still on its way: the verdict passes the bytes of a decided,
                // not yet paired connection up to here.
                Err(true) if buffered.len() < FIRST_REQUEST_MAX => {
                    if !read_more(client, &mut buffered, deadline).await {
                        let _ = self.tier.l7_forget(cookie);
                        return FirstRequest::Closed;
                    }
                }
                Err(_) => {
                    // Not walkable HTTP/2 framing: let the user tier answer (and refuse) it.
                    let _ = self.tier.l7_forget(cookie);
                    return FirstRequest::UserTier {
                        buffered,
                        strip_settings_ack: true,
                    };
                }
            }
        };
        FirstRequest::Decided {
            cluster: decided,
            cookie,
            buffered,
            consumed,
        }
    }

    /// Hands a connection whose first request the kernel decided to the kernel, once the
    /// proxy has connected `upstream` for it, and sends the request bytes read so far
    /// (`buffered`) on. Which path it takes follows [`KernelBinding::choose_path`]: socket
    /// direct when client and backend are both local, else the sk_skb splice unless the
    /// backend's hop is sk_msg-redirected, else the user relay. Call
    /// [`KernelBinding::forget`] with `cookie` when the connection ends.
    pub async fn take_decided(
        &self,
        cookie: u64,
        client: &TcpStream,
        upstream: &mut TcpStream,
        buffered: &[u8],
        consumed: usize,
    ) -> std::io::Result<KernelPath> {
        use tokio::io::AsyncWriteExt as _;
        let redirect = self.redirect_on();
        let (client_local, upstream_local) = (peer_is_local(client), peer_is_local(upstream));
        if redirect && client_local && upstream_local {
            if let Some(mut d) = self.direct(client, upstream) {
                upstream.write_all(buffered).await?;
                // Everything read from the client is dealt with: arm with the bytes read.
                d.to_backend.forwarded(consumed, upstream);
                return Ok(KernelPath::Direct(Box::new(d)));
            }
        }
        if !(redirect && upstream_local) {
            if let Some((a, b)) = self.splice_decided(cookie, buffered, upstream).await? {
                return Ok(KernelPath::Spliced(a, b));
            }
            // splice_decided has sent the request when it gave up.
            return Ok(KernelPath::User);
        }
        upstream.write_all(buffered).await?;
        Ok(KernelPath::User)
    }

    /// Splices a decided connection: the upstream joins the sockhash with the client as its
    /// peer, the buffered request goes out, then the client's further bytes go straight to
    /// the upstream. Returns both cookies for [`KernelBinding::forget`], or `None` if the
    /// kernel refused (the caller then relays in user space).
    pub async fn splice_decided(
        &self,
        cookie: u64,
        buffered: &[u8],
        upstream: &mut TcpStream,
    ) -> std::io::Result<Option<(u64, u64)>> {
        use tokio::io::AsyncWriteExt as _;
        let up_cookie = match self.tier.l7_attach_upstream(cookie, upstream) {
            Ok(c) => c,
            Err(err) => {
                tracing::debug!(error = %err, "tier K could not attach the upstream; relaying in user space");
                let _ = self.tier.l7_forget(cookie);
                upstream.write_all(buffered).await?;
                return Ok(None);
            }
        };
        upstream.write_all(buffered).await?;
        if let Err(err) = self.tier.l7_pair(cookie, up_cookie) {
            tracing::debug!(error = %err, "tier K could not pair the connection; relaying in user space");
        }
        Ok(Some((cookie, up_cookie)))
    }
}
