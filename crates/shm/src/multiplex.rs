//! epoll, poll and select over a mix of kernel fds and shared-memory connections.
//!
//! A shared-memory connection's kernel socket stays in the application's epoll set, but
//! registered by the library: for `EPOLLIN | EPOLLRDHUP | EPOLLET` with a token as its data, so
//! that wake-up bytes, EOF and resets wake the set. The application's own registration
//! (events, data, EPOLLET, EPOLLONESHOT) lives in a shadow table here. epoll_wait() first polls
//! the rings (no system call), then sleeps in the real epoll_wait() with the rings armed, and
//! turns tokens back into the application's events. poll() and select() do the same with a
//! copy of the fd array. Readiness of ring data is checked in user space; edge-triggered
//! registrations report an edge when the ring's byte counters moved since the last report.

use crate::conn::{self, Conn, Inbound};
use crate::io::{self, Readiness};
use crate::notify;
use crate::real::{self, errno, set_errno};
use libc::{c_int, epoll_event};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN_TAG: u64 = 0xF1A7_5E00_0000_0000;
const TOKEN_MASK: u64 = 0xFFFF_FF00_0000_0000;
const NEVER: u64 = u64::MAX - 1;

struct Watch {
    fd: c_int,
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    last_in: u64,
    last_out: u64,
    eof_reported: bool,
    error_reported: bool,
    disabled: bool,
    /// Kernel-mode connections: data was there at the last look, so look again.
    kernel_hint: bool,
    /// The kernel registration includes EPOLLOUT (while the connector still writes over the
    /// kernel socket, its send buffer decides writability).
    kernel_out: bool,
}

#[derive(Default)]
struct EpollSet {
    watches: Vec<Watch>,
    cursor: usize,
    pacer: Pacer,
}

/// When the rings alone have something to report, a wait skips the kernel (no system call)
/// except every `EVERY`-th time or once `INTERVAL` has passed: a busy event loop then makes no
/// system call per message, and kernel fds in the same set still get their turn. (epoll never
/// promises to report every ready fd in one call; poll and select do, see `poll`.)
#[derive(Default, Clone, Copy)]
struct Pacer {
    skipped: u32,
    last: Option<Instant>,
}

impl Pacer {
    const EVERY: u32 = 16;
    const INTERVAL: Duration = Duration::from_micros(200);

    fn due(&self) -> bool {
        self.skipped >= Self::EVERY || self.last.is_none_or(|at| at.elapsed() >= Self::INTERVAL)
    }

    fn looked(&mut self) {
        self.skipped = 0;
        self.last = Some(Instant::now());
    }
}

/// poll()/select() have no set to hang state on: one per thread, for the set it saw last.
#[derive(Clone, Copy)]
struct PollPacer {
    pacer: Pacer,
    /// The (fd, events) list of the last call (a hash).
    set: u64,
    /// The last kernel look at that set found none of its kernel fds ready.
    kernel_quiet: bool,
}

thread_local! {
    static POLL_PACER: std::cell::Cell<PollPacer> = const {
        std::cell::Cell::new(PollPacer {
            pacer: Pacer { skipped: 0, last: None },
            set: 0,
            kernel_quiet: false,
        })
    };
}

/// A hash of a poll set's fds and requested events.
fn set_signature(entries: &[libc::pollfd]) -> u64 {
    entries
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, entry| {
            (hash ^ ((entry.fd as u32 as u64) << 16 | entry.events as u16 as u64))
                .wrapping_mul(0x0100_0000_01b3)
        })
}

fn pacer_due(epfd: c_int) -> bool {
    EPOLLS.lock().set(epfd).is_none_or(|s| s.pacer.due())
}

fn pacer_update(epfd: c_int, looked: bool) {
    if let Some(set) = EPOLLS.lock().set_mut(epfd) {
        if looked {
            set.pacer.looked();
        } else {
            set.pacer.skipped += 1;
        }
    }
}

/// The application's epoll instances. An instance can have several fds (mio clones its
/// registry with dup and registers through one fd while it waits on the other), so sets are
/// keyed by instance, and every fd of an instance maps to it.
struct Epolls {
    by_fd: BTreeMap<c_int, u64>,
    sets: BTreeMap<u64, EpollSet>,
    next_id: u64,
}

impl Epolls {
    /// The instance behind `epfd`, registered on first sight.
    fn id(&mut self, epfd: c_int) -> u64 {
        if let Some(&id) = self.by_fd.get(&epfd) {
            return id;
        }
        self.next_id += 1;
        self.by_fd.insert(epfd, self.next_id);
        self.next_id
    }

    fn set(&self, epfd: c_int) -> Option<&EpollSet> {
        self.sets.get(self.by_fd.get(&epfd)?)
    }

    fn set_mut(&mut self, epfd: c_int) -> Option<&mut EpollSet> {
        let id = *self.by_fd.get(&epfd)?;
        self.sets.get_mut(&id)
    }

    /// Some open fd of instance `id`.
    fn fd_of(&self, id: u64) -> Option<c_int> {
        self.by_fd
            .iter()
            .find(|(_, &instance)| instance == id)
            .map(|(&fd, _)| fd)
    }

    /// `fd` (an epoll fd or not) is closing.
    fn forget_epoll_fd(&mut self, fd: c_int) {
        let Some(id) = self.by_fd.remove(&fd) else {
            return;
        };
        if self.fd_of(id).is_none() {
            if let Some(set) = self.sets.remove(&id) {
                WATCH_COUNT.fetch_sub(set.watches.len(), Ordering::Relaxed);
            }
        }
    }
}

static EPOLLS: Mutex<Epolls> = Mutex::new(Epolls {
    by_fd: BTreeMap::new(),
    sets: BTreeMap::new(),
    next_id: 0,
});
static WATCH_COUNT: AtomicUsize = AtomicUsize::new(0);

fn kernel_registration(fd: c_int, out: bool) -> epoll_event {
    let mut events = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
    if out {
        events |= libc::EPOLLOUT as u32;
    }
    epoll_event {
        events,
        u64: TOKEN_TAG | fd as u32 as u64,
    }
}

fn remove_watch(epolls: &mut Epolls, epfd: c_int, fd: c_int) {
    if let Some(set) = epolls.set_mut(epfd) {
        let before = set.watches.len();
        set.watches.retain(|w| w.fd != fd);
        WATCH_COUNT.fetch_sub(before - set.watches.len(), Ordering::Relaxed);
    }
}

/// After epoll_create*(): a new instance (whatever an old fd of that number was is gone).
pub fn created(epfd: c_int) {
    if epfd < 0 {
        return;
    }
    let mut epolls = EPOLLS.lock();
    epolls.forget_epoll_fd(epfd);
    epolls.id(epfd);
}

/// After dup*() or F_DUPFD: if `old` is an epoll fd, `new` names the same instance.
pub fn duplicated(old: c_int, new: c_int) {
    if new < 0 || old == new {
        return;
    }
    let mut epolls = EPOLLS.lock();
    if let Some(&id) = epolls.by_fd.get(&old) {
        epolls.by_fd.insert(new, id);
    }
}

/// epoll_ctl() interposer.
///
/// # Safety
/// Arguments as for epoll_ctl(2).
pub unsafe fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut epoll_event) -> c_int {
    let Some(conn) = conn::lookup(fd) else {
        if WATCH_COUNT.load(Ordering::Relaxed) != 0 {
            remove_watch(&mut EPOLLS.lock(), epfd, fd);
        }
        // SAFETY: the caller's arguments, passed on unchanged (this function's `# Safety`).
        return unsafe { real::epoll_ctl(epfd, op, fd, event) };
    };
    let app = if event.is_null() {
        None
    } else {
        // SAFETY: non-null, so epoll_ctl(2)'s contract makes it a readable epoll_event;
        // read_unaligned copies it whatever its alignment.
        Some(unsafe { std::ptr::read_unaligned(event) })
    };
    match op {
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            let Some(app) = app else {
                set_errno(libc::EFAULT);
                return -1;
            };
            let kernel_out = app.events & libc::EPOLLOUT as u32 != 0 && !conn.outbound_on_ring();
            let mut kernel = kernel_registration(fd, kernel_out);
            // SAFETY: epoll_ctl reads one epoll_event, `kernel`, a live local.
            let rc = unsafe { real::epoll_ctl(epfd, op, fd, &mut kernel) };
            if rc != 0 {
                return rc;
            }
            conn.epoll_watched.store(true, Ordering::Release);
            let mut epolls = EPOLLS.lock();
            remove_watch(&mut epolls, epfd, fd);
            let id = epolls.id(epfd);
            epolls.sets.entry(id).or_default().watches.push(Watch {
                fd,
                conn,
                events: app.events,
                data: app.u64,
                last_in: NEVER,
                last_out: NEVER,
                eof_reported: false,
                error_reported: false,
                disabled: false,
                kernel_hint: true,
                kernel_out,
            });
            WATCH_COUNT.fetch_add(1, Ordering::Relaxed);
            0
        }
        _ => {
            // SAFETY: the caller's arguments, passed on unchanged (this function's `# Safety`).
            let rc = unsafe { real::epoll_ctl(epfd, op, fd, event) };
            if rc == 0 {
                remove_watch(&mut EPOLLS.lock(), epfd, fd);
            }
            rc
        }
    }
}

/// Bookkeeping when `fd` closes: drop its watches (and the kernel registrations, which a dup
/// of the socket would otherwise keep alive), and forget it as an epoll fd.
pub fn forget_fd(fd: c_int) {
    let mut epolls = EPOLLS.lock();
    if epolls.by_fd.is_empty() {
        return;
    }
    epolls.forget_epoll_fd(fd);
    if WATCH_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let ids: Vec<u64> = epolls
        .sets
        .iter()
        .filter(|(_, s)| s.watches.iter().any(|w| w.fd == fd))
        .map(|(&id, _)| id)
        .collect();
    for id in ids {
        if let Some(epfd) = epolls.fd_of(id) {
            // SAFETY: EPOLL_CTL_DEL takes no event (null is allowed since Linux 2.6.9); it
            // only removes the registration of `fd`, which the library made.
            unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
        }
        if let Some(set) = epolls.sets.get_mut(&id) {
            let before = set.watches.len();
            set.watches.retain(|w| w.fd != fd);
            WATCH_COUNT.fetch_sub(before - set.watches.len(), Ordering::Relaxed);
        }
    }
}

fn has_watches(epfd: c_int) -> bool {
    WATCH_COUNT.load(Ordering::Relaxed) != 0
        && EPOLLS
            .lock()
            .set(epfd)
            .is_some_and(|s| !s.watches.is_empty())
}

/// What to report for a watch now (and update its edge state).
fn evaluate(epfd: c_int, watch: &mut Watch, activity: bool) -> u32 {
    if watch.disabled {
        return 0;
    }
    if watch.kernel_out && watch.conn.outbound_on_ring() {
        // Writes go to shared memory now: stop waking on the kernel send buffer.
        let mut kernel = kernel_registration(watch.fd, false);
        // SAFETY: EPOLL_CTL_MOD reads one epoll_event, `kernel`, a live local.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, watch.fd, &mut kernel) };
        watch.kernel_out = false;
    }
    let check_kernel = activity || watch.kernel_hint;
    let ready = readiness(watch.fd, &watch.conn, activity, check_kernel);
    if watch.conn.inbound_source() != Inbound::Ring {
        watch.kernel_hint = ready.readable || ready.eof;
    }
    let edge = watch.events & libc::EPOLLET as u32 != 0;
    let mut events = 0u32;
    let wants_in = watch.events & libc::EPOLLIN as u32 != 0;
    let wants_rdhup = watch.events & libc::EPOLLRDHUP as u32 != 0;
    if ready.readable || ready.eof {
        let new_edge = ready.in_sequence != watch.last_in
            || (ready.eof && !watch.eof_reported)
            || (activity && ready.in_sequence == u64::MAX);
        if !edge || new_edge {
            if wants_in {
                events |= libc::EPOLLIN as u32;
            }
            if ready.eof && wants_rdhup {
                events |= libc::EPOLLRDHUP as u32;
            }
        }
    }
    if watch.events & libc::EPOLLOUT as u32 != 0
        && ready.writable
        && (!edge
            || ready.out_sequence != watch.last_out
            || (activity && ready.out_sequence == u64::MAX))
    {
        events |= libc::EPOLLOUT as u32;
    }
    if ready.error && (!edge || !watch.error_reported) {
        events |= (libc::EPOLLERR | libc::EPOLLHUP) as u32;
    }
    if events != 0 {
        if events & (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 != 0 {
            watch.last_in = ready.in_sequence;
            watch.eof_reported |= ready.eof;
        }
        if events & libc::EPOLLOUT as u32 != 0 {
            watch.last_out = ready.out_sequence;
        }
        watch.error_reported |= ready.error;
        if watch.events & libc::EPOLLONESHOT as u32 != 0 {
            watch.disabled = true;
        }
    }
    events
}

fn readiness(fd: c_int, conn: &Conn, activity: bool, check_kernel: bool) -> Readiness {
    if !check_kernel && conn.inbound_source() != Inbound::Ring {
        // Nothing came over the kernel since the last look and nothing was there then.
        let mut ready = io::readiness_without_kernel(fd, conn);
        ready.in_sequence = u64::MAX;
        return ready;
    }
    io::readiness(fd, conn, activity)
}

/// A look at the rings only, no system call: would a wait return now?
fn quick_ready(watch: &Watch) -> bool {
    if watch.disabled || watch.conn.inbound_source() != Inbound::Ring {
        return false;
    }
    let edge = watch.events & libc::EPOLLET as u32 != 0;
    let inbound = watch.conn.inbound();
    if watch.events & libc::EPOLLIN as u32 != 0
        && inbound.readable() > 0
        && (!edge || inbound.written() != watch.last_in)
    {
        return true;
    }
    if watch.events & libc::EPOLLOUT as u32 != 0 && watch.conn.outbound_on_ring() {
        let outbound = watch.conn.outbound();
        if outbound.write_ready() && (!edge || outbound.consumed() != watch.last_out) {
            return true;
        }
    }
    false
}

fn collect(epfd: c_int, out: &mut [epoll_event], fired: &[c_int]) -> usize {
    let mut epolls = EPOLLS.lock();
    let Some(set) = epolls.set_mut(epfd) else {
        return 0;
    };
    let count = set.watches.len();
    let mut written = 0;
    for step in 0..count {
        if written == out.len() {
            break;
        }
        let index = (set.cursor + step) % count;
        let watch = &mut set.watches[index];
        let events = evaluate(epfd, watch, fired.contains(&watch.fd));
        if events != 0 {
            out[written] = epoll_event {
                events,
                u64: watch.data,
            };
            written += 1;
        }
    }
    if count > 0 {
        set.cursor = (set.cursor + 1) % count;
    }
    written
}

fn arm_set(epfd: c_int, signal: bool) {
    if let Some(set) = EPOLLS.lock().set(epfd) {
        for watch in set.watches.iter().filter(|w| !w.disabled) {
            io::arm(
                &watch.conn,
                watch.events & libc::EPOLLIN as u32 != 0,
                watch.events & libc::EPOLLOUT as u32 != 0,
                signal,
            );
        }
    }
}

/// How long a sleep may last when a writer on a full pipe cannot be woken by its peer: once
/// the peer has shut down its sending side (or its kernel socket reported EOF), its kernel
/// socket can send no wake-up byte, so the pipe is looked at in short steps instead (as the
/// blocking send does, see `io::wait_writable`). Bounded: only while a write waits for room.
const UNWAKEABLE_STEP_MS: c_int = 10;

/// The sleep for `wait_ms` (-1: forever), shortened if a watched writer cannot be woken.
fn cap_for_unwakeable(epfd: c_int, wait_ms: c_int) -> c_int {
    let unwakeable = EPOLLS.lock().set(epfd).is_some_and(|s| {
        s.watches.iter().any(|w| {
            !w.disabled && w.events & libc::EPOLLOUT as u32 != 0 && io::writer_unwakeable(&w.conn)
        })
    });
    if unwakeable && !(0..=UNWAKEABLE_STEP_MS).contains(&wait_ms) {
        UNWAKEABLE_STEP_MS
    } else {
        wait_ms
    }
}

fn any_quick_ready(epfd: c_int) -> bool {
    EPOLLS
        .lock()
        .set(epfd)
        .is_some_and(|s| s.watches.iter().any(quick_ready))
}

/// Moves the application's events to the front of `events[..n]` and returns their count,
/// collecting the fds whose kernel sockets (our tokens) fired.
fn split_tokens(events: &mut [epoll_event], fired: &mut Vec<c_int>) -> usize {
    let mut kept = 0;
    for index in 0..events.len() {
        let event = events[index];
        let data = event.u64;
        if data & TOKEN_MASK == TOKEN_TAG {
            fired.push((data & 0xFFFF_FFFF) as u32 as c_int);
        } else {
            events[kept] = event;
            kept += 1;
        }
    }
    kept
}

fn remaining_ms(deadline: Option<Instant>) -> Option<c_int> {
    match deadline {
        None => Some(-1),
        Some(at) => {
            let now = Instant::now();
            if now >= at {
                None
            } else {
                Some((at - now).as_micros().div_ceil(1000).min(i32::MAX as u128) as c_int)
            }
        }
    }
}

/// epoll_wait()/epoll_pwait() interposer.
///
/// # Safety
/// Arguments as for epoll_pwait(2).
pub unsafe fn epoll_wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    if max <= 0 || events.is_null() || !has_watches(epfd) {
        // SAFETY: the caller's arguments, passed on unchanged (this function's `# Safety`).
        return unsafe { real::epoll_pwait(epfd, events, max, timeout, mask) };
    }
    // SAFETY: `events` is non-null and `max > 0` (checked above), and epoll_pwait(2)'s contract
    // makes it valid for `max` writable events, which nothing else uses during this call (the
    // kernel calls below write them through `out`).
    let out = unsafe { std::slice::from_raw_parts_mut(events, max as usize) };
    let deadline = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    let mut spun = false;
    let mut fired = Vec::new();
    loop {
        if !pacer_due(epfd) {
            // The rings alone, no system call.
            let count = collect(epfd, out, &[]);
            if count > 0 {
                pacer_update(epfd, false);
                return count as c_int;
            }
        }
        // Kernel events that are already there, then the rings.
        fired.clear();
        // SAFETY: `out` is `max` writable events (above); no signal mask (null).
        let rc = unsafe { real::epoll_pwait(epfd, out.as_mut_ptr(), max, 0, std::ptr::null()) };
        if rc < 0 {
            return rc;
        }
        pacer_update(epfd, true);
        let mut count = split_tokens(&mut out[..rc as usize], &mut fired);
        count += collect(epfd, &mut out[count..], &fired);
        if count > 0 || timeout == 0 {
            return count as c_int;
        }
        if !spun {
            spun = true;
            if io::spin_until(|| any_quick_ready(epfd)) {
                continue;
            }
        }
        // `async` mode: the peers signal this thread, which sleeps with the signal unblocked.
        let signal = notify::event_waits_use_signals();
        arm_set(epfd, signal);
        let count = collect(epfd, out, &[]);
        if count > 0 {
            return count as c_int;
        }
        let Some(wait_ms) = remaining_ms(deadline) else {
            return 0;
        };
        let wait_ms = cap_for_unwakeable(epfd, wait_ms);
        let signal_mask = signal.then(|| notify::signal_sleep_mask(mask));
        let sleep_mask = signal_mask
            .as_ref()
            .map_or(mask, |(unblocked, _)| unblocked as *const libc::sigset_t);
        // SAFETY: `out` is `max` writable events (above); `sleep_mask` is the caller's `mask`
        // (null or a sigset, this function's `# Safety`) or a live local sigset.
        let rc = unsafe { real::epoll_pwait(epfd, out.as_mut_ptr(), max, wait_ms, sleep_mask) };
        if rc < 0 {
            if let Some((_, before)) = signal_mask {
                if errno() == libc::EINTR && notify::woken_by_signal(before) {
                    // A peer's wake-up, not the program's signal: look at the rings again.
                    continue;
                }
            }
            return rc;
        }
        fired.clear();
        let mut count = split_tokens(&mut out[..rc as usize], &mut fired);
        count += collect(epfd, &mut out[count..], &fired);
        if count > 0 {
            return count as c_int;
        }
        if remaining_ms(deadline).is_none() {
            return 0;
        }
    }
}

fn poll_bits(ready: &Readiness, requested: i16) -> i16 {
    let mut bits = 0;
    if requested & libc::POLLIN != 0 && (ready.readable || ready.eof) {
        bits |= libc::POLLIN;
    }
    if requested & libc::POLLRDHUP != 0 && ready.eof {
        bits |= libc::POLLRDHUP;
    }
    if requested & libc::POLLOUT != 0 && ready.writable {
        bits |= libc::POLLOUT;
    }
    if ready.error {
        bits |= libc::POLLERR | libc::POLLHUP;
    }
    bits
}

/// poll()/ppoll() interposer.
///
/// # Safety
/// Arguments as for ppoll(2), with the timeout in milliseconds (-1: none).
pub unsafe fn poll(
    fds: *mut libc::pollfd,
    count: libc::nfds_t,
    timeout: c_int,
    mask: Option<*const libc::sigset_t>,
) -> c_int {
    // SAFETY: `fds` is the caller's array of `count` pollfds (this function's `# Safety`) or
    // `copy`, a live Vec of exactly `count`; `mask` is the caller's.
    let real_poll = |fds: *mut libc::pollfd, timeout: c_int| unsafe {
        match mask {
            None => real::poll(fds, count, timeout),
            Some(mask) => real::ppoll_ms(fds, count, timeout, mask),
        }
    };
    if !conn::any_live() || fds.is_null() || count == 0 {
        return real_poll(fds, timeout);
    }
    // SAFETY: `fds` is non-null and `count > 0` (checked above), and ppoll(2)'s contract makes
    // it valid for `count` pollfds, read and written; only `entries` uses them from here on.
    let entries = unsafe { std::slice::from_raw_parts_mut(fds, count as usize) };
    let shm: Vec<(usize, Arc<Conn>)> = entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| conn::lookup(e.fd).map(|c| (i, c)))
        .collect();
    if shm.is_empty() {
        return real_poll(fds, timeout);
    }
    // When the rings alone have something to report, skip the kernel (a system call) except
    // every Pacer::EVERY-th call or once Pacer::INTERVAL has passed, as epoll_wait does: a busy
    // loop over shared-memory connections then makes no system call per message (the kernel
    // look also drains wake-ups and notices EOF or reset, which can wait a few calls). poll
    // and select report every ready fd, so a set that also holds kernel fds is skipped only
    // when it is the set of this thread's previous call and the last kernel look at it found
    // none of those ready: a busy loop such as iperf3's select() over its listener and its
    // connections (which paid one poll(2) per message), while a set with a pipe or listener
    // that was ready is looked at every time. A kernel fd that becomes ready between two
    // looks is reported at the next one, at most 16 calls or 200 µs later.
    let signature = set_signature(entries);
    let state = POLL_PACER.with(|p| p.get());
    let may_skip = shm.len() == entries.len() || (state.set == signature && state.kernel_quiet);
    if may_skip && !state.pacer.due() {
        // The rings alone, no system call.
        let mut ready = 0;
        for (index, entry) in entries.iter_mut().enumerate() {
            entry.revents = match shm.iter().find(|(i, _)| *i == index) {
                Some((_, conn)) => poll_bits(&io::readiness(entry.fd, conn, false), entry.events),
                None => 0,
            };
            ready += c_int::from(entry.revents != 0);
        }
        if ready > 0 {
            POLL_PACER.with(|p| {
                let mut state = p.get();
                state.pacer.skipped += 1;
                p.set(state);
            });
            return ready;
        }
    }
    // Records what a kernel look found in the set's kernel fds.
    let looked = |copy: &[libc::pollfd]| {
        let quiet = copy
            .iter()
            .enumerate()
            .all(|(index, entry)| entry.revents == 0 || shm.iter().any(|(i, _)| *i == index));
        POLL_PACER.with(|p| {
            let mut state = p.get();
            state.pacer.looked();
            state.set = signature;
            state.kernel_quiet = quiet;
            p.set(state);
        });
    };
    let deadline = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    let mut copy: Vec<libc::pollfd> = entries.to_vec();
    let mut spun = false;
    let merge = |entries: &mut [libc::pollfd], copy: &[libc::pollfd]| -> c_int {
        let mut ready_count = 0;
        for (index, entry) in entries.iter_mut().enumerate() {
            entry.revents = match shm.iter().find(|(i, _)| *i == index) {
                Some((_, conn)) => {
                    let activity = copy[index].revents != 0;
                    poll_bits(&io::readiness(entry.fd, conn, activity), entry.events)
                }
                None => copy[index].revents,
            };
            if entry.revents != 0 {
                ready_count += 1;
            }
        }
        ready_count
    };
    loop {
        for (index, entry) in entries.iter().enumerate() {
            copy[index] = *entry;
            copy[index].revents = 0;
        }
        for (index, _) in &shm {
            copy[*index].events = libc::POLLIN;
        }
        // SAFETY: `copy` is a live Vec of exactly `count` pollfds (a copy of `entries`).
        let rc = unsafe { real::poll(copy.as_mut_ptr(), count, 0) };
        if rc < 0 {
            return rc;
        }
        looked(&copy);
        let ready = merge(entries, &copy);
        if ready > 0 || timeout == 0 {
            return ready;
        }
        if !spun {
            spun = true;
            let ring_ready = || {
                shm.iter().any(|(index, conn)| {
                    let wanted = entries[*index].events;
                    conn.inbound_source() == Inbound::Ring
                        && ((wanted & libc::POLLIN != 0 && conn.inbound().readable() > 0)
                            || (wanted & libc::POLLOUT != 0
                                && conn.outbound_on_ring()
                                && conn.outbound().write_ready()))
                })
            };
            if io::spin_until(ring_ready) {
                continue;
            }
        }
        for (index, conn) in &shm {
            // poll and select sleep with the caller's signal mask: bytes, not signals.
            io::arm(
                conn,
                entries[*index].events & libc::POLLIN != 0,
                entries[*index].events & libc::POLLOUT != 0,
                false,
            );
        }
        for entry in copy.iter_mut() {
            entry.revents = 0;
        }
        if merge(entries, &copy) > 0 {
            continue;
        }
        let Some(mut wait_ms) = remaining_ms(deadline) else {
            return 0;
        };
        let unwakeable = shm.iter().any(|(index, conn)| {
            entries[*index].events & libc::POLLOUT != 0 && io::writer_unwakeable(conn)
        });
        if unwakeable && !(0..=UNWAKEABLE_STEP_MS).contains(&wait_ms) {
            wait_ms = UNWAKEABLE_STEP_MS;
        }
        for (index, entry) in entries.iter().enumerate() {
            copy[index] = *entry;
            copy[index].revents = 0;
        }
        for (index, _) in &shm {
            copy[*index].events = libc::POLLIN;
        }
        let rc = real_poll(copy.as_mut_ptr(), wait_ms);
        if rc < 0 {
            return rc;
        }
        looked(&copy);
        let ready = merge(entries, &copy);
        if ready > 0 {
            return ready;
        }
        if remaining_ms(deadline).is_none() {
            return 0;
        }
    }
}

/// select()/pselect() interposer over poll. `None` when no shared-memory fd is involved.
///
/// # Safety
/// Arguments as for pselect(2), timeout in milliseconds (-1: none).
pub unsafe fn select(
    nfds: c_int,
    read: *mut libc::fd_set,
    write: *mut libc::fd_set,
    except: *mut libc::fd_set,
    timeout: c_int,
    mask: Option<*const libc::sigset_t>,
) -> Option<c_int> {
    if !conn::any_live() || nfds <= 0 {
        return None;
    }
    let nfds = nfds.min(libc::FD_SETSIZE as c_int);
    // SAFETY: a non-null set is the caller's readable fd_set (select(2)'s contract), and
    // `fd < nfds <= FD_SETSIZE` stays inside it.
    let is_set =
        |set: *mut libc::fd_set, fd: c_int| !set.is_null() && unsafe { libc::FD_ISSET(fd, set) };
    let mut entries = Vec::new();
    let mut any_shm = false;
    for fd in 0..nfds {
        let mut events = 0;
        if is_set(read, fd) {
            events |= libc::POLLIN;
        }
        if is_set(write, fd) {
            events |= libc::POLLOUT;
        }
        if is_set(except, fd) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            any_shm |= conn::lookup(fd).is_some();
            entries.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    if !any_shm {
        return None;
    }
    // SAFETY: `entries` is a live Vec of `entries.len()` pollfds; `mask` is the caller's (this
    // function's `# Safety`).
    let rc = unsafe {
        poll(
            entries.as_mut_ptr(),
            entries.len() as libc::nfds_t,
            timeout,
            mask,
        )
    };
    if rc < 0 {
        return Some(rc);
    }
    for set in [read, write, except] {
        if !set.is_null() {
            // SAFETY: a non-null set is the caller's writable fd_set (select(2)'s contract).
            unsafe { libc::FD_ZERO(set) };
        }
    }
    let mut bits = 0;
    for entry in &entries {
        if entry.revents & libc::POLLNVAL != 0 {
            set_errno(libc::EBADF);
            return Some(-1);
        }
        let readable = entry.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        let writable = entry.revents & (libc::POLLOUT | libc::POLLERR) != 0;
        let exceptional = entry.revents & libc::POLLPRI != 0;
        for (wanted, set, hit) in [
            (libc::POLLIN, read, readable),
            (libc::POLLOUT, write, writable),
            (libc::POLLPRI, except, exceptional),
        ] {
            if entry.events & wanted != 0 && hit {
                // SAFETY: `wanted` is in `entry.events` only if `is_set(set, fd)` held, so `set`
                // is the caller's non-null, writable fd_set; `entry.fd < nfds <= FD_SETSIZE`.
                unsafe { libc::FD_SET(entry.fd, set) };
                bits += 1;
            }
        }
    }
    let _ = errno();
    Some(bits)
}
