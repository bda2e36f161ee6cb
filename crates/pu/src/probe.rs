//! Is a port still held on this PU? An agent asks before it releases one of its PU's ports
//! from the table: a socket bound but not listening (between bind() and listen(), or a client
//! bound to a fixed port) is invisible to the scan of listening sockets, but still holds the
//! port, and releasing it would let another PU bind it too.
//!
//! The probe binds the port itself, as one IPv6 dual-stack socket on `[::]:port` (falling back
//! to IPv4 `0.0.0.0:port` where IPv6 is off), with SO_REUSEADDR, and listens with a backlog
//! of one. It conflicts with every bind of the port on this PU (127.0.0.1, 0.0.0.0, ::1, [::], with
//! or without SO_REUSEADDR/SO_REUSEPORT), so if it binds, nothing here holds the port; and while
//! it is held, no app on this PU can bind the port, so the agent can release it without an app
//! slipping in between the check and the release. SO_REUSEADDR lets it bind over TIME_WAIT
//! sockets of a port closed a moment ago (those hold no port for a new bind); listening is
//! what keeps an app's own SO_REUSEADDR bind out. The bind hook lets it through: the port
//! belongs to the agent's own PU.
//!
//! Blind spot: a socket bound with SO_REUSEADDR and not (yet) listening does not conflict with
//! the probe (two SO_REUSEADDR sockets may share a port until one listens), so such a port is
//! released although that socket still holds it.
//!
//! Cost to apps: for the moment the probe holds a port (bind, the table delete, close: micro-
//! seconds, longer if the agent is preempted), a bind of that port on this PU fails with
//! EADDRINUSE, as it would against any socket on one host. Only ports nothing on the PU has held
//! for two polls are probed, so an app that restarts hits this only if its new bind falls in
//! that moment. Not built: counting a port's bound sockets in the kernel (the bind hook plus a
//! cgroup sock_release program), which would let the agent release without a probe.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use socket2::{Domain, Socket, Type};

/// Binds `port` on this PU if nothing here holds it. `Some(socket)`: it was free and is held
/// until the socket is dropped; `None`: something on this PU holds it.
pub fn hold_if_free(port: u16) -> std::io::Result<Option<Socket>> {
    let bound = match bind_dual_stack(port) {
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => bind_v4(port),
        other => other,
    };
    match bound {
        Ok(socket) => Ok(Some(socket)),
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => Ok(None),
        Err(e) => Err(e),
    }
}

fn bind_dual_stack(port: u16) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::IPV6, Type::STREAM, None)?;
    s.set_only_v6(false)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    s.listen(1)?;
    Ok(s)
}

fn bind_v4(port: u16) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
    s.listen(1)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn free_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    #[test]
    fn a_bound_socket_holds_the_port_even_before_listen() {
        let port = free_port();
        // Without SO_REUSEADDR: a bound, idle SO_REUSEADDR socket does not conflict with the
        // probe (see the module doc).
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)).into())
            .unwrap();
        assert!(hold_if_free(port).unwrap().is_none());
        drop(s);
        assert!(hold_if_free(port).unwrap().is_some());
    }

    #[test]
    fn while_held_no_bind_of_the_port_gets_through() {
        let port = free_port();
        let held = hold_if_free(port).unwrap().unwrap();
        for addr in ["127.0.0.1", "0.0.0.0"] {
            let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
            s.set_reuse_address(true).unwrap();
            s.set_reuse_port(true).unwrap();
            let e = s
                .bind(
                    &format!("{addr}:{port}")
                        .parse::<SocketAddr>()
                        .unwrap()
                        .into(),
                )
                .unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EADDRINUSE), "{addr}");
        }
        drop(held);
        let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        drop(l);
    }

    #[test]
    fn time_wait_does_not_hold_the_port() {
        // Leave a TIME_WAIT socket on the port: the server side closes first.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (s, _) = l.accept().unwrap();
        drop(s);
        drop(l);
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(c);
        assert!(hold_if_free(port).unwrap().is_some());
    }
}
