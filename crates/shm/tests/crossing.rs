//! A shared-memory region belongs to exactly one connection (issue "Hardening", item 1).
//!
//! The rendezvous file's name carries the server address and the client's port, not the
//! client's address. A second client that connects from another address with the same port (a
//! local user without the library, or a remote client that happened to pick that ephemeral
//! port) must not be handed the first client's region: the server would read one client's
//! bytes on the other's connection and answer into the wrong one. Here the server accepts the
//! intruder first, while the victim's region file is waiting, so the old name-only match
//! attached the victim's region to the intruder's connection.
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::FromRawFd;
use std::time::Duration;

fn bind(fd: i32, ip: std::net::Ipv4Addr, port: u16) -> bool {
    let address = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: bind reads `len` bytes of `address`, a live local sockaddr_in of exactly that
    // size; a bad fd only fails.
    unsafe { libc::bind(fd, (&address as *const libc::sockaddr_in).cast(), len) == 0 }
}

fn local_port(fd: i32) -> u16 {
    // SAFETY: sockaddr_in is integers, for which all-zero bytes are valid; getsockname writes at
    // most `len` (its size) bytes into `address`, a live local, and the length into `len`.
    unsafe {
        let mut address: libc::sockaddr_in = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        libc::getsockname(
            fd,
            (&mut address as *mut libc::sockaddr_in).cast(),
            &mut len,
        );
        u16::from_be(address.sin_port)
    }
}

fn tcp_socket() -> i32 {
    // SAFETY: socket takes no pointer; the new fd is handed to the caller, its one owner.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    fd
}

/// A TCP socket bound to 127.0.0.2 on a port that is free on 127.0.0.1 too (the victim binds
/// it there next), and that port.
fn socket_on_second_loopback_address() -> (i32, u16) {
    for _ in 0..100 {
        let fd = tcp_socket();
        assert!(
            bind(fd, std::net::Ipv4Addr::new(127, 0, 0, 2), 0),
            "bind 127.0.0.2: {}",
            std::io::Error::last_os_error()
        );
        let port = local_port(fd);
        let check = tcp_socket();
        let free_on_first = bind(check, std::net::Ipv4Addr::LOCALHOST, port);
        // SAFETY: `check` is a socket this function opened and closes once; close takes no
        // pointer.
        unsafe { libc::close(check) };
        if free_on_first {
            return (fd, port);
        }
        // SAFETY: `fd` is likewise ours, closed once, and not returned.
        unsafe { libc::close(fd) };
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2 in 100 tries");
}

fn connect_fd(fd: i32, port: u16) -> TcpStream {
    let server = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect reads a live local sockaddr_in of the size given. `fd` comes from
    // `socket_on_second_loopback_address`, which hands it over to this function alone, so the
    // TcpStream may own (and close) it.
    unsafe {
        let rc = libc::connect(
            fd,
            (&server as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
        TcpStream::from_raw_fd(fd)
    }
}

#[test]
fn a_region_is_never_handed_to_a_connection_from_another_address_with_the_same_port() {
    require_root();
    // The server accepts only once both connections wait, so the intruder's (queued first) is
    // accepted while the victim's region file is there.
    let mut server = command(probe(), true);
    server
        .args(["serve", "thread", "2"])
        .env("SHM_PROBE_ACCEPT_WHEN_QUEUED", "2");
    let mut server = Running::spawn(server);
    let port: u16 = server.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .parse()
        .unwrap();

    // The intruder: no library, 127.0.0.2, some port P.
    let (fd, shared_port) = socket_on_second_loopback_address();
    let mut intruder = connect_fd(fd, port);
    intruder
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();

    // The victim: the library, 127.0.0.1, the same port P. It checks its own echo and that its
    // connection moved to shared memory.
    let mut victim = command(probe(), true);
    victim.args(["client", &port.to_string(), &format!("from:{shared_port}")]);
    let victim = Running::spawn(victim);

    // The intruder's request must come back to the intruder, over TCP, unchanged.
    let request = b"intruder request: nobody else may read this";
    intruder.write_all(request).unwrap();
    let mut echo = vec![0u8; request.len()];
    intruder
        .read_exact(&mut echo)
        .expect("the intruder's echo never came back: its connection was wired to another");
    assert_eq!(&echo, request);
    intruder.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    intruder.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "the intruder received another connection's bytes: {:?}",
        String::from_utf8_lossy(&rest)
    );

    let mut victim = victim;
    let line = victim.expect_line("ok ", Duration::from_secs(30));
    assert!(victim.wait(Duration::from_secs(10)).success(), "{line}");
    let summary = server.expect_line("served ", Duration::from_secs(30));
    assert!(
        summary.contains("attached 1 "),
        "exactly the victim's connection must be on shared memory: {summary}"
    );
    assert!(server.wait(Duration::from_secs(10)).success());
}
