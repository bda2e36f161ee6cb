//! One shared-memory connection as this process sees it, and the table that attaches it to
//! kernel fd numbers. The kernel socket stays the identity of the connection: dup, fork and
//! close act on it as usual, and its byte stream carries only wake-up bytes once the data path
//! has moved (plus, for the connector, the bytes it sent before the acceptor attached).

use arc_swap::ArcSwapOption;
use crate::lock::SpinGuard;
use crate::region::{Pipe, Region, ATTACHED};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// Called connect(); created the region; writes direction 0.
    Connector,
    /// Returned from accept(); attached the region; writes direction 1.
    Acceptor,
}

/// Where the next incoming bytes come from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Inbound {
    /// The ring. Kernel bytes are wake-ups only.
    Ring,
    /// Connector before the acceptor attached: the kernel carries data (a peer without the
    /// library never attaches, so this is the plain-TCP fallback).
    Kernel,
    /// Acceptor: the connector's bytes sent before it switched; `u64::MAX` while not switched.
    KernelPrefix(u64),
}

pub struct Conn {
    pub region: Region,
    pub role: Role,
    /// Connector: the rendezvous file, removed on drop if the acceptor never took it.
    pub handoff_path: Option<CString>,
    pub nonblocking: AtomicBool,
    /// The kernel socket reported EOF (peer closed or shut down its side).
    pub kernel_eof: AtomicBool,
    /// The kernel socket reported an error (reset): its errno.
    pub kernel_error: AtomicI32,
    /// shutdown(SHUT_RD) was called here.
    pub read_shut: AtomicBool,
    /// A probe byte was sent to learn whether a peer that sent FIN is gone entirely.
    pub probe_sent: AtomicBool,
    /// Held by the one thread of this process that may read (drain) wake-up bytes from the
    /// kernel socket. Draining without it could steal a wake-up another thread sleeps for.
    pub kernel_waiter: parking_lot::Mutex<()>,
    /// Bumped whenever the kernel waiter role is released; other threads sleep on it (futex).
    pub local_sequence: AtomicU32,
    pub local_sleepers: AtomicU32,
    /// The connection is (or was) in one of this process's epoll sets. Wake-up bytes are then
    /// left for the epoll waiter to drain: a nonblocking recv on another thread that drained
    /// them would take the only event that ends the waiter's sleep.
    pub epoll_watched: AtomicBool,
    /// fds of this process that refer to the connection.
    fds: AtomicUsize,
    /// Notify-on-RW (`notify`): this side's userfaultfd until the peer took a copy, and our
    /// copy of the peer's (or `notify::NOT_TRIED` / `UNAVAILABLE`).
    pub own_fault_fd: AtomicI32,
    pub peer_fault_fd: AtomicI32,
    /// Per `notify::Awaited`: the peer's counter (+ 1) when a sleep ended in its fault; 0 none.
    pub fault_seen: [AtomicU64; 2],
}

impl Conn {
    pub fn new(
        region: Region,
        role: Role,
        handoff_path: Option<CString>,
        nonblocking: bool,
    ) -> Conn {
        let conn = Conn {
            region,
            role,
            handoff_path,
            nonblocking: AtomicBool::new(nonblocking),
            kernel_eof: AtomicBool::new(false),
            kernel_error: AtomicI32::new(0),
            read_shut: AtomicBool::new(false),
            probe_sent: AtomicBool::new(false),
            kernel_waiter: parking_lot::Mutex::new(()),
            local_sequence: AtomicU32::new(0),
            local_sleepers: AtomicU32::new(0),
            epoll_watched: AtomicBool::new(false),
            fds: AtomicUsize::new(0),
            own_fault_fd: AtomicI32::new(-1),
            peer_fault_fd: AtomicI32::new(crate::notify::NOT_TRIED),
            fault_seen: [AtomicU64::new(0), AtomicU64::new(0)],
        };
        conn.own_fault_fd
            .store(crate::notify::publish_fault_channel(&conn), Ordering::Release);
        conn
    }

    /// This process's side of the region: 0 connector, 1 acceptor.
    pub fn side(&self) -> usize {
        if self.role == Role::Connector {
            0
        } else {
            1
        }
    }

    pub fn peer_side(&self) -> usize {
        1 - self.side()
    }

    /// One more process (a forked child) holds this side. Counted in the parent before the
    /// fork (see [`before_fork`]), so the count never dips to zero while the child starts.
    fn add_hold_count(&self) {
        self.region.control().holders[self.side()].fetch_add(1, Ordering::AcqRel);
    }

    /// This process lets go; true if it was the last process on its side.
    pub fn release_process_hold(&self) -> bool {
        self.region.remove_pid(self.side());
        self.region.control().holders[self.side()].fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// The last process of this side is closing: nobody here will read the inbound direction
    /// again, so its arena records go back (and the peer may append no more). The outbound
    /// records stay for the peer to read, unless every process of the peer's side is dead.
    pub fn release_records(&self) {
        if !self.attached() {
            return;
        }
        self.inbound().release_all(true);
        let peer = 1 - self.side();
        let outbound = self.outbound();
        if outbound.records_held() > 0 && !self.region.side_may_live(peer) {
            outbound.release_all(true);
        }
    }

    pub fn outbound(&self) -> Pipe<'_> {
        self.region
            .direction(if self.role == Role::Connector { 0 } else { 1 })
    }

    pub fn inbound(&self) -> Pipe<'_> {
        self.region
            .direction(if self.role == Role::Connector { 1 } else { 0 })
    }

    pub fn attached(&self) -> bool {
        self.region.control().state.load(Ordering::Acquire) == ATTACHED
    }

    /// Connector: once the acceptor has attached, record how many bytes went over the kernel
    /// and move the outgoing direction to the ring. Must happen before any wake-up byte is sent,
    /// so that the acceptor can tell data from wake-ups in the kernel stream.
    pub fn ensure_switched(&self) {
        if self.role != Role::Connector {
            return;
        }
        let control = &self.region.direction(0).control.control.0;
        if control.switched.load(Ordering::Acquire) != 0 {
            return;
        }
        let Ok(_guard) = SpinGuard::lock(
            &self.region.direction(0).control.write_lock.0,
            self.region.same_pid_namespace(),
        ) else {
            // The peer keeps our lock: the connection is broken; reads and writes now fail.
            self.kernel_error.store(libc::ECONNRESET, Ordering::Release);
            return;
        };
        if control.switched.load(Ordering::Acquire) == 0 {
            control.kernel_prefix.store(
                control.kernel_sent.load(Ordering::Acquire),
                Ordering::Release,
            );
            control.switched.store(1, Ordering::Release);
            crate::stats::bump(&crate::stats::get().accelerated);
        }
    }

    /// True when outgoing bytes go to the ring (otherwise over the kernel socket).
    pub fn outbound_on_ring(&self) -> bool {
        match self.role {
            Role::Acceptor => true,
            Role::Connector => {
                if self.attached() {
                    self.ensure_switched();
                    true
                } else {
                    false
                }
            }
        }
    }

    pub fn inbound_source(&self) -> Inbound {
        match self.role {
            Role::Connector => {
                if self.attached() {
                    self.ensure_switched();
                    Inbound::Ring
                } else {
                    Inbound::Kernel
                }
            }
            Role::Acceptor => {
                let control = &self.region.direction(0).control.control.0;
                if control.switched.load(Ordering::Acquire) == 0 {
                    return Inbound::KernelPrefix(u64::MAX);
                }
                let prefix = control.kernel_prefix.load(Ordering::Acquire);
                let consumed = control.kernel_consumed.load(Ordering::Acquire);
                if consumed >= prefix {
                    Inbound::Ring
                } else {
                    Inbound::KernelPrefix(prefix - consumed)
                }
            }
        }
    }

    /// The peer shut down its sending side through the library (a fast EOF hint; the kernel
    /// FIN that follows is the authoritative one).
    pub fn peer_shut_wr(&self) -> bool {
        self.inbound()
            .control
            .control
            .0
            .shut_wr
            .load(Ordering::Acquire)
            != 0
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        crate::notify::close_fault_channels(self);
        if let Some(path) = &self.handoff_path {
            if !self.attached() {
                // SAFETY: `path` is a CString (NUL-terminated) that outlives the call.
                unsafe { libc::unlink(path.as_ptr()) };
            }
        }
    }
}

/// Highest fd number the library accelerates; sockets above it use plain TCP.
pub const MAX_FD: usize = 1 << 16;

/// fd -> connection. Each slot is an `ArcSwapOption`: a lookup takes its own reference safely
/// even while another thread replaces or removes the slot (the application closing an fd that
/// another of its threads is using), with no lock on the read path.
static TABLE: [ArcSwapOption<Conn>; MAX_FD] = [const { ArcSwapOption::const_empty() }; MAX_FD];
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn slot(fd: libc::c_int) -> Option<&'static ArcSwapOption<Conn>> {
    usize::try_from(fd).ok().and_then(|index| TABLE.get(index))
}

/// The connection behind `fd`, if it is a shared-memory one.
pub fn lookup(fd: libc::c_int) -> Option<Arc<Conn>> {
    slot(fd)?.load_full()
}

/// Attaches `conn` to `fd` (dropping whatever was there).
pub fn insert(fd: libc::c_int, conn: Arc<Conn>) {
    let Some(slot) = slot(fd) else { return };
    conn.fds.fetch_add(1, Ordering::AcqRel);
    match slot.swap(Some(conn)) {
        None => {
            LIVE.fetch_add(1, Ordering::Relaxed);
        }
        // The fd was closed behind the library's back (a path it does not intercept) and the
        // number reused: let go of the old connection.
        Some(previous) => {
            if previous.fds.fetch_sub(1, Ordering::AcqRel) == 1 && previous.release_process_hold()
            {
                previous.release_records();
            }
        }
    }
}

/// Detaches the connection behind `fd`. Returns it, and whether this was the last process
/// holding this side of it (the caller then drains wake-ups before the kernel socket closes).
pub fn remove(fd: libc::c_int) -> Option<(Arc<Conn>, bool)> {
    let conn = slot(fd)?.swap(None)?;
    LIVE.fetch_sub(1, Ordering::Relaxed);
    let last = conn.fds.fetch_sub(1, Ordering::AcqRel) == 1 && conn.release_process_hold();
    Some((conn, last))
}

/// Every distinct connection in the table, with one of its fds.
pub fn all() -> Vec<(libc::c_int, Arc<Conn>)> {
    let mut found: Vec<(libc::c_int, Arc<Conn>)> = Vec::new();
    if !any_live() {
        return found;
    }
    for fd in 0..MAX_FD as libc::c_int {
        if let Some(conn) = lookup(fd) {
            if !found.iter().any(|(_, c)| Arc::ptr_eq(c, &conn)) {
                found.push((fd, conn));
            }
        }
    }
    found
}

/// Connections whose hold count `before_fork` raised for the coming child.
static FORKING: parking_lot::Mutex<Vec<Arc<Conn>>> = parking_lot::Mutex::new(Vec::new());

/// Before fork() (pthread_atfork prepare, in the parent): the child will hold every connection
/// too. Counting it here, not in the child, matters: a parent that closes its copy right after
/// fork() (a fork-per-connection server) must not look like the last holder while the child has
/// not run its fork hook yet, or it would give back the child's unread records and take its
/// wake-ups.
pub fn before_fork() {
    let conns: Vec<Arc<Conn>> = all().into_iter().map(|(_, conn)| conn).collect();
    for conn in &conns {
        conn.add_hold_count();
    }
    *FORKING.lock() = conns;
}

/// In the parent after fork() (pthread_atfork parent): the connections counted for the child.
pub fn after_fork_in_parent() -> Vec<Arc<Conn>> {
    std::mem::take(&mut *FORKING.lock())
}

/// fork() failed: no child holds `counted` after all.
pub fn fork_failed(counted: Vec<Arc<Conn>>) {
    for conn in counted {
        if conn.region.control().holders[conn.side()].fetch_sub(1, Ordering::AcqRel) == 1 {
            // This process closed its last fd of it meanwhile (not seen as last then).
            conn.release_records();
        }
    }
}

/// In a forked child: register as a holder of every connection in the (copied) table, and fix
/// the count where the table changed between `before_fork` and the fork itself (another thread
/// opened or closed a connection).
pub fn after_fork_in_child() {
    crate::process::after_fork_in_child();
    crate::arena::after_fork_in_child();
    let counted = std::mem::take(&mut *FORKING.lock());
    let present = all();
    for (_, conn) in &present {
        if !counted.iter().any(|c| Arc::ptr_eq(c, conn)) {
            conn.add_hold_count();
        }
        conn.region.add_pid(conn.side());
        crate::notify::forget_own_fault_channel_in_child(conn);
    }
    for conn in counted {
        if !present.iter().any(|(_, c)| Arc::ptr_eq(c, &conn)) && conn.release_process_hold() {
            conn.release_records();
        }
    }
}

/// Whether any fd in this process is a shared-memory connection (fast path for poll/select).
pub fn any_live() -> bool {
    LIVE.load(Ordering::Relaxed) != 0
}
