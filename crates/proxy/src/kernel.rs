//! Tier K in the node: attach what the config's `kernel:` section asks for, keep the kernel's
//! maps in step with each config snapshot, and the per-connection paths that hand a
//! connection's bytes to the kernel (docs/kernel.md):
//! - **socket direct** (`kernel.redirect`): when a connection's client and backend are both
//!   on this host, [`KernelBinding::direct`] arms sk_msg shortcuts so the client's sendmsg
//!   lands in the backend's socket and back, without TCP and without the proxy; the proxy
//!   keeps both connections open and carries FIN, RST and whatever the kernel does not;
//! - **splice** (`kernel.tcp_splice`, and decided L7 connections with a remote end):
//!   [`KernelBinding::splice`] pairs the proxy's two sockets and the sk_skb verdict moves every
//!   later byte between them;
//! - the L7 `http` listener: `fm_sockops_l7` registers each accepted connection before any
//!   payload arrives; [`KernelBinding::first_request`] reads the kernel's decision for the
//!   first request and either hands the connection to the kernel for the decided cluster or
//!   hands the bytes read so far to the user L7 path, which then answers exactly as without
//!   tier K.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use flatmesh_config::Config;
use flatmesh_kernel::{
    CaptureConfig, DirectBytes, HopPort, KernelConfig, KernelEntry, KernelTier, L7Decision, SockKey,
};
use flatmesh_rules::{KernelRuntime, TableKind};
use parking_lot::Mutex;
use tokio::net::TcpStream;

use crate::snapshot::Snapshot;

/// How much of a connection the node reads while the kernel has not decided its first
/// request. The kernel only looks at the first 256 bytes of an HTTP/1.1 request and at the
/// first HEADERS frame of HTTP/2, so a connection past this is the user tier's. The verdict
/// gives up at the same bound (FM_PENDING_MAX in bpf/dispatch.bpf.c: `PendingLimit`).
const FIRST_REQUEST_MAX: usize = 16 * 1024;

/// The node's handle on tier K.
pub struct KernelBinding {
    tier: KernelTier,
    installed: Mutex<Installed>,
}

/// What is in the kernel's maps now, so a reload only changes the difference.
#[derive(Default)]
struct Installed {
    services: BTreeSet<(SocketAddr, SocketAddr)>,
    redirect_ports: BTreeMap<u16, HopPort>,
    l7_ports: BTreeSet<u16>,
    /// Why the last route table could not be installed, if it could not.
    table_error: Option<String>,
}

/// What a snapshot asks of the kernel, worked out without touching it.
#[derive(Debug, Default, PartialEq)]
pub struct KernelPlan {
    /// Captured service address → the node listener that takes it.
    pub services: BTreeSet<(SocketAddr, SocketAddr)>,
    /// Ports whose local hops sk_msg shortens, and which ends of their connections join.
    pub redirect_ports: BTreeMap<u16, HopPort>,
    /// Http listener ports whose connections the verdict decides.
    pub l7_ports: BTreeSet<u16>,
    /// The L7 listener's route table, as the tier-K lowering made it.
    pub routes: Vec<KernelEntry>,
}

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

/// The HTTP/2 client connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// An empty SETTINGS frame: the server connection preface with every setting at its default.
const H2_EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];

/// Where the client's first SETTINGS ACK sits in `stream` (bytes from the connection's start):
/// `Ok(offset)` of its 9-byte frame, `Err(true)` if more bytes are needed to tell, `Err(false)`
/// if the stream is not HTTP/2 framing the proxy can walk.
fn settings_ack_at(stream: &[u8]) -> Result<usize, bool> {
    if !stream.starts_with(H2_PREFACE) {
        return Err(stream.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(stream));
    }
    let mut at = H2_PREFACE.len();
    loop {
        let Some(h) = stream.get(at..at + 9) else {
            return Err(true);
        };
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        if h[3] == 4 && h[4] & 1 == 1 && len == 0 {
            return Ok(at);
        }
        at += 9 + len;
    }
}

/// Attaches tier K if the config has a `kernel:` section and the host can run it. Without
/// privileges or kernel support it logs one line saying what is missing and returns why
/// tier K is off (for `/rules`): the node then runs on the user tiers.
pub fn attach(config: &Config) -> Result<KernelBinding, String> {
    let Some(k) = config.kernel.as_ref() else {
        return Err("the config has no `kernel:` section".into());
    };
    if let Some(line) = flatmesh_kernel::probe() {
        tracing::warn!("{line}");
        let missing = flatmesh_kernel::missing_requirements().join(", ");
        return Err(format!("missing {missing}"));
    }
    let cfg = KernelConfig {
        pin_dir: k
            .pin_dir
            .clone()
            .unwrap_or_else(|| flatmesh_kernel::DEFAULT_PIN_DIR.into()),
        cgroup_root: k
            .cgroup_root
            .clone()
            .unwrap_or_else(flatmesh_kernel::default_cgroup_root),
        capture: k.capture.as_ref().map(|c| CaptureConfig {
            cgroup: c.cgroup.clone(),
        }),
        redirect: k.redirect,
        // The splice of tcp listeners runs on the same sk_skb verdict as L7 dispatch.
        l7_dispatch: k.l7_dispatch || k.tcp_splice,
        l7_stream_parser: k.l7_stream_parser,
        own_netns_only: true,
    };
    if cfg.capture.is_none() && !cfg.redirect && !cfg.l7_dispatch {
        tracing::info!("the kernel section enables nothing; tier K stays off");
        return Err("the kernel section enables nothing".into());
    }
    let tier = match KernelTier::attach(&cfg) {
        Ok(tier) => tier,
        Err(err) => {
            tracing::warn!("tier K (eBPF) could not attach: {err}; running on the user tiers");
            return Err(format!("it could not attach: {err}"));
        }
    };
    if cfg.capture.is_some() {
        // The node's own upstream connections must never be captured back to itself.
        if let Err(err) = tier.bypass_pid(std::process::id()) {
            tracing::warn!("tier K: cannot exempt the node from capture ({err}); capture is off");
            let _ = tier.detach();
            return Err(format!("cannot exempt the node from capture: {err}"));
        }
    }
    tracing::info!(
        pin_dir = %cfg.pin_dir.display(),
        capture = cfg.capture.is_some(),
        redirect = cfg.redirect,
        l7_dispatch = k.l7_dispatch,
        tcp_splice = k.tcp_splice,
        "tier K (eBPF) attached"
    );
    Ok(KernelBinding {
        tier,
        installed: Mutex::new(Installed::default()),
    })
}

/// Works out what `snapshot` asks of the kernel. `bound` gives a listener's actual address
/// (the configured one may have port 0).
pub fn plan(snapshot: &Snapshot, bound: &dyn Fn(&str) -> Option<SocketAddr>) -> KernelPlan {
    let config = &snapshot.config;
    let mut plan = KernelPlan::default();
    let Some(k) = &config.kernel else {
        return plan;
    };
    let l7_listener = config.kernel_l7_listener();
    if let Some(capture) = &k.capture {
        for s in &capture.services {
            if let Some(addr) = bound(&s.listener) {
                plan.services
                    .insert((s.address, reachable(addr, s.address.is_ipv4())));
            }
        }
    }
    for (lid, l) in snapshot.listeners.iter().enumerate() {
        let table = &snapshot.program.listeners()[lid];
        let port = bound(&l.name).map(|a| a.port());
        match (&table.kind, port) {
            (TableKind::Http(_), Some(port)) if Some(l.name.as_str()) == l7_listener => {
                plan.l7_ports.insert(port);
                plan.routes = snapshot.program.kernel().entries.clone();
                // The accepted end belongs to the sk_skb dispatcher, which must see the
                // client's bytes come in through TCP; the client end joins the sockhash so a
                // decided connection can go socket direct.
                if k.redirect {
                    plan.redirect_ports.insert(port, HopPort::ClientOnly);
                }
            }
            // tcp listeners and the other http listeners: both ends of the local hop.
            (_, Some(port)) if k.redirect => {
                plan.redirect_ports.insert(port, HopPort::Both);
            }
            _ => {}
        }
    }
    if k.redirect {
        // Local backends: the proxy's upstream hop to them is shortened, and with the client
        // end they make socket direct possible.
        for c in &snapshot.clusters {
            for e in c.endpoints.iter().filter(|e| e.ip().is_loopback()) {
                plan.redirect_ports.entry(e.port()).or_insert(HopPort::Both);
            }
        }
    }
    plan
}

/// A listener bound to the unspecified address is reached on loopback, in the captured
/// service's family when the listener is dual stack ([::] takes IPv4 on 127.0.0.1).
fn reachable(addr: SocketAddr, for_ipv4: bool) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() && for_ipv4 => {
            (Ipv4Addr::LOCALHOST, addr.port()).into()
        }
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
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

pin_project_lite::pin_project! {
    /// The client's side of an HTTP/2 connection with the first SETTINGS ACK frame taken
    /// out: the ACK of the SETTINGS the proxy sent while tier K was deciding, which the
    /// user tier's HTTP/2 server never sent and would refuse as a protocol error. Walks the
    /// frames from the preface up to that ACK (at most [`FIRST_REQUEST_MAX`] bytes), then
    /// passes everything through.
    pub struct StripSettingsAck<S> {
        #[pin]
        inner: S,
        // Bytes read from `inner` and not yet handed out (or dropped).
        held: Vec<u8>,
        // Offset in the stream of `held[0]`.
        held_at: usize,
        // Stream offset up to which the bytes are known to need no stripping.
        clear_to: usize,
        done: bool,
    }
}

impl<S> StripSettingsAck<S> {
    pub fn new(inner: S) -> Self {
        StripSettingsAck {
            inner,
            held: Vec::new(),
            held_at: 0,
            clear_to: 0,
            done: false,
        }
    }
}

impl<S: tokio::io::AsyncRead> tokio::io::AsyncRead for StripSettingsAck<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let mut this = self.project();
        loop {
            // Hand out what is known to be clear.
            let clear = if *this.done {
                this.held.len()
            } else {
                this.clear_to
                    .saturating_sub(*this.held_at)
                    .min(this.held.len())
            };
            if clear > 0 {
                let n = clear.min(buf.remaining());
                buf.put_slice(&this.held[..n]);
                this.held.drain(..n);
                *this.held_at += n;
                return Poll::Ready(Ok(()));
            }
            if *this.done {
                return this.inner.as_mut().poll_read(cx, buf);
            }
            // Read more, then walk the frames the held bytes complete.
            let mut chunk = [0u8; 4096];
            let mut rb = tokio::io::ReadBuf::new(&mut chunk);
            match this.inner.as_mut().poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    // EOF: whatever is held goes out as it is.
                    *this.done = true;
                    if this.held.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                    continue;
                }
                Poll::Ready(Ok(())) => this.held.extend_from_slice(rb.filled()),
            }
            // Re-walk from the stream's start over a view of everything seen so far: cheap,
            // as only the first few frames are ever walked.
            let walked = *this.held_at;
            let mut at = (*this.clear_to).max(walked);
            if at < H2_PREFACE.len() {
                at = (walked + this.held.len()).min(H2_PREFACE.len());
                *this.clear_to = at;
                if at < H2_PREFACE.len() {
                    continue;
                }
            }
            loop {
                let rel = at - walked;
                let Some(h) = this.held.get(rel..rel + 9) else {
                    break;
                };
                let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                if h[3] == 4 && h[4] & 1 == 1 && len == 0 {
                    this.held.drain(rel..rel + 9);
                    *this.done = true;
                    break;
                }
                at += 9 + len;
                *this.clear_to = at;
                if at >= FIRST_REQUEST_MAX {
                    *this.done = true;
                    break;
                }
            }
        }
    }
}

impl<S: tokio::io::AsyncWrite> tokio::io::AsyncWrite for StripSettingsAck<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

/// Whether the far end of `sock` is on this host (and in its network namespace): a loopback
/// peer, or a peer that has the socket's own local address.
pub fn peer_is_local(sock: &TcpStream) -> bool {
    let unmapped = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    match (sock.local_addr(), sock.peer_addr()) {
        (Ok(local), Ok(peer)) => {
            let (local, peer) = (unmapped(local.ip()), unmapped(peer.ip()));
            peer.is_loopback() || peer == local
        }
        _ => false,
    }
}

/// How a connection's bytes travel once its upstream is connected.
pub enum KernelPath {
    /// The user relay carries everything (local hops may still be shortened by sk_msg).
    User,
    /// The sk_skb verdict moves the bytes between the proxy's two sockets; the cookies are
    /// for [`KernelBinding::forget`].
    Spliced(u64, u64),
    /// Socket direct: the client's and the backend's sockets talk straight to each other
    /// (boxed: it is much larger than the other variants).
    Direct(Box<DirectConn>),
}

/// One direction of a socket-direct connection, as the proxy's relay sees it.
pub struct DirectDir {
    tier: KernelTier,
    from: SockKey,
    to: SockKey,
    forwarded: u64,
    armed: bool,
}

impl DirectDir {
    /// Call after writing `n` more bytes of this direction through `through` (the proxy's
    /// socket toward the receiver). Arms the shortcut again with the new total, or gives it
    /// up for good if `through` did not hand its bytes to the receiver's socket in the kernel
    /// (then the direct bytes could overtake them).
    pub fn forwarded(&mut self, n: usize, through: &TcpStream) {
        self.forwarded += n as u64;
        if !self.armed {
            return;
        }
        if crate::tcp::sent_through_tcp(through) {
            self.armed = false;
            if let Err(err) = self.tier.direct_disarm(&self.from) {
                tracing::debug!(error = %err, "tier K: disarming a socket-direct shortcut failed");
            }
            return;
        }
        if let Err(err) = self.tier.direct_arm(&self.from, &self.to, self.forwarded) {
            tracing::debug!(error = %err, "tier K: re-arming a socket-direct shortcut failed; the proxy relays");
            self.armed = false;
        }
    }
}

/// A connection going socket direct. Dropping it removes its shortcuts.
pub struct DirectConn {
    tier: KernelTier,
    client: SockKey,
    backend: SockKey,
    /// Client to backend, backend to client.
    pub to_backend: DirectDir,
    pub to_client: DirectDir,
    ended: bool,
}

impl DirectConn {
    /// Removes both shortcuts; returns the bytes the kernel carried directly.
    pub fn end(mut self) -> DirectBytes {
        self.finish()
    }

    fn finish(&mut self) -> DirectBytes {
        if std::mem::replace(&mut self.ended, true) {
            return DirectBytes::default();
        }
        match self.tier.direct_end(&self.client, &self.backend) {
            Ok(b) => b,
            Err(err) => {
                tracing::warn!(error = %err, "tier K: removing a socket-direct shortcut failed");
                DirectBytes::default()
            }
        }
    }
}

impl Drop for DirectConn {
    fn drop(&mut self) {
        self.finish();
    }
}

impl KernelBinding {
    /// Brings the kernel's maps in step with `plan`. Failures are logged per entry: the
    /// user tiers still carry whatever the kernel does not.
    pub fn install(&self, plan: &KernelPlan) {
        let mut installed = self.installed.lock();
        let log = |what: &str, err: flatmesh_kernel::KernelError| {
            tracing::warn!("tier K: cannot {what}: {err}; the user tiers carry it instead");
        };
        for gone in installed.services.difference(&plan.services) {
            if let Err(e) = self.tier.remove_service(gone.0) {
                log("remove a captured service", e);
            }
        }
        for (service, proxy) in plan.services.difference(&installed.services) {
            if let Err(e) = self.tier.add_service(*service, *proxy) {
                log(&format!("capture {service}"), e);
            }
        }
        for port in installed.redirect_ports.keys() {
            if !plan.redirect_ports.contains_key(port) {
                if let Err(e) = self.tier.remove_redirect_port(*port) {
                    log("unmark a redirect port", e);
                }
            }
        }
        for (port, mode) in &plan.redirect_ports {
            if installed.redirect_ports.get(port) != Some(mode) {
                if let Err(e) = self.tier.add_hop_port(*port, *mode) {
                    log(&format!("shorten hops on port {port}"), e);
                }
            }
        }
        for port in installed.l7_ports.difference(&plan.l7_ports) {
            if let Err(e) = self.tier.remove_l7_port(*port) {
                log("unmark an L7 port", e);
            }
        }
        if !plan.l7_ports.is_empty() {
            // Table before port: a connection registered on the port must find the new routes.
            let result = self.tier.set_routes(&plan.routes);
            installed.table_error = result.as_ref().err().map(|e| e.to_string());
            if let Err(e) = result {
                log("install the L7 route table", e);
            }
        }
        for port in plan.l7_ports.difference(&installed.l7_ports) {
            if let Err(e) = self.tier.add_l7_port(*port) {
                log(&format!("dispatch port {port} in the kernel"), e);
            }
        }
        installed.services = plan.services.clone();
        installed.redirect_ports = plan.redirect_ports.clone();
        installed.l7_ports = plan.l7_ports.clone();
    }

    /// What this node has of tier K, for `/rules`.
    pub fn runtime(&self) -> KernelRuntime {
        KernelRuntime::Attached {
            verdict: self.tier.config().l7_dispatch,
            table_error: self.installed.lock().table_error.clone(),
        }
    }

    /// Whether sk_msg local-hop redirect (and so socket direct) is attached.
    pub fn redirect_on(&self) -> bool {
        self.tier.config().redirect
    }

    /// Arms socket direct for a connection whose client (the peer of `accepted`) and backend
    /// (the peer of `upstream`) are both on this host. `None` (logged at debug) leaves the
    /// connection to the other paths. Call before relaying any byte.
    pub fn direct(&self, accepted: &TcpStream, upstream: &TcpStream) -> Option<DirectConn> {
        let keys = SockKey::of_peer(accepted).and_then(|c| Ok((c, SockKey::of_peer(upstream)?)));
        let (client, backend) = match keys {
            Ok(k) => k,
            Err(err) => {
                tracing::debug!(error = %err, "tier K: no socket direct for this connection");
                return None;
            }
        };
        let armed = self
            .tier
            .direct_begin(&client, &backend)
            .and_then(|()| self.tier.direct_arm(&backend, &client, 0))
            .and_then(|()| self.tier.direct_arm(&client, &backend, 0));
        let conn = DirectConn {
            tier: self.tier.clone(),
            client,
            backend,
            to_backend: DirectDir {
                tier: self.tier.clone(),
                from: client,
                to: backend,
                forwarded: 0,
                armed: true,
            },
            to_client: DirectDir {
                tier: self.tier.clone(),
                from: backend,
                to: client,
                forwarded: 0,
                armed: true,
            },
            ended: false,
        };
        match armed {
            Ok(()) => Some(conn),
            Err(err) => {
                // Dropping `conn` removes whatever was armed.
                tracing::debug!(error = %err, "tier K: cannot arm socket direct; the proxy relays");
                None
            }
        }
    }

    /// Pairs a tcp listener's client and upstream sockets in the kernel. `None` (logged at
    /// debug) leaves the whole connection to the user relay.
    pub fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Option<(u64, u64)> {
        match self.tier.splice(client, upstream) {
            Ok(cookies) => Some(cookies),
            Err(err) => {
                tracing::debug!(error = %err, "tier K splice refused; the user relay carries the connection");
                None
            }
        }
    }

    /// Ends a spliced pair: the bytes the kernel moved from each socket (client, upstream)
    /// without user space seeing them, then its state is dropped. `None` when the kernel lost
    /// count (the map entry was evicted).
    pub fn splice_end(&self, client: u64, upstream: u64) -> Option<(u64, u64)> {
        let counts = match (
            self.tier.l7_spliced_bytes(client),
            self.tier.l7_spliced_bytes(upstream),
        ) {
            (Ok(Some(a)), Ok(Some(b))) => Some((a, b)),
            _ => None,
        };
        self.forget(&[client, upstream]);
        counts
    }

    /// Drops the kernel's state of finished connections (their sockhash entries go when the
    /// sockets close).
    pub fn forget(&self, cookies: &[u64]) {
        for c in cookies {
            let _ = self.tier.l7_forget(*c);
        }
    }

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
            if !sent_settings && buffered.starts_with(H2_PREFACE) {
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
    /// (`buffered`) on. Which path it takes follows [`crate::tcp::kernel_path`]: socket
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            0,
        ];
        f.extend_from_slice(payload);
        f
    }

    /// preface, SETTINGS, WINDOW_UPDATE, SETTINGS ACK, HEADERS, SETTINGS ACK (a second one).
    fn client_stream() -> (Vec<u8>, usize) {
        let mut s = H2_PREFACE.to_vec();
        s.extend(frame(4, 0, &[0, 3, 0, 0, 0, 100]));
        s.extend(frame(8, 0, &[0, 0, 0xff, 0xff]));
        let ack = s.len();
        s.extend(frame(4, 1, &[]));
        s.extend(frame(1, 4, &[0x83, 0x86, 0x84]));
        s.extend(frame(4, 1, &[]));
        (s, ack)
    }

    #[test]
    fn the_first_settings_ack_is_found_after_the_preface() {
        let (s, ack) = client_stream();
        assert_eq!(settings_ack_at(&s), Ok(ack));
        // Not there yet: more bytes needed, at any cut before the ACK's end.
        for cut in 0..ack + 9 {
            assert_eq!(settings_ack_at(&s[..cut]), Err(true), "cut at {cut}");
        }
        assert_eq!(settings_ack_at(b"GET / HTTP/1.1\r\n"), Err(false));
    }

    async fn strip(input: Vec<u8>, chunk: usize) -> Vec<u8> {
        let (mut a, b) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            for c in input.chunks(chunk) {
                a.write_all(c).await.unwrap();
            }
        });
        let mut out = Vec::new();
        let mut s = StripSettingsAck::new(b);
        s.read_to_end(&mut out).await.unwrap();
        writer.await.unwrap();
        out
    }

    #[tokio::test]
    async fn only_the_first_settings_ack_is_taken_out_however_the_bytes_arrive() {
        let (s, ack) = client_stream();
        let mut want = s.clone();
        want.drain(ack..ack + 9);
        for chunk in [1, 2, 7, 9, 24, 25, 1000] {
            assert_eq!(strip(s.clone(), chunk).await, want, "chunks of {chunk}");
        }
        // A stream without any ACK passes unchanged.
        let mut none = H2_PREFACE.to_vec();
        none.extend(frame(4, 0, &[]));
        none.extend(frame(1, 4, &[0x82]));
        assert_eq!(strip(none.clone(), 5).await, none);
    }
}
