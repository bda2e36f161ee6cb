//! Receive-side dispatch (RSD) in user space, on per-core shared-nothing workers (§3, §5).
//!
//! Every worker is one thread with its own single-threaded runtime and its own QNP endpoint; no
//! state is shared between workers. Requests reach them in one of three ways:
//!
//! - [`Mode::Reuseport`]: each worker has its own UDP socket on the service port (SO_REUSEPORT)
//!   and the kernel spreads flows by hash. This is the RSS analogue: L4 cost, no L7 control.
//! - [`Mode::SoftwareQueue`] / [`Mode::SoftwareUds`]: the paper's software baseline. Dispatcher
//!   threads (SO_REUSEPORT among themselves) parse the QNP header and the dispatch field of each
//!   first packet, match the skip-and-check rules, cache the decision in a stash for the request's
//!   follow-on packets (§4.2.2), and pass the packet to the chosen worker through an in-process
//!   queue or a Unix datagram socket.
//!
//! Workers answer from their own ephemeral UDP socket; QNP matches responses by `req_acked_id`,
//! not by source address, so clients accept them.

use crate::header::QnpHeader;
use crate::rules::{Decision, FastMatcher, RuleSet};
use crate::tlv;
use crate::transport::{Datagram, Endpoint, OutReq, QnpConfig, Request, RxStats};
use crate::QnpError;
use arc_swap::ArcSwap;
use bytes::Bytes;
use parking_lot::Mutex;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket as StdUdp};
use std::os::unix::net::UnixDatagram as StdUnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::mpsc;

/// The paper's stash depth (§4.2.2).
pub const STASH_DEPTH: usize = 256;

/// Cached dispatch decisions of requests whose first packet was seen: a direct-mapped table
/// indexed by request id, like the paper's 256-entry stash. A collision evicts the older
/// request; its remaining packets are then dropped and the sender retransmits.
pub struct Stash {
    slots: Vec<Option<(SocketAddr, u32, u8)>>,
}

impl Stash {
    pub fn new(depth: usize) -> Stash {
        Stash {
            slots: vec![None; depth.max(1)],
        }
    }
    fn slot(&self, req_id: u32) -> usize {
        req_id as usize % self.slots.len()
    }
    pub fn get(&self, peer: SocketAddr, req_id: u32) -> Option<u8> {
        match self.slots[self.slot(req_id)] {
            Some((p, id, q)) if p == peer && id == req_id => Some(q),
            _ => None,
        }
    }
    pub fn put(&mut self, peer: SocketAddr, req_id: u32, queue: u8) {
        let i = self.slot(req_id);
        self.slots[i] = Some((peer, req_id, queue));
    }
}

/// The dispatch rules in force. Reads are lock-free (arc-swap); a reconfiguration swaps in a
/// whole new matcher, so a packet sees either the old rules or the new ones, never a mix.
pub struct Rsd {
    matcher: ArcSwap<FastMatcher>,
    rules: Mutex<RuleSet>,
}

impl Rsd {
    pub fn new(rules: RuleSet) -> Rsd {
        Rsd {
            matcher: ArcSwap::from_pointee(FastMatcher::new(&rules)),
            rules: Mutex::new(rules),
        }
    }

    /// Decides where a packet goes. First packets are matched and their decision stashed;
    /// follow-on packets reuse it, and are dropped without it (their first packet was not seen).
    pub fn decide(&self, pkt: &[u8], peer: SocketAddr, stash: &mut Stash) -> Decision {
        let Ok((hdr, payload)) = QnpHeader::parse(pkt) else {
            return Decision::Drop;
        };
        if hdr.pkt_seq_num_in_req != 0 {
            return stash
                .get(peer, hdr.req_id)
                .map_or(Decision::Drop, Decision::Queue);
        }
        let d = self
            .matcher
            .load()
            .eval(hdr.app_id, hdr.req_type, |f| tlv::find_field(payload, f));
        if let (Decision::Queue(q), true) = (d, hdr.req_len_in_pkts > 1) {
            stash.put(peer, hdr.req_id, q);
        }
        d
    }

    /// Replaces the rules of one app; the other apps' rules, and so their traffic, are untouched
    /// (§5.2.2). `app_rules` must only hold rules and defaults of `app_id`.
    pub fn reconfigure_app(&self, app_id: u8, app_rules: &RuleSet) -> Result<(), QnpError> {
        let mut rules = self.rules.lock();
        let next = Self::merged(&rules, app_id, app_rules)?;
        self.matcher.store(Arc::new(FastMatcher::new(&next)));
        *rules = next;
        Ok(())
    }

    /// The rules in force.
    pub fn rules(&self) -> RuleSet {
        self.rules.lock().clone()
    }

    /// `current` with the rules of `app_id` replaced by `app_rules`.
    fn merged(current: &RuleSet, app_id: u8, app_rules: &RuleSet) -> Result<RuleSet, QnpError> {
        if let Some(r) = app_rules.rules.iter().find(|r| r.app_id != app_id) {
            return Err(QnpError::Rules {
                file: "reconfiguration".into(),
                line: r.line,
                msg: format!(
                    "a rule of app {} is in the rules for app {app_id}; reconfigure one app at a time",
                    r.app_id
                ),
            });
        }
        if let Some((a, _)) = app_rules.defaults.keys().find(|(a, _)| *a != app_id) {
            return Err(QnpError::Rules {
                file: "reconfiguration".into(),
                line: 0,
                msg: format!(
                    "a default of app {a} is in the rules for app {app_id}; reconfigure one app at a time"
                ),
            });
        }
        let mut next = current.without_app(app_id);
        // Keep the other apps' rules first: order only matters within one app/type.
        next.rules.extend(app_rules.rules.iter().cloned());
        next.defaults
            .extend(app_rules.defaults.iter().map(|(k, v)| (*k, *v)));
        Ok(next)
    }
}

/// Refuses rules that send to a queue no worker serves: their requests would vanish. `file`
/// names the rules in the error.
pub(crate) fn check_queues(file: &str, set: &RuleSet, workers: usize) -> Result<(), QnpError> {
    let too_far = set
        .rules
        .iter()
        .map(|r| (r.queue, r.line, "rule"))
        .chain(
            set.defaults
                .values()
                .map(|(q, line)| (*q, *line, "default")),
        )
        .find(|(q, _, _)| usize::from(*q) >= workers);
    match too_far {
        None => Ok(()),
        Some((q, line, what)) => Err(QnpError::Rules {
            file: file.into(),
            line,
            msg: format!(
                "the {what} sends to queue {q} but there are {workers} worker(s), queues 0..={}; send to an existing queue or add workers",
                workers.saturating_sub(1)
            ),
        }),
    }
}

/// How requests reach the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Kernel SO_REUSEPORT hashing straight to the workers (the RSS analogue).
    Reuseport,
    /// The sk_reuseport eBPF program matches the rules and picks the worker's socket.
    Kernel,
    /// Software RSD, dispatcher to worker over an in-process queue.
    SoftwareQueue,
    /// Software RSD, dispatcher to worker over a Unix datagram socket.
    SoftwareUds,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "reuseport" => Ok(Mode::Reuseport),
            "kernel" => Ok(Mode::Kernel),
            "software-queue" => Ok(Mode::SoftwareQueue),
            "software-uds" => Ok(Mode::SoftwareUds),
            _ => Err(format!(
                "unknown dispatch mode `{s}`; use reuseport, kernel, software-queue or software-uds"
            )),
        }
    }
}

/// What a worker does with a request: `(worker index, request) -> response`.
pub type Handler = Arc<dyn Fn(usize, &Request) -> OutReq + Send + Sync>;

/// Counters, one slot per thread so that no two threads write the same counter; they are
/// summed only when read.
#[derive(Default)]
pub struct Counters {
    /// Requests answered, per worker.
    pub handled: Vec<AtomicU64>,
    /// Packets passed to a worker, per dispatcher.
    pub dispatched: Vec<AtomicU64>,
    /// Packets dropped (no rule, no stash entry, full worker queue), per dispatcher.
    pub dropped: Vec<AtomicU64>,
    /// CPU time of the worker and dispatcher threads that have ended, in ns.
    pub cpu_ns: AtomicU64,
    /// The receive counters of the workers' endpoints, added up as each worker ends.
    pub rx: Mutex<RxStats>,
}

/// What a stopped server reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopReport {
    /// CPU time the worker and dispatcher threads used.
    pub cpu: Duration,
    /// The workers' receive counters, summed.
    pub rx: RxStats,
}

fn sum(v: &[AtomicU64]) -> u64 {
    v.iter().map(|c| c.load(Ordering::Relaxed)).sum()
}

/// A running dispatch server.
pub struct DispatchServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
    rsd: Arc<Rsd>,
    kernel: Option<Mutex<crate::kernel_rsd::KernelRsd>>,
}

fn reuseport_socket(addr: SocketAddr) -> Result<StdUdp, QnpError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let what = || format!("binding UDP {addr} with SO_REUSEPORT (is another program on the port?)");
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| QnpError::io(what(), e))?;
    s.set_reuse_port(true)
        .map_err(|e| QnpError::io(what(), e))?;
    s.bind(&addr.into()).map_err(|e| QnpError::io(what(), e))?;
    Ok(s.into())
}

/// The receive side of a worker fed by a dispatcher.
enum Inbox {
    Queue(tokio::sync::Mutex<mpsc::Receiver<(Bytes, SocketAddr)>>),
    Uds(tokio::net::UnixDatagram),
}

/// A worker's socket under software RSD: packets come from the dispatcher, responses leave
/// through the worker's own UDP socket.
struct WorkerSocket {
    inbox: Inbox,
    out: tokio::net::UdpSocket,
    public: SocketAddr,
}

/// Encodes a peer address in front of a packet passed over a Unix socket.
fn put_addr(out: &mut Vec<u8>, a: SocketAddr) {
    match a.ip() {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&ip.octets());
        }
    }
    out.extend_from_slice(&a.port().to_be_bytes());
}

fn take_addr(b: &[u8]) -> Option<(SocketAddr, &[u8])> {
    let (ip, rest): (IpAddr, &[u8]) = match b.split_first()? {
        (4, r) => {
            let (o, r) = r.split_first_chunk::<4>()?;
            ((*o).into(), r)
        }
        (6, r) => {
            let (o, r) = r.split_first_chunk::<16>()?;
            ((*o).into(), r)
        }
        _ => return None,
    };
    let (port, rest) = rest.split_first_chunk::<2>()?;
    Some((SocketAddr::new(ip, u16::from_be_bytes(*port)), rest))
}

impl Datagram for WorkerSocket {
    async fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<()> {
        self.out.send_to(buf, to).await.map(drop)
    }
    async fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        let closed = || io::Error::new(io::ErrorKind::NotConnected, "dispatcher gone");
        match &self.inbox {
            Inbox::Queue(rx) => {
                let (pkt, from) = rx.lock().await.recv().await.ok_or_else(closed)?;
                let n = pkt.len().min(buf.len());
                buf[..n].copy_from_slice(&pkt[..n]);
                Ok((n, from))
            }
            Inbox::Uds(sock) => loop {
                let mut tmp = vec![0u8; buf.len() + 19];
                let n = sock.recv(&mut tmp).await?;
                if let Some((from, pkt)) = take_addr(&tmp[..n]) {
                    let n = pkt.len().min(buf.len());
                    buf[..n].copy_from_slice(&pkt[..n]);
                    return Ok((n, from));
                }
            },
        }
    }
    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.public)
    }
}

enum Outbox {
    Queue(mpsc::Sender<(Bytes, SocketAddr)>),
    Uds(StdUnixDatagram),
}

/// How a worker thread receives its packets.
enum Feed {
    Udp(StdUdp),
    Queue(mpsc::Receiver<(Bytes, SocketAddr)>),
    Uds(StdUnixDatagram),
}

impl DispatchServer {
    /// Starts `workers` worker threads and, for the software modes, `dispatchers` dispatcher
    /// threads, serving QNP at `addr` (port 0 picks a free port).
    pub fn start(
        mode: Mode,
        addr: SocketAddr,
        workers: usize,
        dispatchers: usize,
        rsd: Arc<Rsd>,
        cfg: QnpConfig,
        handler: Handler,
    ) -> Result<DispatchServer, QnpError> {
        Self::start_on(&[], mode, addr, workers, dispatchers, rsd, cfg, handler)
    }

    /// [`DispatchServer::start`] with every worker and dispatcher thread pinned to `cpus` (empty:
    /// unpinned), so that a benchmark gives every mode the same cores.
    // The arguments are those of `start` plus the CPUs; a struct for them would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub fn start_on(
        cpus: &[usize],
        mode: Mode,
        addr: SocketAddr,
        workers: usize,
        dispatchers: usize,
        rsd: Arc<Rsd>,
        cfg: QnpConfig,
        handler: Handler,
    ) -> Result<DispatchServer, QnpError> {
        cfg.validate()?;
        let workers = workers.max(1);
        check_queues("dispatch rules", &rsd.rules(), workers)?;
        let direct = matches!(mode, Mode::Reuseport | Mode::Kernel);
        let dispatchers = if direct { 0 } else { dispatchers.max(1) };
        // Lower before binding anything, so rules the kernel cannot run fail early.
        let kernel_prog = match mode {
            Mode::Kernel => Some(crate::kernel_rsd::lower(&rsd.rules.lock())?),
            _ => None,
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let counters = Arc::new(Counters {
            handled: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            dispatched: (0..dispatchers).map(|_| AtomicU64::new(0)).collect(),
            dropped: (0..dispatchers).map(|_| AtomicU64::new(0)).collect(),
            cpu_ns: AtomicU64::new(0),
            rx: Mutex::new(RxStats::default()),
        });
        // The first socket fixes the port the others share.
        let first = reuseport_socket(addr)?;
        let public = first
            .local_addr()
            .map_err(|e| QnpError::io("reading the bound address", e))?;
        // Reuseport and kernel: one socket per worker. Software RSD: one per dispatcher.
        let sockets = if direct { workers } else { dispatchers };
        let mut listen = vec![first];
        for _ in 1..sockets {
            listen.push(reuseport_socket(public)?);
        }
        let kernel = match kernel_prog {
            Some(prog) => {
                if workers > crate::kernel_rsd::MAX_WORKERS {
                    return Err(QnpError::TableFull(format!(
                        "{workers} workers exceed the kernel dispatcher's {}",
                        crate::kernel_rsd::MAX_WORKERS
                    )));
                }
                let mut k = crate::kernel_rsd::KernelRsd::load(&prog)?;
                for (w, sock) in listen.iter().enumerate() {
                    k.set_worker(w as u32, sock)?;
                }
                k.attach(&listen[0])?;
                Some(Mutex::new(k))
            }
            None => None,
        };
        let mut feeds = Vec::new();
        let mut outboxes = Vec::new();
        for _ in 0..workers {
            feeds.push(match mode {
                // Worker w takes socket w: the kernel program's queue w is that socket.
                Mode::Reuseport | Mode::Kernel => Feed::Udp(listen.remove(0)),
                Mode::SoftwareQueue => {
                    let (tx, rx) = mpsc::channel(cfg.max_tracked_requests.max(64));
                    outboxes.push(Outbox::Queue(tx));
                    Feed::Queue(rx)
                }
                Mode::SoftwareUds => {
                    let (a, b) = StdUnixDatagram::pair()
                        .map_err(|e| QnpError::io("creating a Unix socket pair", e))?;
                    // A full worker socket drops the packet, as a full NIC queue would, instead
                    // of stalling the dispatcher for every other worker.
                    a.set_nonblocking(true)
                        .map_err(|e| QnpError::io("configuring a Unix socket", e))?;
                    outboxes.push(Outbox::Uds(a));
                    Feed::Uds(b)
                }
            });
        }
        let mut server = DispatchServer {
            addr: public,
            stop: Arc::new(AtomicBool::new(false)),
            stop_tx,
            threads: Vec::new(),
            counters,
            rsd: Arc::clone(&rsd),
            kernel,
        };
        for (w, feed) in feeds.into_iter().enumerate() {
            let (stop_rx, handler, counters, cpus) = (
                stop_rx.clone(),
                Arc::clone(&handler),
                Arc::clone(&server.counters),
                cpus.to_vec(),
            );
            let t = std::thread::Builder::new()
                .name(format!("qnp-worker-{w}"))
                .spawn(move || {
                    pin(&cpus);
                    let totals = Arc::clone(&counters);
                    worker_thread(w, feed, public, cfg, stop_rx, handler, counters);
                    totals.cpu_ns.fetch_add(thread_cpu_ns(), Ordering::Relaxed);
                })
                .map_err(|e| QnpError::io("spawning a worker thread", e))?;
            server.threads.push(t);
        }
        let outboxes = Arc::new(outboxes);
        for (d, sock) in listen.into_iter().enumerate().take(dispatchers) {
            let (stop, rsd, outboxes, counters, cpus) = (
                Arc::clone(&server.stop),
                Arc::clone(&rsd),
                Arc::clone(&outboxes),
                Arc::clone(&server.counters),
                cpus.to_vec(),
            );
            sock.set_read_timeout(Some(Duration::from_millis(50)))
                .map_err(|e| QnpError::io("configuring a dispatcher socket", e))?;
            let t = std::thread::Builder::new()
                .name(format!("qnp-dispatch-{d}"))
                .spawn(move || {
                    pin(&cpus);
                    dispatcher_thread(d, sock, &rsd, &outboxes, &stop, &counters);
                    counters
                        .cpu_ns
                        .fetch_add(thread_cpu_ns(), Ordering::Relaxed);
                })
                .map_err(|e| QnpError::io("spawning a dispatcher thread", e))?;
            server.threads.push(t);
        }
        Ok(server)
    }

    /// Replaces the rules of one app in the dispatcher that serves this mode (the software
    /// matcher, and in kernel mode the program's maps); other apps' traffic is not disturbed.
    /// In kernel mode the new rules are lowered first, so rules that do not fit change nothing.
    pub fn reconfigure_app(&self, app_id: u8, app_rules: &RuleSet) -> Result<(), QnpError> {
        check_queues("dispatch rules", app_rules, self.counters.handled.len())?;
        if let Some(kernel) = &self.kernel {
            // One reconfiguration at a time: the kernel maps and the rules change together.
            let mut kernel = kernel.lock();
            let next = Rsd::merged(&self.rsd.rules(), app_id, app_rules)?;
            let prog = crate::kernel_rsd::lower(&next)?;
            let entries = prog.apps.get(&app_id).map_or(&[][..], Vec::as_slice);
            kernel.install_app(app_id, entries)?;
        }
        self.rsd.reconfigure_app(app_id, app_rules)
    }

    /// Kernel mode: the dispatcher program's `(run time ns, runs)` so far (see
    /// [`crate::kernel_rsd::KernelRsd::run_stats`]).
    pub fn kernel_run_stats(&self) -> Option<(u64, u64)> {
        self.kernel.as_ref()?.lock().run_stats()
    }

    /// The address clients send to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests answered by each worker.
    pub fn handled(&self) -> Vec<u64> {
        self.counters
            .handled
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    /// Packets passed on and dropped by the dispatchers (both 0 in `Reuseport` mode).
    pub fn dispatched_dropped(&self) -> (u64, u64) {
        (sum(&self.counters.dispatched), sum(&self.counters.dropped))
    }

    /// Stops all threads, waits for them, and returns the CPU time they used (what serving
    /// cost, whatever share of the cores other processes took meanwhile) and what the workers'
    /// endpoints received.
    pub fn stop(mut self) -> StopReport {
        self.shutdown();
        StopReport {
            cpu: Duration::from_nanos(self.counters.cpu_ns.load(Ordering::Relaxed)),
            rx: *self.counters.rx.lock(),
        }
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.stop_tx.send(true);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The workers' sockets are closed now, which destroys the group and detaches the program.
        self.kernel = None;
    }
}

impl Drop for DispatchServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// CPU time the calling thread has used.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// Pins the calling server thread; a failure leaves it unpinned and says so (the benchmark checks
/// its CPU list before it starts a server).
fn pin(cpus: &[usize]) {
    if let Err(e) = crate::cpu::pin_current_thread(cpus) {
        tracing::error!(error = %e, "qnp: a server thread runs unpinned");
    }
}

fn dispatcher_thread(
    index: usize,
    sock: StdUdp,
    rsd: &Rsd,
    outboxes: &[Outbox],
    stop: &AtomicBool,
    counters: &Counters,
) {
    let mut stash = Stash::new(STASH_DEPTH);
    let mut buf = vec![0u8; 65_536];
    let mut framed = Vec::with_capacity(2048);
    let (mut sent, mut dropped) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let Ok((n, from)) = sock.recv_from(&mut buf) else {
            // Timeouts let the loop see `stop`; other errors (ICMP) are per packet.
            continue;
        };
        let pkt = &buf[..n];
        let ok = match rsd.decide(pkt, from, &mut stash) {
            Decision::Queue(q) => match outboxes.get(usize::from(q)) {
                Some(Outbox::Queue(tx)) => tx.try_send((Bytes::copy_from_slice(pkt), from)).is_ok(),
                Some(Outbox::Uds(u)) => {
                    framed.clear();
                    put_addr(&mut framed, from);
                    framed.extend_from_slice(pkt);
                    u.send(&framed).is_ok()
                }
                None => false,
            },
            Decision::Drop => false,
        };
        // Each dispatcher owns its slots: a plain store, no contention.
        if ok {
            sent += 1;
            counters.dispatched[index].store(sent, Ordering::Relaxed);
        } else {
            dropped += 1;
            counters.dropped[index].store(dropped, Ordering::Relaxed);
        }
    }
    counters.dispatched[index].store(sent, Ordering::Relaxed);
    counters.dropped[index].store(dropped, Ordering::Relaxed);
}

fn worker_thread(
    index: usize,
    feed: Feed,
    public: SocketAddr,
    cfg: QnpConfig,
    stop: tokio::sync::watch::Receiver<bool>,
    handler: Handler,
    counters: Arc<Counters>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(worker = index, error = %e, "qnp: cannot start a worker runtime");
            return;
        }
    };
    let result: Result<(), QnpError> = rt.block_on(async move {
        let serve_on =
            async |out: Option<tokio::net::UdpSocket>| -> Result<tokio::net::UdpSocket, QnpError> {
                match out {
                    Some(s) => Ok(s),
                    None => {
                        let any = SocketAddr::new(public.ip(), 0);
                        tokio::net::UdpSocket::bind(any).await.map_err(|e| {
                            QnpError::io(format!("binding a worker's reply socket on {any}"), e)
                        })
                    }
                }
            };
        match feed {
            Feed::Udp(s) => {
                s.set_nonblocking(true)
                    .map_err(|e| QnpError::io("configuring a worker socket", e))?;
                let sock = tokio::net::UdpSocket::from_std(s)
                    .map_err(|e| QnpError::io("registering a worker socket", e))?;
                serve(index, Endpoint::new(sock, cfg)?, stop, handler, counters).await
            }
            Feed::Queue(rx) => {
                let out = serve_on(None).await?;
                let sock = WorkerSocket {
                    inbox: Inbox::Queue(tokio::sync::Mutex::new(rx)),
                    out,
                    public,
                };
                serve(index, Endpoint::new(sock, cfg)?, stop, handler, counters).await
            }
            Feed::Uds(u) => {
                u.set_nonblocking(true)
                    .map_err(|e| QnpError::io("configuring a worker's Unix socket", e))?;
                let inbox = tokio::net::UnixDatagram::from_std(u)
                    .map_err(|e| QnpError::io("registering a worker's Unix socket", e))?;
                let out = serve_on(None).await?;
                let sock = WorkerSocket {
                    inbox: Inbox::Uds(inbox),
                    out,
                    public,
                };
                serve(index, Endpoint::new(sock, cfg)?, stop, handler, counters).await
            }
        }
    });
    if let Err(e) = result {
        tracing::error!(worker = index, error = %e, "qnp: worker stopped");
    }
}

async fn serve<S: Datagram>(
    index: usize,
    ep: Endpoint<S>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    handler: Handler,
    counters: Arc<Counters>,
) -> Result<(), QnpError> {
    let result = async {
        loop {
            let req = tokio::select! {
                _ = stop.changed() => return Ok(()),
                req = ep.recv_req() => req?,
            };
            let resp = handler(index, &req);
            // Counted before the answer leaves, so a client that has its answer sees the count.
            counters.handled[index].fetch_add(1, Ordering::Relaxed);
            ep.respond(&req, &resp).await?;
        }
    }
    .await;
    counters.rx.lock().add(&ep.stats());
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::segment::segment;

    fn peer() -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 2], 5000))
    }

    fn request(app: u8, key: &str, extra: usize) -> OutReq {
        let mut payload = Vec::new();
        tlv::put_string(&mut payload, 0, key).unwrap();
        let dispatch_len = payload.len();
        tlv::put_bytes(&mut payload, 1, &vec![0u8; extra]).unwrap();
        OutReq {
            app_id: app,
            req_type: 0,
            payload: Bytes::from(payload),
            dispatch_len,
        }
    }

    const RULES: &str =
        "rule 1 0 0 \"a\" -> 0\nrule 1 0 0 \"b\" -> 1\nrule 2 0 0 \"..x\" -> 1\ndefault 2 0 -> 0\n";

    #[test]
    fn first_packets_are_matched_and_follow_ons_use_the_stash() {
        let rsd = Rsd::new(RuleSet::parse("r", RULES).unwrap());
        let mut stash = Stash::new(STASH_DEPTH);
        let pkts = segment(&request(1, "b-key", 4000), 7, None, &QnpConfig::default()).unwrap();
        assert_eq!(pkts.len(), 3);
        // A follow-on packet before its first packet has no decision.
        assert_eq!(rsd.decide(&pkts[1], peer(), &mut stash), Decision::Drop);
        for p in &pkts {
            assert_eq!(rsd.decide(p, peer(), &mut stash), Decision::Queue(1));
        }
        // Another client's request with the same id does not reuse this decision.
        let other = SocketAddr::from(([10, 0, 0, 3], 5000));
        assert_eq!(rsd.decide(&pkts[2], other, &mut stash), Decision::Drop);
        // A colliding request id evicts the entry.
        let evict = segment(
            &request(1, "a", 4000),
            7 + STASH_DEPTH as u32,
            None,
            &QnpConfig::default(),
        )
        .unwrap();
        assert_eq!(
            rsd.decide(&evict[0], peer(), &mut stash),
            Decision::Queue(0)
        );
        assert_eq!(rsd.decide(&pkts[2], peer(), &mut stash), Decision::Drop);
        assert_eq!(rsd.decide(b"junk", peer(), &mut stash), Decision::Drop);
    }

    #[test]
    fn reconfiguring_one_app_leaves_the_others_alone() {
        let rsd = Rsd::new(RuleSet::parse("r", RULES).unwrap());
        let mut stash = Stash::new(4);
        let decide = |app: u8, key: &str, stash: &mut Stash| {
            let p = segment(&request(app, key, 0), 1, None, &QnpConfig::default()).unwrap();
            rsd.decide(&p[0], peer(), stash)
        };
        let keys = ["a1", "b2", "zzx", "c"];
        let before: Vec<_> = keys.iter().map(|k| decide(1, k, &mut stash)).collect();
        assert_eq!(decide(2, "zzx", &mut stash), Decision::Queue(1));
        rsd.reconfigure_app(2, &RuleSet::parse("new", "rule 2 0 0 \"zz\" -> 3").unwrap())
            .unwrap();
        let after: Vec<_> = keys.iter().map(|k| decide(1, k, &mut stash)).collect();
        assert_eq!(before, after, "app 1 is untouched");
        assert_eq!(decide(2, "zzx", &mut stash), Decision::Queue(3));
        assert_eq!(
            decide(2, "q", &mut stash),
            Decision::Drop,
            "app 2's old default is gone"
        );
        let wrong = RuleSet::parse("new", "rule 1 0 0 \"x\" -> 3").unwrap();
        assert!(rsd.reconfigure_app(2, &wrong).is_err());
    }

    #[test]
    fn unix_socket_framing_round_trips_addresses() {
        for a in [peer(), "[::1]:9".parse().unwrap()] {
            let mut b = Vec::new();
            put_addr(&mut b, a);
            b.extend_from_slice(b"pkt");
            assert_eq!(take_addr(&b), Some((a, &b"pkt"[..])));
        }
        assert_eq!(take_addr(&[9, 1]), None);
        assert_eq!(take_addr(&[4, 1, 2]), None);
    }

    fn run_mode(mode: Mode) {
        let rsd = Arc::new(Rsd::new(RuleSet::parse("r", RULES).unwrap()));
        let handler: Handler = Arc::new(|w, req: &Request| OutReq {
            app_id: req.app_id,
            req_type: req.req_type,
            payload: Bytes::from(vec![w as u8]),
            dispatch_len: 0,
        });
        let server = DispatchServer::start(
            mode,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            2,
            1,
            rsd,
            QnpConfig::default(),
            handler,
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let client = Endpoint::new(sock, QnpConfig::default()).unwrap();
            for i in 0..20 {
                let key = if i % 2 == 0 { "a-key" } else { "b-key" };
                let resp = client
                    .send_req(server.addr(), &request(1, key, i * 300))
                    .await
                    .unwrap();
                if mode != Mode::Reuseport {
                    assert_eq!(
                        resp.payload[..],
                        [u8::from(i % 2 == 1)],
                        "{key} goes to its worker ({mode:?})"
                    );
                }
            }
            // App 2: a skip-and-check rule, its default, and an app with no rules (dropped).
            for (key, worker) in [("zzx", 1u8), ("..x", 1), ("zzy", 0), ("", 0)] {
                let resp = client
                    .send_req(server.addr(), &request(2, key, 2000))
                    .await
                    .unwrap();
                if mode != Mode::Reuseport {
                    assert_eq!(resp.payload[..], [worker], "app 2 {key:?} ({mode:?})");
                }
            }
            if mode != Mode::Reuseport {
                let quick = QnpConfig {
                    max_attempts: 2,
                    rto: Duration::from_millis(20),
                    ..QnpConfig::default()
                };
                let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
                let other = Endpoint::new(sock, quick).unwrap();
                let err = other.send_req(server.addr(), &request(3, "a", 0)).await;
                assert!(
                    matches!(err, Err(QnpError::Timeout { .. })),
                    "app 3 has no rules: dropped ({mode:?})"
                );
            }
        });
        assert_eq!(server.handled().iter().sum::<u64>(), 24);
        if mode != Mode::Reuseport {
            assert_eq!(server.handled(), vec![12, 12]);
        }
        server.stop();
    }

    /// App 2's rules flip between two workers continuously while app 1 runs with one
    /// transmission per request: any packet of app 1 lost to a reconfiguration fails the test.
    fn reconfigure_under_load(mode: Mode) {
        let rsd = Arc::new(Rsd::new(RuleSet::parse("r", RULES).unwrap()));
        let handler: Handler = Arc::new(|w, req: &Request| OutReq {
            app_id: req.app_id,
            req_type: req.req_type,
            payload: Bytes::from(vec![w as u8]),
            dispatch_len: 0,
        });
        let server = DispatchServer::start(
            mode,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            2,
            1,
            rsd,
            QnpConfig::default(),
            handler,
        )
        .unwrap();
        let addr = server.addr();
        let done = AtomicBool::new(false);
        let flips = std::sync::atomic::AtomicU32::new(0);
        let app2 = |q: u32| RuleSet::parse("app2", &format!("rule 2 0 0 \"\" -> {q}")).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    let q = flips.load(Ordering::Relaxed) % 2;
                    server.reconfigure_app(2, &app2(q)).unwrap();
                    flips.fetch_add(1, Ordering::Relaxed);
                    std::thread::yield_now();
                }
            });
            rt.block_on(async {
                let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
                let cfg = QnpConfig {
                    max_attempts: 1,
                    rto: Duration::from_secs(2),
                    ..QnpConfig::default()
                };
                let client = Endpoint::new(sock, cfg).unwrap();
                // At least 200 requests, and on until app 2 has been reconfigured 20 times:
                // on a busy machine the flipper thread may start late (bounded by 20,000).
                let mut i = 0;
                while i < 200 || (flips.load(Ordering::Relaxed) < 20 && i < 20_000) {
                    let key = if i % 2 == 0 { "a" } else { "b" };
                    let resp = client
                        .send_req(addr, &request(1, key, (i % 4) * 1000))
                        .await
                        .unwrap();
                    assert_eq!(resp.payload[..], [u8::from(i % 2 == 1)], "{mode:?}");
                    i += 1;
                }
            });
            done.store(true, Ordering::Relaxed);
        });
        assert!(
            flips.load(Ordering::Relaxed) > 10,
            "app 2 was reconfigured during the run"
        );
        assert_eq!(
            server.dispatched_dropped().1,
            0,
            "nothing of app 1 was dropped"
        );
        // App 2's requests follow its latest rules.
        rt.block_on(async {
            let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let client = Endpoint::new(sock, QnpConfig::default()).unwrap();
            for q in [1u8, 0, 1] {
                server.reconfigure_app(2, &app2(u32::from(q))).unwrap();
                let resp = client.send_req(addr, &request(2, "k", 0)).await.unwrap();
                assert_eq!(resp.payload[..], [q], "{mode:?}");
            }
        });
        server.stop();
    }

    #[test]
    fn reconfiguring_an_app_under_load_does_not_disturb_another() {
        reconfigure_under_load(Mode::SoftwareQueue);
    }

    #[test]
    fn reconfiguring_an_app_behind_unix_sockets_does_not_disturb_another() {
        reconfigure_under_load(Mode::SoftwareUds);
    }

    /// Needs root and sk_reuseport BPF.
    #[test]
    fn reconfiguring_an_app_in_the_kernel_does_not_disturb_another() {
        reconfigure_under_load(Mode::Kernel);
    }

    #[test]
    fn reuseport_workers_serve() {
        run_mode(Mode::Reuseport);
    }

    /// Needs root and sk_reuseport BPF; fails with the loader's explanation otherwise.
    #[test]
    fn kernel_rsd_dispatches_by_rule() {
        run_mode(Mode::Kernel);
    }

    #[test]
    fn software_rsd_over_a_queue_dispatches_by_rule() {
        run_mode(Mode::SoftwareQueue);
    }

    #[test]
    fn software_rsd_over_unix_sockets_dispatches_by_rule() {
        run_mode(Mode::SoftwareUds);
    }
}
