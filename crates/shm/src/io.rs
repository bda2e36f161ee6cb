//! The data path: send and receive on a shared-memory connection, and the waits (§4.2.4,
//! "user-mode NAPI"): a waiter polls the ring for a short while, then announces that it sleeps
//! (`*_wants_wake`) and sleeps in poll() on the kernel socket. The other side, after it moved
//! bytes, sends one wake-up byte over the kernel socket only if someone announced sleeping.
//! So a busy connection makes no system call per message, an idle one burns no CPU, and a peer
//! that dies wakes the sleeper through the kernel socket's EOF or reset.

use crate::conn::{Conn, Inbound};
use crate::lock::SpinGuard;
use crate::notify::{self, Awaited};
use crate::region::{BytePointer, Corrupt};
use crate::real::{self, errno, set_errno};
use crate::settings;
use crate::stats;
use libc::c_int;
use std::borrow::Cow;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

/// Outgoing data: (pointer, length) pairs, each valid for reads of its length during the call
/// (the interposers pass their caller's buffers, which libc's contract makes so).
pub type Chunks<'a> = &'a [(*const u8, usize)];
/// Incoming buffers: (pointer, length) pairs, each valid for writes of its length during the
/// call, likewise.
pub type Buffers<'a> = &'a [(*mut u8, usize)];

fn fail(code: c_int) -> isize {
    set_errno(code);
    -1
}

/// `list` past its first `skip` bytes (outgoing chunks or incoming buffers alike). Borrowed,
/// with no copy, when `skip` is 0: the common case, where a whole message moves in one pass.
fn skip_bytes<P: BytePointer>(list: &[(P, usize)], mut skip: usize) -> Cow<'_, [(P, usize)]> {
    if skip == 0 {
        return Cow::Borrowed(list);
    }
    let mut rest = Vec::with_capacity(list.len());
    for &(ptr, len) in list {
        if skip >= len {
            skip -= len;
            continue;
        }
        rest.push((ptr.advanced(skip), len - skip));
        skip = 0;
    }
    Cow::Owned(rest)
}

fn cap_buffers(buffers: &[(*mut u8, usize)], mut cap: usize) -> Vec<(*mut u8, usize)> {
    let mut out = Vec::with_capacity(buffers.len());
    for &(ptr, len) in buffers {
        if cap == 0 {
            break;
        }
        let take = len.min(cap);
        out.push((ptr, take));
        cap -= take;
    }
    out
}

/// Sends one wake-up byte. False if the peer is gone.
pub fn send_wake(fd: c_int) -> bool {
    let byte = 0u8;
    stats::bump(&stats::get().wakeups_sent);
    // SAFETY: send reads 1 byte, from `byte`, a live local; a bad fd only fails.
    let sent = unsafe {
        real::send(
            fd,
            (&byte as *const u8).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    sent >= 0 || matches!(errno(), libc::EAGAIN | libc::EINTR)
}

/// Wakes the peer's reader if it announced that it sleeps (`notify::wake`).
pub fn wake_reader(fd: c_int, conn: &Conn) {
    let control = &conn.outbound().control.control.0;
    if !notify::wake(fd, conn, &control.reader_wants_wake, &control.reader_thread) {
        conn.kernel_error.store(libc::EPIPE, Ordering::Release);
    }
}

/// After a read: wake the peer's writer if it sleeps on a full pipe and the pipe has drained to
/// its low-water mark (a writer that has not slept yet sees the space by itself).
fn wake_writer(fd: c_int, conn: &Conn) {
    let inbound = conn.inbound();
    let control = &inbound.control.control.0;
    fence(Ordering::SeqCst);
    if control.writer_wants_wake.load(Ordering::Relaxed) != 0
        && inbound.readable() <= inbound.wake_threshold()
    {
        notify::wake(fd, conn, &control.writer_wants_wake, &control.writer_thread);
    }
}

pub enum KernelState {
    Open,
    Eof,
    Error,
}

/// Learns whether the peer closed or reset, draining wake-up bytes if this thread may (holds
/// or can take the kernel-waiter role); otherwise only peeks. Only valid while incoming data
/// comes from the ring (kernel bytes are then wake-ups only).
pub fn kernel_check(fd: c_int, conn: &Conn) -> KernelState {
    let error = conn.kernel_error.load(Ordering::Acquire);
    if error != 0 {
        return KernelState::Error;
    }
    if conn.kernel_eof.load(Ordering::Acquire) {
        return KernelState::Eof;
    }
    match conn.kernel_waiter.try_lock() {
        Some(role) => {
            let state = drain(fd, conn, libc::MSG_DONTWAIT);
            drop(role);
            release_local_sleepers(conn);
            state
        }
        None => drain(fd, conn, libc::MSG_DONTWAIT | libc::MSG_PEEK),
    }
}

/// `kernel_check` for a nonblocking read that found the ring empty. On a connection in an
/// epoll set it only peeks: the wake-up bytes belong to the epoll waiter, which may be asleep
/// in the kernel on another thread and would never learn of them if they were drained here
/// (with EPOLLET, bytes left queued still raise a new edge for every byte that arrives later).
fn nonblocking_check(fd: c_int, conn: &Conn) -> KernelState {
    if !conn.epoll_watched.load(Ordering::Acquire) {
        return kernel_check(fd, conn);
    }
    let error = conn.kernel_error.load(Ordering::Acquire);
    if error != 0 {
        return KernelState::Error;
    }
    if conn.kernel_eof.load(Ordering::Acquire) {
        return KernelState::Eof;
    }
    drain(fd, conn, libc::MSG_DONTWAIT | libc::MSG_PEEK)
}

fn drain(fd: c_int, conn: &Conn, flags: c_int) -> KernelState {
    stats::bump(&stats::get().kernel_checks);
    let mut scratch = [0u8; 256];
    for _ in 0..64 {
        // SAFETY: recv writes at most `scratch.len()` bytes, into `scratch`, a live local array.
        let got = unsafe { real::recv(fd, scratch.as_mut_ptr().cast(), scratch.len(), flags) };
        if got > 0 {
            if flags & libc::MSG_PEEK != 0 {
                return KernelState::Open;
            }
            continue;
        }
        if got == 0 {
            conn.kernel_eof.store(true, Ordering::Release);
            return KernelState::Eof;
        }
        match errno() {
            libc::EAGAIN | libc::EINTR => return KernelState::Open,
            code => {
                conn.kernel_error.store(code, Ordering::Release);
                return KernelState::Error;
            }
        }
    }
    KernelState::Open
}

/// Wakes this process's threads that sleep on the connection while another held the role.
fn release_local_sleepers(conn: &Conn) {
    conn.local_sequence.fetch_add(1, Ordering::SeqCst);
    if conn.local_sleepers.load(Ordering::SeqCst) > 0 {
        // SAFETY: FUTEX_WAKE uses the address of `local_sequence`, a live aligned AtomicU32 of
        // `conn`, only as a key; it reads and writes no memory.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                conn.local_sequence.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                i32::MAX,
            )
        };
    }
}

/// Asks the peer for a wake-up byte, then looks once more: true if `ready` holds.
fn announce_and_look(conn: &Conn, awaited: Awaited, ready: &dyn Fn() -> bool) -> bool {
    notify::announce(conn, awaited, false);
    fence(Ordering::SeqCst);
    ready()
}

/// Sleeps until the peer wakes this thread (`notify`: a wake-up byte, a signal or a fault),
/// EOF or reset arrives on the kernel socket (or `events`), or another thread of this process
/// did so. `awaited` says what the sleep is for and `ready` whether it holds already. Returns
/// Err(EAGAIN) on timeout.
fn sleep_on_kernel(
    fd: c_int,
    conn: &Conn,
    events: i16,
    timeout_ms: c_int,
    awaited: Awaited,
    ready: &dyn Fn() -> bool,
) -> Result<(), c_int> {
    let sequence = conn.local_sequence.load(Ordering::SeqCst);
    if let Some(role) = conn.kernel_waiter.try_lock() {
        // Drain old wake-ups, then announce the sleep, then look once more: a wake-up sent
        // after the announcement stays queued (byte, signal) or blocks the peer (fault) and
        // ends the sleep.
        let result = match drain(fd, conn, libc::MSG_DONTWAIT) {
            KernelState::Open => armed_sleep(fd, conn, events, timeout_ms, awaited, ready),
            KernelState::Eof | KernelState::Error => Ok(()),
        };
        drop(role);
        release_local_sleepers(conn);
        return result;
    }
    // Another thread holds the kernel-waiter role: it sleeps on the socket, so a wake-up byte
    // reaches it, and it wakes this thread when it lets the role go.
    if announce_and_look(conn, awaited, ready) {
        return Ok(());
    }
    conn.local_sleepers.fetch_add(1, Ordering::SeqCst);
    stats::bump(&stats::get().sleeps);
    let timeout = real::timespec_of_ms(timeout_ms);
    // SAFETY: FUTEX_WAIT atomically reads `local_sequence`, a live aligned AtomicU32 of `conn`
    // (borrowed across the call); the timeout is null or points to the local `timeout`, alive
    // until the call returns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            conn.local_sequence.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            sequence,
            timeout
                .as_ref()
                .map_or(std::ptr::null(), |t| t as *const libc::timespec),
        )
    };
    let code = errno();
    conn.local_sleepers.fetch_sub(1, Ordering::SeqCst);
    match (rc, code) {
        (0, _) | (_, libc::EAGAIN) => Ok(()),
        (_, libc::ETIMEDOUT) => Err(libc::EAGAIN),
        (_, code) => Err(code),
    }
}

/// The kernel waiter's sleep: announce it (`notify::arm`), look once more, sleep unless
/// ready, withdraw the announcement.
fn armed_sleep(
    fd: c_int,
    conn: &Conn,
    events: i16,
    timeout_ms: c_int,
    awaited: Awaited,
    ready: &dyn Fn() -> bool,
) -> Result<(), c_int> {
    let armed = notify::arm(conn, awaited);
    fence(Ordering::SeqCst);
    let result = if ready() {
        Ok(())
    } else {
        stats::bump(&stats::get().sleeps);
        match notify::sleep(fd, events, timeout_ms, &armed) {
            Ok(0) => Err(libc::EAGAIN),
            Ok(_) => Ok(()),
            Err(code) => Err(code),
        }
    };
    notify::disarm(conn, awaited, armed);
    result
}

/// Before the last process on this side closes the kernel socket: give back arena records
/// (see `Conn::release_records`), stop asking the peer for wake-ups and read the queued ones,
/// since closing a TCP socket with unread bytes makes the kernel send a reset instead of FIN.
pub fn last_close(fd: c_int, conn: &Conn) {
    conn.release_records();
    if conn.inbound_source() != Inbound::Ring {
        return;
    }
    conn.inbound()
        .control
        .control
        .0
        .reader_wants_wake
        .store(0, Ordering::SeqCst);
    conn.outbound()
        .control
        .control
        .0
        .writer_wants_wake
        .store(0, Ordering::SeqCst);
    let mut scratch = [0u8; 256];
    for _ in 0..64 {
        // SAFETY: recv writes at most `scratch.len()` bytes, into `scratch`, a live local array.
        let got = unsafe {
            real::recv(
                fd,
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if got <= 0 {
            return;
        }
    }
}

thread_local! {
    /// This thread's current spin budget in microseconds (adaptive, see `spin_until`).
    static SPIN_BUDGET_US: std::cell::Cell<u32> = const { std::cell::Cell::new(u32::MAX) };
    static SPIN_SKIPPED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Polls `ready` before the caller sleeps (the polling half of user-mode NAPI); true as soon
/// as it holds. Like NAPI, it adapts: a spin that ended in data doubles this thread's budget
/// (up to `FLATMESH_SHM_SPIN_US`), a spin that found nothing halves it, so a thread whose peer
/// answers quickly polls and a thread that waits for long does not burn a core. Once the
/// budget is zero a short spin is still tried every 64th wait to notice traffic coming back.
pub fn spin_until(mut ready: impl FnMut() -> bool) -> bool {
    if ready() {
        return true;
    }
    let max_us = settings::get().spin.as_micros().min(u32::MAX as u128) as u32;
    if max_us == 0 {
        return false;
    }
    let mut budget_us = SPIN_BUDGET_US.with(|b| b.get()).min(max_us);
    if budget_us == 0 {
        let skipped = SPIN_SKIPPED.with(|s| {
            s.set(s.get().wrapping_add(1));
            s.get()
        });
        if !skipped.is_multiple_of(64) {
            return false;
        }
        budget_us = 1;
    }
    let budget = Duration::from_micros(budget_us as u64);
    let start = Instant::now();
    let mut round = 0u32;
    let found = loop {
        if (0..64).any(|_| {
            std::hint::spin_loop();
            ready()
        }) {
            break true;
        }
        round += 1;
        if start.elapsed() >= budget {
            break false;
        }
        if round.is_multiple_of(16) {
            // Let a peer on the same core run (2-core machines share cores).
            // SAFETY: sched_yield takes no arguments and has no preconditions.
            unsafe { libc::sched_yield() };
        }
    };
    let next = if found {
        budget_us.saturating_mul(2).saturating_add(1).min(max_us)
    } else {
        budget_us / 2
    };
    SPIN_BUDGET_US.with(|b| b.set(next));
    found
}

fn socket_timeout(fd: c_int, option: c_int) -> Option<Duration> {
    let mut value = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` (the size of a timeval) bytes into `value`, a
    // live local timeval, and the actual length into `len`, a live local.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&mut value as *mut libc::timeval).cast(),
            &mut len,
        )
    };
    if rc != 0 || (value.tv_sec == 0 && value.tv_usec == 0) {
        return None;
    }
    Some(Duration::from_secs(value.tv_sec as u64) + Duration::from_micros(value.tv_usec as u64))
}

/// A lazily computed deadline from SO_RCVTIMEO / SO_SNDTIMEO.
struct Deadline {
    option: c_int,
    at: Option<Option<Instant>>,
}

impl Deadline {
    fn new(option: c_int) -> Self {
        Deadline { option, at: None }
    }

    /// Milliseconds left for poll(): -1 for no limit; `None` when expired.
    fn poll_ms(&mut self, fd: c_int, cap_ms: Option<i32>) -> Option<c_int> {
        let option = self.option;
        let at = *self
            .at
            .get_or_insert_with(|| socket_timeout(fd, option).map(|d| Instant::now() + d));
        let left = match at {
            None => -1,
            Some(at) => {
                let now = Instant::now();
                if now >= at {
                    return None;
                }
                (at - now).as_millis().clamp(1, i32::MAX as u128) as c_int
            }
        };
        Some(match cap_ms {
            Some(cap) if left < 0 || left > cap => cap,
            _ => left,
        })
    }
}

fn poll_one(fd: c_int, events: i16, timeout_ms: c_int) -> Result<i16, c_int> {
    let mut entry = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: poll reads and writes exactly one pollfd (n = 1): `entry`, a live local.
    let rc = unsafe { real::poll(&mut entry, 1, timeout_ms) };
    if rc < 0 {
        return Err(errno());
    }
    Ok(entry.revents)
}

fn kernel_recv(fd: c_int, buffers: &[(*mut u8, usize)], flags: c_int) -> isize {
    let mut iov: Vec<libc::iovec> = buffers
        .iter()
        .map(|&(p, l)| libc::iovec {
            iov_base: p.cast(),
            iov_len: l,
        })
        .collect();
    // SAFETY: msghdr is integers and pointers, for which all-zero bytes (null, 0) are valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    let flags = (flags & !libc::MSG_WAITALL) | libc::MSG_DONTWAIT;
    // SAFETY: `msg` names `iov`, a live Vec of `iov.len()` iovecs over the caller's buffers,
    // each valid for writes of its length (`Buffers`); no name or control buffer (null, 0).
    unsafe { real::recvmsg(fd, &mut msg, flags) }
}

/// The peer broke the connection's shared state (see `region::Corrupt`): reset, as TCP would
/// on a protocol violation. Returns what the call moved before, or ECONNRESET.
fn reset_broken(conn: &Conn, moved: usize) -> isize {
    conn.kernel_error.store(libc::ECONNRESET, Ordering::Release);
    if moved > 0 {
        moved as isize
    } else {
        fail(libc::ECONNRESET)
    }
}

fn kernel_send(fd: c_int, chunks: &[(*const u8, usize)], flags: c_int) -> isize {
    let mut iov: Vec<libc::iovec> = chunks
        .iter()
        .map(|&(p, l)| libc::iovec {
            iov_base: p.cast_mut().cast(),
            iov_len: l,
        })
        .collect();
    // SAFETY: msghdr is integers and pointers, for which all-zero bytes (null, 0) are valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    // SAFETY: `msg` names `iov`, a live Vec of `iov.len()` iovecs over the caller's chunks,
    // each valid for reads of its length (`Chunks`); sendmsg only reads them.
    unsafe { real::sendmsg(fd, &msg, flags | libc::MSG_DONTWAIT) }
}

/// Lets the kernel produce the error (and SIGPIPE, unless MSG_NOSIGNAL) for a send on a
/// connection whose peer is gone or whose sending side is shut.
fn kernel_send_error(fd: c_int, flags: c_int) -> isize {
    let byte = 0u8;
    // SAFETY: send reads 1 byte, from `byte`, a live local; a bad fd only fails.
    let rc = unsafe {
        real::send(
            fd,
            (&byte as *const u8).cast(),
            1,
            (flags & libc::MSG_NOSIGNAL) | libc::MSG_DONTWAIT,
        )
    };
    if rc < 0 {
        -1
    } else {
        fail(libc::EPIPE)
    }
}

/// recv/read/readv/recvmsg on a shared-memory connection.
pub fn recv(fd: c_int, conn: &Conn, buffers: Buffers<'_>, flags: c_int) -> isize {
    let total: usize = buffers.iter().map(|b| b.1).sum();
    if total == 0 {
        return 0;
    }
    if flags & (libc::MSG_OOB | libc::MSG_ERRQUEUE) != 0 {
        return fail(libc::EOPNOTSUPP);
    }
    if conn.read_shut.load(Ordering::Acquire) {
        return 0;
    }
    let peek = flags & libc::MSG_PEEK != 0;
    let wait_all = flags & libc::MSG_WAITALL != 0 && !peek;
    let nonblocking = flags & libc::MSG_DONTWAIT != 0 || conn.nonblocking.load(Ordering::Relaxed);
    let mut got = 0usize;
    let mut deadline = Deadline::new(libc::SO_RCVTIMEO);
    let done = |got: usize| !wait_all || got == total;
    loop {
        match conn.inbound_source() {
            Inbound::Ring => {
                let ring = conn.inbound();
                let n = match ring.read(&skip_bytes(buffers, got), peek) {
                    Ok(n) => n,
                    Err(Corrupt) => return reset_broken(conn, got),
                };
                if n > 0 {
                    if !peek {
                        wake_writer(fd, conn);
                    }
                    got += n;
                    if done(got) || peek {
                        return got as isize;
                    }
                    continue;
                }
                // Look at the kernel (a system call) only when we would otherwise give up or sleep.
                let closed = conn.peer_shut_wr()
                    || conn.kernel_eof.load(Ordering::Acquire)
                    || conn.kernel_error.load(Ordering::Acquire) != 0
                    || (nonblocking && !matches!(nonblocking_check(fd, conn), KernelState::Open));
                if closed {
                    if ring.readable() > 0 {
                        continue;
                    }
                    // A reset is reported as EOF: data never travels in the kernel stream, so the
                    // only unread bytes a closing peer can leave behind are wake-ups, and those
                    // turn its normal close into a reset.
                    let error = conn.kernel_error.load(Ordering::Acquire);
                    if error != 0 && error != libc::ECONNRESET && got == 0 && !conn.peer_shut_wr() {
                        return fail(error);
                    }
                    return got as isize;
                }
            }
            Inbound::Kernel => {
                let rc = kernel_recv(fd, &skip_bytes(buffers, got), flags);
                if conn.attached() {
                    // The acceptor attached meanwhile: whatever came over the kernel were wake-ups.
                    continue;
                }
                if rc > 0 {
                    got += rc as usize;
                    if done(got) {
                        return got as isize;
                    }
                    continue;
                }
                if rc == 0 {
                    return got as isize;
                }
                let code = errno();
                if code != libc::EAGAIN {
                    return if got > 0 { got as isize } else { fail(code) };
                }
            }
            Inbound::KernelPrefix(remaining) => {
                let control = &conn.region.direction(0).control.control.0;
                let want = (total - got).min(usize::try_from(remaining).unwrap_or(usize::MAX));
                let rc = kernel_recv(fd, &cap_buffers(&skip_bytes(buffers, got), want), flags);
                if rc > 0 {
                    let mut valid = rc as u64;
                    if remaining == u64::MAX && control.switched.load(Ordering::Acquire) != 0 {
                        // The connector switched during our recv: bytes past the prefix are wake-ups.
                        let prefix = control.kernel_prefix.load(Ordering::Acquire);
                        let consumed = control.kernel_consumed.load(Ordering::Acquire);
                        valid = valid.min(prefix.saturating_sub(consumed));
                    }
                    if !peek {
                        control.kernel_consumed.fetch_add(valid, Ordering::AcqRel);
                    }
                    got += valid as usize;
                    if valid > 0 && (done(got) || peek) {
                        return got as isize;
                    }
                    continue;
                }
                if rc == 0 {
                    if control.switched.load(Ordering::Acquire) != 0 {
                        continue;
                    }
                    return got as isize;
                }
                let code = errno();
                if code != libc::EAGAIN {
                    return if got > 0 { got as isize } else { fail(code) };
                }
            }
        }
        if nonblocking {
            return if got > 0 {
                got as isize
            } else {
                fail(libc::EAGAIN)
            };
        }
        if let Err(code) = wait_readable(fd, conn, &mut deadline) {
            return if got > 0 { got as isize } else { fail(code) };
        }
    }
}

fn wait_readable(fd: c_int, conn: &Conn, deadline: &mut Deadline) -> Result<(), c_int> {
    let on_ring = conn.inbound_source() == Inbound::Ring;
    let pipe = conn.inbound();
    let control = &pipe.control.control.0;
    // Polled in a tight loop: two loads of lines the writer stores only when something happens.
    let ready = || pipe.readable() > 0 || control.shut_wr.load(Ordering::Acquire) != 0;
    if on_ring && spin_until(ready) {
        return Ok(());
    }
    let Some(timeout) = deadline.poll_ms(fd, None) else {
        return Err(libc::EAGAIN);
    };
    if !on_ring {
        // Kernel bytes are data here: wait for them like plain TCP (nothing is drained).
        if announce_and_look(conn, Awaited::Data, &ready) {
            return Ok(());
        }
        return match poll_one(fd, libc::POLLIN, timeout)? {
            0 => Err(libc::EAGAIN),
            _ => Ok(()),
        };
    }
    sleep_on_kernel(fd, conn, 0, timeout, Awaited::Data, &ready)
}

/// send/write/writev/sendmsg on a shared-memory connection.
pub fn send(fd: c_int, conn: &Conn, chunks: Chunks<'_>, flags: c_int) -> isize {
    let total: usize = chunks.iter().map(|c| c.1).sum();
    if total == 0 {
        return 0;
    }
    if flags & libc::MSG_OOB != 0 {
        return fail(libc::EOPNOTSUPP);
    }
    let nonblocking = flags & libc::MSG_DONTWAIT != 0 || conn.nonblocking.load(Ordering::Relaxed);
    let mut sent = 0usize;
    let mut retried = 0u32;
    let mut deadline = Deadline::new(libc::SO_SNDTIMEO);
    // The last wait said "retry" and the write still placed nothing (the arena or the process
    // is out of records): the next wait must not trust `write_ready` (see `wait_writable`).
    let mut waited = false;
    let mut futile = false;
    loop {
        if conn.outbound_on_ring() {
            let ring = conn.outbound();
            if ring.control.control.0.shut_wr.load(Ordering::Acquire) != 0
                || conn.kernel_error.load(Ordering::Acquire) != 0
            {
                return if sent > 0 {
                    sent as isize
                } else {
                    kernel_send_error(fd, flags)
                };
            }
            let n = match ring.write(&skip_bytes(chunks, sent)) {
                Ok(n) => n,
                Err(Corrupt) => return reset_broken(conn, sent),
            };
            futile = n == 0 && waited;
            if n > 0 {
                sent += n;
                wake_reader(fd, conn);
                if sent == total {
                    return sent as isize;
                }
                continue;
            }
            if nonblocking {
                // EAGAIN or a short write. Like the kernel's SOCK_NOSPACE, ask the reader for a wake-up before
                // reporting it: the caller's epoll waiter may be another thread that is already
                // asleep, and armed nothing because the pipe still had room when it looked. Then
                // look once more, since the reader may have drained before it saw the request.
                ring.control
                    .control
                    .0
                    .writer_wants_wake
                    .store(1, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                if ring.write_ready() && retried < 4 {
                    retried += 1;
                    continue;
                }
            }
        } else {
            // Connector before the acceptor attached: plain TCP, counted under the write lock so
            // that a concurrent switch records the exact prefix length.
            let direction = conn.region.direction(0).control;
            let control = &direction.control.0;
            let Ok(guard) =
                SpinGuard::lock(&direction.write_lock.0, conn.region.same_pid_namespace())
            else {
                return reset_broken(conn, sent);
            };
            if conn.attached() {
                drop(guard);
                continue;
            }
            let rc = kernel_send(fd, &skip_bytes(chunks, sent), flags);
            if rc > 0 {
                control.kernel_sent.fetch_add(rc as u64, Ordering::AcqRel);
            }
            drop(guard);
            if rc > 0 {
                sent += rc as usize;
                if sent == total {
                    return sent as isize;
                }
                continue;
            }
            let code = errno();
            if code != libc::EAGAIN {
                return if sent > 0 { sent as isize } else { fail(code) };
            }
        }
        if nonblocking {
            return if sent > 0 {
                sent as isize
            } else {
                fail(libc::EAGAIN)
            };
        }
        waited = true;
        match wait_writable(fd, conn, &mut deadline, futile) {
            Ok(()) => {}
            Err(_) if sent > 0 => return sent as isize,
            Err(libc::EPIPE) => return kernel_send_error(fd, flags),
            Err(code) => return fail(code),
        }
    }
}

/// `futile`: the last wait ended because the pipe looked ready, yet the write placed nothing
/// (no arena record to be had). The reader's wake-up condition may then hold while no write
/// can succeed, so this wait looks only at real room and sleeps in steps of at most 10 ms
/// (nothing else announces records coming free in an arena): bounded, never a busy loop.
fn wait_writable(
    fd: c_int,
    conn: &Conn,
    deadline: &mut Deadline,
    futile: bool,
) -> Result<(), c_int> {
    if !conn.outbound_on_ring() {
        let Some(timeout) = deadline.poll_ms(fd, None) else {
            return Err(libc::EAGAIN);
        };
        return match poll_one(fd, libc::POLLOUT, timeout)? {
            0 => Err(libc::EAGAIN),
            _ => Ok(()),
        };
    }
    let ring = conn.outbound();
    let ready = || {
        (if futile {
            ring.writable() > 0
        } else {
            ring.write_ready()
        }) || conn.kernel_error.load(Ordering::Acquire) != 0
    };
    if !futile && spin_until(ready) {
        return Ok(());
    }
    let can_drain = conn.inbound_source() == Inbound::Ring;
    if can_drain {
        if let KernelState::Error = kernel_check(fd, conn) {
            return Err(libc::EPIPE);
        }
    }
    if conn.kernel_eof.load(Ordering::Acquire) || !can_drain || futile {
        // The peer sent FIN (it may still read: half-close) or unread prefix data sits in the
        // kernel: wake-ups cannot arrive over the kernel socket then. Or no record is to be had
        // (`futile`): nothing announces one coming free. Either way, sleep in short steps.
        if announce_and_look(conn, Awaited::Room, &ready) {
            return Ok(());
        }
        if conn.kernel_eof.load(Ordering::Acquire)
            && !conn.probe_sent.swap(true, Ordering::AcqRel)
            && !send_wake(fd)
        {
            conn.kernel_error.store(libc::EPIPE, Ordering::Release);
            return Err(libc::EPIPE);
        }
        let Some(timeout) = deadline.poll_ms(fd, Some(10)) else {
            return Err(libc::EAGAIN);
        };
        let revents = poll_one(fd, 0, timeout)?;
        if revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            conn.kernel_error.store(libc::EPIPE, Ordering::Release);
            return Err(libc::EPIPE);
        }
        return Ok(());
    }
    let Some(timeout) = deadline.poll_ms(fd, None) else {
        return Err(libc::EAGAIN);
    };
    match sleep_on_kernel(fd, conn, 0, timeout, Awaited::Room, &ready) {
        Err(libc::EAGAIN) => Err(libc::EAGAIN),
        Err(code) => Err(code),
        Ok(()) if conn.kernel_error.load(Ordering::Acquire) != 0 => Err(libc::EPIPE),
        Ok(()) => Ok(()),
    }
}

/// What a shared-memory connection is ready for, for epoll/poll/select.
pub struct Readiness {
    pub readable: bool,
    pub eof: bool,
    pub error: bool,
    pub writable: bool,
    /// Changes whenever new bytes arrive (edge detection for EPOLLET).
    pub in_sequence: u64,
    /// Changes whenever the peer consumed bytes.
    pub out_sequence: u64,
}

/// Current readiness. `kernel_activity`: the kernel socket was reported readable, so drain
/// wake-ups and look for EOF/reset (a system call; skipped otherwise).
pub fn readiness(fd: c_int, conn: &Conn, kernel_activity: bool) -> Readiness {
    let mut ready = Readiness {
        readable: false,
        eof: false,
        error: false,
        writable: false,
        in_sequence: 0,
        out_sequence: 0,
    };
    if conn.inbound_source() == Inbound::Ring {
        if kernel_activity {
            kernel_check(fd, conn);
        }
        let ring = conn.inbound();
        ready.readable = ring.readable() > 0;
        ready.eof = conn.read_shut.load(Ordering::Acquire)
            || conn.peer_shut_wr()
            || conn.kernel_eof.load(Ordering::Acquire);
        ready.in_sequence = ring.written();
    } else {
        let mut byte = 0u8;
        // SAFETY: recv writes at most 1 byte, into `byte`, a live local.
        let rc = unsafe {
            real::recv(
                fd,
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if conn.inbound_source() == Inbound::Ring {
            return readiness(fd, conn, kernel_activity);
        }
        match rc {
            1.. => ready.readable = true,
            0 => ready.eof = true,
            _ if errno() != libc::EAGAIN => {
                conn.kernel_error.store(errno(), Ordering::Release);
            }
            _ => {}
        }
        ready.in_sequence = u64::MAX;
    }
    ready.error = conn.kernel_error.load(Ordering::Acquire) != 0;
    if conn.outbound_on_ring() {
        let ring = conn.outbound();
        ready.writable = ring.write_ready() || ready.error;
        ready.out_sequence = ring.consumed();
    } else {
        // Still writing over the kernel socket (connector before the acceptor attached): its
        // send buffer decides, as for plain TCP (a connect in progress is not writable yet).
        ready.writable = poll_one(fd, libc::POLLOUT, 0)
            .is_ok_and(|revents| revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0);
        ready.out_sequence = u64::MAX;
    }
    ready
}

/// Announces that this thread is about to sleep waiting for `events` on the connection, so the
/// peer wakes it when it changes the ring: with a signal if `signal`
/// (`notify::event_waits_use_signals`), otherwise with a wake-up byte.
pub fn arm(conn: &Conn, want_in: bool, want_out: bool, signal: bool) {
    if want_in {
        notify::announce(conn, Awaited::Data, signal);
    }
    if want_out && conn.outbound_on_ring() && !conn.outbound().write_ready() {
        notify::announce(conn, Awaited::Room, signal);
    }
    fence(Ordering::SeqCst);
}

/// A writer on this connection may be waiting for room that its peer cannot announce: the peer
/// shut down its sending side (its kernel socket can carry no wake-up byte any more) while the
/// pipe is full or a write asked for a wake-up. Waits must then look at the pipe in steps.
pub fn writer_unwakeable(conn: &Conn) -> bool {
    if !conn.outbound_on_ring() || !(conn.peer_shut_wr() || conn.kernel_eof.load(Ordering::Acquire))
    {
        return false;
    }
    let ring = conn.outbound();
    ring.writable() == 0
        || ring
            .control
            .control
            .0
            .writer_wants_wake
            .load(Ordering::Acquire)
            != 0
}

/// FIONREAD on a shared-memory connection.
pub fn bytes_readable(conn: &Conn) -> Option<u64> {
    (conn.inbound_source() == Inbound::Ring).then(|| conn.inbound().readable())
}

/// Readiness without any system call (for kernel-mode connections that showed no activity).
pub fn readiness_without_kernel(fd: c_int, conn: &Conn) -> Readiness {
    let error = conn.kernel_error.load(Ordering::Acquire) != 0;
    let on_ring = conn.outbound_on_ring();
    let writable = if on_ring {
        conn.outbound().write_ready()
    } else {
        poll_one(fd, libc::POLLOUT, 0).is_ok_and(|revents| revents & libc::POLLOUT != 0)
    };
    Readiness {
        readable: false,
        eof: conn.kernel_eof.load(Ordering::Acquire),
        error,
        writable: writable || error,
        in_sequence: u64::MAX,
        out_sequence: if on_ring {
            conn.outbound().consumed()
        } else {
            u64::MAX
        },
    }
}
