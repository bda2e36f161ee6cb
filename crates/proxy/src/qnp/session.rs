//! Client sessions of one qnp socket (Envoy's udp_proxy sessions): per client and worker, a
//! UDP socket of the node connected to the worker. A client's packets go to the worker from
//! it, and what the worker sends back to it goes to the client from the listener's address.
//! A session ends after `idle_timeout` without a packet either way; each socket task holds at
//! most `max_sessions`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket as StdUdp};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::time::Instant;

/// The largest UDP payload: a worker's answer is relayed whole.
const MAX_DATAGRAM: usize = 65_536;

thread_local! {
    /// The receive buffer of every session on this worker thread: answers are relayed without
    /// an await in between, so one buffer serves them all (a session holds none of its own).
    static ANSWER: RefCell<Vec<u8>> = RefCell::new(vec![0; MAX_DATAGRAM]);
}

struct Session {
    /// The socket's sending side, used without tokio: a socket registered a moment ago has no
    /// readiness yet, and tokio's `try_send` would refuse its first packet.
    sender: StdUdp,
    /// Milliseconds since `opened` of the last packet either way.
    last: Arc<AtomicU64>,
    opened: Instant,
    relay: tokio::task::AbortHandle,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.relay.abort();
    }
}

fn since(opened: Instant) -> u64 {
    opened.elapsed().as_millis() as u64
}

/// The sessions of one listening socket; dropping it ends them all.
#[derive(Default)]
pub struct Sessions {
    open: HashMap<(SocketAddr, SocketAddr), Session>,
}

/// Why a packet could not be relayed.
pub enum RelayError {
    /// `max_sessions` are open.
    Full,
    /// The session's socket could not be opened or could not send.
    Send,
}

impl Sessions {
    /// Sends `pkt` from `client` to `worker`, through their session; opens it if needed
    /// (`Ok(true)`: a session was opened). Never waits: a send that would block drops the
    /// packet (the client retransmits), so one slow worker cannot stall the socket.
    pub fn relay(
        &mut self,
        listener: &Arc<StdUdp>,
        client: SocketAddr,
        worker: SocketAddr,
        pkt: &[u8],
        idle: Duration,
        max: usize,
    ) -> Result<bool, RelayError> {
        let key = (client, worker);
        let mut opened = false;
        if self.open.get(&key).is_none_or(|s| s.relay.is_finished()) {
            if self.open.len() >= max {
                self.open.retain(|_, s| !s.relay.is_finished());
                if self.open.len() >= max {
                    return Err(RelayError::Full);
                }
            }
            let session = open(listener, client, worker, idle).map_err(|e| {
                tracing::debug!(%worker, error = %e, "qnp: cannot open a session to the worker");
                RelayError::Send
            })?;
            self.open.insert(key, session);
            opened = true;
        }
        let Some(s) = self.open.get(&key) else {
            return Err(RelayError::Send);
        };
        s.last.store(since(s.opened), Ordering::Relaxed);
        match s.sender.send(pkt) {
            Ok(_) => Ok(opened),
            Err(_) => Err(RelayError::Send),
        }
    }
}

fn open(
    listener: &Arc<StdUdp>,
    client: SocketAddr,
    worker: SocketAddr,
    idle: Duration,
) -> std::io::Result<Session> {
    let any: SocketAddr = if worker.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let std = StdUdp::bind(any)?;
    std.connect(worker)?;
    std.set_nonblocking(true)?;
    let sender = std.try_clone()?;
    let upstream = UdpSocket::from_std(std)?;
    let last = Arc::new(AtomicU64::new(0));
    let opened = Instant::now();
    let relay = tokio::spawn(relay_answers(
        upstream,
        listener.clone(),
        client,
        idle,
        last.clone(),
        opened,
    ))
    .abort_handle();
    Ok(Session {
        sender,
        last,
        opened,
        relay,
    })
}

/// Relays what the worker sends to the client, until the session has been idle for `idle`.
async fn relay_answers(
    upstream: UdpSocket,
    listener: Arc<StdUdp>,
    client: SocketAddr,
    idle: Duration,
    last: Arc<AtomicU64>,
    opened: Instant,
) {
    loop {
        let quiet =
            Duration::from_millis(since(opened).saturating_sub(last.load(Ordering::Relaxed)));
        let Some(wait) = idle.checked_sub(quiet).filter(|w| !w.is_zero()) else {
            return;
        };
        match tokio::time::timeout(wait, upstream.readable()).await {
            Ok(Ok(())) => {}
            // The socket failed: the session ends, the next packet opens another.
            Ok(Err(_)) => return,
            Err(_elapsed) => continue,
        }
        ANSWER.with_borrow_mut(|buf| loop {
            match upstream.try_recv(buf) {
                Ok(n) => {
                    last.store(since(opened), Ordering::Relaxed);
                    // A full send buffer drops the answer; the client retransmits its request
                    // and the worker answers it again from its cache.
                    let _ = listener.send_to(&buf[..n], client);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // An ICMP error from the worker (no one listens there yet): keep the session.
                Err(_) => break,
            }
        });
    }
}
