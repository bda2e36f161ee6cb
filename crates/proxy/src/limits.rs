//! Budgets that keep hostile or broken clients from exhausting the node (docs/config.md,
//! "limits"; docs/security.md, "Faults and attacks survived"):
//! - file descriptors: the soft `RLIMIT_NOFILE` is raised to the hard limit at start, every
//!   data-plane socket is counted, and new client connections are refused while fewer than
//!   `limits.reserved_fds` descriptors would stay free for the admin port and the process;
//! - connections: `limits.max_connections` for the whole node and
//!   `listeners[].limits.max_connections` for one listener, checked at accept;
//! - memory: bytes held in connection buffers for clients are reserved from a per-connection
//!   budget (`limits.per_connection_buffer_bytes`) and the node's (`limits.memory_budget_bytes`),
//!   and released when the bytes leave; over the node's budget, new connections are refused.
//!
//! A refused connection is closed at accept, at once, and counted by listener and reason
//! (`flatmesh_downstream_connections_refused_total`); the accept loop never waits on a budget.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use flatmesh_config::{Limits, Listener};
use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;

use crate::metrics::{counter, gauge};

/// What the budget of a new client connection covers at once: its read buffer as a request
/// head fills it (an idle HTTP/1.1 connection holds about 4 KiB in all: a 2 KiB buffer and its
/// task, BENCHMARKS.md `idle_connections`). The buffers it grows later are reserved as they
/// fill (HTTP/2 response data, the TCP relay's).
pub const CONNECTION_BASE_BYTES: usize = 16 * 1024;

/// Sockets the data plane must leave free whatever `limits.reserved_fds` says: past this
/// floor even upstream connects are refused, so that the admin port can always accept.
const FD_FLOOR: usize = 16;

/// The label set of a node-wide gauge.
const NO_LABELS: [(&str, &str); 0] = [];

/// Why a new client connection was refused; the `reason` label of the refusal counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refusal {
    /// Fewer than `limits.reserved_fds` descriptors would stay free.
    Fds,
    /// `limits.max_connections` connections are open on the node.
    NodeConnections,
    /// `listeners[].limits.max_connections` connections are open on this listener.
    ListenerConnections,
    /// The node's `limits.memory_budget_bytes` is spent.
    Memory,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::Fds => "fd_budget",
            Refusal::NodeConnections => "max_connections",
            Refusal::ListenerConnections => "listener_max_connections",
            Refusal::Memory => "memory_budget",
        }
    }
}

/// The process's file-descriptor limit, as found at start and as raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit the process started with.
    pub started: u64,
    /// The soft limit in force: the hard limit when raising it worked.
    pub soft: u64,
    pub hard: u64,
}

static FD_LIMIT: OnceLock<FdLimit> = OnceLock::new();

/// Data-plane sockets open in this process: client connections and upstream connections.
/// Process-wide on purpose: descriptors are a per-process resource, whatever node uses them.
static OPEN_SOCKETS: AtomicUsize = AtomicUsize::new(0);

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, once per process, and returns the limits.
/// A node at the common soft limit of 1,024 runs out of descriptors with a thousand idle
/// clients; the hard limit is usually far higher.
pub fn raise_fd_limit() -> FdLimit {
    *FD_LIMIT.get_or_init(|| {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let found = getrlimit(Resource::Nofile);
        // `None` is RLIM_INFINITY; descriptors are capped by the kernel's nr_open anyway.
        let cap = |v: Option<u64>| v.unwrap_or(1 << 20);
        let (started, hard) = (cap(found.current), cap(found.maximum));
        let soft = if started < hard {
            let raised = Rlimit {
                current: found.maximum,
                maximum: found.maximum,
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => hard,
                Err(err) => {
                    tracing::warn!(soft = started, hard, error = %err, "cannot raise the soft fd limit to the hard limit; the node serves fewer connections");
                    started
                }
            }
        } else {
            started
        };
        FdLimit {
            started,
            soft,
            hard,
        }
    })
}

/// The fd limit in force (raised first if nobody has yet).
pub fn fd_limit() -> FdLimit {
    raise_fd_limit()
}

/// Sockets the data plane may hold while leaving `reserved` descriptors free.
fn socket_budget(reserved: usize) -> usize {
    usize::try_from(fd_limit().soft)
        .unwrap_or(usize::MAX)
        .saturating_sub(reserved)
}

/// One open data-plane socket, counted until dropped.
#[derive(Debug)]
pub struct SocketSlot(());

impl Drop for SocketSlot {
    fn drop(&mut self) {
        OPEN_SOCKETS.fetch_sub(1, Ordering::Relaxed);
    }
}

fn take_socket() -> SocketSlot {
    OPEN_SOCKETS.fetch_add(1, Ordering::Relaxed);
    SocketSlot(())
}

/// A slot for a new upstream connection. Upstream connects are refused only at the last
/// [`FD_FLOOR`] descriptors: client connections are refused long before, at
/// `limits.reserved_fds`, which keeps room for the upstreams of the clients already in.
pub fn upstream_socket() -> std::io::Result<SocketSlot> {
    let budget = socket_budget(FD_FLOOR);
    if OPEN_SOCKETS.load(Ordering::Relaxed) >= budget {
        return Err(std::io::Error::other(format!(
            "the node's file descriptors are spent ({budget} sockets open); raise the hard `ulimit -n` or lower limits.max_connections"
        )));
    }
    Ok(take_socket())
}

/// Data-plane sockets open in this process.
pub fn open_sockets() -> usize {
    OPEN_SOCKETS.load(Ordering::Relaxed)
}

/// A byte budget: bytes taken are given back when their [`Reservation`] drops. Waiters are
/// woken whenever bytes come back.
#[derive(Debug, Default)]
pub struct ByteBudget {
    used: AtomicUsize,
    /// The most bytes taken at once since [`ByteBudget::take_peak`] last looked.
    peak: AtomicUsize,
    returned: tokio::sync::Notify,
}

impl ByteBudget {
    /// Takes `n` bytes if that keeps the budget within `limit`.
    pub fn try_take(self: &Arc<Self>, n: usize, limit: usize) -> Option<Reservation> {
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|after| *after <= limit)
            })
            .ok()?;
        self.peak.fetch_max(before + n, Ordering::Relaxed);
        Some(Reservation {
            budget: self.clone(),
            bytes: n,
        })
    }

    /// The peak since the last call, and the bytes taken now; the peak starts over from now.
    fn take_peak(&self) -> (usize, usize) {
        let now = self.used();
        (self.peak.swap(now, Ordering::Relaxed).max(now), now)
    }

    /// Waits until `n` bytes fit within `limit`, then takes them.
    pub async fn take(self: &Arc<Self>, n: usize, limit: usize) -> Reservation {
        // Most takes fit at once: no waiter to register for them.
        if let Some(r) = self.try_take(n, limit) {
            return r;
        }
        loop {
            let returned = self.returned.notified();
            tokio::pin!(returned);
            // Registered before the check: bytes given back after it still wake us.
            returned.as_mut().enable();
            if let Some(r) = self.try_take(n, limit) {
                return r;
            }
            returned.await;
        }
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// Bytes taken from a [`ByteBudget`], given back on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<ByteBudget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
            self.budget.returned.notify_waiters();
        }
    }
}

/// How often the node looks whether a burst has ended, and how much of its memory budget
/// must have come back since the peak for the freed heap to be handed back to the kernel.
const TRIM_CHECK: Duration = Duration::from_secs(2);
const TRIM_AFTER_FREED: usize = 1 << 20;

/// Hands the heap that a burst of connections left free back to the kernel, for as long as
/// the node runs. glibc's malloc keeps freed memory in its arenas (a burst of a few thousand
/// hostile streams left the node twice its resident size after they closed, measured by
/// `tests/h2_memory.rs`); `malloc_trim` returns it. It runs only when the memory budget's use
/// fell by [`TRIM_AFTER_FREED`] since its peak, or idle connections gave that much back
/// (`NodeBudget::count_idle_freed`), so a steady node never pays for it.
pub async fn trim_after_bursts(budget: Arc<NodeBudget>) {
    let mut tick = tokio::time::interval(TRIM_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (peak, now) = budget.memory.take_peak();
        let idle_freed = budget.idle_freed.swap(0, Ordering::Relaxed);
        if (peak - now) + idle_freed >= TRIM_AFTER_FREED {
            release_free_heap();
            tracing::debug!(
                peak,
                now,
                idle_freed,
                "burst over or connections idle; freed heap handed back to the kernel"
            );
        }
    }
}

/// `malloc_trim(0)`: glibc returns every whole free page of its heaps to the kernel.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn release_free_heap() {
    extern "C" {
        fn malloc_trim(pad: usize) -> std::os::raw::c_int;
    }
    // SAFETY: malloc_trim takes no pointer and has no precondition; it only gives free
    // pages of the allocator's own heaps back to the kernel, under the allocator's locks.
    unsafe {
        malloc_trim(0);
    }
}

/// Other allocators (musl's) give freed memory back by themselves.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_free_heap() {}

/// The node's budgets, shared by its workers: open client connections (node-wide and per
/// listener), the memory budget, and the refusals counted by listener and reason.
#[derive(Debug, Default)]
pub struct NodeBudget {
    connections: AtomicUsize,
    /// Per listener name: its open client connections.
    listeners: Mutex<BTreeMap<String, Arc<AtomicUsize>>>,
    pub memory: Arc<ByteBudget>,
    refused: Mutex<BTreeMap<(String, Refusal), u64>>,
    /// HTTP/2 streams the node reset or refused to bound a client, by reason.
    stream_resets: Mutex<BTreeMap<&'static str, u64>>,
    /// Heap bytes idle connections gave back since the trimmer last looked (the HTTP/2
    /// server's buffers), which it hands back to the kernel too.
    idle_freed: AtomicUsize,
}

/// A client connection let in: its share of every budget, given back when it drops.
#[derive(Debug)]
pub struct Admitted {
    _socket: SocketSlot,
    _memory: Reservation,
    node: Arc<NodeBudget>,
    listener: Arc<AtomicUsize>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.node.connections.fetch_sub(1, Ordering::Relaxed);
        self.listener.fetch_sub(1, Ordering::Relaxed);
    }
}

impl NodeBudget {
    pub fn new() -> Arc<NodeBudget> {
        Arc::new(NodeBudget::default())
    }

    /// An idle connection freed `bytes` of heap (`trim_after_bursts` returns them to the
    /// kernel once enough have been).
    pub fn count_idle_freed(&self, bytes: usize) {
        self.idle_freed.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The open-connection count of the listener called `name`.
    pub fn listener(&self, name: &str) -> Arc<AtomicUsize> {
        let mut listeners = self.listeners.lock();
        match listeners.get(name) {
            Some(open) => open.clone(),
            None => listeners.entry(name.to_owned()).or_default().clone(),
        }
    }

    /// Lets a new client connection of `listener` in, or says why not. Never waits. A
    /// refusal is counted; the caller closes the connection.
    pub fn admit(
        self: &Arc<Self>,
        listener: &Listener,
        open_on_listener: &Arc<AtomicUsize>,
        limits: &Limits,
    ) -> Result<Admitted, Refusal> {
        let admitted = self.try_admit(listener, open_on_listener, limits);
        if let Err(reason) = admitted {
            *self
                .refused
                .lock()
                .entry((listener.name.clone(), reason))
                .or_default() += 1;
        }
        admitted
    }

    fn try_admit(
        self: &Arc<Self>,
        listener: &Listener,
        open_on_listener: &Arc<AtomicUsize>,
        limits: &Limits,
    ) -> Result<Admitted, Refusal> {
        // The client's socket is already open; room for its upstream must stay.
        if OPEN_SOCKETS.load(Ordering::Relaxed) + 2 > socket_budget(limits.reserved_fds) {
            return Err(Refusal::Fds);
        }
        let socket = take_socket();
        let memory = self
            .memory
            .try_take(CONNECTION_BASE_BYTES, limits.memory_budget_bytes)
            .ok_or(Refusal::Memory)?;
        if self.connections.fetch_add(1, Ordering::Relaxed) >= limits.max_connections {
            self.connections.fetch_sub(1, Ordering::Relaxed);
            return Err(Refusal::NodeConnections);
        }
        let cap = listener
            .limits
            .max_connections
            .unwrap_or(limits.max_connections);
        if open_on_listener.fetch_add(1, Ordering::Relaxed) >= cap {
            open_on_listener.fetch_sub(1, Ordering::Relaxed);
            self.connections.fetch_sub(1, Ordering::Relaxed);
            return Err(Refusal::ListenerConnections);
        }
        Ok(Admitted {
            _socket: socket,
            _memory: memory,
            node: self.clone(),
            listener: open_on_listener.clone(),
        })
    }

    /// Counts an HTTP/2 stream reset or refused because of `reason` (`stalled`: its client
    /// took no data for `limits.stream_stall_timeout`; `memory_budget`: the node's is spent).
    pub fn count_stream_reset(&self, reason: &'static str) {
        *self.stream_resets.lock().entry(reason).or_default() += 1;
    }

    /// Client connections open on the node.
    pub fn open_connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// One line per limit for `/ready`: the fd limit as found and as raised, and what is in use.
    pub fn report(&self, limits: &Limits) -> String {
        let fd = fd_limit();
        let mut out = String::new();
        let raised = if fd.soft > fd.started {
            format!(" (raised from {})", fd.started)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "fd limit: {}{raised}, hard {}; {} data-plane sockets open, clients refused past {} (limits.reserved_fds: {})",
            fd.soft,
            fd.hard,
            open_sockets(),
            socket_budget(limits.reserved_fds),
            limits.reserved_fds
        );
        let _ = writeln!(
            out,
            "connections: {} open (limits.max_connections: {})",
            self.open_connections(),
            limits.max_connections
        );
        let _ = writeln!(
            out,
            "memory budget: {} bytes held (limits.memory_budget_bytes: {})",
            self.memory.used(),
            limits.memory_budget_bytes
        );
        out
    }

    /// The budgets' metrics, for `/metrics`.
    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let refused: Vec<_> = self
            .refused
            .lock()
            .iter()
            .map(|((listener, reason), n)| {
                (
                    [
                        ("listener", listener.clone()),
                        ("reason", reason.label().into()),
                    ],
                    *n,
                )
            })
            .collect();
        counter(
            enc,
            "flatmesh_downstream_connections_refused",
            "Client connections closed at accept because a budget was spent, by listener and reason",
            &refused,
        )?;
        let resets: Vec<_> = self
            .stream_resets
            .lock()
            .iter()
            .map(|(reason, n)| ([("reason", *reason)], *n))
            .collect();
        counter(
            enc,
            "flatmesh_http2_streams_reset",
            "HTTP/2 streams reset or refused by the node to bound a client, by reason",
            &resets,
        )?;
        let as_gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let fd = fd_limit();
        gauge(
            enc,
            "flatmesh_fd_limit",
            "The process's soft file-descriptor limit (RLIMIT_NOFILE), raised to the hard limit at start",
            &[(NO_LABELS, as_gauge(fd.soft))],
        )?;
        gauge(
            enc,
            "flatmesh_data_plane_sockets",
            "Data-plane sockets open (client and upstream connections)",
            &[(NO_LABELS, as_gauge(open_sockets() as u64))],
        )?;
        gauge(
            enc,
            "flatmesh_memory_budget_used_bytes",
            "Bytes held in connection buffers for clients, out of limits.memory_budget_bytes",
            &[(NO_LABELS, as_gauge(self.memory.used() as u64))],
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn listener(max: Option<usize>) -> Listener {
        Listener {
            name: "web".into(),
            address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            protocol: flatmesh_config::ListenerProtocol::Tcp,
            routes: vec![],
            cluster: Some("c".into()),
            limits: flatmesh_config::ListenerLimits {
                max_connections: max,
                ..Default::default()
            },
            normalize_path: None,
            merge_slashes: None,
            path_with_escaped_slashes_action: None,
            tls: None,
            authorization: None,
            hbone: None,
            rate_limit: None,
            connection_rate_limit: None,
            qnp: None,
        }
    }

    #[test]
    fn connections_past_the_node_or_listener_cap_are_refused_and_counted() {
        let node = NodeBudget::new();
        let limits = Limits {
            max_connections: 3,
            ..Limits::default()
        };
        let (a, b) = (listener(Some(2)), {
            let mut l = listener(None);
            l.name = "other".into();
            l
        });
        let (open_a, open_b) = (node.listener("web"), node.listener("other"));
        let first = node.admit(&a, &open_a, &limits).unwrap();
        let _second = node.admit(&a, &open_a, &limits).unwrap();
        assert_eq!(
            node.admit(&a, &open_a, &limits).unwrap_err(),
            Refusal::ListenerConnections
        );
        let _third = node.admit(&b, &open_b, &limits).unwrap();
        assert_eq!(
            node.admit(&b, &open_b, &limits).unwrap_err(),
            Refusal::NodeConnections
        );
        // A connection that ends makes room again.
        drop(first);
        let _again = node.admit(&a, &open_a, &limits).unwrap();
        assert_eq!(node.memory.used(), 3 * CONNECTION_BASE_BYTES);
        let refused = node.refused.lock().clone();
        assert_eq!(
            refused[&("web".to_string(), Refusal::ListenerConnections)],
            1
        );
        assert_eq!(refused[&("other".to_string(), Refusal::NodeConnections)], 1);
    }

    #[test]
    fn a_spent_memory_budget_refuses_new_connections() {
        let node = NodeBudget::new();
        let limits = Limits {
            memory_budget_bytes: CONNECTION_BASE_BYTES,
            ..Limits::default()
        };
        let l = listener(None);
        let open = node.listener("web");
        let _first = node.admit(&l, &open, &limits).unwrap();
        assert_eq!(node.admit(&l, &open, &limits).unwrap_err(), Refusal::Memory);
        assert_eq!(open.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_byte_budget_wakes_its_waiters_when_bytes_come_back() {
        let budget = Arc::new(ByteBudget::default());
        let held = budget.try_take(100, 100).unwrap();
        assert!(budget.try_take(1, 100).is_none());
        let waiter = {
            let budget = budget.clone();
            tokio::spawn(async move { budget.take(60, 100).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(held);
        let got = waiter.await.unwrap();
        assert_eq!(budget.used(), 60);
        drop(got);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn the_fd_limit_is_raised_to_the_hard_limit() {
        let fd = raise_fd_limit();
        assert!(fd.soft >= fd.started);
        assert_eq!(fd.soft, fd.hard, "{fd:?}");
        let now = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(now.current.unwrap_or(1 << 20), fd.soft);
    }
}
