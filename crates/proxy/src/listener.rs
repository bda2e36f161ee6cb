//! Listening sockets: one SO_REUSEPORT socket per worker per listener, so the kernel spreads
//! new connections over shared-nothing workers without a shared accept queue.

use std::net::{SocketAddr, TcpListener};

use socket2::{Domain, Protocol, Socket, Type};

use crate::error::ProxyError;

const BACKLOG: i32 = 4096;

fn bind_one(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// Bind `count` sockets to `address`. Port 0 picks one ephemeral port for all of them.
/// Returns the bound address and the sockets.
pub fn bind_group(
    what: &str,
    address: SocketAddr,
    count: usize,
) -> Result<(SocketAddr, Vec<TcpListener>), ProxyError> {
    let err = |source| ProxyError::Bind {
        what: what.to_owned(),
        address,
        source,
    };
    let first = bind_one(address).map_err(err)?;
    let bound = first.local_addr().map_err(err)?;
    let mut sockets = vec![first];
    for _ in 1..count.max(1) {
        sockets.push(bind_one(bound).map_err(err)?);
    }
    Ok((bound, sockets))
}

/// A plain (non-reuseport) listener for the admin endpoint.
pub fn bind_admin(address: SocketAddr) -> Result<TcpListener, ProxyError> {
    let err = |source| ProxyError::Bind {
        what: "the admin endpoint".into(),
        address,
        source,
    };
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )
    .map_err(err)?;
    socket.set_reuse_address(true).map_err(err)?;
    socket.set_nonblocking(true).map_err(err)?;
    socket.bind(&address.into()).map_err(err)?;
    socket.listen(128).map_err(err)?;
    Ok(socket.into())
}
