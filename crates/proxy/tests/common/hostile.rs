//! Hostile clients and what they are measured against, for the budget tests
//! (`tests/h2_memory.rs`, `tests/budgets.rs`, `tests/fd_limit.rs`): raw HTTP/2 clients built on
//! the `h2` crate that open many streams and never read, a backend that answers every request
//! with a large body and counts its open connections, and the process's resident memory.
#![allow(dead_code, clippy::unwrap_used)]

use std::future::Future;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// The body every request to a [`BigBackend`] gets, in pieces of this static buffer (so the
/// backend allocates nothing per request and the test process's memory is the node's).
static PIECE: [u8; 64 * 1024] = [b'x'; 64 * 1024];

/// An HTTP/1.1 backend that answers every request with `body_len` bytes and counts its open
/// connections (now and at most).
pub struct BigBackend {
    pub addr: SocketAddr,
    open: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    answering: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl BigBackend {
    pub async fn start(body_len: usize) -> BigBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let answering = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(serve_big(
            listener,
            body_len,
            open.clone(),
            peak.clone(),
            answering.clone(),
        ));
        BigBackend {
            addr,
            open,
            peak,
            answering,
            task,
        }
    }

    /// Connections open right now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// The most connections that were open at once.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Connections in the middle of an answer (a request head read, its body not all
    /// written): held by a request. The others wait for a request (idle in the node's pool).
    pub fn answering(&self) -> usize {
        self.answering.load(Ordering::Relaxed)
    }
}

impl Drop for BigBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves every connection on one task, and looks at its connections before it accepts the
/// next one: a connection the node closed before opening another is counted as closed
/// before the new one is counted (with a task per connection, the scheduler may run the
/// accept first and count both). Before it counts a new connection it also asks the kernel
/// whether each older one was closed, since tokio hears of a close only when its reactor
/// next runs, which on a busy machine can be after the accept (a CI run counted 25 for 20).
async fn serve_big(
    listener: TcpListener,
    body_len: usize,
    open: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    answering: Arc<AtomicUsize>,
) {
    type Answer = Pin<Box<dyn Future<Output = ()> + Send>>;
    let mut conns: Vec<(RawFd, Answer)> = Vec::new();
    loop {
        let accepted = std::future::poll_fn(|cx| {
            conns.retain_mut(|(_, conn)| conn.as_mut().poll(cx).is_pending());
            open.store(conns.len(), Ordering::Relaxed);
            let accepted = ready!(listener.poll_accept(cx));
            // Dropping an answer closes its socket, so each fd is open while it is looked at.
            conns.retain(|(fd, _)| !closed_by_peer(*fd));
            Poll::Ready(accepted)
        })
        .await;
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let fd = stream.as_raw_fd();
        conns.push((
            fd,
            Box::pin(answer_big(stream, body_len, answering.clone())),
        ));
        open.store(conns.len(), Ordering::Relaxed);
        peak.fetch_max(conns.len(), Ordering::Relaxed);
    }
}

/// Whether the peer closed the connection on `fd`, asked of the kernel (a peek without
/// waiting): end of stream or an error (a reset) is closed; data or nothing yet is open.
fn closed_by_peer(fd: RawFd) -> bool {
    // SAFETY: the caller's connection owns `fd` and is alive for this call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut byte = [MaybeUninit::<u8>::uninit(); 1];
    match socket2::SockRef::from(&fd).peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(err) => err.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// Counts an answer in progress until dropped.
struct Answering(Arc<AtomicUsize>);

impl Answering {
    fn start(count: &Arc<AtomicUsize>) -> Answering {
        count.fetch_add(1, Ordering::Relaxed);
        Answering(count.clone())
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One connection of a [`BigBackend`]: each request head gets `body_len` bytes.
async fn answer_big(mut stream: TcpStream, body_len: usize, answering: Arc<AtomicUsize>) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        // One request head (the node sends no request bodies here), then the answer.
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        head.clear();
        let _answering = Answering::start(&answering);
        let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {body_len}\r\n\r\n");
        if stream.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
        let mut left = body_len;
        while left > 0 {
            let n = left.min(PIECE.len());
            if stream.write_all(&PIECE[..n]).await.is_err() {
                return;
            }
            left -= n;
        }
    }
}

/// A client socket that stops reading after its first `budget` bytes: the server's SETTINGS
/// get through, then the client reads nothing more, as a client that never reads.
pub struct StopsReading {
    inner: TcpStream,
    budget: usize,
}

impl AsyncRead for StopsReading {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.budget == 0 {
            // Never woken: the socket's receive queue fills, then the server's send buffer.
            return Poll::Pending;
        }
        let mut local = [0u8; 4096];
        let room = self.budget.min(buf.remaining()).min(local.len());
        let mut limited = ReadBuf::new(&mut local[..room]);
        let polled = Pin::new(&mut self.inner).poll_read(cx, &mut limited);
        let n = limited.filled().len();
        buf.put_slice(limited.filled());
        self.budget -= n;
        polled
    }
}

impl AsyncWrite for StopsReading {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A raw HTTP/2 client (the `h2` crate) that opens `streams` GETs of `url_path` on one
/// connection to `addr`, advertising `window` as its flow-control windows, and never reads a
/// response body. `reads`: the bytes of the server's it reads before it stops reading
/// (`None`: it keeps reading, which answers PINGs and SETTINGS but takes no data beyond the
/// window). Stopped (the connection closed) when dropped.
pub struct H2Attacker {
    tasks: JoinSet<()>,
}

impl H2Attacker {
    pub async fn open(
        addr: SocketAddr,
        url_path: &str,
        streams: usize,
        window: u32,
        reads: Option<usize>,
    ) -> H2Attacker {
        H2Attacker::open_pinging(addr, url_path, streams, window, reads, None).await
    }

    /// Like [`H2Attacker::open`], and sends a PING every `ping` while it lasts (a client that
    /// keeps its connection from looking idle).
    pub async fn open_pinging(
        addr: SocketAddr,
        url_path: &str,
        streams: usize,
        window: u32,
        reads: Option<usize>,
        ping: Option<Duration>,
    ) -> H2Attacker {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        if reads.is_some() {
            // A client that stops reading with a small receive queue: the node's answers
            // pile up in the node, not in this process's socket buffers.
            socket.set_recv_buffer_size(4096).unwrap();
        }
        let tcp = socket.connect(addr).await.unwrap();
        let io = StopsReading {
            inner: tcp,
            budget: reads.unwrap_or(usize::MAX),
        };
        let (client, conn) = h2::client::Builder::new()
            .initial_window_size(window)
            .initial_connection_window_size(window.max(65_535))
            .max_concurrent_reset_streams(usize::MAX)
            .handshake::<_, Bytes>(io)
            .await
            .unwrap();
        let mut conn = conn;
        let mut tasks = JoinSet::new();
        if let (Some(every), Some(mut pings)) = (ping, conn.ping_pong()) {
            tasks.spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    if pings.ping(h2::Ping::opaque()).await.is_err() {
                        return;
                    }
                }
            });
        }
        tasks.spawn(async move {
            let _ = conn.await;
        });
        let uri = format!("http://{addr}{url_path}");
        for _ in 0..streams {
            let client = client.clone();
            let uri = uri.clone();
            tasks.spawn(async move {
                let Ok(mut ready) = client.ready().await else {
                    return;
                };
                let req = http::Request::get(uri).body(()).unwrap();
                let Ok((response, _)) = ready.send_request(req, true) else {
                    return;
                };
                // The head may come; the body is never read (its receive stream is held
                // open without taking data), for as long as the task lives.
                if let Ok(resp) = response.await {
                    let _body = resp.into_body();
                    std::future::pending::<()>().await;
                }
            });
        }
        H2Attacker { tasks }
    }
}

/// The resident memory of this process, in bytes (VmRSS of /proc/self/status).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/self/status"));
    kib * 1024
}

/// `n` bytes in MiB, for messages.
pub fn mib(n: u64) -> f64 {
    n as f64 / (1024.0 * 1024.0)
}

/// Waits `d` (wall clock: the node runs on its own threads).
pub async fn settle(d: Duration) {
    tokio::time::sleep(d).await;
}
