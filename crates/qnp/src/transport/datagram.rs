//! The datagram sockets QNP runs over: real UDP, an in-memory network for deterministic tests,
//! and a lossy shim that drops, duplicates and reorders packets.

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A connectionless datagram socket.
pub trait Datagram: Send + Sync + 'static {
    /// Sends one datagram. Like UDP, delivery is not guaranteed.
    fn send_to(&self, buf: &[u8], to: SocketAddr) -> impl Future<Output = io::Result<()>> + Send;
    /// Receives one datagram into `buf`; returns its length and sender.
    fn recv_from(
        &self,
        buf: &mut [u8],
    ) -> impl Future<Output = io::Result<(usize, SocketAddr)>> + Send;
    /// The address peers send to.
    fn local_addr(&self) -> io::Result<SocketAddr>;
}

impl Datagram for tokio::net::UdpSocket {
    async fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<()> {
        tokio::net::UdpSocket::send_to(self, buf, to)
            .await
            .map(drop)
    }
    async fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        tokio::net::UdpSocket::recv_from(self, buf).await
    }
    fn local_addr(&self) -> io::Result<SocketAddr> {
        tokio::net::UdpSocket::local_addr(self)
    }
}

type Inbox = mpsc::UnboundedSender<(Vec<u8>, SocketAddr)>;

/// An in-memory datagram network: sockets created from one `MemNet` reach each other by address.
/// Nothing in it depends on wall-clock time, so tests on it run on tokio's paused clock.
#[derive(Clone, Default)]
pub struct MemNet {
    sockets: Arc<Mutex<HashMap<SocketAddr, Inbox>>>,
}

impl MemNet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Creates a socket at `addr`, replacing any earlier socket there.
    pub fn socket(&self, addr: SocketAddr) -> MemSocket {
        let (tx, rx) = mpsc::unbounded_channel();
        self.sockets.lock().insert(addr, tx);
        MemSocket {
            net: self.clone(),
            addr,
            rx: tokio::sync::Mutex::new(rx),
        }
    }
}

/// A socket on a [`MemNet`].
pub struct MemSocket {
    net: MemNet,
    addr: SocketAddr,
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<(Vec<u8>, SocketAddr)>>,
}

impl Datagram for MemSocket {
    async fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<()> {
        let inbox = self.net.sockets.lock().get(&to).cloned();
        // Like UDP: a datagram to nobody vanishes without an error.
        if let Some(inbox) = inbox {
            let _ = inbox.send((buf.to_vec(), self.addr));
        }
        Ok(())
    }
    async fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        let mut rx = self.rx.lock().await;
        let (data, from) = rx.recv().await.ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotConnected, "the in-memory network is gone")
        })?;
        // Like UDP: a datagram longer than the buffer is truncated.
        let n = data.len().min(buf.len());
        buf[..n].copy_from_slice(&data[..n]);
        Ok((n, from))
    }
    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }
}

/// How a [`LossySocket`] mistreats the datagrams it sends.
#[derive(Debug, Clone, Copy)]
pub struct Impairment {
    /// Probability that a datagram is dropped.
    pub drop: f64,
    /// Probability that a datagram is sent twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back, so later ones overtake it.
    pub delay: f64,
    /// The longest hold-back.
    pub max_delay: Duration,
    /// Seed of the random choices, so a failing run can be replayed.
    pub seed: u64,
}

/// A socket wrapper that drops, duplicates and delays (reorders) outgoing datagrams.
pub struct LossySocket<S> {
    inner: Arc<S>,
    how: Impairment,
    rng: Mutex<StdRng>,
}

impl<S: Datagram> LossySocket<S> {
    pub fn new(inner: S, how: Impairment) -> Self {
        LossySocket {
            inner: Arc::new(inner),
            how,
            rng: Mutex::new(StdRng::seed_from_u64(how.seed)),
        }
    }
}

impl<S: Datagram> Datagram for LossySocket<S> {
    async fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<()> {
        let (dropped, copies, delay) = {
            let mut rng = self.rng.lock();
            let dropped = rng.random_bool(self.how.drop);
            let copies = if rng.random_bool(self.how.duplicate) {
                2
            } else {
                1
            };
            let delay = if rng.random_bool(self.how.delay) {
                Some(self.how.max_delay.mul_f64(rng.random::<f64>()))
            } else {
                None
            };
            (dropped, copies, delay)
        };
        if dropped {
            return Ok(());
        }
        for _ in 0..copies {
            match delay {
                Some(d) => {
                    let inner = Arc::clone(&self.inner);
                    let data = buf.to_vec();
                    tokio::spawn(async move {
                        tokio::time::sleep(d).await;
                        let _ = inner.send_to(&data, to).await;
                    });
                }
                None => self.inner.send_to(buf, to).await?,
            }
        }
        Ok(())
    }
    fn recv_from(
        &self,
        buf: &mut [u8],
    ) -> impl Future<Output = io::Result<(usize, SocketAddr)>> + Send {
        self.inner.recv_from(buf)
    }
    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}
