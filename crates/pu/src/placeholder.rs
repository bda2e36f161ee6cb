//! Making "that port is taken on another PU" true for unmodified programs: for every port held by
//! another PU, the agent keeps a socket bound to it in its own PU. A later `bind()` of that port
//! here then fails with EADDRINUSE, exactly as on one host.
//!
//! The placeholder is one IPv6 dual-stack socket bound to `[::]:port` (falling back to IPv4
//! `0.0.0.0:port` where IPv6 is off), with SO_REUSEADDR, listening with a backlog of 1. It
//! conflicts with every bind of the port: 127.0.0.1, 0.0.0.0, ::1, [::], with or without
//! SO_REUSEADDR (the kernel never lets a second socket share a port with a *listening*
//! SO_REUSEADDR socket) and SO_REUSEPORT (the placeholder does not set it). It also keeps the port
//! out of this PU's ephemeral range.
//!
//! Why listening, with SO_REUSEADDR: a port that this PU used a moment ago may still have
//! TIME_WAIT sockets, and only SO_REUSEADDR lets the placeholder bind over them; a bound but
//! idle SO_REUSEADDR socket would then let an app's SO_REUSEADDR bind through, a listening one
//! does not. No packet reaches it: this PU's connections to 127.0.0.1:port are DNATed to the
//! owner before routing, and peers send only to the owner. The agent leaves its own placeholders
//! out of the ports it sees listening.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use socket2::{Domain, Socket, Type};

#[derive(Default)]
pub struct Placeholders {
    held: BTreeMap<u16, Socket>,
}

impl Placeholders {
    /// Binds a placeholder for `port`. An error means something in this PU already holds it.
    pub fn reserve(&mut self, port: u16) -> std::io::Result<()> {
        if self.held.contains_key(&port) {
            return Ok(());
        }
        let socket = match bind_dual_stack(port) {
            Ok(s) => s,
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
                s.set_reuse_address(true)?;
                s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
                s.listen(1)?;
                s
            }
            Err(e) => return Err(e),
        };
        self.held.insert(port, socket);
        Ok(())
    }

    /// Closes the placeholder of `port`, letting this PU bind it again.
    pub fn release(&mut self, port: u16) {
        self.held.remove(&port);
    }

    pub fn holds(&self, port: u16) -> bool {
        self.held.contains_key(&port)
    }

    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.held.keys().copied()
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
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

/// Raises this process's open-file limit to its hard limit (root: at least `want`), since an
/// agent holds one descriptor per port owned elsewhere.
pub fn raise_fd_limit(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the plain struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        let mut new = lim;
        new.rlim_max = new.rlim_max.max(want);
        new.rlim_cur = new.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &new) != 0 {
            // Not root: take what the hard limit allows.
            new.rlim_max = lim.rlim_max;
            new.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &new);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn placeholder_blocks_every_kind_of_bind() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut p = Placeholders::default();
        p.reserve(port).unwrap();
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
        p.release(port);
        let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        drop(l);
    }

    #[test]
    fn placeholder_binds_over_time_wait() {
        // Leave a TIME_WAIT socket on the port: the server side closes first.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (s, _) = l.accept().unwrap();
        drop(s);
        drop(l);
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(c);
        let mut p = Placeholders::default();
        p.reserve(port).unwrap();
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        let e = s
            .bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)).into())
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EADDRINUSE));
    }
}
