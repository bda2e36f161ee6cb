//! A small test program for the hetero-socket library: echo servers in several I/O styles and
//! clients that check socket semantics. The tests in `tests/semantics.rs` run it under
//! `LD_PRELOAD`; it uses only plain libc/std socket calls, like any unmodified program.
//!
//! ```text
//! shm_probe serve <thread|fork|epoll|epoll2|poll|select> <connections>
//!                         prints "ready <port>", then "served <n> attached <k> ticks <t>"
//! shm_probe crash-serve   accepts one, reads a byte, SIGKILLs itself
//! shm_probe crash-hold    accepts one, reads a byte, answers one, stops reading, SIGKILLs itself
//! shm_probe fork-close-first BYTES
//!                         accepts one, waits for BYTES to be buffered, forks, and the parent
//!                         closes its copy before the child runs; prints "child ok|failed ..."
//! shm_probe client <port> <integrity|small:N|burst:MIB|dup|fork|nonblocking|epollout-thread|
//!                          half-close-full[:BYTES]|wake-race:SECS|pingpong:TRIPS|
//!                          stale|crash|
//!                          crash-burst:PID|many:N|fork-close-first:BYTES|from:SOURCE_PORT>
//! ```
//!
//! Environment: `SHM_PROBE_TICK_MS` (epoll/poll/select servers: how often a thread writes to
//! the pipe in the set; default 5, 0 = no pipe traffic), `SHM_PROBE_WAIT_MS` (epoll/poll
//! servers: the timeout of one wait; default 1000, -1 = none) and `SHM_PROBE_HOLD_SECS` (`many:N`:
//! how long the connections stay open and idle) and `SHM_PROBE_ACCEPT_WHEN_QUEUED` (`serve`: wait
//! until that many connections are queued before the first accept, so a test fixes the order),
//! `SHM_PROBE_PORT` (`serve`: listen on this port instead of a free one),
//! `SHM_PROBE_THINK_US` (`pingpong`: pause between round trips, so the echo server's waits
//! outlast its polling and it sleeps) and
//! `SHM_PROBE_SERVER_IP` (`client`: the address to dial instead of 127.0.0.1, e.g. a service
//! address that interception rules redirect).
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::time::{Duration, Instant};

fn main() {
    raise_fd_limit();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    match arg(0) {
        "serve" => serve(arg(1), arg(2).parse().unwrap_or(1)),
        "crash-serve" => crash_serve(),
        "crash-hold" => crash_hold(),
        "fork-close-first" => fork_close_first(arg(1).parse().expect("bytes")),
        "client" => client(arg(1).parse().expect("port"), arg(2)),
        _ => {
            eprintln!("usage: shm_probe serve MODE N | crash-serve | client PORT TEST");
            std::process::exit(2);
        }
    }
}

fn raise_fd_limit() {
    let limit = libc::rlimit {
        rlim_cur: 8192,
        rlim_max: 8192,
    };
    // SAFETY: setrlimit reads one rlimit, `limit`, a live local.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
}

/// Connection regions this process has mapped (connections the library accelerated; the
/// shared arenas are not counted).
fn shm_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/dev/shm/flatmesh-shm-") && !l.contains("-arena-"))
        .count()
}

/// Whether the library moved this fd's connection to shared memory (asks the library through
/// its `flatmesh_shm_fd_state` diagnostic; false when the library is not loaded).
fn on_shared_memory(fd: RawFd) -> bool {
    type FdState = unsafe extern "C" fn(libc::c_int) -> libc::c_int;
    static STATE: std::sync::OnceLock<Option<FdState>> = std::sync::OnceLock::new();
    let state = STATE.get_or_init(|| {
        // SAFETY: dlsym only reads the NUL-terminated literal; RTLD_DEFAULT is a valid
        // pseudo-handle.
        let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"flatmesh_shm_fd_state".as_ptr()) };
        (!symbol.is_null())
            // SAFETY: a non-null `flatmesh_shm_fd_state` is the library's
            // `extern "C" fn(c_int) -> c_int` (src/interpose.rs): exactly FdState, and a code
            // address fits a fn pointer.
            .then(|| unsafe { std::mem::transmute::<*mut libc::c_void, FdState>(symbol) })
    });
    // SAFETY: FdState takes an fd number by value and has no preconditions: any number, open or
    // not, gives an answer.
    state.is_some_and(|f| unsafe { f(fd) } == 2)
}

fn check(rc: isize, what: &str) -> isize {
    if rc < 0 {
        panic!("{what}: {}", std::io::Error::last_os_error());
    }
    rc
}

fn set_nonblocking(fd: RawFd) {
    // SAFETY: F_GETFL and F_SETFL take integers only; a bad fd only fails.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

// ---- servers -----------------------------------------------------------------------------

/// A listener on a free loopback port, announced to the test as `ready PORT` on stdout.
fn announced_listener() -> TcpListener {
    let port: u16 = std::env::var("SHM_PROBE_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    println!("ready {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    listener
}

fn serve(mode: &str, connections: usize) {
    let listener = announced_listener();
    let cpu_before = process_cpu_seconds();
    if let Some(queued) = std::env::var("SHM_PROBE_ACCEPT_WHEN_QUEUED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        wait_until_queued(&listener, queued);
    }
    let (attached, ticks) = match mode {
        "thread" => serve_threads(&listener, connections),
        "fork" => serve_fork(&listener, connections),
        "epoll" | "epoll2" | "poll" | "select" => serve_events(listener, connections, mode),
        _ => panic!("unknown mode {mode}"),
    };
    println!("served {connections} attached {attached} ticks {ticks}");
    // From "ready" on: the serving, not the program's start.
    println!("server_cpu_s {:.4}", process_cpu_seconds() - cpu_before);
}

/// Waits (up to 20 s) until `count` connections wait in the listener's accept queue, so that a
/// test decides the order in which they are accepted. A listening socket's TCP_INFO reports
/// its accept queue length in `tcpi_unacked` (offset 24).
fn wait_until_queued(listener: &TcpListener, count: u32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut info = [0u8; 232];
        let mut len = info.len() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` (the array's size) bytes into `info`, a live
        // local array, and the length into `len`, a live local.
        let rc = unsafe {
            libc::getsockopt(
                listener.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        };
        check(rc as isize, "getsockopt(TCP_INFO)");
        let queued = u32::from_ne_bytes(info[24..28].try_into().unwrap());
        if queued >= count {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {queued} of {count} connections queued after 20 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn echo_blocking(mut stream: TcpStream) {
    let mut buffer = vec![0u8; 100_000];
    loop {
        let n = stream.read(&mut buffer).unwrap();
        if n == 0 {
            break;
        }
        stream.write_all(&buffer[..n]).unwrap();
    }
    stream.shutdown(Shutdown::Write).unwrap();
}

fn serve_threads(listener: &TcpListener, connections: usize) -> (usize, usize) {
    let mut attached = 0;
    let mut handles = Vec::new();
    for _ in 0..connections {
        let (stream, _) = listener.accept().unwrap();
        attached += usize::from(on_shared_memory(stream.as_raw_fd()));
        handles.push(std::thread::spawn(move || echo_blocking(stream)));
    }
    for handle in handles {
        handle.join().unwrap();
    }
    (attached, 0)
}

/// One child per connection; the parent closes its copy at once (the child's must survive).
fn serve_fork(listener: &TcpListener, connections: usize) -> (usize, usize) {
    let mut attached = 0;
    let mut children = Vec::new();
    for _ in 0..connections {
        let (stream, _) = listener.accept().unwrap();
        attached += usize::from(on_shared_memory(stream.as_raw_fd()));
        // SAFETY: fork takes no arguments. This process is single-threaded here (the fork server
        // starts no thread), so the child may go on running Rust code.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            echo_blocking(stream);
            // SAFETY: _exit takes a status and ends the child at once (no destructor, no atexit
            // hook of the parent's).
            unsafe { libc::_exit(0) };
        }
        drop(stream);
        children.push(pid);
    }
    for pid in children {
        let mut status = 0;
        // SAFETY: waitpid writes one int, into `status`, a live local; `pid` is our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child failed: {status}"
        );
    }
    (attached, 0)
}

struct Peer {
    fd: RawFd,
    pending: Vec<u8>,
    eof: bool,
}

/// Nonblocking echo over epoll (edge-triggered, like nginx), poll or select. A pipe that a
/// thread writes to every few milliseconds sits in the same set: kernel and shared-memory fds
/// mixed.
fn serve_events(listener: TcpListener, connections: usize, mode: &str) -> (usize, usize) {
    listener.set_nonblocking(true).unwrap();
    let listen_fd = listener.as_raw_fd();
    let mut pipe = [0; 2];
    // SAFETY: pipe2 writes two ints, into `pipe`, a live local array of two.
    unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_NONBLOCK) };
    let ticker_fd = pipe[1];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_ticker = stop.clone();
    let tick_ms: u64 = std::env::var("SHM_PROBE_TICK_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    // How long one epoll_wait/poll may sleep (-1: forever, so that a missed wake-up hangs).
    let wait_ms: libc::c_int = std::env::var("SHM_PROBE_WAIT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let ticker = std::thread::spawn(move || {
        while !stop_ticker.load(std::sync::atomic::Ordering::Relaxed) {
            if tick_ms > 0 {
                // SAFETY: write reads 1 byte of a static literal; a bad fd only fails.
                unsafe { libc::write(ticker_fd, b"t".as_ptr().cast(), 1) };
            }
            std::thread::sleep(Duration::from_millis(tick_ms.max(5)));
        }
    });
    let epfd = if mode.starts_with("epoll") {
        // SAFETY: epoll_create1 takes no pointer.
        unsafe { libc::epoll_create1(0) }
    } else {
        -1
    };
    let add = |fd: RawFd, events: u32| {
        if epfd >= 0 {
            let mut event = libc::epoll_event {
                events,
                u64: fd as u64,
            };
            check(
                // SAFETY: epoll_ctl reads one epoll_event, `event`, a live local.
                unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut event) } as isize,
                "epoll_ctl",
            );
        }
    };
    add(listen_fd, libc::EPOLLIN as u32);
    add(pipe[0], libc::EPOLLIN as u32);
    let mut peers: std::collections::BTreeMap<RawFd, Peer> = Default::default();
    let (mut accepted, mut done, mut attached, mut ticks) = (0usize, 0usize, 0usize, 0usize);
    let mut buffer = vec![0u8; 65536];
    while done < connections {
        // Which fds to look at.
        let mut ready: Vec<RawFd> = Vec::new();
        match mode {
            "epoll" | "epoll2" => {
                let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
                let n = if mode == "epoll" {
                    // SAFETY: epoll_wait writes at most 64 events into `events`, a live Vec of 64.
                    unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), 64, wait_ms) }
                } else {
                    let timeout = libc::timespec {
                        tv_sec: 1,
                        tv_nsec: 0,
                    };
                    // SAFETY: epoll_pwait2 writes at most 64 events into `events`, a live Vec of
                    // 64, and reads `timeout`, a live local timespec; no signal mask (null).
                    unsafe {
                        libc::epoll_pwait2(
                            epfd,
                            events.as_mut_ptr(),
                            64,
                            &timeout,
                            std::ptr::null(),
                        )
                    }
                };
                let n = check(n as isize, "epoll_wait");
                ready.extend(events[..n as usize].iter().map(|e| e.u64 as RawFd));
            }
            "poll" => {
                let mut fds: Vec<libc::pollfd> = [listen_fd, pipe[0]]
                    .iter()
                    .chain(peers.keys())
                    .map(|&fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN
                            | if peers.get(&fd).is_some_and(|p| !p.pending.is_empty()) {
                                libc::POLLOUT
                            } else {
                                0
                            },
                        revents: 0,
                    })
                    .collect();
                check(
                    // SAFETY: poll reads and writes the `fds.len()` pollfds of `fds`, a live Vec.
                    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, wait_ms) } as isize,
                    "poll",
                );
                ready.extend(fds.iter().filter(|p| p.revents != 0).map(|p| p.fd));
            }
            // SAFETY: fd_set is an array of integers, for which all-zero bytes are valid (an empty
            // set); every fd put in or looked up is below 1024 = FD_SETSIZE (asserted, and
            // `0..=max`); select reads and writes the two live local sets and `timeout`, a live
            // local; no exception set (null).
            _ => unsafe {
                let mut read: libc::fd_set = std::mem::zeroed();
                let mut write: libc::fd_set = std::mem::zeroed();
                let mut max = 0;
                for &fd in [listen_fd, pipe[0]].iter().chain(peers.keys()) {
                    assert!(fd < 1024, "select needs fds below 1024");
                    libc::FD_SET(fd, &mut read);
                    if peers.get(&fd).is_some_and(|p| !p.pending.is_empty()) {
                        libc::FD_SET(fd, &mut write);
                    }
                    max = max.max(fd);
                }
                let mut timeout = libc::timeval {
                    tv_sec: 1,
                    tv_usec: 0,
                };
                check(
                    libc::select(
                        max + 1,
                        &mut read,
                        &mut write,
                        std::ptr::null_mut(),
                        &mut timeout,
                    ) as isize,
                    "select",
                );
                for fd in 0..=max {
                    if libc::FD_ISSET(fd, &read) || libc::FD_ISSET(fd, &write) {
                        ready.push(fd);
                    }
                }
            },
        }
        for fd in ready {
            if fd == listen_fd {
                loop {
                    // SAFETY: accept4 may be given null address and length pointers (no peer
                    // address wanted); the new fd is owned by `peers` until it is closed below.
                    let peer = unsafe {
                        libc::accept4(
                            listen_fd,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            libc::SOCK_NONBLOCK,
                        )
                    };
                    if peer < 0 {
                        break;
                    }
                    accepted += 1;
                    attached += usize::from(on_shared_memory(peer));
                    add(
                        peer,
                        (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
                    );
                    peers.insert(
                        peer,
                        Peer {
                            fd: peer,
                            pending: Vec::new(),
                            eof: false,
                        },
                    );
                }
                continue;
            }
            if fd == pipe[0] {
                let mut sink = [0u8; 64];
                // SAFETY: read writes at most 64 bytes into `sink`, a live local array of 64.
                while unsafe { libc::read(pipe[0], sink.as_mut_ptr().cast(), 64) } > 0 {
                    ticks += 1;
                }
                continue;
            }
            let Some(peer) = peers.get_mut(&fd) else {
                continue;
            };
            // Read until EAGAIN (edge-triggered), write what we can.
            while !peer.eof && peer.pending.len() < 4 << 20 {
                // SAFETY: read writes at most `buffer.len()` bytes into `buffer`, a live Vec.
                let n = unsafe { libc::read(peer.fd, buffer.as_mut_ptr().cast(), buffer.len()) };
                if n > 0 {
                    peer.pending.extend_from_slice(&buffer[..n as usize]);
                } else if n == 0 {
                    peer.eof = true;
                } else {
                    let error = std::io::Error::last_os_error();
                    assert_eq!(error.raw_os_error(), Some(libc::EAGAIN), "read: {error}");
                    break;
                }
            }
            while !peer.pending.is_empty() {
                // SAFETY: write reads `peer.pending.len()` bytes of `peer.pending`, a live Vec.
                let n = unsafe {
                    libc::write(peer.fd, peer.pending.as_ptr().cast(), peer.pending.len())
                };
                if n < 0 {
                    let error = std::io::Error::last_os_error();
                    assert_eq!(error.raw_os_error(), Some(libc::EAGAIN), "write: {error}");
                    break;
                }
                peer.pending.drain(..n as usize);
            }
            if peer.eof && peer.pending.is_empty() {
                // SAFETY: `fd` is the accepted socket that `peers` owns: shut down and closed once
                // here, then removed from `peers`.
                unsafe {
                    libc::shutdown(fd, libc::SHUT_WR);
                    libc::close(fd);
                }
                peers.remove(&fd);
                done += 1;
            }
        }
        let _ = accepted;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    ticker.join().unwrap();
    (attached, ticks)
}

/// The byte at stream offset `i` of a `fork-close-first` burst.
fn burst_byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// Accepts one connection, acknowledges its first byte, waits until the client's burst of
/// `burst` bytes is buffered (the local record and a chain of arena records), then forks. The
/// parent runs with a real-time priority on one CPU, so after fork() it keeps that CPU until it
/// blocks: it closes its copy of the connection before the child has run at all (not even its
/// fork hooks). The child must still read every byte: it became a holder when fork() returned.
fn fork_close_first(burst: usize) {
    let listener = announced_listener();
    let (mut stream, _) = listener.accept().unwrap();
    let attached = usize::from(on_shared_memory(stream.as_raw_fd()));
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte).unwrap();
    stream.write_all(b"k").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut buffered: libc::c_int = 0;
        check(
            // SAFETY: FIONREAD writes one int, into `buffered`, a live local int.
            unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut buffered) } as isize,
            "FIONREAD",
        );
        if buffered as usize >= burst {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {buffered} of {burst} bytes arrived"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: an all-zero cpu_set_t is a valid empty set (CPU_SET indexes it with a bounds check);
    // sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of `one` and sched_setscheduler one
    // sched_param, `param`: live locals.
    unsafe {
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(libc::sched_getcpu().max(0) as usize, &mut one);
        check(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) as isize,
            "sched_setaffinity",
        );
        let param = libc::sched_param { sched_priority: 10 };
        check(
            libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) as isize,
            "sched_setscheduler(SCHED_FIFO) (needs root)",
        );
    }
    // SAFETY: fork takes no arguments. This process is single-threaded (it started no thread), so
    // the child may go on running Rust code.
    let pid = unsafe { libc::fork() };
    check(pid as isize, "fork");
    if pid == 0 {
        // Back to normal scheduling on every CPU, then read the whole burst.
        // SAFETY: as above: `param` and `all` (all-zero, then filled through bounds-checked
        // CPU_SET) are live locals that the calls read.
        unsafe {
            let param = libc::sched_param { sched_priority: 0 };
            libc::sched_setscheduler(0, libc::SCHED_OTHER, &param);
            let mut all: libc::cpu_set_t = std::mem::zeroed();
            for cpu in 0..libc::CPU_SETSIZE as usize {
                libc::CPU_SET(cpu, &mut all);
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all);
        }
        let mut data = vec![0u8; burst];
        let code = match stream.read_exact(&mut data) {
            Err(e) => {
                eprintln!("fork-close-first child: read: {e}");
                1
            }
            Ok(()) => match (0..burst).find(|&i| data[i] != burst_byte(i)) {
                Some(i) => {
                    eprintln!("fork-close-first child: byte {i} differs");
                    1
                }
                None => i32::from(stream.write_all(b"ok").is_err()),
            },
        };
        drop(stream);
        // SAFETY: _exit takes a status and ends the child at once (no destructor, no atexit hook of
        // the parent's).
        unsafe { libc::_exit(code) };
    }
    drop(stream);
    let mut status = 0;
    check(
        // SAFETY: waitpid writes one int, into `status`, a live local; `pid` is our child.
        unsafe { libc::waitpid(pid, &mut status, 0) } as isize,
        "waitpid",
    );
    let good = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    println!(
        "child {} attached {attached}",
        if good { "ok" } else { "failed" }
    );
}

/// Client of `fork-close-first`: a byte (answered once the server attached, so the burst goes
/// to shared memory), the burst, then the child's "ok" and EOF.
fn fork_close_first_client(port: u16, burst: usize) {
    let mut stream = connect(port);
    stream.write_all(b"g").unwrap();
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).unwrap();
    assert_eq!(&ack, b"k");
    let data: Vec<u8> = (0..burst).map(burst_byte).collect();
    stream.write_all(&data).unwrap();
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).unwrap();
    assert_eq!(reply, b"ok", "the forked child did not get every byte");
}

/// Accepts one connection, reads one byte and acknowledges it, then stops reading (the client
/// fills the arena) and dies by SIGKILL with those records still in the chain.
fn crash_hold() {
    let listener = announced_listener();
    let (mut stream, _) = listener.accept().unwrap();
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte).unwrap();
    // The acknowledgement tells the client that we have attached (its burst then goes to
    // shared memory, not over TCP as the bytes sent before the accept do).
    stream.write_all(b"k").unwrap();
    println!(
        "attached {} pid {}",
        usize::from(on_shared_memory(stream.as_raw_fd())),
        std::process::id()
    );
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: getpid has no preconditions; kill takes no pointer. Dying by SIGKILL here is the
    // test.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}

fn crash_serve() {
    let listener = announced_listener();
    let (mut stream, _) = listener.accept().unwrap();
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte).unwrap();
    println!(
        "attached {}",
        usize::from(on_shared_memory(stream.as_raw_fd()))
    );
    std::io::stdout().flush().unwrap();
    // SAFETY: getpid has no preconditions; kill takes no pointer. Dying by SIGKILL here is the
    // test.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}

// ---- clients -----------------------------------------------------------------------------

/// A deterministic byte stream (xorshift), so both ends can check content without storing it.
struct Stream(u64);
impl Stream {
    fn fill(&mut self, out: &mut [u8]) {
        for byte in out {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            *byte = self.0 as u8;
        }
    }
}

fn connect(port: u16) -> TcpStream {
    let ip = std::env::var("SHM_PROBE_SERVER_IP").unwrap_or_else(|_| "127.0.0.1".to_string());
    TcpStream::connect((ip.as_str(), port)).unwrap()
}

fn roundtrip(stream: &mut TcpStream, message: &[u8]) {
    stream.write_all(message).unwrap();
    let mut back = vec![0u8; message.len()];
    stream.read_exact(&mut back).unwrap();
    assert_eq!(back, message, "echo differs");
}

fn client(port: u16, test: &str) {
    match test {
        "integrity" => integrity(port),
        "dup" => dup_test(port),
        "fork" => fork_test(port),
        "nonblocking" => nonblocking(port),
        "epollout-thread" => epollout_thread(port),
        "half-close-full" => half_close_full(port, 6 << 20),
        race if race.starts_with("wake-race:") => wake_race(port, race[10..].parse().unwrap()),
        full if full.starts_with("half-close-full:") => {
            half_close_full(port, full[16..].parse().unwrap())
        }
        "crash" => crash(port),
        "stale" => stale(port),
        small if small.starts_with("small:") => small_messages(port, small[6..].parse().unwrap()),
        pingpong if pingpong.starts_with("pingpong:") => {
            ping_pong(port, pingpong[9..].parse().unwrap())
        }
        burst if burst.starts_with("burst:") => burst_test(port, burst[6..].parse().unwrap()),
        crash_burst if crash_burst.starts_with("crash-burst:") => {
            crash_burst_test(port, crash_burst[12..].parse().unwrap())
        }
        many if many.starts_with("many:") => many_connections(port, many[5..].parse().unwrap()),
        from if from.starts_with("from:") => from_port(port, from[5..].parse().unwrap()),
        fork if fork.starts_with("fork-close-first:") => {
            fork_close_first_client(port, fork[17..].parse().unwrap())
        }
        _ => panic!("unknown test {test}"),
    }
    println!("ok {test} mapped {}", shm_mappings());
}

/// A connection from 127.0.0.1:`source` (a port the test chose): distinct messages echo back
/// unchanged, and the connection is on shared memory.
fn from_port(port: u16, source: u16) {
    // SAFETY: socket takes no pointer; the new fd goes to `stream` right below, its one owner.
    let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    check(socket as isize, "socket");
    // SAFETY: `socket` is a new, open fd (checked above) that nothing else owns: the TcpStream
    // takes it over and closes it once.
    let stream = unsafe { TcpStream::from_raw_fd(socket) };
    let address = |port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // A closed connection of an earlier run may still hold the port in TIME_WAIT.
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes of `one`, a live local int.
    unsafe {
        libc::setsockopt(
            socket,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let local = address(source);
    // SAFETY: bind reads `len` bytes of `local`, a live local sockaddr_in of exactly that size.
    let rc = unsafe { libc::bind(socket, (&local as *const libc::sockaddr_in).cast(), len) };
    check(rc as isize, "bind to the chosen source port");
    let server = address(port);
    // SAFETY: connect reads `len` bytes of `server`, a live local sockaddr_in of exactly that size.
    let rc = unsafe { libc::connect(socket, (&server as *const libc::sockaddr_in).cast(), len) };
    check(rc as isize, "connect");
    let mut stream = stream;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    for i in 0..20 {
        roundtrip(&mut stream, format!("victim message {i}").as_bytes());
    }
    assert!(
        on_shared_memory(stream.as_raw_fd()),
        "the connection from port {source} did not move to shared memory"
    );
    stream.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "unexpected bytes after the echo: {rest:?}");
}

/// Full duplex: a thread writes 8 MiB in odd-sized chunks, then half-closes; the main thread
/// reads the echo until EOF and checks every byte.
fn integrity(port: u16) {
    let stream = connect(port);
    let mut writer = stream.try_clone().unwrap();
    let total = 8usize << 20;
    let sender = std::thread::spawn(move || {
        let mut source = Stream(0x9E37_79B9_7F4A_7C15);
        let mut sent = 0;
        let mut size = 1usize;
        while sent < total {
            size = (size * 7 + 13) % 150_000 + 1;
            let mut chunk = vec![0u8; size.min(total - sent)];
            source.fill(&mut chunk);
            writer.write_all(&chunk).unwrap();
            sent += chunk.len();
        }
        writer.shutdown(Shutdown::Write).unwrap();
    });
    let mut reader = stream;
    let mut expected = Stream(0x9E37_79B9_7F4A_7C15);
    let mut received = 0;
    let mut buffer = vec![0u8; 70_000];
    let mut want = vec![0u8; 70_000];
    loop {
        let n = reader.read(&mut buffer).unwrap();
        if n == 0 {
            break;
        }
        expected.fill(&mut want[..n]);
        assert_eq!(
            &buffer[..n],
            &want[..n],
            "byte mismatch near offset {received}"
        );
        received += n;
    }
    sender.join().unwrap();
    assert_eq!(received, total, "EOF before all bytes came back");
}

fn dup_test(port: u16) {
    let stream = connect(port);
    let fd = stream.into_raw_fd();
    // SAFETY: dup takes no pointer; `fd` is ours (from `into_raw_fd`), and so is the copy.
    let copy = unsafe { libc::dup(fd) };
    check(
        // SAFETY: write reads 7 bytes of a 7-byte static literal.
        unsafe { libc::write(copy, b"via-dup".as_ptr().cast(), 7) },
        "write on dup",
    );
    // SAFETY: `fd` is ours (from `into_raw_fd`) and closed once; `copy` stays open.
    unsafe { libc::close(fd) };
    let mut back = [0u8; 7];
    let mut got = 0;
    while got < 7 {
        got += check(
            // SAFETY: read writes at most `7 - got` bytes into `back[got..]`, which is that long.
            unsafe { libc::read(copy, back[got..].as_mut_ptr().cast(), 7 - got) },
            "read on dup",
        ) as usize;
    }
    assert_eq!(&back, b"via-dup");
    // SAFETY: dup2 takes no pointer; `copy` is ours, and nothing else in this program uses fd 200.
    let high = check(unsafe { libc::dup2(copy, 200) } as isize, "dup2") as RawFd;
    // SAFETY: `high` is the open fd dup2 made (checked), owned by nothing else: the TcpStream takes
    // it over.
    let mut stream = unsafe { TcpStream::from_raw_fd(high) };
    roundtrip(&mut stream, b"via-dup2");
    // SAFETY: `copy` is ours (dup above) and closed once; `stream` holds its own fd, 200.
    unsafe { libc::close(copy) };
    // Larger than one ring: the echo crosses both rings while this side still writes.
    roundtrip(&mut stream, &[5u8; 60_000]);
}

fn fork_test(port: u16) {
    let mut stream = connect(port);
    roundtrip(&mut stream, b"parent-before");
    // SAFETY: fork takes no arguments. This process is single-threaded (it started no thread), so
    // the child may go on running Rust code.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        roundtrip(&mut stream, &[3u8; 60_000]);
        roundtrip(&mut stream, b"child");
        // SAFETY: _exit takes a status and ends the child at once (no destructor, no atexit hook of
        // the parent's).
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waitpid writes one int, into `status`, a live local; `pid` is our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child failed"
    );
    roundtrip(&mut stream, b"parent-after");
}

fn nonblocking(port: u16) {
    let mut stream = connect(port);
    let fd = stream.as_raw_fd();
    set_nonblocking(fd);
    let mut byte = [0u8; 1];
    // SAFETY: read writes at most 1 byte into `byte`, a live local array of 1.
    let rc = unsafe { libc::read(fd, byte.as_mut_ptr().cast(), 1) };
    assert!(
        rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN),
        "empty nonblocking read must be EAGAIN, got {rc}"
    );
    // Write without reading until EAGAIN: the echo fills both directions.
    let chunk = vec![9u8; 16384];
    let mut sent = 0usize;
    let mut saw_eagain = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !saw_eagain && Instant::now() < deadline {
        // SAFETY: write reads `chunk.len()` bytes of `chunk`, a live Vec.
        let n = unsafe { libc::write(fd, chunk.as_ptr().cast(), chunk.len()) };
        if n < 0 {
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EAGAIN)
            );
            saw_eagain = true;
        } else {
            sent += n as usize;
        }
    }
    assert!(saw_eagain, "writes never blocked");
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one pollfd (n = 1): `entry`, a live local.
    check(unsafe { libc::poll(&mut entry, 1, 5000) } as isize, "poll");
    assert!(entry.revents & libc::POLLIN != 0, "no echo within 5 s");
    let mut available: libc::c_int = 0;
    check(
        // SAFETY: FIONREAD writes one int, into `available`, a live local int.
        unsafe { libc::ioctl(fd, libc::FIONREAD, &mut available) } as isize,
        "FIONREAD",
    );
    assert!(
        available > 0,
        "FIONREAD reports nothing although echoes are waiting"
    );
    // Drain everything with poll.
    let mut received = 0usize;
    let mut buffer = vec![0u8; 65536];
    while received < sent {
        let mut entry = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes one pollfd (n = 1): `entry`, a live local.
        check(unsafe { libc::poll(&mut entry, 1, 5000) } as isize, "poll");
        assert!(
            entry.revents & libc::POLLIN != 0,
            "poll timed out with {} bytes outstanding",
            sent - received
        );
        // SAFETY: read writes at most `buffer.len()` bytes into `buffer`, a live Vec.
        let n = unsafe { libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len()) };
        if n > 0 {
            assert!(buffer[..n as usize].iter().all(|&b| b == 9));
            received += n as usize;
        }
    }
    stream.shutdown(Shutdown::Write).unwrap();
    let _ = stream.set_nonblocking(false);
    assert_eq!(
        stream.read(&mut buffer).unwrap(),
        0,
        "expected EOF after half-close"
    );
}

/// Half-close while the echo is stuck on a full pipe: 6 MiB more than the server-to-client
/// direction holds (local record plus its arena share) go out without reading, so the server
/// blocks on EAGAIN and sleeps (epoll, poll) or blocks in send (threads). Then the client shuts
/// down its sending side, which leaves its kernel socket unable to carry a wake-up byte, and
/// only then reads. The server must still notice the room and send every byte.
/// Writes `total` bytes to an echo server without reading, half-closes, then reads the echo.
/// Beyond one direction's capacity both pipes fill: the server blocks writing the echo while
/// the client still writes. That must not stall as long as the two pipes together hold
/// `total` (as two TCP socket buffers would): the server, blocked on its own write, must let
/// the client's writer use the room it has made. Both waits are bounded (10 s).
fn half_close_full(port: u16, total: usize) {
    let mut stream = connect(port);
    let message: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    if let Err(e) = stream.write_all(&message) {
        panic!("writing {total} bytes without reading stalled: {e} (the writer was not woken)");
    }
    stream.shutdown(Shutdown::Write).unwrap();
    // Let the server fill the pipe, fail with EAGAIN and go to sleep.
    std::thread::sleep(Duration::from_millis(300));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut back = Vec::with_capacity(total);
    let mut buffer = vec![0u8; 65536];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => back.extend_from_slice(&buffer[..n]),
            Err(e) => panic!(
                "echo stalled after {} of {total} bytes: {e} (the server was not woken)",
                back.len()
            ),
        }
    }
    assert_eq!(back.len(), total, "echo length");
    assert!(back == message, "echo differs");
}

/// Pins the calling thread to the last CPU (when there is more than one), so that its peer,
/// left elsewhere, is woken across CPUs.
fn pin_last_cpu() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus > 1 {
        // SAFETY: an all-zero cpu_set_t is a valid empty set (CPU_SET indexes it with a bounds
        // check); sched_setaffinity reads that live local, for this thread (pid 0).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpus - 1, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

/// Hammers the sleep/wake-up handshake in both directions for `secs` seconds: a writer thread
/// sends messages of random sizes (a few bytes to 200 KB) with random pauses, the reader reads
/// the echo with random buffer sizes and random pauses, so that readers find the pipe empty and
/// writers find it full over and over, each time at a different moment. Run with
/// `FLATMESH_SHM_SPIN_US=0` on both sides, every such wait is a sleep in the kernel. The client
/// runs on the last CPU (the server elsewhere), so wake-ups cross CPUs. Every read and write
/// has a 5 s timeout: a lost wake-up fails the run instead of hanging it.
fn wake_race(port: u16, secs: u64) {
    /// A pause of 0 to ~200 µs: nothing, a spin, or a sleep (the peer then waits for us).
    fn pause(random: &mut Stream) {
        let mut pick = [0u8; 2];
        random.fill(&mut pick);
        match pick[0] % 4 {
            0 => {}
            1 => {
                let until = Instant::now() + Duration::from_micros(pick[1] as u64 / 8);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            2 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(pick[1] as u64 % 200)),
        }
    }
    fn size(random: &mut Stream) -> usize {
        let mut pick = [0u8; 4];
        random.fill(&mut pick);
        let value = u32::from_le_bytes(pick) as usize;
        match value % 3 {
            0 => value / 3 % 64 + 1,
            1 => value / 3 % 8192 + 1,
            _ => value / 3 % 200_000 + 1,
        }
    }
    pin_last_cpu();
    let stream = connect(port);
    let timeout = Some(Duration::from_secs(5));
    stream.set_write_timeout(timeout).unwrap();
    stream.set_read_timeout(timeout).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let sender = std::thread::spawn(move || {
        pin_last_cpu();
        let mut data = Stream(0x5DEE_CE66_D1CE_4E5B);
        let mut random = Stream(0x2545_F491_4F6C_DD1D);
        let mut sent = 0usize;
        let mut chunk = vec![0u8; 200_000];
        while Instant::now() < deadline {
            let n = size(&mut random);
            data.fill(&mut chunk[..n]);
            if let Err(e) = writer.write_all(&chunk[..n]) {
                panic!("write stalled after {sent} bytes: {e} (a lost wake-up?)");
            }
            sent += n;
            pause(&mut random);
        }
        writer.shutdown(Shutdown::Write).unwrap();
        sent
    });
    let mut reader = stream;
    let mut expected = Stream(0x5DEE_CE66_D1CE_4E5B);
    let mut random = Stream(0x9E37_79B9_7F4A_7C15);
    let mut buffer = vec![0u8; 200_000];
    let mut want = vec![0u8; 200_000];
    let mut received = 0usize;
    let mut reads = 0u64;
    loop {
        let len = size(&mut random);
        let n = match reader.read(&mut buffer[..len]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => panic!("read stalled after {received} bytes: {e} (a lost wake-up?)"),
        };
        expected.fill(&mut want[..n]);
        assert!(buffer[..n] == want[..n], "echo differs at {received}");
        received += n;
        reads += 1;
        pause(&mut random);
    }
    let sent = sender.join().unwrap();
    assert_eq!(received, sent, "echo length");
    println!("wake-race bytes {received} reads {reads}");
}

/// Edge-triggered EPOLLOUT across threads, as in a tokio runtime: a thread sleeps in
/// epoll_wait (EPOLLOUT|EPOLLET only) while the pipe is empty, so nothing is full when it goes
/// to sleep. Then the main thread writes until EAGAIN and reads the echo back with
/// nonblocking reads (no poll, no epoll): the pipe drains, and the sleeper must get its
/// EPOLLOUT edge, as with kernel TCP, instead of sleeping until its timeout.
fn epollout_thread(port: u16) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let mut stream = connect(port);
    // One round trip first: both sides are on shared memory before the test starts (the switch
    // itself may raise an EPOLLOUT edge).
    roundtrip(&mut stream, b"x");
    let fd = stream.as_raw_fd();
    set_nonblocking(fd);
    let epfd = check(
        // SAFETY: epoll_create1 takes no pointer.
        unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) } as isize,
        "epoll",
    ) as i32;
    let mut event = libc::epoll_event {
        events: (libc::EPOLLOUT | libc::EPOLLET) as u32,
        u64: 7,
    };
    check(
        // SAFETY: epoll_ctl reads one epoll_event, `event`, a live local.
        unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut event) } as isize,
        "epoll_ctl",
    );
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // SAFETY: epoll_wait writes at most 4 events into `events`, a live local array of 4.
    let n = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), 4, 5000) };
    assert!(
        n == 1 && events[0].events & libc::EPOLLOUT as u32 != 0,
        "a new connection must be writable"
    );
    let asleep = Arc::new(AtomicBool::new(false));
    let eagain_at = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let sleeper = {
        let asleep = asleep.clone();
        std::thread::spawn(move || {
            let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
            asleep.store(true, Ordering::SeqCst);
            // SAFETY: epoll_wait writes at most 4 events into `events`, a live local array of 4.
            let n = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), 4, 10_000) };
            (n, events[0].events, start.elapsed())
        })
    };
    while !asleep.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    // Let the sleeper spin out and sleep in the kernel.
    std::thread::sleep(Duration::from_millis(300));
    let chunk = vec![5u8; 16384];
    let mut sent = 0usize;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "writes never blocked");
        // SAFETY: write reads `chunk.len()` bytes of `chunk`, a live Vec.
        let n = unsafe { libc::write(fd, chunk.as_ptr().cast(), chunk.len()) };
        if n < 0 {
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EAGAIN)
            );
            eagain_at.store(start.elapsed().as_micros() as u64, Ordering::SeqCst);
            break;
        }
        sent += n as usize;
    }
    let mut received = 0usize;
    let mut buffer = vec![0u8; 65536];
    let deadline = Instant::now() + Duration::from_secs(20);
    while received < sent {
        assert!(
            Instant::now() < deadline,
            "echo stalled with {} bytes outstanding",
            sent - received
        );
        // SAFETY: read writes at most `buffer.len()` bytes into `buffer`, a live Vec.
        let n = unsafe { libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len()) };
        if n > 0 {
            assert!(buffer[..n as usize].iter().all(|&b| b == 5));
            received += n as usize;
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let drained = start.elapsed();
    let (n, got, woke) = sleeper.join().unwrap();
    // The sleeper's epoll_wait ends at 10 s anyway (and then sees the edge): it must have been
    // woken long before that.
    assert!(
        woke < drained + Duration::from_secs(3),
        "the sleeping thread was not woken: the pipe drained at {drained:?}, epoll_wait \
         returned {n} (events {got:#x}) only at {woke:?}"
    );
    let eagain = Duration::from_micros(eagain_at.load(Ordering::SeqCst));
    assert!(
        n == 1 && got & libc::EPOLLOUT as u32 != 0,
        "the sleeping thread got no EPOLLOUT after a write hit EAGAIN at {eagain:?} and the \
         pipe drained (epoll_wait returned {n} after {woke:?})"
    );
    assert!(
        woke >= eagain,
        "EPOLLOUT at {woke:?}, before the pipe was full at {eagain:?}"
    );
    // SAFETY: `epfd` is the epoll fd made above, ours; the sleeper that used it has been joined,
    // and it is closed once.
    unsafe { libc::close(epfd) };
    stream.shutdown(Shutdown::Write).unwrap();
    let _ = stream.set_nonblocking(false);
    assert_eq!(
        stream.read(&mut buffer).unwrap(),
        0,
        "expected EOF after half-close"
    );
}

/// The server SIGKILLs itself: reads must end with EOF or reset, writes with EPIPE or reset.
fn crash(port: u16) {
    let mut stream = connect(port);
    stream.write_all(b"x").unwrap();
    let mut buffer = [0u8; 16];
    match stream.read(&mut buffer) {
        Ok(0) => {}
        Ok(n) => panic!("read {n} bytes from a dead peer"),
        Err(e) => assert!(
            matches!(e.raw_os_error(), Some(libc::ECONNRESET)),
            "unexpected error {e}"
        ),
    }
    let chunk = vec![1u8; 65536];
    for _ in 0..10_000 {
        // SAFETY: send reads `chunk.len()` bytes of `chunk`, a live Vec.
        let rc = unsafe {
            libc::send(
                stream.as_raw_fd(),
                chunk.as_ptr().cast(),
                chunk.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if rc < 0 {
            let code = std::io::Error::last_os_error().raw_os_error();
            assert!(
                matches!(code, Some(libc::EPIPE | libc::ECONNRESET)),
                "unexpected send error {code:?}"
            );
            return;
        }
    }
    panic!("writes to a dead peer kept succeeding");
}

/// Full duplex with small messages: a thread sends `count` 64-byte messages, the main thread
/// reads the echo 64 bytes at a time and checks each.
fn small_messages(port: u16, count: usize) {
    let stream = connect(port);
    let mut writer = stream.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let mut source = Stream(0xA5A5_5A5A_1234_5678);
        let mut message = [0u8; 64];
        for _ in 0..count {
            source.fill(&mut message);
            writer.write_all(&message).unwrap();
        }
        writer.shutdown(Shutdown::Write).unwrap();
    });
    let mut reader = stream;
    let mut expected = Stream(0xA5A5_5A5A_1234_5678);
    let mut want = [0u8; 64];
    let mut got = [0u8; 64];
    for index in 0..count {
        reader.read_exact(&mut got).unwrap();
        expected.fill(&mut want);
        assert_eq!(got, want, "message {index} differs");
    }
    assert_eq!(reader.read(&mut got).unwrap(), 0, "expected EOF");
    sender.join().unwrap();
}

/// sockperf-style ping-pong of `trips` round trips: one 16-byte message at a time (a sequence
/// number and a checksum of it), sendto() then recvfrom() with an address buffer, the client
/// pinned to the last CPU so that the echo server runs on another one (the fast cross-CPU
/// hand-off). Every reply must be the message just sent, whole: a torn, stale, repeated or
/// shifted read fails the run.
fn ping_pong(port: u16, trips: u64) {
    pin_last_cpu();
    let stream = connect(port);
    stream.set_nodelay(true).unwrap();
    let fd = stream.as_raw_fd();
    let started = Instant::now();
    let cpu_before = process_cpu_seconds();
    let mut round_trips_ns: Vec<u64> = Vec::with_capacity(trips.min(10_000_000) as usize);
    let think = Duration::from_micros(
        std::env::var("SHM_PROBE_THINK_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    for sequence in 1..=trips {
        if !think.is_zero() {
            std::thread::sleep(think);
        }
        let trip_started = Instant::now();
        let mut message = [0u8; 16];
        message[..8].copy_from_slice(&sequence.to_be_bytes());
        message[8..].copy_from_slice(&(sequence.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
        // SAFETY: sendto reads 16 bytes of `message`, a live local of 16; a null address
        // of length 0 is allowed on a connected socket.
        let sent = unsafe { libc::sendto(fd, message.as_ptr().cast(), 16, 0, std::ptr::null(), 0) };
        assert_eq!(sent, 16, "sendto: {}", std::io::Error::last_os_error());
        let mut reply = [0u8; 16];
        let mut got = 0usize;
        while got < 16 {
            // SAFETY: sockaddr_storage is integers and bytes, for which all-zero bytes are
            // valid.
            let mut address: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            // SAFETY: recvfrom writes at most `16 - got` bytes into `reply[got..]`, which is
            // that long, and at most `len` (its size) bytes into `address`, a live local,
            // with the length into `len`.
            let n = unsafe {
                libc::recvfrom(
                    fd,
                    reply[got..].as_mut_ptr().cast(),
                    16 - got,
                    0,
                    (&mut address as *mut libc::sockaddr_storage).cast(),
                    &mut len,
                )
            };
            assert!(
                n > 0,
                "recvfrom returned {n}: {}",
                std::io::Error::last_os_error()
            );
            got += n as usize;
        }
        assert_eq!(
            reply,
            message,
            "reply to message {sequence} is not that message (sequence {} came back)",
            u64::from_be_bytes(reply[..8].try_into().unwrap())
        );
        round_trips_ns.push(trip_started.elapsed().as_nanos() as u64);
    }
    let elapsed = started.elapsed().as_secs_f64();
    round_trips_ns.sort_unstable();
    let percentile = |p: f64| {
        let index = ((round_trips_ns.len() as f64 - 1.0) * p).round() as usize;
        round_trips_ns.get(index).copied().unwrap_or(0) as f64 / 1000.0
    };
    // A ping-pong's one-way latency is half the round trip (sockperf reports it so).
    println!(
        "pingpong round-trips {trips} in {elapsed:.2} s p50_us {:.3} p99_us {:.3} client_cpu_s {:.4}",
        percentile(0.5) / 2.0,
        percentile(0.99) / 2.0,
        process_cpu_seconds() - cpu_before
    );
}

/// CPU time (user + system) this process used so far.
fn process_cpu_seconds() -> f64 {
    // SAFETY: rusage is plain integers, valid when zeroed; getrusage writes one into `usage`,
    // a live local.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Writes `mib` MiB without reading anything back (far more than a local record: only the
/// arena can hold it), then reads the whole echo and checks it.
fn burst_test(port: u16, mib: usize) {
    let mut stream = connect(port);
    let total = mib << 20;
    let mut data = vec![0u8; total];
    Stream(0x0BAD_CAFE_F00D_0001).fill(&mut data);
    stream.write_all(&data).unwrap();
    println!("buffered {total}");
    std::io::stdout().flush().unwrap();
    let mut back = vec![0u8; total];
    stream.read_exact(&mut back).unwrap();
    assert!(back == data, "echo of the burst differs");
    stream.shutdown(Shutdown::Write).unwrap();
    assert_eq!(stream.read(&mut [0u8; 1]).unwrap(), 0);
}

/// Against `crash-hold`: fill the chain toward a peer that stopped reading, see it die, wait
/// until its process is gone, then close (the library must give the records back).
fn crash_burst_test(port: u16, server_pid: u32) {
    let mut stream = connect(port);
    stream.write_all(b"x").unwrap();
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).unwrap();
    assert_eq!(&ack, b"k");
    let data = vec![0x5Au8; 2 << 20];
    stream.write_all(&data).unwrap();
    println!("buffered {}", data.len());
    std::io::stdout().flush().unwrap();
    match stream.read(&mut [0u8; 16]) {
        Ok(0) => {}
        Ok(n) => panic!("read {n} bytes from a peer that never wrote"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET), "unexpected {e}"),
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while process_exists(server_pid) {
        assert!(
            Instant::now() < deadline,
            "server {server_pid} still exists"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(stream);
}

/// True while the pid names a process that has not exited (zombies count as exited).
fn process_exists(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit(')')
                .next()
                .and_then(|rest| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => false,
    }
}

/// fds closed by paths other than close() (close_range, fclose) must not leave the library
/// believing that a later fd with the same number is the old connection.
fn stale(port: u16) {
    for how in ["close_range", "fclose"] {
        let mut stream = connect(port);
        roundtrip(&mut stream, how.as_bytes());
        let fd = stream.into_raw_fd();
        match how {
            "close_range" => {
                check(
                    // SAFETY: `fd` is ours (from `into_raw_fd`) and closed once; no pointer.
                    unsafe { libc::close_range(fd as u32, fd as u32, 0) } as isize,
                    "close_range",
                );
            }
            _ => {
                // SAFETY: `fd` is ours (from `into_raw_fd`) and handed to the FILE, which `fclose`
                // closes; the mode is a NUL-terminated literal.
                let file = unsafe { libc::fdopen(fd, c"r+".as_ptr()) };
                assert!(!file.is_null(), "fdopen");
                // SAFETY: `file` is the open FILE* fdopen returned (non-null, asserted), closed
                // once.
                check(unsafe { libc::fclose(file) } as isize, "fclose");
            }
        }
        // pipe() is not intercepted and takes the lowest free numbers: the old socket's.
        let mut pipe = [0; 2];
        // SAFETY: pipe writes two ints, into `pipe`, a live local array of two.
        check(unsafe { libc::pipe(pipe.as_mut_ptr()) } as isize, "pipe");
        assert!(
            pipe.contains(&fd),
            "pipe did not reuse fd {fd}: {pipe:?}; the test cannot check {how}"
        );
        check(
            // SAFETY: write reads 9 bytes of a 9-byte static literal.
            unsafe { libc::write(pipe[1], b"pipe-data".as_ptr().cast(), 9) },
            "write to pipe",
        );
        let mut back = [0u8; 9];
        let n = check(
            // SAFETY: read writes at most 9 bytes into `back`, a live local array of 9.
            unsafe { libc::read(pipe[0], back.as_mut_ptr().cast(), 9) },
            "read from pipe",
        );
        assert_eq!(
            &back[..n as usize],
            b"pipe-data",
            "{how}: the pipe read went elsewhere"
        );
        // SAFETY: the pipe's two fds are ours, each closed once.
        unsafe {
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
    }
}

fn many_connections(port: u16, count: usize) {
    let mut streams: Vec<TcpStream> = (0..count).map(|_| connect(port)).collect();
    for (index, stream) in streams.iter_mut().enumerate() {
        stream
            .write_all(format!("connection {index:05}").as_bytes())
            .unwrap();
    }
    for (index, stream) in streams.iter_mut().enumerate() {
        let expected = format!("connection {index:05}");
        let mut back = vec![0u8; expected.len()];
        stream.read_exact(&mut back).unwrap();
        assert_eq!(back, expected.as_bytes());
    }
    println!("open {} mapped {}", streams.len(), shm_mappings());
    std::io::stdout().flush().unwrap();
    // Benchmarks measure memory and idle CPU while the connections stay open.
    let hold: u64 = std::env::var("SHM_PROBE_HOLD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    std::thread::sleep(Duration::from_secs(hold));
    for stream in &streams {
        stream.shutdown(Shutdown::Write).unwrap();
    }
    for stream in &mut streams {
        let mut rest = [0u8; 1];
        assert_eq!(stream.read(&mut rest).unwrap(), 0);
    }
}
