//! The exported libc functions. Each one looks the fd up; a shared-memory connection goes to
//! the library, anything else straight to libc (the kernel socket is the fallback for all that
//! the library does not handle).
//!
//! Every exported function is `unsafe extern "C"` with the contract of the libc function of the
//! same name (its manual page): the pointers and lengths a program passes are as that function
//! requires. The `SAFETY` comments here rest on that contract; calls into [`real`] pass the
//! arguments on unchanged under it.

use crate::conn::{self, Conn};
use crate::io;
use crate::multiplex;
use crate::negotiate;
use crate::real;
use libc::{
    c_int, c_ulong, c_void, iovec, msghdr, nfds_t, pollfd, sigset_t, size_t, sockaddr, socklen_t,
    ssize_t, timespec,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn chunks(iov: *const iovec, count: c_int) -> Vec<(*const u8, usize)> {
    if iov.is_null() || count <= 0 {
        return Vec::new();
    }
    // SAFETY: `iov` is non-null and `count > 0` (checked above). Every caller passes on its own
    // caller's iovec array, which readv, writev, recvmsg and sendmsg's contract makes `count`
    // readable iovecs, alive for the whole call.
    unsafe { std::slice::from_raw_parts(iov, count as usize) }
        .iter()
        .map(|v| (v.iov_base.cast_const().cast::<u8>(), v.iov_len))
        .collect()
}

fn buffers(iov: *const iovec, count: c_int) -> Vec<(*mut u8, usize)> {
    chunks(iov, count)
        .into_iter()
        .map(|(p, l)| (p.cast_mut(), l))
        .collect()
}

fn msg_iov_count(msg: &msghdr) -> c_int {
    c_int::try_from(msg.msg_iovlen).unwrap_or(c_int::MAX)
}

fn timespec_ms(spec: *const timespec) -> c_int {
    if spec.is_null() {
        return -1;
    }
    // SAFETY: non-null (checked), so the caller's contract (ppoll, pselect, epoll_pwait2: the
    // timeout is null or a readable timespec) makes it readable.
    let spec = unsafe { &*spec };
    let ms = spec.tv_sec as i128 * 1000 + (spec.tv_nsec as i128 + 999_999) / 1_000_000;
    ms.clamp(0, c_int::MAX as i128) as c_int
}

fn with_conn<R>(fd: c_int, shm: impl FnOnce(Arc<Conn>) -> R, kernel: impl FnOnce() -> R) -> R {
    match conn::lookup(fd) {
        Some(conn) => shm(conn),
        None => kernel(),
    }
}

// ---- connection set-up -------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: connect(2)'s contract, which `negotiate::connect` asks for; the arguments are passed
    // on unchanged.
    unsafe { negotiate::connect(fd, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn __connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: an alias of connect: same arguments, same contract.
    unsafe { connect(fd, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: listen takes no pointer; the caller's arguments, unchanged.
    let rc = unsafe { real::listen(fd, backlog) };
    if rc == 0 {
        let code = real::errno();
        negotiate::advertise(fd);
        real::set_errno(code);
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged under accept4(2)'s contract. `addr` and
    // `len` are null or valid.
    let accepted = unsafe { real::accept4(fd, addr, len, flags) };
    if accepted >= 0 {
        discard_stale(accepted);
        negotiate::accepted(accepted, flags & libc::SOCK_NONBLOCK != 0);
    }
    accepted
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: accept's contract is accept4's with no flags; `addr` and `len` are passed on.
    unsafe { accept4(fd, addr, len, 0) }
}

/// The library's part of closing `fd` (before the kernel closes it).
fn before_close(fd: c_int) {
    multiplex::forget_fd(fd);
    if let Some((conn, true)) = conn::remove(fd) {
        io::last_close(fd, &conn);
    }
    negotiate::forget_listener(fd);
}

/// `fd` was just handed out by the kernel: any table entry under its number is stale (its
/// previous owner was closed by a path the library does not intercept).
fn discard_stale(fd: c_int) {
    if fd >= 0 && conn::lookup(fd).is_some() {
        multiplex::forget_fd(fd);
        if let Some((conn, true)) = conn::remove(fd) {
            conn.release_records();
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    before_close(fd);
    // SAFETY: the caller's fd, closed as close(2) was asked to; no pointer.
    unsafe { real::close(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn __close(fd: c_int) -> c_int {
    // SAFETY: an alias of close: same arguments, same contract.
    unsafe { close(fd) }
}

/// close_range(2): closes (or only marks close-on-exec) a range of fds; daemons and spawners
/// use it to close everything they inherited.
#[no_mangle]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        let end = last.min(conn::MAX_FD as libc::c_uint - 1);
        for fd in first..=end {
            before_close(fd as c_int);
        }
    }
    // SAFETY: the caller's range, passed on unchanged; no pointer.
    unsafe { real::close_range(first, last, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(first: c_int) {
    for fd in first.max(0)..conn::MAX_FD as c_int {
        before_close(fd);
    }
    // SAFETY: the caller's bound, passed on unchanged; no pointer.
    unsafe { real::closefrom(first) }
}

/// fclose() on a FILE* made with fdopen() on a socket closes the fd inside libc.
#[no_mangle]
pub unsafe extern "C" fn fclose(stream: *mut libc::FILE) -> c_int {
    if !stream.is_null() {
        // SAFETY: non-null, so fclose(3)'s contract makes it an open FILE*; fileno only reads
        // it.
        let fd = unsafe { libc::fileno(stream) };
        if fd >= 0 {
            before_close(fd);
        }
    }
    // SAFETY: the caller's arguments, passed on unchanged under fclose(3)'s contract.
    unsafe { real::fclose(stream) }
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, kind: c_int, protocol: c_int) -> c_int {
    // SAFETY: socket takes no pointer; the caller's arguments, unchanged.
    let fd = unsafe { real::socket(domain, kind, protocol) };
    discard_stale(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn socketpair(
    domain: c_int,
    kind: c_int,
    protocol: c_int,
    fds: *mut c_int,
) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged under socketpair(2)'s contract. `fds`
    // holds two ints.
    let rc = unsafe { real::socketpair(domain, kind, protocol, fds) };
    if rc == 0 && !fds.is_null() {
        // SAFETY: `fds` is non-null, so socketpair(2)'s contract makes it an array of two ints,
        // both written by the call that just succeeded.
        unsafe {
            discard_stale(*fds);
            discard_stale(*fds.add(1));
        }
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(conn) = conn::lookup(fd) {
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            conn.read_shut.store(true, Ordering::Release);
        }
        if (how == libc::SHUT_WR || how == libc::SHUT_RDWR) && conn.outbound_on_ring() {
            conn.outbound()
                .control
                .control
                .0
                .shut_wr
                .store(1, Ordering::SeqCst);
            io::wake_reader(fd, &conn);
        }
    }
    // SAFETY: shutdown takes no pointer; the caller's arguments, unchanged.
    let rc = unsafe { real::shutdown(fd, how) };
    if rc != 0
        && real::errno() == libc::ENOTCONN
        && conn::lookup(fd).is_some_and(|c| {
            c.kernel_error.load(Ordering::Acquire) == libc::ECONNRESET
                || c.kernel_eof.load(Ordering::Acquire)
        })
    {
        // The peer closed and a stray wake-up byte made its kernel reset the connection; with
        // plain TCP this shutdown would have succeeded.
        return 0;
    }
    rc
}

// ---- data ---------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    with_conn(
        fd,
        |c| io::recv(fd, &c, &[(buf.cast(), n)], 0),
        // SAFETY: the caller's arguments, passed on unchanged under read(2)'s contract.
        || unsafe { real::read(fd, buf, n) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the caller's arguments, passed on unchanged under __read_chk's contract. glibc
        // reports the overflow.
        return unsafe { real::__read_chk(fd, buf, n, buflen) };
    }
    with_conn(
        fd,
        |c| io::recv(fd, &c, &[(buf.cast(), n)], 0),
        // SAFETY: the caller's arguments, passed on unchanged under __read_chk's contract.
        || unsafe { real::__read_chk(fd, buf, n, buflen) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    // SAFETY: an alias of read: same arguments, same contract.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn __write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    // SAFETY: an alias of write: same arguments, same contract.
    unsafe { write(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    with_conn(
        fd,
        |c| io::send(fd, &c, &[(buf.cast(), n)], 0),
        // SAFETY: the caller's arguments, passed on unchanged under write(2)'s contract.
        || unsafe { real::write(fd, buf, n) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t {
    with_conn(
        fd,
        |c| io::recv(fd, &c, &buffers(iov, count), 0),
        // SAFETY: the caller's arguments, passed on unchanged under readv(2)'s contract.
        || unsafe { real::readv(fd, iov, count) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t {
    with_conn(
        fd,
        |c| io::send(fd, &c, &chunks(iov, count), 0),
        // SAFETY: the caller's arguments, passed on unchanged under writev(2)'s contract.
        || unsafe { real::writev(fd, iov, count) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    with_conn(
        fd,
        |c| io::recv(fd, &c, &[(buf.cast(), n)], flags),
        // SAFETY: the caller's arguments, passed on unchanged under recv(2)'s contract.
        || unsafe { real::recv(fd, buf, n, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the caller's arguments, passed on unchanged under __recv_chk's contract. glibc
        // reports the overflow.
        return unsafe { real::__recv_chk(fd, buf, n, buflen, flags) };
    }
    with_conn(
        fd,
        |c| io::recv(fd, &c, &[(buf.cast(), n)], flags),
        // SAFETY: the caller's arguments, passed on unchanged under __recv_chk's contract.
        || unsafe { real::__recv_chk(fd, buf, n, buflen, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    with_conn(
        fd,
        |c| io::send(fd, &c, &[(buf.cast(), n)], flags),
        // SAFETY: the caller's arguments, passed on unchanged under send(2)'s contract.
        || unsafe { real::send(fd, buf, n, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: an alias of send: same arguments, same contract.
    unsafe { send(fd, buf, n, flags) }
}

/// TCP reports no source address: a connected stream's recvfrom leaves the address empty.
fn clear_address(len: *mut socklen_t) {
    if !len.is_null() {
        // SAFETY: non-null (checked); the caller passes recvfrom(2)'s `len`, which its contract
        // makes a writable socklen_t whenever `addr` is non-null (checked by the caller).
        unsafe { *len = 0 };
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    with_conn(
        fd,
        |c| {
            let rc = io::recv(fd, &c, &[(buf.cast(), n)], flags);
            if rc >= 0 && !addr.is_null() {
                clear_address(len);
            }
            rc
        },
        // SAFETY: the caller's arguments, passed on unchanged under recvfrom(2)'s contract.
        || unsafe { real::recvfrom(fd, buf, n, flags, addr, len) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the caller's arguments, passed on unchanged under __recvfrom_chk's contract.
        // glibc reports the overflow.
        return unsafe { real::__recvfrom_chk(fd, buf, n, buflen, flags, addr, len) };
    }
    // SAFETY: `n <= buflen` (checked above) and `buf` holds `buflen` bytes (__recvfrom_chk's
    // contract), so recvfrom's contract holds.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    with_conn(
        fd,
        |c| io::send(fd, &c, &[(buf.cast(), n)], flags),
        // SAFETY: the caller's arguments, passed on unchanged under sendto(2)'s contract.
        || unsafe { real::sendto(fd, buf, n, flags, addr, len) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if msg.is_null() {
        // SAFETY: the caller's arguments, passed on unchanged under recvmsg(2)'s contract.
        return unsafe { real::recvmsg(fd, msg, flags) };
    }
    with_conn(
        fd,
        |c| {
            // SAFETY: non-null (checked above), so recvmsg(2)'s contract makes it a valid msghdr,
            // readable and writable, that nothing else uses during the call.
            let header = unsafe { &mut *msg };
            let rc = io::recv(
                fd,
                &c,
                &buffers(header.msg_iov, msg_iov_count(header)),
                flags,
            );
            if rc >= 0 {
                header.msg_namelen = 0;
                header.msg_controllen = 0;
                header.msg_flags = 0;
            }
            rc
        },
        // SAFETY: the caller's arguments, passed on unchanged under recvmsg(2)'s contract.
        || unsafe { real::recvmsg(fd, msg, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if msg.is_null() {
        // SAFETY: the caller's arguments, passed on unchanged under sendmsg(2)'s contract.
        return unsafe { real::sendmsg(fd, msg, flags) };
    }
    with_conn(
        fd,
        |c| {
            // SAFETY: non-null (checked above), so sendmsg(2)'s contract makes it a readable
            // msghdr.
            let header = unsafe { &*msg };
            if header.msg_controllen != 0 {
                // Ancillary data cannot travel through the ring.
                real::set_errno(libc::EOPNOTSUPP);
                return -1;
            }
            io::send(
                fd,
                &c,
                &chunks(header.msg_iov, msg_iov_count(header)),
                flags,
            )
        },
        // SAFETY: the caller's arguments, passed on unchanged under sendmsg(2)'s contract.
        || unsafe { real::sendmsg(fd, msg, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    count: libc::c_uint,
    flags: c_int,
) -> c_int {
    let Some(_) = conn::lookup(fd) else {
        // SAFETY: the caller's arguments, passed on unchanged to the system call under
        // sendmmsg(2)'s contract.
        return unsafe { libc::syscall(libc::SYS_sendmmsg, fd, msgs, count, flags) as c_int };
    };
    let mut done = 0;
    for index in 0..count as usize {
        // SAFETY: `index < count`, and sendmmsg(2)'s contract makes `msgs` an array of `count`
        // writable mmsghdrs that nothing else uses during the call.
        let entry = unsafe { &mut *msgs.add(index) };
        // SAFETY: `entry` is one of the caller's mmsghdrs (above), so its `msg_hdr` is a valid
        // msghdr for sendmsg(2).
        let rc = unsafe { sendmsg(fd, &entry.msg_hdr, flags) };
        if rc < 0 {
            return if done > 0 { done } else { -1 };
        }
        entry.msg_len = rc as libc::c_uint;
        done += 1;
    }
    done
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    count: libc::c_uint,
    flags: c_int,
    timeout: *mut timespec,
) -> c_int {
    let Some(_) = conn::lookup(fd) else {
        // SAFETY: the caller's arguments, passed on unchanged to the system call under
        // recvmmsg(2)'s contract.
        return unsafe {
            libc::syscall(libc::SYS_recvmmsg, fd, msgs, count, flags, timeout) as c_int
        };
    };
    let mut done = 0;
    for index in 0..count as usize {
        // SAFETY: `index < count`, and recvmmsg(2)'s contract makes `msgs` an array of `count`
        // writable mmsghdrs that nothing else uses during the call.
        let entry = unsafe { &mut *msgs.add(index) };
        // SAFETY: `entry` is one of the caller's mmsghdrs (above), so its `msg_hdr` is a valid,
        // writable msghdr for recvmsg(2).
        let rc = unsafe {
            recvmsg(
                fd,
                &mut entry.msg_hdr,
                if done > 0 {
                    flags | libc::MSG_DONTWAIT
                } else {
                    flags
                },
            )
        };
        if rc <= 0 {
            return if done > 0 { done } else { rc as c_int };
        }
        entry.msg_len = rc as libc::c_uint;
        done += 1;
    }
    done
}

/// sendfile() and sendfile64().
///
/// # Safety
/// As sendfile(2): `offset` is null or a readable and writable off_t.
unsafe fn sendfile_impl(
    out: c_int,
    input: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    let Some(conn) = conn::lookup(out) else {
        // SAFETY: the caller's arguments, passed on unchanged under sendfile(2)'s contract.
        return unsafe { real::sendfile(out, input, offset, count) };
    };
    let mut buffer = vec![0u8; count.clamp(1, 64 * 1024)];
    // SAFETY: read and pread write at most `buffer.len()` bytes, into `buffer`, a live Vec; a
    // non-null `offset` is the caller's readable off_t (sendfile(2)'s contract).
    let got = unsafe {
        if offset.is_null() {
            real::read(input, buffer.as_mut_ptr().cast(), buffer.len())
        } else {
            libc::pread(input, buffer.as_mut_ptr().cast(), buffer.len(), *offset)
        }
    };
    if got <= 0 {
        return got;
    }
    let sent = io::send(out, &conn, &[(buffer.as_ptr(), got as usize)], 0);
    let code = real::errno();
    let unsent = if sent < 0 { got } else { got - sent };
    // SAFETY: lseek takes no pointer; a non-null `offset` is the caller's readable and writable
    // off_t (sendfile(2)'s contract).
    unsafe {
        if offset.is_null() {
            if unsent > 0 {
                libc::lseek(input, -(unsent as libc::off_t), libc::SEEK_CUR);
            }
        } else if sent > 0 {
            *offset += sent as libc::off_t;
        }
    }
    real::set_errno(code);
    sent
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    input: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: sendfile(2)'s contract, which `sendfile_impl` asks for.
    unsafe { sendfile_impl(out, input, offset, count) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    input: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: sendfile64 has sendfile(2)'s contract (64-bit off_t on this target), which
    // `sendfile_impl` asks for.
    unsafe { sendfile_impl(out, input, offset, count) }
}

// ---- fd bookkeeping ---------------------------------------------------------------------

fn copy_conn(old: c_int, new: c_int) {
    multiplex::duplicated(old, new);
    if new >= 0 {
        match conn::lookup(old) {
            Some(conn) => conn::insert(new, conn),
            None => discard_stale(new),
        }
    }
}

/// `new` is about to be replaced by dup2/dup3 (the kernel closes it if `old` is valid):
/// forget what it was.
fn release_target(old: c_int, new: c_int) {
    // SAFETY: F_GETFD takes no pointer (its argument is ignored).
    if old != new && unsafe { real::fcntl(old, libc::F_GETFD, 0) } >= 0 {
        before_close(new);
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: dup takes no pointer; the caller's fd, unchanged.
    let new = unsafe { real::dup(fd) };
    copy_conn(fd, new);
    new
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    release_target(old, new);
    // SAFETY: dup2 takes no pointer; the caller's fds, unchanged.
    let rc = unsafe { real::dup2(old, new) };
    if old != new {
        copy_conn(old, rc);
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn __dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: an alias of dup2: same arguments, same contract.
    unsafe { dup2(old, new) }
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    release_target(old, new);
    // SAFETY: dup3 takes no pointer; the caller's arguments, unchanged.
    let rc = unsafe { real::dup3(old, new, flags) };
    if old != new {
        copy_conn(old, rc);
    }
    rc
}

/// fcntl() and its aliases.
///
/// # Safety
/// As fcntl(2): for a command that takes a pointer, `arg` is one it may use.
unsafe fn fcntl_impl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged under fcntl(2)'s contract. A command that
    // takes a pointer gets the caller's `arg`.
    let rc = unsafe { real::fcntl(fd, cmd, arg) };
    match cmd {
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => copy_conn(fd, rc),
        libc::F_SETFL if rc == 0 => {
            if let Some(conn) = conn::lookup(fd) {
                conn.nonblocking
                    .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed);
            }
        }
        _ => {}
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: fcntl(2)'s contract, which `fcntl_impl` asks for.
    unsafe { fcntl_impl(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn __fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: an alias of fcntl, whose contract `fcntl_impl` asks for.
    unsafe { fcntl_impl(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: fcntl64 has fcntl(2)'s contract (this is a 64-bit target), which `fcntl_impl` asks
    // for.
    unsafe { fcntl_impl(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int {
    if let Some(conn) = conn::lookup(fd) {
        if request == libc::FIONREAD && !arg.is_null() {
            if let Some(bytes) = io::bytes_readable(&conn) {
                // SAFETY: `arg` is non-null (checked), and ioctl(2)'s contract for FIONREAD
                // makes it a writable int.
                unsafe { *arg.cast::<c_int>() = bytes.min(c_int::MAX as u64) as c_int };
                return 0;
            }
        }
        // SAFETY: the caller's arguments, passed on unchanged under ioctl(2)'s contract. `arg` is
        // what `request` expects.
        let rc = unsafe { real::ioctl(fd, request, arg) };
        if request == libc::FIONBIO && rc == 0 && !arg.is_null() {
            // SAFETY: `arg` is non-null (checked), and ioctl(2)'s contract for FIONBIO makes it
            // a readable int.
            conn.nonblocking
                .store(unsafe { *arg.cast::<c_int>() } != 0, Ordering::Relaxed);
        }
        return rc;
    }
    // SAFETY: the caller's arguments, passed on unchanged under ioctl(2)'s contract.
    unsafe { real::ioctl(fd, request, arg) }
}

// ---- readiness ----------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: epoll_create takes no pointer.
    let epfd = unsafe { real::epoll_create(size) };
    discard_stale(epfd);
    multiplex::created(epfd);
    epfd
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: epoll_create1 takes no pointer.
    let epfd = unsafe { real::epoll_create1(flags) };
    discard_stale(epfd);
    multiplex::created(epfd);
    epfd
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    event: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: epoll_ctl(2)'s contract, which `multiplex::epoll_ctl` asks for; the arguments are
    // passed on.
    unsafe { multiplex::epoll_ctl(epfd, op, fd, event) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: epoll_wait(2)'s contract for `events` and `max`, which `multiplex::epoll_wait` asks
    // as epoll_pwait's; a null mask means none.
    unsafe { multiplex::epoll_wait(epfd, events, max, timeout, std::ptr::null()) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: epoll_pwait(2)'s contract, which `multiplex::epoll_wait` asks for; the arguments are
    // passed on.
    unsafe { multiplex::epoll_wait(epfd, events, max, timeout, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    if !conn::any_live() {
        // SAFETY: the caller's arguments, passed on unchanged under epoll_pwait2(2)'s contract.
        return unsafe { real::epoll_pwait2(epfd, events, max, timeout, mask) };
    }
    // SAFETY: epoll_pwait2(2)'s contract for `events`, `max` and `mask` is epoll_pwait's, which
    // `multiplex::epoll_wait` asks for; `timespec_ms` reads the timeout (see there).
    unsafe { multiplex::epoll_wait(epfd, events, max, timespec_ms(timeout), mask) }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, count: nfds_t, timeout: c_int) -> c_int {
    // SAFETY: poll(2)'s contract, which `multiplex::poll` asks for (as ppoll's, with no mask).
    unsafe { multiplex::poll(fds, count, timeout, None) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll(fds: *mut pollfd, count: nfds_t, timeout: c_int) -> c_int {
    // SAFETY: an alias of poll: poll(2)'s contract, which `multiplex::poll` asks for.
    unsafe { multiplex::poll(fds, count, timeout, None) }
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    count: nfds_t,
    timeout: *const timespec,
    mask: *const sigset_t,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<pollfd>()) < count as usize {
        // Let glibc report the overflow exactly as it would.
        // SAFETY: the caller's arguments, passed on unchanged under __ppoll_chk's contract.
        return unsafe { real::__ppoll_chk(fds, count, timeout, mask, fdslen) };
    }
    // SAFETY: `fdslen` covers `count` pollfds (checked above), so ppoll's contract holds for the
    // caller's arguments.
    unsafe { ppoll(fds, count, timeout, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    count: nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<pollfd>()) < count as usize {
        // SAFETY: abort has no preconditions. FORTIFY's answer to `fds` shorter than `count`
        // ("buffer overflow detected"), as glibc's __poll_chk.
        unsafe { libc::abort() };
    }
    // SAFETY: `fdslen` covers `count` pollfds (checked above): poll(2)'s contract, which
    // `multiplex::poll` asks for.
    unsafe { multiplex::poll(fds, count, timeout, None) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    count: nfds_t,
    timeout: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    if !conn::any_live() {
        // SAFETY: the caller's arguments, passed on unchanged under ppoll(2)'s contract.
        return unsafe { real::ppoll(fds, count, timeout, mask) };
    }
    // SAFETY: ppoll(2)'s contract, which `multiplex::poll` asks for; `timespec_ms` reads the
    // timeout (see there).
    unsafe { multiplex::poll(fds, count, timespec_ms(timeout), Some(mask)) }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    read: *mut libc::fd_set,
    write: *mut libc::fd_set,
    except: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    let ms = if timeout.is_null() {
        -1
    } else {
        // SAFETY: non-null, so select(2)'s contract makes it a readable timeval.
        let t = unsafe { &*timeout };
        (t.tv_sec as i128 * 1000 + (t.tv_usec as i128 + 999) / 1000).clamp(0, c_int::MAX as i128)
            as c_int
    };
    // SAFETY: select(2)'s contract for the fd sets, which `multiplex::select` asks as pselect's; no
    // mask.
    match unsafe { multiplex::select(nfds, read, write, except, ms, None) } {
        Some(rc) => {
            if rc == 0 && !timeout.is_null() {
                // SAFETY: as above; select(2)'s timeout is writable too (Linux reports the
                // time left in it).
                unsafe {
                    *timeout = libc::timeval {
                        tv_sec: 0,
                        tv_usec: 0,
                    }
                };
            }
            rc
        }
        // SAFETY: the caller's arguments, passed on unchanged under select(2)'s contract.
        None => unsafe { real::select(nfds, read, write, except, timeout) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn __select(
    nfds: c_int,
    read: *mut libc::fd_set,
    write: *mut libc::fd_set,
    except: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    // SAFETY: an alias of select: same arguments, same contract.
    unsafe { select(nfds, read, write, except, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    read: *mut libc::fd_set,
    write: *mut libc::fd_set,
    except: *mut libc::fd_set,
    timeout: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: pselect(2)'s contract, which `multiplex::select` asks for; `timespec_ms` reads the
    // timeout (see there).
    match unsafe { multiplex::select(nfds, read, write, except, timespec_ms(timeout), Some(mask)) }
    {
        Some(rc) => rc,
        // SAFETY: the caller's arguments, passed on unchanged under pselect(2)'s contract.
        None => unsafe { real::pselect(nfds, read, write, except, timeout, mask) },
    }
}

// ---- diagnostics --------------------------------------------------------------------------

/// What the library knows of `fd`: 0 a plain kernel fd, 1 a connection waiting for its peer to
/// attach (still TCP), 2 a connection whose data path is on shared memory. For tests and
/// tools that want to know (found with dlsym; absent when the library is not loaded).
#[no_mangle]
pub extern "C" fn flatmesh_shm_fd_state(fd: c_int) -> c_int {
    match conn::lookup(fd) {
        None => 0,
        Some(conn) if conn.attached() => 2,
        Some(_) => 1,
    }
}

// ---- process life cycle -------------------------------------------------------------------

thread_local! {
    /// Connections counted for the child of the fork() this thread is in (see `fork`).
    static FORKED: std::cell::RefCell<Vec<std::sync::Arc<conn::Conn>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

extern "C" fn prepare_fork() {
    conn::before_fork();
}

extern "C" fn parent_after_fork() {
    let counted = conn::after_fork_in_parent();
    // try_with: a thread forking while its thread-locals are torn down only skips the undo.
    let _ = FORKED.try_with(|forked| *forked.borrow_mut() = counted);
}

extern "C" fn child_after_fork() {
    let _ = FORKED.try_with(|forked| forked.borrow_mut().clear());
    conn::after_fork_in_child();
}

/// fork(): the atfork hooks count the child as a holder before it exists; only here is it
/// known whether it came to exist.
#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    // SAFETY: fork takes no arguments; the atfork hooks registered at load keep the library's
    // counts right in both processes.
    let pid = unsafe { real::fork() };
    if pid != 0 {
        let counted = FORKED
            .try_with(|forked| std::mem::take(&mut *forked.borrow_mut()))
            .unwrap_or_default();
        if pid < 0 {
            let saved = real::errno();
            conn::fork_failed(counted);
            real::set_errno(saved);
        }
    }
    pid
}

/// The real vfork, looked up by `vfork_uses_fork` just before `vfork` jumps to it.
static REAL_VFORK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether `vfork` must become `fork`: a vfork child runs in its parent's memory, so the
/// library's bookkeeping for what the child does before exec (typically closing or dup2-ing
/// its copy of each socket) would act on the parent's own tables: the parent's connection
/// would look closed, its records given back, its fd numbers remapped. While this process has
/// shared-memory connections vfork is therefore a fork, which POSIX allows (a vfork child may
/// only exec or _exit; a program that relies on writing its parent's memory from the child
/// sees the difference). Otherwise the real vfork runs.
extern "C" fn vfork_uses_fork() -> c_int {
    if conn::any_live() {
        return 1;
    }
    if REAL_VFORK.load(Ordering::Relaxed) == 0 {
        // SAFETY: dlsym only reads the NUL-terminated literal; RTLD_NEXT is a valid
        // pseudo-handle in a shared object.
        let found = unsafe { libc::dlsym(libc::RTLD_NEXT, c"vfork".as_ptr()) } as usize;
        if found == 0 {
            return 1;
        }
        REAL_VFORK.store(found, Ordering::Relaxed);
    }
    0
}

/// `vfork` when it must be a fork (see `vfork_uses_fork`).
extern "C" fn fork_for_vfork() -> libc::pid_t {
    // SAFETY: fork (the interposer above) takes no arguments and has no preconditions; it keeps
    // the library's counts right.
    unsafe { fork() }
}

/// vfork(): a fork while shared-memory connections are live (see `vfork_uses_fork`),
/// otherwise the real vfork. Written as a naked function that ends in a jump: a vfork child
/// returns through its parent's stack, so no frame of ours may be live when the real vfork
/// runs (glibc's own vfork is written the same way).
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    core::arch::naked_asm!(
        // On entry rsp is 8 off a 16-byte boundary; one push aligns it for the call.
        "push rax",
        "call {decide}",
        "pop rcx",
        "test eax, eax",
        "jnz {fork}",
        "jmp qword ptr [rip + {real}]",
        decide = sym vfork_uses_fork,
        fork = sym fork_for_vfork,
        real = sym REAL_VFORK,
    );
}

/// Registers the fork hooks when the library loads.
extern "C" fn on_load() {
    // SAFETY: pthread_atfork only stores the three argument-less `extern "C"` functions, which
    // stay mapped as long as the library (a preloaded library is never unloaded).
    unsafe {
        libc::pthread_atfork(
            Some(prepare_fork),
            Some(parent_after_fork),
            Some(child_after_fork),
        )
    };
}

/// At exit(), let go of every connection the way close() would, so that queued wake-up bytes
/// do not turn the peer's EOF into a reset.
extern "C" fn on_exit() {
    if conn::any_live() {
        for fd in 0..conn::MAX_FD as c_int {
            if let Some((conn, true)) = conn::remove(fd) {
                io::last_close(fd, &conn);
            }
        }
    }
    crate::stats::print_at_exit();
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

#[used]
#[link_section = ".fini_array"]
static ON_EXIT: extern "C" fn() = on_exit;
