//! The real libc functions behind the interposers, found with `dlsym(RTLD_NEXT, ..)`.
//!
//! Code inside this library must call these, never the plain `libc::` names of interposed
//! functions: inside a preloaded library those names resolve to our own interposers.

use libc::{
    c_int, c_void, iovec, msghdr, nfds_t, pollfd, sigset_t, size_t, sockaddr, socklen_t, ssize_t,
    timespec,
};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Looks a symbol up once and caches it. Aborts with a message if libc lacks it: nothing the
/// library does could then be correct.
fn resolve(cache: &AtomicUsize, name: &'static [u8]) -> usize {
    let cached = cache.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: dlsym only reads `name`, a NUL-terminated literal (every caller passes
    // `concat!(.., "\0")`); RTLD_NEXT is a valid pseudo-handle in a shared object.
    let found = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
    if found == 0 {
        let msg = b"flatmesh-shm: libc symbol not found; unset LD_PRELOAD\n";
        // SAFETY: SYS_write reads `msg.len()` bytes of a static buffer (the raw system call,
        // since `write` is interposed; a closed fd 2 only makes it fail); abort has no
        // preconditions.
        unsafe {
            libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len());
            libc::abort();
        }
    }
    cache.store(found, Ordering::Relaxed);
    found
}

macro_rules! real {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {$(
        /// The real libc function of the same name.
        ///
        /// # Safety
        /// Same contract as the libc function.
        pub unsafe fn $name($($arg: $ty),*) -> $ret {
            static CACHE: AtomicUsize = AtomicUsize::new(0);
            let address = resolve(&CACHE, concat!(stringify!($name), "\0").as_bytes());
            // SAFETY: `address` is the non-null address (`resolve` aborts otherwise) of the
            // next definition of this very symbol, a libc function whose C prototype is the
            // signature written in the list below; a code address fits a fn pointer on Linux.
            let function: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(address) };
            // SAFETY: the caller upholds the libc function's contract (`# Safety` above).
            unsafe { function($($arg),*) }
        }
    )*};
}

real! {
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    listen(fd: c_int, backlog: c_int) -> c_int;
    accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    readv(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t;
    writev(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t;
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    close(fd: c_int) -> c_int;
    shutdown(fd: c_int, how: c_int) -> c_int;
    dup(fd: c_int) -> c_int;
    dup2(old: c_int, new: c_int) -> c_int;
    dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int;
    ioctl(fd: c_int, request: libc::c_ulong, arg: *mut c_void) -> c_int;
    poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    ppoll(fds: *mut pollfd, n: nfds_t, timeout: *const timespec, mask: *const sigset_t) -> c_int;
    select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *mut libc::timeval) -> c_int;
    pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *const timespec, mask: *const sigset_t) -> c_int;
    epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut libc::epoll_event) -> c_int;
    epoll_pwait(epfd: c_int, events: *mut libc::epoll_event, max: c_int, timeout: c_int, mask: *const sigset_t) -> c_int;
    epoll_pwait2(epfd: c_int, events: *mut libc::epoll_event, max: c_int, timeout: *const timespec, mask: *const sigset_t) -> c_int;
    socket(domain: c_int, kind: c_int, protocol: c_int) -> c_int;
    fork() -> libc::pid_t;
    epoll_create(size: c_int) -> c_int;
    epoll_create1(flags: c_int) -> c_int;
    socketpair(domain: c_int, kind: c_int, protocol: c_int, fds: *mut c_int) -> c_int;
    close_range(first: libc::c_uint, last: libc::c_uint, flags: c_int) -> c_int;
    closefrom(first: c_int) -> ();
    fclose(stream: *mut libc::FILE) -> c_int;
    __ppoll_chk(fds: *mut pollfd, n: nfds_t, timeout: *const timespec, mask: *const sigset_t, fdslen: size_t) -> c_int;
    sendfile(out: c_int, input: c_int, offset: *mut libc::off_t, count: size_t) -> ssize_t;
    __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t;
    __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    __recvfrom_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
}

/// A poll-style timeout in milliseconds (negative: none) as a timespec (None: none).
pub fn timespec_of_ms(timeout_ms: c_int) -> Option<timespec> {
    (timeout_ms >= 0).then(|| timespec {
        tv_sec: (timeout_ms / 1000) as libc::time_t,
        tv_nsec: (timeout_ms % 1000) as libc::c_long * 1_000_000,
    })
}

/// The real `ppoll` with a poll-style timeout in milliseconds (negative: none).
///
/// # Safety
///
/// As ppoll(2): `fds` is valid for `n` pollfds, read and written; `mask` is null or points
/// to a live sigset_t.
pub unsafe fn ppoll_ms(
    fds: *mut pollfd,
    n: nfds_t,
    timeout_ms: c_int,
    mask: *const sigset_t,
) -> c_int {
    let timeout = timespec_of_ms(timeout_ms);
    let timeout = timeout.as_ref().map_or(std::ptr::null(), std::ptr::from_ref);
    // SAFETY: `fds` and `mask` are the caller's (this function's `# Safety`); `timeout` is
    // null or points to the local above, alive until the call returns.
    unsafe { ppoll(fds, n, timeout, mask) }
}

/// Reads `errno`.
pub fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno slot: non-null, aligned and live
    // for as long as the thread runs.
    unsafe { *libc::__errno_location() }
}

/// Sets `errno`.
pub fn set_errno(value: c_int) {
    // SAFETY: as in `errno`; the slot is only ever accessed from its own thread.
    unsafe { *libc::__errno_location() = value }
}
