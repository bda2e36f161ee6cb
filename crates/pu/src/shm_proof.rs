//! The proof service that lets hetero-socket (crates/shm) use shared memory between the PUs of
//! a split namespace (issue "HeteroK8s-Mesh end to end", item 1; docs/shm.md "Between PUs").
//!
//! An acceptor may attach a connector's region only if the kernel says its connection ends in
//! the connector's socket (the region holds that socket's cookie). Within one network namespace
//! the acceptor asks the socket table itself. Between PUs it cannot: the connector's socket is in
//! another network namespace, and the split namespace's NAT (docs/pu.md, `rules`) rewrote the
//! connection's addresses on the way. Each PU's agent runs this service, which can:
//!
//! 1. The acceptor sends the accepted socket itself (`SCM_RIGHTS`) and the cookie. The service
//!    reads the socket's addresses from the kernel and checks that it is a TCP socket of this PU.
//! 2. In this PU's connection tracking table, the entry whose replies carry those addresses
//!    says where the connection came from: another PU's link address.
//! 3. In that PU's table, the entry whose replies go to that address says what the connector's
//!    socket saw: its own local and remote address.
//! 4. That PU's socket table names the socket with those addresses; its cookie must be the
//!    region's.
//!
//! Any step that finds nothing is a no, and the connection stays TCP. The answer is one byte,
//! `y` or `n`. The service is control plane: it answers one acceptor at a time, waits at most
//! `CLIENT_WAIT` for a request, and an acceptor gives up after 250 ms (crates/shm/src/group.rs).

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use flatmesh_netlink::conntrack::Tuple;
use flatmesh_netlink::Netlink;
use socket2::{Domain, SockAddr, Socket, Type};

use crate::backend::PuBackend;
use crate::config::SplitConfig;
use crate::error::{PuError, Result};
use crate::topology::Topology;

/// How long the service waits for an acceptor's request once it has connected.
const CLIENT_WAIT: Duration = Duration::from_millis(50);
/// How often the service looks at its stop flag.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// How long after a PU's netlink sockets could not be opened they are tried again.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// The directory the PUs of a split namespace share for hetero-socket (`FLATMESH_SHM_GROUP`).
pub fn group_dir(config: &SplitConfig) -> PathBuf {
    config.table_dir().join("shm")
}

/// Creates the group directory and its `l/` (advertisements), writable by every user of the PUs
/// like /tmp (sticky: a user removes only its own names).
pub fn create_group_dir(dir: &Path) -> Result<()> {
    for path in [dir.to_path_buf(), dir.join("l")] {
        let io = |e| PuError::StateIo {
            path: path.clone(),
            source: e,
        };
        std::fs::create_dir_all(&path).map_err(io)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o1777)).map_err(io)?;
    }
    Ok(())
}

/// `<group>/intercept`: the split namespace's interception rules, for connectors (the library
/// reads it to know that a call to a service address will reach a proxy port on another PU).
pub fn intercept_path(dir: &Path) -> PathBuf {
    dir.join("intercept")
}

/// The interception rules in the library's format (crates/shm/src/group.rs reads it): a header
/// line, then one line per rule, `<proxy port> <ports, comma-separated, or *> <excluded
/// prefixes, comma-separated, or ->`. Rules with `proxy_uid` (apps on the proxy's own PU,
/// intercepted in one network namespace) are written too; the library leaves connections to a
/// proxy in its own network namespace on TCP.
pub fn intercept_text(rules: &[crate::config::InterceptConfig]) -> String {
    let mut text = String::from("flatmesh-pu intercept v1\n");
    for rule in rules {
        let list = |items: Vec<String>, none: &str| {
            if items.is_empty() {
                none.to_string()
            } else {
                items.join(",")
            }
        };
        let ports = list(rule.ports.iter().map(u16::to_string).collect(), "*");
        let exclude = list(
            rule.exclude
                .iter()
                .filter_map(|c| crate::config::Ipv4Prefix::parse(c))
                .map(|p| p.to_string())
                .collect(),
            "-",
        );
        text.push_str(&format!("{} {ports} {exclude}\n", rule.proxy_port));
    }
    text
}

/// Writes `<group>/intercept` (replacing a file anyone may have put there first: the directory
/// is world-writable), readable by all.
/// Every agent of the split namespace writes the same file, so each stages its copy under a
/// name of its own (`pu`) before the rename.
fn write_intercept(dir: &Path, pu: &str, rules: &[crate::config::InterceptConfig]) -> Result<()> {
    let path = intercept_path(dir);
    let io = |e| PuError::StateIo {
        path: path.clone(),
        source: e,
    };
    let staging = dir.join(format!(".intercept.{pu}.{}", std::process::id()));
    let _ = std::fs::remove_file(&staging);
    std::fs::write(&staging, intercept_text(rules)).map_err(io)?;
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o644)).map_err(io)?;
    std::fs::rename(&staging, &path).map_err(io)
}

/// `<group>/proof-<netns inode>`: the service of the PU whose network namespace has that inode
/// (the library finds its own PU's service by its own namespace's inode).
pub fn socket_path(dir: &Path, netns_inode: u64) -> PathBuf {
    dir.join(format!("proof-{netns_inode}"))
}

/// A PU's two tables, opened inside its network namespace.
struct Tables {
    sockets: Netlink,
    connections: Netlink,
}

impl Tables {
    fn open() -> std::io::Result<Tables> {
        Ok(Tables {
            sockets: Netlink::sock_diag()?,
            connections: Netlink::conntrack()?,
        })
    }
}

/// The service of PU `me`, bound and ready to serve.
pub struct ProofService<'a> {
    topo: Topology,
    me: usize,
    backend: &'a dyn PuBackend,
    listener: Socket,
    path: PathBuf,
    /// This PU's network namespace, as `SO_NETNS_COOKIE` names it.
    netns_cookie: u64,
    /// Each PU's tables, opened on first use; `Err(when)` after a failed open.
    tables: Vec<Option<std::result::Result<Tables, Instant>>>,
}

impl<'a> ProofService<'a> {
    /// Binds the service's socket. Must run on a thread inside PU `me` (the agent's).
    pub fn bind(
        config: &SplitConfig,
        me: usize,
        backend: &'a dyn PuBackend,
    ) -> Result<ProofService<'a>> {
        backend.check_on(me)?;
        let dir = group_dir(config);
        create_group_dir(&dir)?;
        write_intercept(&dir, &config.pus[me].name, &config.intercept)?;
        let (_, inode) = crate::netns::current_id()
            .map_err(|e| PuError::io("cannot identify this thread's network namespace", e))?;
        let path = socket_path(&dir, inode);
        let io = |what: &str, e| PuError::io(format!("{what} {}", path.display()), e);
        // This PU's agent lock is held (one agent per PU), so a name here is a dead service's.
        let _ = std::fs::remove_file(&path);
        let listener = Socket::new(Domain::UNIX, Type::SEQPACKET, None)
            .map_err(|e| io("cannot open the proof service socket", e))?;
        let address = SockAddr::unix(&path).map_err(|e| io("cannot name the socket", e))?;
        listener
            .bind(&address)
            .map_err(|e| io("cannot bind the proof service to", e))?;
        // Any process of the PU may ask (the answer tells only the holder of a connection
        // about that connection).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| io("cannot open up", e))?;
        listener.listen(64).map_err(|e| io("cannot listen on", e))?;
        listener
            .set_read_timeout(Some(STOP_CHECK))
            .map_err(|e| io("cannot set a timeout on", e))?;
        let netns_cookie = crate::netns::cookie()
            .map_err(|e| PuError::io("cannot read this network namespace's cookie", e))?;
        let topo = Topology::new(config);
        let tables = (0..topo.pus.len()).map(|_| None).collect();
        let mut service = ProofService {
            topo,
            me,
            backend,
            listener,
            path,
            netns_cookie,
            tables,
        };
        // Open every PU's tables now: entering a PU takes a while (its cpuset above all), and
        // an acceptor waits 250 ms at most. A PU that fails here is tried again on use.
        for pu in 0..service.topo.pus.len() {
            service.with_tables(pu, |_| Some(()));
        }
        Ok(service)
    }

    /// Answers acceptors until `stop` is set, then removes the socket's name.
    pub fn serve(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            let client = match self.listener.accept() {
                Ok((client, _)) => client,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    tracing::warn!(error = %e, "shm proof service: accept failed");
                    std::thread::sleep(STOP_CHECK);
                    continue;
                }
            };
            let proven = match receive(&client) {
                Some((connection, cookie)) => self.proven(&connection, cookie),
                None => false,
            };
            let _ = client.send(if proven { b"y" } else { b"n" });
        }
        let _ = std::fs::remove_file(&self.path);
    }

    /// Steps 1 to 4 of the module's comment; a refusal is logged (at debug) with its step.
    fn proven(&mut self, connection: &OwnedFd, cookie: u64) -> bool {
        match self.check(connection, cookie) {
            Ok(()) => true,
            Err(step) => {
                tracing::debug!(pu = %self.topo.pus[self.me], step, "shm proof refused");
                false
            }
        }
    }

    fn check(
        &mut self,
        connection: &OwnedFd,
        cookie: u64,
    ) -> std::result::Result<(), &'static str> {
        if cookie == 0
            || crate::netns::cookie_of(connection.as_fd()).ok() != Some(self.netns_cookie)
        {
            return Err("not a socket of this PU");
        }
        let socket = socket2::SockRef::from(connection);
        if !matches!(socket.r#type(), Ok(Type::STREAM)) {
            return Err("not a stream socket");
        }
        let (Some(local), Some(peer)) = (
            socket.local_addr().ok().and_then(|a| a.as_socket()),
            socket.peer_addr().ok().and_then(|a| a.as_socket()),
        ) else {
            return Err("no addresses");
        };
        let arrived = self
            .with_tables(self.me, |t| {
                t.connections.original_of_reply(Tuple {
                    source: local,
                    destination: peer,
                })
            })
            .ok_or("no tracked connection here")?;
        let origin = self
            .pu_at(arrived.source)
            .ok_or("the connection did not come from another PU")?;
        // The connector's PU saw the replies come from where the connection arrived here, to
        // the address it left from.
        let reply_there = Tuple {
            source: arrived.destination,
            destination: arrived.source,
        };
        let left = self
            .with_tables(origin, |t| t.connections.original_of_reply(reply_there))
            .ok_or("no tracked connection on the connector's PU")?;
        let found = self
            .with_tables(origin, |t| {
                t.sockets.cookie_of(left.source, left.destination)
            })
            .ok_or("no such socket on the connector's PU")?;
        if found == cookie {
            Ok(())
        } else {
            Err("another socket's cookie")
        }
    }

    /// The PU whose link address (on its link to this PU) is `address`'s.
    fn pu_at(&self, address: SocketAddr) -> Option<usize> {
        (0..self.topo.pus.len()).find(|&pu| {
            pu != self.me
                && self
                    .topo
                    .link_to(self.me, pu)
                    .is_some_and(|link| std::net::IpAddr::V4(link.peer_addr) == address.ip())
        })
    }

    /// Runs `f` on PU `pu`'s tables, opening them first (inside its network namespace, on a
    /// thread of its own) if need be.
    fn with_tables<T>(&mut self, pu: usize, f: impl FnOnce(&Tables) -> Option<T>) -> Option<T> {
        let retry = match &self.tables[pu] {
            None => true,
            Some(Err(failed)) => failed.elapsed() >= REOPEN_AFTER,
            Some(Ok(_)) => false,
        };
        if retry {
            let backend = self.backend;
            let opened = std::thread::scope(|scope| {
                scope
                    .spawn(|| -> std::result::Result<Tables, String> {
                        backend.enter_thread(pu).map_err(|e| e.to_string())?;
                        Tables::open().map_err(|e| e.to_string())
                    })
                    .join()
                    .unwrap_or_else(|_| Err("the thread panicked".to_string()))
            });
            self.tables[pu] = Some(opened.map_err(|e| {
                tracing::warn!(pu = %self.topo.pus[pu], error = %e, "shm proof service: cannot open the PU's socket and connection tables");
                Instant::now()
            }));
        }
        match &self.tables[pu] {
            Some(Ok(tables)) => f(tables),
            _ => None,
        }
    }
}

/// Reads one request: exactly eight bytes (the cookie) and exactly one descriptor. Every
/// descriptor received is owned (closed on drop), also those of a malformed request.
fn receive(client: &Socket) -> Option<(OwnedFd, u64)> {
    client.set_read_timeout(Some(CLIENT_WAIT)).ok()?;
    let mut body = [0u8; 16];
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    // Room for a few descriptors: more than one is refused, and each is closed.
    let mut control = [0u64; 8];
    // SAFETY: msghdr is integers and pointers, for which all-zero bytes are valid.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `message` points to live locals (`iov` over `body`, `control`) of the sizes it
    // gives; MSG_CMSG_CLOEXEC keeps received descriptors from leaking into children.
    let received =
        unsafe { libc::recvmsg(client.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC) };
    let mut descriptors = Vec::new();
    // SAFETY: the kernel filled `message.msg_control` with `msg_controllen` bytes of cmsg
    // headers; CMSG_FIRSTHDR/NXTHDR stay within them and return null at the end.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
                let bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    // Each received descriptor is new in this process and ours alone.
                    descriptors.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            header = libc::CMSG_NXTHDR(&message, header);
        }
    }
    let whole = received == 8 && message.msg_flags & (libc::MSG_CTRUNC | libc::MSG_TRUNC) == 0;
    if !whole || descriptors.len() != 1 {
        return None;
    }
    let cookie = u64::from_ne_bytes(body[..8].try_into().ok()?);
    Some((descriptors.pop()?, cookie))
}
