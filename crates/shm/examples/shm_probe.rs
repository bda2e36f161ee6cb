//! A small test program for the hetero-socket library: echo servers in several I/O styles and
//! clients that check socket semantics. The tests in `tests/semantics.rs` run it under
//! `LD_PRELOAD`; it uses only plain libc/std socket calls, like any unmodified program.
//!
//! ```text
//! shm_probe serve <thread|fork|epoll|poll|select> <connections>   prints "ready <port>", then
//!                                                                  "served <n> attached <k> ticks <t>"
//! shm_probe crash-serve                                            accepts one, reads a byte, SIGKILLs itself
//! shm_probe client <port> <integrity|dup|fork|nonblocking|crash|many:N>
//! ```
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
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
}

/// Shared-memory regions this process has mapped (connections the library accelerated).
fn shm_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("flatmesh-shm-"))
        .count()
}

fn check(rc: isize, what: &str) -> isize {
    if rc < 0 {
        panic!("{what}: {}", std::io::Error::last_os_error());
    }
    rc
}

fn set_nonblocking(fd: RawFd) {
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

// ---- servers -----------------------------------------------------------------------------

fn serve(mode: &str, connections: usize) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("ready {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (attached, ticks) = match mode {
        "thread" => serve_threads(&listener, connections),
        "fork" => serve_fork(&listener, connections),
        "epoll" | "poll" | "select" => serve_events(listener, connections, mode),
        _ => panic!("unknown mode {mode}"),
    };
    println!("served {connections} attached {attached} ticks {ticks}");
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
        let before = shm_mappings();
        let (stream, _) = listener.accept().unwrap();
        attached += usize::from(shm_mappings() > before);
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
        let before = shm_mappings();
        let (stream, _) = listener.accept().unwrap();
        attached += usize::from(shm_mappings() > before);
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            echo_blocking(stream);
            unsafe { libc::_exit(0) };
        }
        drop(stream);
        children.push(pid);
    }
    for pid in children {
        let mut status = 0;
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
    unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_NONBLOCK) };
    let ticker_fd = pipe[1];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_ticker = stop.clone();
    let ticker = std::thread::spawn(move || {
        while !stop_ticker.load(std::sync::atomic::Ordering::Relaxed) {
            unsafe { libc::write(ticker_fd, b"t".as_ptr().cast(), 1) };
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let epfd = if mode == "epoll" {
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
            "epoll" => {
                let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
                let n = check(
                    unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), 64, 1000) } as isize,
                    "epoll_wait",
                );
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
                    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, 1000) } as isize,
                    "poll",
                );
                ready.extend(fds.iter().filter(|p| p.revents != 0).map(|p| p.fd));
            }
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
                    let before = shm_mappings();
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
                    attached += usize::from(shm_mappings() > before);
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

fn crash_serve() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("ready {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut stream, _) = listener.accept().unwrap();
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte).unwrap();
    println!("attached {}", shm_mappings());
    std::io::stdout().flush().unwrap();
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
    TcpStream::connect(("127.0.0.1", port)).unwrap()
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
        "crash" => crash(port),
        many if many.starts_with("many:") => many_connections(port, many[5..].parse().unwrap()),
        _ => panic!("unknown test {test}"),
    }
    println!("ok {test} mapped {}", shm_mappings());
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
    let copy = unsafe { libc::dup(fd) };
    check(
        unsafe { libc::write(copy, b"via-dup".as_ptr().cast(), 7) },
        "write on dup",
    );
    unsafe { libc::close(fd) };
    let mut back = [0u8; 7];
    let mut got = 0;
    while got < 7 {
        got += check(
            unsafe { libc::read(copy, back[got..].as_mut_ptr().cast(), 7 - got) },
            "read on dup",
        ) as usize;
    }
    assert_eq!(&back, b"via-dup");
    let high = check(unsafe { libc::dup2(copy, 200) } as isize, "dup2") as RawFd;
    let mut stream = unsafe { TcpStream::from_raw_fd(high) };
    roundtrip(&mut stream, b"via-dup2");
    unsafe { libc::close(copy) };
    // Larger than one ring: the echo crosses both rings while this side still writes.
    roundtrip(&mut stream, &[5u8; 60_000]);
}

fn fork_test(port: u16) {
    let mut stream = connect(port);
    roundtrip(&mut stream, b"parent-before");
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        roundtrip(&mut stream, &[3u8; 60_000]);
        roundtrip(&mut stream, b"child");
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
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
    check(unsafe { libc::poll(&mut entry, 1, 5000) } as isize, "poll");
    assert!(entry.revents & libc::POLLIN != 0, "no echo within 5 s");
    let mut available: libc::c_int = 0;
    check(
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
        check(unsafe { libc::poll(&mut entry, 1, 5000) } as isize, "poll");
        assert!(
            entry.revents & libc::POLLIN != 0,
            "poll timed out with {} bytes outstanding",
            sent - received
        );
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
