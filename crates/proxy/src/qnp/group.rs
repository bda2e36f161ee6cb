//! What the node binds for one qnp listener: its SO_REUSEPORT group of UDP sockets and, with
//! tier K, the `sk_reuseport` dispatcher attached to the group.

use std::net::{SocketAddr, UdpSocket};

use flatmesh_qnp::kernel_rsd::{self, KernelProgram, KernelRsd};
use socket2::{Domain, Protocol, Socket, Type};

use super::QnpPlan;
use crate::error::ProxyError;

/// One socket of a qnp listener, for a node worker to serve.
pub struct QnpSocket {
    pub socket: UdpSocket,
    /// Kernel mode: the worker this socket's requests go to, decided by the kernel. `None`:
    /// the serving task decides each request in user space.
    pub queue: Option<u8>,
}

/// A qnp listener's bound sockets and its kernel dispatcher, owned by the node's control state.
pub struct QnpGroup {
    name: String,
    /// The bound address (the configured port may be 0).
    pub actual: SocketAddr,
    kernel: Option<KernelDispatch>,
}

/// Tier K's dispatcher of one listener, and the map contents installed in it.
struct KernelDispatch {
    rsd: KernelRsd,
    installed: KernelProgram,
    /// Sockets in the program's socket array: socket `q` is worker `q`'s.
    queues: usize,
}

fn bind_one(address: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    Ok(socket.into())
}

impl QnpGroup {
    /// Binds listener `name`'s sockets. With tier K asked for (`kernel`), loads the dispatcher
    /// with the plan's image and binds one socket per worker; if it cannot load or attach,
    /// says so once and binds (or keeps) sockets for user-space dispatch, one per node worker.
    pub fn bind(
        name: &str,
        address: SocketAddr,
        plan: &QnpPlan,
        node_workers: usize,
        kernel: bool,
    ) -> Result<(QnpGroup, Vec<QnpSocket>), ProxyError> {
        let err = |source| ProxyError::Bind {
            what: format!("qnp listener `{name}` (UDP)"),
            address,
            source,
        };
        let mut dispatcher = None;
        if kernel {
            match kernel_rsd::lower(&plan.rules.rules).and_then(|p| {
                let rsd = KernelRsd::load(&p)?;
                Ok((rsd, p))
            }) {
                Ok((rsd, installed)) => {
                    dispatcher = Some(KernelDispatch {
                        rsd,
                        installed,
                        queues: 0,
                    })
                }
                Err(e) => warn_user_space(name, &e),
            }
        }
        let count = match &dispatcher {
            Some(_) => plan.workers.len(),
            None => node_workers,
        }
        .max(1);
        let first = bind_one(address).map_err(err)?;
        let actual = first.local_addr().map_err(err)?;
        let mut sockets = vec![first];
        for _ in 1..count {
            sockets.push(bind_one(actual).map_err(err)?);
        }
        if let Some(k) = &mut dispatcher {
            let attached = sockets
                .iter()
                .enumerate()
                .try_for_each(|(q, s)| k.rsd.set_worker(q as u32, s))
                .and_then(|()| k.rsd.attach(&sockets[0]));
            match attached {
                Ok(()) => k.queues = sockets.len(),
                Err(e) => {
                    warn_user_space(name, &e);
                    dispatcher = None;
                }
            }
        }
        let in_kernel = dispatcher.is_some();
        if in_kernel {
            tracing::info!(listener = name, workers = count, "qnp: tier K dispatches the listener's requests (sk_reuseport, the rules' Matcher image)");
        }
        let sockets = sockets
            .into_iter()
            .enumerate()
            .map(|(q, socket)| QnpSocket {
                socket,
                queue: in_kernel.then_some(q as u8),
            })
            .collect();
        Ok((
            QnpGroup {
                name: name.to_owned(),
                actual,
                kernel: dispatcher,
            },
            sockets,
        ))
    }

    /// A reload, before the new snapshot is in force: in kernel mode, binds and registers a
    /// socket for each worker the plan adds (they join the group, so the program already
    /// covers them). Returns the new sockets for node workers to serve; they count as the
    /// group's once [`install`](Self::install) runs (a reload refused after this drops them,
    /// and a closed socket leaves the program's socket array by itself).
    pub fn grow(&mut self, plan: &QnpPlan) -> Result<Vec<QnpSocket>, ProxyError> {
        let Some(k) = &mut self.kernel else {
            return Ok(Vec::new());
        };
        let mut added = Vec::new();
        for q in k.queues..plan.workers.len() {
            let socket = bind_one(self.actual).map_err(|source| ProxyError::Bind {
                what: format!("qnp listener `{}` (UDP, worker {q})", self.name),
                address: self.actual,
                source,
            })?;
            k.rsd
                .set_worker(q as u32, &socket)
                .map_err(|e| ProxyError::Config(format!("qnp listener `{}`: {e}", self.name)))?;
            added.push(QnpSocket {
                socket,
                queue: Some(q as u8),
            });
        }
        Ok(added)
    }

    /// A reload, once the new snapshot is in force: in kernel mode, installs the plan's rules,
    /// app by app (each app's switch is atomic: a packet sees its old or its new entries).
    pub fn install(&mut self, plan: &QnpPlan) {
        let Some(k) = &mut self.kernel else {
            return;
        };
        k.queues = k.queues.max(plan.workers.len());
        let next = match kernel_rsd::lower(&plan.rules.rules) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(listener = %self.name, error = %e, "qnp: tier K keeps the listener's previous rules");
                return;
            }
        };
        let apps: std::collections::BTreeSet<u8> = k
            .installed
            .apps
            .keys()
            .chain(next.apps.keys())
            .copied()
            .collect();
        for app in apps {
            let entries = next.apps.get(&app).map_or(&[][..], Vec::as_slice);
            if k.installed.apps.get(&app).map_or(&[][..], Vec::as_slice) == entries {
                continue;
            }
            match k.rsd.install_app(app, entries) {
                Ok(()) if entries.is_empty() => {
                    k.installed.apps.remove(&app);
                }
                Ok(()) => {
                    k.installed.apps.insert(app, entries.to_vec());
                }
                Err(e) => {
                    tracing::error!(listener = %self.name, app, error = %e, "qnp: tier K keeps the app's previous rules");
                }
            }
        }
    }
}

fn warn_user_space(name: &str, e: &flatmesh_qnp::QnpError) {
    tracing::warn!(
        listener = name,
        "qnp: tier K cannot dispatch the listener's requests ({e}); they are dispatched in user space"
    );
}
