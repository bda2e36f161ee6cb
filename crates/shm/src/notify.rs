//! How a sleeping waiter gets woken (U-NAPI's event management, §4.2.4). A waiter first polls
//! the ring (`io::spin_until`); when it goes on to sleep, `FLATMESH_SHM_NOTIFY` says how its
//! peer tells it that the pipe changed:
//!
//! - `sync` (default), the paper's `enable_notify_gshm(sync)` with proactive notification: the
//!   waiter sleeps in poll() on the connection's kernel socket; the peer, seeing the waiter's
//!   flag, sends one wake-up byte over it (a TCP send on the peer's CPU, a TCP receive on ours).
//! - `async`, the paper's `enable_notify_gshm(async)`: the peer sends the sleeping thread a
//!   signal (tgkill, [`SIGNAL`]) instead, so no TCP stack runs on either side; the thread's
//!   handler does nothing but end the sleep, and the thread goes back to polling. The waiter
//!   still sleeps on the socket, so EOF, a reset and wake-up bytes from `sync` threads of its
//!   own process still end the sleep. Blocking calls and epoll waits use it; poll and select
//!   waits ask for bytes.
//! - `norw`, Notify-on-RW: the waiter revokes the peer's write permission on the header page of
//!   the direction it waits on (through the peer's userfaultfd, write-protect mode), and sleeps
//!   on that userfaultfd and the socket. The peer does nothing special: its next store to that
//!   page (its counter after a write, or after a read) faults, the fault wakes the waiter, and
//!   the waiter lifts the protection, which lets the peer's store complete. The peer's fast path
//!   then needs no flag check to notify anybody; it pays a fault and a wait for our CPU instead.
//!
//! On real hardware the paper's kernel of one PU asks the kernel of the other to revoke the
//! permission; here both PUs run on one Linux kernel, and the peer's userfaultfd is that
//! cooperation. Trust: a userfaultfd gives whoever holds it control over the faults of its
//! creator's memory, so it is never handed over. The waiter takes it with pidfd_getfd(), which the
//! kernel allows only to a process that may already ptrace the peer (same user and dumpable, or
//! CAP_SYS_PTRACE), that is one that controls the peer's memory anyway. A waiter that may not
//! falls back to `sync`, as does everything that fails on the way.
//!
//! Calls to functions the library interposes (poll, ppoll, read, ioctl) go to `real`: the
//! interposer of ppoll, say, would treat the socket as a shared-memory connection again.

use crate::conn::Conn;
use crate::real::{self, errno};
use crate::settings::{self, NotifyMode as Mode};
use crate::stats;
use libc::c_int;
use std::sync::atomic::{fence, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Once;

/// Values of a `*_wants_wake` flag: how the sleeper asked to be woken.
pub const WAKE_BYTE: u32 = 1;
pub const WAKE_SIGNAL: u32 = 2;
/// Protected: the peer's own store wakes the sleeper; the peer sends nothing.
pub const WAKE_FAULT: u32 = 3;

/// The signal of `async` mode. SIGURG because its default action is to ignore it: a peer that
/// names another process as its sleeping thread (the thread word is in shared memory, so the
/// peer writes it) can make this process send that process nothing worse than an ignored
/// signal, and only a process this one may signal anyway.
pub const SIGNAL: c_int = libc::SIGURG;

/// What a waiter waits for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Awaited {
    /// Bytes to read (the inbound direction's writer wakes it).
    Data,
    /// Room to write (the outbound direction's reader wakes it).
    Room,
}

/// The direction a waiter watches, its flag and its thread word.
fn watched(conn: &Conn, awaited: Awaited) -> (usize, &AtomicU32, &AtomicU64) {
    // Each side writes the direction of its own number: the peer's is our inbound one.
    match awaited {
        Awaited::Data => {
            let control = &conn.region.direction(conn.peer_side()).control.control.0;
            (conn.peer_side(), &control.reader_wants_wake, &control.reader_thread)
        }
        Awaited::Room => {
            let control = &conn.region.direction(conn.side()).control.control.0;
            (conn.side(), &control.writer_wants_wake, &control.writer_thread)
        }
    }
}

// ---- The waking side ----

/// After moving bytes: wakes the peer that sleeps on `flag` the way it asked. False if the
/// peer is gone (its socket refused the wake-up byte).
pub fn wake(fd: c_int, conn: &Conn, flag: &AtomicU32, thread: &AtomicU64) -> bool {
    close_own_fault_channel_once_taken(conn);
    fence(Ordering::SeqCst);
    let asked = flag.load(Ordering::Relaxed);
    if asked == 0 || asked == WAKE_FAULT && our_stores_fault(conn) {
        return true;
    }
    match flag.swap(0, Ordering::AcqRel) {
        0 => true,
        WAKE_FAULT if our_stores_fault(conn) => true,
        WAKE_SIGNAL if signal_thread(conn, thread.load(Ordering::Acquire)) => true,
        _ => crate::io::send_wake(fd),
    }
}

/// Whether this process's stores to the region fault while the peer protects them: it is the
/// process whose userfaultfd the peer holds. A forked child is not (its memory is not
/// registered with the parent's userfaultfd), so it wakes a sleeper that asked for a fault
/// with a wake-up byte instead; the sleeper also sleeps on the socket.
fn our_stores_fault(conn: &Conn) -> bool {
    let owner = conn.region.control().fault_owner[conn.side()].load(Ordering::Relaxed);
    (owner >> 32) as u32 == crate::process::pid()
}

/// Sends [`SIGNAL`] to the peer's sleeping thread `word` (`tgid << 32 | tid`). Only to a
/// process the region lists as holding the peer's side, in this pid namespace; false (the
/// caller sends a byte instead) otherwise or if the thread is gone.
fn signal_thread(conn: &Conn, word: u64) -> bool {
    let (tgid, tid) = ((word >> 32) as u32, word as u32);
    let peer = conn.peer_side();
    let listed = conn.region.control().pids[peer]
        .iter()
        .any(|slot| slot.load(Ordering::Relaxed) == tgid);
    if tgid == 0 || tid == 0 || !listed || !conn.region.same_pid_namespace() {
        return false;
    }
    stats::bump(&stats::get().wake_signals);
    // SAFETY: tgkill takes three integers; it signals thread `tid` only if it belongs to
    // process `tgid` and this process may signal it, and fails otherwise.
    unsafe { libc::syscall(libc::SYS_tgkill, tgid as c_int, tid as c_int, SIGNAL) == 0 }
}

// ---- The sleeping side ----

/// How a sleep was announced to the peer.
pub enum Armed {
    Byte,
    Signal,
    /// The peer's page `[page, page + 4096)` is write-protected through `uffd`; `faulted`:
    /// the sleep ended in the peer's fault.
    Fault {
        uffd: c_int,
        page: u64,
        faulted: std::cell::Cell<bool>,
    },
}

/// The counter the peer moves when what `awaited` waits for happens: bytes written into our
/// inbound direction, or consumed from our outbound one.
fn progress(conn: &Conn, awaited: Awaited) -> u64 {
    match awaited {
        Awaited::Data => conn.inbound().written(),
        Awaited::Room => conn.outbound().consumed(),
    }
}

/// Whether this thread's event waits (epoll) ask for signals: `async` mode, with the signal
/// usable in this thread.
pub fn event_waits_use_signals() -> bool {
    settings::get().notify == Mode::Async && signals_usable()
}

/// Announces a wait for `awaited`: with a signal to this thread if `signal` (see
/// [`event_waits_use_signals`]; the sleep must then unblock it, [`signal_sleep_mask`]),
/// otherwise with a wake-up byte (which every waiter can use).
pub fn announce(conn: &Conn, awaited: Awaited, signal: bool) {
    let (_, flag, thread) = watched(conn, awaited);
    if signal {
        // SAFETY: getpid and gettid take no arguments and cannot fail.
        let (tgid, tid) = unsafe { (libc::getpid() as u32, libc::gettid() as u32) };
        thread.store(u64::from(tgid) << 32 | u64::from(tid), Ordering::Release);
        flag.store(WAKE_SIGNAL, Ordering::SeqCst);
    } else {
        flag.store(WAKE_BYTE, Ordering::SeqCst);
    }
}

/// For a sleep announced with a signal: the mask to sleep with (`mask`, the caller's, or else
/// this thread's, without [`SIGNAL`]) and the count of signals received so far, for
/// [`woken_by_signal`].
pub fn signal_sleep_mask(mask: *const libc::sigset_t) -> (libc::sigset_t, u32) {
    let mut unblocked = if mask.is_null() {
        thread_mask()
    } else {
        // SAFETY: a non-null `mask` is the caller's sigset (epoll_pwait(2)'s contract), read once.
        unsafe { *mask }
    };
    // SAFETY: sigdelset writes into `unblocked`, a live local sigset_t.
    unsafe { libc::sigdelset(&mut unblocked, SIGNAL) };
    (unblocked, SIGNALS_RECEIVED.load(Ordering::SeqCst))
}

/// Whether a sleep that failed with EINTR was ended by a wake-up signal (received after
/// `before`, from [`signal_sleep_mask`]) rather than by one of the program's own signals.
pub fn woken_by_signal(before: u32) -> bool {
    SIGNALS_RECEIVED.load(Ordering::SeqCst) != before
}

/// Announces that this thread is about to sleep for `awaited`, in this process's mode. The
/// caller then looks at the ring once more (after a full fence) and sleeps with [`sleep`]
/// unless it is ready, and calls [`disarm`] either way.
pub fn arm(conn: &Conn, awaited: Awaited) -> Armed {
    let (direction, flag, _) = watched(conn, awaited);
    match settings::get().notify {
        Mode::Async if signals_usable() => {
            announce(conn, awaited, true);
            return Armed::Signal;
        }
        Mode::NotifyOnRw if !peer_still_faulting(conn, awaited) => {
            if let Some((uffd, page)) = protect_peer_page(conn, direction) {
                flag.store(WAKE_FAULT, Ordering::SeqCst);
                return Armed::Fault {
                    uffd,
                    page,
                    faulted: std::cell::Cell::new(false),
                };
            }
        }
        _ => {}
    }
    announce(conn, awaited, false);
    Armed::Byte
}

/// Sleeps on the kernel socket `fd` for `events` (POLLIN is always added: wake-up bytes, EOF,
/// reset) and whatever `armed` adds, at most `timeout_ms` (-1: no limit). Ok(0) on timeout,
/// otherwise Ok(non-zero): woken, look again.
pub fn sleep(fd: c_int, events: i16, timeout_ms: c_int, armed: &Armed) -> Result<i16, c_int> {
    let socket = libc::pollfd {
        fd,
        events: events | libc::POLLIN,
        revents: 0,
    };
    // A fault wakes the sleeper through the peer's userfaultfd, so that is polled too.
    let uffd = match armed {
        Armed::Fault { uffd, .. } => *uffd,
        _ => -1,
    };
    let mut entries = [
        socket,
        libc::pollfd {
            fd: uffd,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // The signal stays blocked in this thread (`signals_usable`) except inside ppoll, so one
    // sent before the sleep began is not lost: it ends the ppoll at once.
    let signal = matches!(armed, Armed::Signal).then(|| signal_sleep_mask(std::ptr::null()));
    let mask = signal
        .as_ref()
        .map_or(std::ptr::null(), |(unblocked, _)| unblocked as *const libc::sigset_t);
    // SAFETY: ppoll reads and writes `entries`, a live local array of two (a negative fd is
    // ignored); `mask` is null or points into `signal`, a live local.
    let rc = unsafe {
        real::ppoll_ms(
            entries.as_mut_ptr(),
            entries.len() as libc::nfds_t,
            timeout_ms,
            mask,
        )
    };
    if rc < 0 {
        let code = errno();
        return match signal {
            Some((_, before)) if code == libc::EINTR && woken_by_signal(before) => Ok(libc::POLLIN),
            _ => Err(code),
        };
    }
    if let Armed::Fault { faulted, .. } = armed {
        if entries[1].revents != 0 {
            stats::bump(&stats::get().wake_faults);
            read_fault_events(uffd);
            faulted.set(true);
            return Ok(libc::POLLIN);
        }
    }
    Ok(entries[0].revents)
}

/// Ends an armed sleep: withdraws the request (a peer that already took it sends its
/// wake-up anyway, which the next sleep drains or ignores) and lifts a protection, which
/// lets a peer blocked on it go on.
pub fn disarm(conn: &Conn, awaited: Awaited, armed: Armed) {
    let (_, flag, _) = watched(conn, awaited);
    match armed {
        Armed::Byte => {}
        Armed::Signal => {
            let _ = flag.compare_exchange(WAKE_SIGNAL, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        Armed::Fault {
            uffd,
            page,
            faulted,
        } => {
            let _ = flag.compare_exchange(WAKE_FAULT, 0, Ordering::AcqRel, Ordering::Relaxed);
            let at = progress(conn, awaited);
            let _ = write_protect(uffd, page, false);
            if faulted.get() && !peer_moves_on(conn, awaited, at) {
                conn.fault_seen[awaited as usize].store(at.wrapping_add(1), Ordering::Relaxed);
            }
        }
    }
}

/// Longest wait, after lifting the protection, for the peer to run the store it faulted on.
const FAULT_RESUME: std::time::Duration = std::time::Duration::from_micros(20);

/// After a fault: the peer was blocked in the kernel until we lifted the protection, and now
/// needs its CPU back to finish the store, usually a few microseconds. Waiting for its counter
/// to move from `at` here (at most [`FAULT_RESUME`]) saves the sleep that would otherwise
/// follow, with a wake-up byte to end it. False if it did not move in time.
fn peer_moves_on(conn: &Conn, awaited: Awaited, at: u64) -> bool {
    let started = std::time::Instant::now();
    loop {
        for _ in 0..64 {
            if progress(conn, awaited) != at {
                return true;
            }
            std::hint::spin_loop();
        }
        if started.elapsed() >= FAULT_RESUME {
            return false;
        }
    }
}

/// The last sleep for `awaited` ended in the peer's fault, and the peer has not finished the
/// store it faulted on (its counter has not moved): it only waits for its CPU to run it. The
/// page must not be protected again before that, or the peer would fault again as soon as it
/// runs (and a waiter quicker than the peer's wake-up would keep it from ever running past
/// the store). Such a sleep asks for a wake-up byte, which the peer sends right after its
/// store.
fn peer_still_faulting(conn: &Conn, awaited: Awaited) -> bool {
    let seen = &conn.fault_seen[awaited as usize];
    let at = seen.load(Ordering::Relaxed);
    if at == 0 {
        return false;
    }
    if progress(conn, awaited).wrapping_add(1) == at {
        return true;
    }
    seen.store(0, Ordering::Relaxed);
    false
}

// ---- Signals (async) ----

/// Signals of [`SIGNAL`] this process received (the handler's only work).
static SIGNALS_RECEIVED: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_wake_signal(_: c_int) {
    SIGNALS_RECEIVED.fetch_add(1, Ordering::SeqCst);
}

thread_local! {
    /// This thread blocks [`SIGNAL`] outside its sleeps.
    static SIGNAL_BLOCKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The calling thread's signal mask.
fn thread_mask() -> libc::sigset_t {
    // SAFETY: sigset_t is a plain bit array, valid when zeroed; pthread_sigmask with a null
    // new set only writes the current mask into `mask`, a live local.
    unsafe {
        let mut mask: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask);
        mask
    }
}

/// Makes [`SIGNAL`] usable for wake-ups in this thread: a handler in the process (installed
/// once, unless the application has its own, which ends a sleep as well), and the signal
/// blocked in this thread outside its sleeps. False if that cannot be done.
fn signals_usable() -> bool {
    static INSTALLED: Once = Once::new();
    static USABLE: AtomicI32 = AtomicI32::new(0);
    INSTALLED.call_once(|| {
        // SAFETY: sigaction reads the new action (a live local, handler set, empty mask) and
        // writes the old one into another live local. `on_wake_signal` only bumps an atomic,
        // which is async-signal-safe.
        let ok = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(SIGNAL, std::ptr::null(), &mut old) == 0
                && (old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN || {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = on_wake_signal as extern "C" fn(c_int) as usize;
                    action.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut action.sa_mask);
                    libc::sigaction(SIGNAL, &action, std::ptr::null_mut()) == 0
                })
        };
        USABLE.store(i32::from(ok), Ordering::Release);
    });
    if USABLE.load(Ordering::Acquire) == 0 {
        return false;
    }
    SIGNAL_BLOCKED.with(|blocked| {
        if !blocked.get() {
            // SAFETY: sigemptyset/sigaddset write into `set`, a live local; pthread_sigmask
            // reads it and writes no old mask (null).
            let ok = unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, SIGNAL);
                libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) == 0
            };
            blocked.set(ok);
        }
        blocked.get()
    })
}

// ---- userfaultfd (norw) ----

/// `fault_state` of a side: its userfaultfd is published; the peer has taken a copy; the owner
/// has closed its own copy (only then may the peer protect: a protector that dies then takes
/// the last copy with it, and the kernel releases every fault it held).
const PUBLISHED: u32 = 1;
const TAKEN: u32 = 2;
const OWNER_CLOSED: u32 = 3;

const PAGE: u64 = 4096;

// From linux/userfaultfd.h.
const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: c_int = 1;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// _IOWR(0xAA, nr, size).
const fn uffdio(nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (0xAA << 8) | nr
}
const UFFDIO_API: u64 = uffdio(0x3F, 24);
const UFFDIO_REGISTER: u64 = uffdio(0x00, 32);
const UFFDIO_WRITEPROTECT: u64 = uffdio(0x06, 24);

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    start: u64,
    len: u64,
    mode: u64,
}

fn ioctl<T>(fd: c_int, request: u64, argument: &mut T) -> bool {
    // SAFETY: each request used here reads and writes exactly the struct its number encodes,
    // which `argument` (a live, exclusively borrowed value of that layout) is.
    unsafe { real::ioctl(fd, request as libc::c_ulong, (argument as *mut T).cast()) == 0 }
}

/// A userfaultfd registered for write-protection over `[start, start + len)` of this process.
fn registered_userfaultfd(start: u64, len: u64) -> Option<c_int> {
    // SAFETY: userfaultfd takes flags only and returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
        )
    } as c_int;
    if fd < 0 {
        return None;
    }
    // Unpopulated pages protected too where the kernel can (6.4+); the region is populated
    // at creation, so without it only pages the kernel reclaimed would slip through.
    let ready = [
        UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_WP_UNPOPULATED,
        UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
    ]
    .into_iter()
    .any(|features| {
        let mut api = UffdioApi {
            api: UFFD_API,
            features,
            ioctls: 0,
        };
        ioctl(fd, UFFDIO_API, &mut api)
    });
    let mut register = UffdioRegister {
        start,
        len,
        mode: UFFDIO_REGISTER_MODE_WP,
        ioctls: 0,
    };
    if ready && ioctl(fd, UFFDIO_REGISTER, &mut register) {
        Some(fd)
    } else {
        // SAFETY: `fd` was created above and is closed once, here.
        unsafe { real::close(fd) };
        None
    }
}

fn write_protect(uffd: c_int, page: u64, on: bool) -> bool {
    let mut request = UffdioWriteprotect {
        start: page,
        len: PAGE,
        mode: if on { UFFDIO_WRITEPROTECT_MODE_WP } else { 0 },
    };
    ioctl(uffd, UFFDIO_WRITEPROTECT, &mut request)
}

/// Reads the pending fault messages (each names a faulting address; the protection is lifted
/// for the whole page in `disarm`, which also wakes the faulting threads).
fn read_fault_events(uffd: c_int) {
    let mut messages = [0u8; 32 * 16];
    for _ in 0..64 {
        // SAFETY: read writes at most `messages.len()` bytes into `messages`, a live local.
        let got = unsafe { real::read(uffd, messages.as_mut_ptr().cast(), messages.len()) };
        if got < messages.len() as isize {
            return;
        }
    }
}

/// This side's fault channel, for a new connection in `norw` mode: a userfaultfd over this
/// process's mapping of the region, published in the region for the peer to take. Returns the
/// fd (or -1: the peer's waits on us stay on wake-up bytes).
pub fn publish_fault_channel(conn: &Conn) -> c_int {
    if settings::get().notify != Mode::NotifyOnRw {
        return -1;
    }
    let (base, len) = conn.region.mapping();
    let Some(fd) = registered_userfaultfd(base as u64, len as u64) else {
        return -1;
    };
    let side = conn.side();
    let control = conn.region.control();
    control.mapping[side].store(base as u64, Ordering::Relaxed);
    // SAFETY: getpid takes no arguments and cannot fail.
    let pid = unsafe { libc::getpid() } as u64;
    control.fault_owner[side].store(pid << 32 | (fd as u64 + 1), Ordering::Release);
    control.fault_state[side].store(PUBLISHED, Ordering::Release);
    fd
}

/// The owner's half of the hand-over: once the peer took its copy of our userfaultfd, close
/// ours (see [`OWNER_CLOSED`]). Called on the data path, where it costs one load.
fn close_own_fault_channel_once_taken(conn: &Conn) {
    let fd = conn.own_fault_fd.load(Ordering::Relaxed);
    if fd < 0 || conn.region.control().fault_state[conn.side()].load(Ordering::Acquire) != TAKEN
    {
        return;
    }
    if conn
        .own_fault_fd
        .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
    {
        // Taken out of `own_fault_fd` by the exchange above, so closed once.
        close_userfaultfd(fd);
        conn.region.control().fault_state[conn.side()].store(OWNER_CLOSED, Ordering::Release);
    }
}

/// `Conn::peer_fault_fd` before the first attempt, and after a failed one.
pub const NOT_TRIED: c_int = -1;
pub const UNAVAILABLE: c_int = -2;

/// Our copy of the peer's userfaultfd, taken on first use with pidfd_getfd (see the module
/// comment on trust). None while it cannot be used (yet).
fn peer_fault_channel(conn: &Conn) -> Option<c_int> {
    let peer = conn.peer_side();
    let control = conn.region.control();
    let mut fd = conn.peer_fault_fd.load(Ordering::Acquire);
    if fd == NOT_TRIED {
        let taken = take_peer_fault_channel(conn).unwrap_or(UNAVAILABLE);
        fd = match conn.peer_fault_fd.compare_exchange(
            NOT_TRIED,
            taken,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => taken,
            Err(current) => {
                if taken >= 0 {
                    // SAFETY: `taken` is the copy made just now, which lost the race; closed once.
                    unsafe { real::close(taken) };
                }
                current
            }
        };
    }
    (fd >= 0 && control.fault_state[peer].load(Ordering::Acquire) == OWNER_CLOSED).then_some(fd)
}

fn take_peer_fault_channel(conn: &Conn) -> Option<c_int> {
    let peer = conn.peer_side();
    let control = conn.region.control();
    if control.fault_state[peer].load(Ordering::Acquire) != PUBLISHED {
        return None;
    }
    let word = control.fault_owner[peer].load(Ordering::Acquire);
    let (pid, number) = ((word >> 32) as c_int, (word as u32).checked_sub(1)? as c_int);
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as c_int;
    if pidfd < 0 {
        return None;
    }
    // SAFETY: pidfd_getfd takes the pidfd opened above, an fd number and flags; the kernel
    // checks that this process may ptrace the target and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, number, 0) } as c_int;
    // SAFETY: `pidfd` was opened above and is closed once, here.
    unsafe { real::close(pidfd) };
    if fd < 0 {
        return None;
    }
    if !is_userfaultfd(fd) {
        // SAFETY: `fd` is the copy made above, closed once.
        unsafe { real::close(fd) };
        return None;
    }
    let _ = control.fault_state[peer].compare_exchange(
        PUBLISHED,
        TAKEN,
        Ordering::AcqRel,
        Ordering::Relaxed,
    );
    Some(fd)
}

/// Closes `fd`, one of this module's userfaultfds, unless the program closed that number behind
/// the library's back (a blanket close of its fds) and it now names something of the
/// program's, which must not be closed.
fn close_userfaultfd(fd: c_int) {
    if is_userfaultfd(fd) {
        // SAFETY: `fd` is a userfaultfd (checked just now) that the caller took out of its slot,
        // so this is its one close.
        unsafe { real::close(fd) };
    }
}

fn is_userfaultfd(fd: c_int) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[userfaultfd]")
}

/// Write-protects the header page of `direction` in the peer's mapping. None if Notify-on-RW
/// is not possible (yet) on this connection.
fn protect_peer_page(conn: &Conn, direction: usize) -> Option<(c_int, u64)> {
    let uffd = peer_fault_channel(conn)?;
    let peer_base = conn.region.control().mapping[conn.peer_side()].load(Ordering::Relaxed);
    let page = peer_base.checked_add(conn.region.record_offset(direction) as u64)?;
    write_protect(uffd, page, true).then_some((uffd, page))
}

/// Closes this connection's userfaultfds (its own, if still held, and its copy of the peer's).
pub fn close_fault_channels(conn: &Conn) {
    for slot in [&conn.own_fault_fd, &conn.peer_fault_fd] {
        let fd = slot.swap(UNAVAILABLE, Ordering::AcqRel);
        if fd >= 0 {
            // Taken out of its slot by the swap, so closed once.
            close_userfaultfd(fd);
        }
    }
}

/// In a forked child: the child's memory is not registered with the parent's userfaultfd,
/// and its inherited copy would keep that userfaultfd alive after the parent closed its own
/// (see [`OWNER_CLOSED`]), so it goes.
pub fn forget_own_fault_channel_in_child(conn: &Conn) {
    let fd = conn.own_fault_fd.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // The child's inherited copy, taken out of its slot by the swap; closed once.
        close_userfaultfd(fd);
    }
}
