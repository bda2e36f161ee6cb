//! Semantic checks on a deserialized [`Config`]. Every problem is reported, each
//! with the config path it is about; `lib.rs` turns paths into line:column.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use crate::locate::Target;
use crate::model::*;
use crate::suggest;

pub const MAX_WORKERS: usize = 1024;
pub const MIN_HEADER_BYTES: usize = 1024;
pub const MAX_HEADER_BYTES: usize = 1024 * 1024;
pub const MAX_TOTAL_WEIGHT: u64 = 1_000_000;
pub const MAX_RETRY_ATTEMPTS: u32 = 10;
/// The lowest endpoint priority (0 is the highest); Envoy has no bound but 128 levels is plenty.
pub const MAX_PRIORITY: u32 = 127;
/// The largest `overprovisioning_factor`, in percent.
pub const MAX_OVERPROVISIONING: u32 = 1000;
/// `retries.budget.ratio`: retries may at most double the load.
pub const MAX_RETRY_BUDGET_RATIO: f64 = 1.0;
/// `retries.budget.min_per_s`.
pub const MAX_RETRY_BUDGET_MIN_PER_S: u32 = 100_000;
/// `retries.max_replay_body`: the hard bound on a body kept for a retry (1 MiB).
pub const MAX_REPLAY_BODY: u64 = 1024 * 1024;
/// Upper bound of connection counts (`limits.max_connections` and the like).
pub const MAX_CONNECTIONS: usize = 10_000_000;
/// The fewest file descriptors the data plane must leave to the admin port and the process.
pub const MIN_RESERVED_FDS: usize = 16;
pub const MAX_CONCURRENT_STREAMS: usize = 1 << 20;
/// One HTTP/2 frame of the default size: the smallest buffer or window worth having.
pub const MIN_BUFFER_BYTES: usize = 16 * 1024;
/// HTTP/2's initial connection window, which a connection window can only grow from.
pub const H2_DEFAULT_WINDOW: usize = 65_535;
/// HTTP/2's largest flow-control window (RFC 9113 §6.9.1).
pub const MAX_WINDOW: usize = (1 << 31) - 1;
pub const ACCESS_LOG_QUEUE_BYTES: std::ops::RangeInclusive<usize> = 64 * 1024..=1024 * 1024 * 1024;
pub const ACCESS_LOG_FIELD_BYTES: std::ops::RangeInclusive<usize> = 64..=64 * 1024;
/// An `original_dst` cluster's `max_destinations`.
pub const MAX_DESTINATIONS: u32 = 65_536;
/// `tracing.queue`, in spans.
pub const TRACING_QUEUE: std::ops::RangeInclusive<usize> = 16..=1_000_000;

/// Headers that frame the message or belong to one hop. Letting a route add or
/// remove them would let config break framing (request smuggling) or hop semantics.
const HOP_HEADERS: &[&str] = &[
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// One semantic problem, located by config path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// e.g. `listeners[0].routes[1].cluster`.
    pub path: String,
    pub target: Target,
    pub message: String,
    pub hint: String,
    /// For duplicates: the path of the first occurrence, cited in the hint.
    pub first: Option<String>,
}

impl std::fmt::Display for Problem {
    /// `listeners[0].routes[1].cluster: message` then `  hint: ...`, for configs
    /// that were built in code or came from elsewhere and have no file positions.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}\n  hint: {}", self.path, self.message, self.hint)
    }
}

/// Check everything; problems come back in the order they were found.
/// [`crate::parse`] calls this and adds file positions; call it directly to check
/// a `Config` built in code (an empty result means valid).
pub fn validate(config: &Config) -> Vec<Problem> {
    let mut check = Checker {
        config,
        problems: Vec::new(),
    };
    check.root();
    check.limits();
    check.listeners();
    check.clusters();
    check.kernel();
    check.workloads();
    check.problems
}

struct Checker<'a> {
    config: &'a Config,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn report(&mut self, path: impl Into<String>, target: Target, message: String, hint: String) {
        self.problems.push(Problem {
            path: path.into(),
            target,
            message,
            hint,
            first: None,
        });
    }

    fn report_duplicate(&mut self, path: String, first: String, message: String, hint: String) {
        self.problems.push(Problem {
            path,
            target: Target::Value,
            message,
            hint,
            first: Some(first),
        });
    }

    fn root(&mut self) {
        let config = self.config;
        if config.listeners.is_empty() {
            self.report(
                "listeners",
                Target::Key,
                "config has no listeners: it needs at least one listener".into(),
                "add a `listeners:` list, e.g. `listeners: [ { name: web, address: 127.0.0.1:8080, protocol: tcp, cluster: api } ]`".into(),
            );
        }
        if let Some(workers) = config.workers {
            if !(1..=MAX_WORKERS).contains(&workers) {
                self.report(
                    "workers",
                    Target::Value,
                    format!("workers is {workers}: it must be between 1 and {MAX_WORKERS}"),
                    "leave `workers` out to run one worker per core".into(),
                );
            }
        }
        if let Some(log) = &config.access_log {
            if log.path.trim().is_empty() {
                self.report(
                    "access_log.path",
                    Target::Value,
                    "access_log.path is empty".into(),
                    "write `stdout`, `stderr` or a file path, or remove `access_log` to log nothing".into(),
                );
            }
            for (key, value, range, default) in [
                (
                    "access_log.queue_bytes",
                    log.queue_bytes,
                    ACCESS_LOG_QUEUE_BYTES,
                    DEFAULT_ACCESS_LOG_QUEUE_BYTES,
                ),
                (
                    "access_log.max_field_bytes",
                    log.max_field_bytes,
                    ACCESS_LOG_FIELD_BYTES,
                    DEFAULT_ACCESS_LOG_MAX_FIELD_BYTES,
                ),
            ] {
                if !range.contains(&value) {
                    self.report(
                        key,
                        Target::Value,
                        format!(
                            "{key} is {value}: it must be between {} and {}",
                            range.start(),
                            range.end()
                        ),
                        format!("remove the key to use the default, {default}"),
                    );
                }
            }
        }
        if let Some(tracing) = &config.tracing {
            self.tracing(tracing);
        }
        crate::admin::check(&config.admin, &mut |path, message, hint| {
            self.report(path, Target::Value, message, hint)
        });
    }

    fn tracing(&mut self, tracing: &Tracing) {
        if !is_host_port(&tracing.otlp) {
            self.report(
                "tracing.otlp",
                Target::Value,
                format!(
                    "tracing.otlp is `{}`: it must be the collector's HOST:PORT",
                    tracing.otlp.escape_debug()
                ),
                "write the OTLP/gRPC address, e.g. `jaeger:4317` or `127.0.0.1:4317`".into(),
            );
        }
        if !(0.0..=1.0).contains(&tracing.sample) {
            self.report(
                "tracing.sample",
                Target::Value,
                format!(
                    "tracing.sample is {}: it must be between 0.0 and 1.0",
                    tracing.sample
                ),
                format!(
                    "write the share of new traces to sample (0.01 is 1%), or remove the key to use the default, {DEFAULT_TRACING_SAMPLE}"
                ),
            );
        }
        if tracing.service_name.trim().is_empty() {
            self.report(
                "tracing.service_name",
                Target::Value,
                "tracing.service_name is empty".into(),
                format!("name the node's service, or remove the key to use `{DEFAULT_TRACING_SERVICE_NAME}`"),
            );
        }
        if !TRACING_QUEUE.contains(&tracing.queue) {
            self.report(
                "tracing.queue",
                Target::Value,
                format!(
                    "tracing.queue is {}: it must be between {} and {} spans",
                    tracing.queue,
                    TRACING_QUEUE.start(),
                    TRACING_QUEUE.end()
                ),
                format!("remove the key to use the default, {DEFAULT_TRACING_QUEUE}"),
            );
        }
    }

    fn limits(&mut self) {
        let limits = &self.config.limits;
        if !(MIN_HEADER_BYTES..=MAX_HEADER_BYTES).contains(&limits.max_header_bytes) {
            self.report(
                "limits.max_header_bytes",
                Target::Value,
                format!(
                    "limits.max_header_bytes is {}: it must be between {MIN_HEADER_BYTES} (1 KiB) and {MAX_HEADER_BYTES} (1 MiB)",
                    limits.max_header_bytes
                ),
                "the default, 65536 (64 KiB), suits almost every client".into(),
            );
        }
        let timeouts = [
            ("header_read_timeout", limits.header_read_timeout),
            ("idle_timeout", limits.idle_timeout),
            ("connect_timeout", limits.connect_timeout),
            ("request_timeout", limits.request_timeout),
            ("stream_stall_timeout", limits.stream_stall_timeout),
            ("tcp_idle_timeout", limits.tcp_idle_timeout),
        ];
        for (name, value) in timeouts {
            self.positive_duration(&format!("limits.{name}"), value);
        }
        if self.config.drain_timeout > crate::duration::MAX {
            self.positive_duration("drain_timeout", self.config.drain_timeout);
        }
        self.budgets("limits", limits, &|_| true);
    }

    /// Range checks of the budgets and windows in `limits`, each reported at `at.KEY`, for
    /// the keys that `written` says were written there.
    fn budgets(&mut self, at: &str, limits: &Limits, written: &dyn Fn(&str) -> bool) {
        let defaults = Limits::default();
        // (key, value, least, most, the default)
        let sizes = [
            (
                "max_connections",
                limits.max_connections,
                1,
                MAX_CONNECTIONS,
                defaults.max_connections,
            ),
            (
                "max_upstream_per_downstream",
                limits.max_upstream_per_downstream,
                1,
                MAX_CONNECTIONS,
                defaults.max_upstream_per_downstream,
            ),
            (
                "reserved_fds",
                limits.reserved_fds,
                MIN_RESERVED_FDS,
                MAX_CONNECTIONS,
                defaults.reserved_fds,
            ),
            (
                "http2_max_concurrent_streams",
                limits.http2_max_concurrent_streams as usize,
                1,
                MAX_CONCURRENT_STREAMS,
                defaults.http2_max_concurrent_streams as usize,
            ),
            (
                "http2_stream_window",
                limits.http2_stream_window as usize,
                MIN_BUFFER_BYTES,
                MAX_WINDOW,
                defaults.http2_stream_window as usize,
            ),
            (
                "http2_connection_window",
                limits.http2_connection_window as usize,
                H2_DEFAULT_WINDOW,
                MAX_WINDOW,
                defaults.http2_connection_window as usize,
            ),
            (
                "per_connection_buffer_bytes",
                limits.per_connection_buffer_bytes,
                MIN_BUFFER_BYTES,
                usize::MAX,
                defaults.per_connection_buffer_bytes,
            ),
            (
                "memory_budget_bytes",
                limits.memory_budget_bytes,
                limits.per_connection_buffer_bytes.max(MIN_BUFFER_BYTES),
                usize::MAX,
                defaults.memory_budget_bytes,
            ),
        ];
        for (name, value, least, most, default) in sizes {
            if written(name) && !(least..=most).contains(&value) {
                let allowed = if most == usize::MAX {
                    format!("at least {least}")
                } else {
                    format!("between {least} and {most}")
                };
                self.report(
                    format!("{at}.{name}"),
                    Target::Value,
                    format!("{at}.{name} is {value}: it must be {allowed}"),
                    format!("the default, {default}, suits most nodes; remove the key to use it (docs/config.md explains each limit)"),
                );
            }
        }
    }

    fn positive_duration(&mut self, path: &str, value: Duration) {
        if value.is_zero() {
            self.report(
                path,
                Target::Value,
                format!("{path} is zero: a timeout must be longer than zero"),
                "write a positive duration such as `500ms` or `5s`, or remove the key to use the default".into(),
            );
        } else if value > crate::duration::MAX {
            // YAML durations are checked when read; this catches configs built in code or
            // translated from xDS.
            self.report(
                path,
                Target::Value,
                format!(
                    "{path} is {}s: longer than {}, the longest duration flatmesh accepts",
                    value.as_secs(),
                    crate::duration::MAX_TEXT
                ),
                "write a shorter duration such as `30s` or `1h`".into(),
            );
        }
    }

    fn listeners(&mut self) {
        let config = self.config;
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, listener) in config.listeners.iter().enumerate() {
            let at = format!("listeners[{i}]");
            let name = listener.name.as_str();
            if name.trim().is_empty() {
                self.report(
                    format!("{at}.name"),
                    Target::Value,
                    "listener name is empty".into(),
                    "give the listener a short name such as `web`; it labels metrics and logs"
                        .into(),
                );
            } else if let Some(first) = names.get(name) {
                self.report_duplicate(
                    format!("{at}.name"),
                    format!("listeners[{first}].name"),
                    format!("listener name `{name}` is used twice"),
                    "rename one of them: listener names must be unique".into(),
                );
            } else {
                names.insert(name, i);
            }

            self.listener_address(i, listener.address);
            self.listener_limits(i, listener);
            if let Some(tls) = &listener.tls {
                self.listener_tls(&format!("{at}.tls"), tls);
            }
            if let Some(authz) = &listener.authorization {
                self.authorization(&format!("{at}.authorization"), listener, authz);
            }

            match listener.protocol {
                ListenerProtocol::Http => self.http_listener(i, listener),
                ListenerProtocol::Tcp => self.tcp_listener(i, listener),
                ListenerProtocol::Hbone => self.hbone_listener(i, listener),
                ListenerProtocol::Qnp => self.qnp_listener(i, listener),
            }
            self.listener_rate_limits(&at, listener);
            if listener.hbone.is_some() && listener.protocol != ListenerProtocol::Hbone {
                self.report(
                    format!("{at}.hbone"),
                    Target::Key,
                    format!("listener `{name}` sets `hbone`, which only hbone listeners use"),
                    "remove it, or set `protocol: hbone` to accept HBONE tunnels".into(),
                );
            }
            if listener.qnp.is_some() && listener.protocol != ListenerProtocol::Qnp {
                self.report(
                    format!("{at}.qnp"),
                    Target::Key,
                    format!("listener `{name}` sets `qnp`, which only qnp listeners use"),
                    "remove it, or set `protocol: qnp` to dispatch QNP requests to local workers"
                        .into(),
                );
            }
        }
    }

    /// A listener's own `limits:`: the same ranges as the node's, a connection cap within
    /// the node's, and an answer buffer within the node's memory budget.
    fn listener_limits(&mut self, i: usize, listener: &Listener) {
        let node = &self.config.limits;
        let own = &listener.limits;
        let at = format!("listeners[{i}].limits");
        let effective = node.for_listener(listener);
        self.budgets(&at, &effective, &|key| match key {
            "per_connection_buffer_bytes" => own.per_connection_buffer_bytes.is_some(),
            "http2_max_concurrent_streams" => own.http2_max_concurrent_streams.is_some(),
            "http2_stream_window" => own.http2_stream_window.is_some(),
            "http2_connection_window" => own.http2_connection_window.is_some(),
            _ => false,
        });
        if let Some(timeout) = own.tcp_idle_timeout {
            self.positive_duration(&format!("{at}.tcp_idle_timeout"), timeout);
        }
        if own
            .per_connection_buffer_bytes
            .is_some_and(|n| n > node.memory_budget_bytes)
        {
            self.report(
                format!("{at}.per_connection_buffer_bytes"),
                Target::Value,
                format!(
                    "per_connection_buffer_bytes is {}, above the node's limits.memory_budget_bytes ({})",
                    effective.per_connection_buffer_bytes, node.memory_budget_bytes
                ),
                "lower it, or raise `limits.memory_budget_bytes`".into(),
            );
        }
        match own.max_connections {
            Some(0) => self.report(
                format!("{at}.max_connections"),
                Target::Value,
                "max_connections is 0: the listener could accept no connection".into(),
                "write a positive number, or remove the key to share `limits.max_connections`"
                    .into(),
            ),
            Some(n) if n > node.max_connections => self.report(
                format!("{at}.max_connections"),
                Target::Value,
                format!(
                    "max_connections is {n}, above the node's limits.max_connections ({}), which applies first",
                    node.max_connections
                ),
                format!(
                    "lower it to at most {}, or raise `limits.max_connections`",
                    node.max_connections
                ),
            ),
            _ => {}
        }
    }

    fn listener_address(&mut self, i: usize, address: SocketAddr) {
        let config = self.config;
        let path = format!("listeners[{i}].address");
        if let Some(first) = config.listeners[..i]
            .iter()
            .position(|other| addresses_clash(other.address, address))
        {
            self.report_duplicate(
                path,
                format!("listeners[{first}].address"),
                format!(
                    "listener address {address} clashes with listener `{}` ({})",
                    config.listeners[first].name, config.listeners[first].address
                ),
                "give each listener its own port".into(),
            );
        } else if let Some(first) = config.listeners[..i].iter().position(|other| {
            address.port() == 0
                && other.address == address
                && other.protocol == config.listeners[i].protocol
        }) {
            // The node tells its listeners apart by address and protocol; two that share both
            // (port 0 included) would be one listener.
            self.report_duplicate(
                path,
                format!("listeners[{first}].address"),
                format!(
                    "listener address {address} is the same as listener `{}`'s, with the same protocol: the node tells listeners apart by address and protocol, so they would be one",
                    config.listeners[first].name
                ),
                "give one of them another IP (127.0.0.2:0) or a port of its own".into(),
            );
        } else if config
            .admin
            .address
            .tcp()
            .is_some_and(|admin| addresses_clash(admin, address))
        {
            self.report(
                path,
                Target::Value,
                format!("listener address {address} clashes with the admin address {}", config.admin.address),
                "move the listener to another port, or set `admin:` to another address (default 127.0.0.1:15000)".into(),
            );
        }
    }

    fn http_listener(&mut self, i: usize, listener: &Listener) {
        let at = format!("listeners[{i}]");
        let name = &listener.name;
        if listener.routes.is_empty() {
            self.report(
                at.clone(),
                Target::Key,
                format!("http listener `{name}` has no routes"),
                "add `routes:` with at least one route, or use `protocol: tcp` with a `cluster:`"
                    .into(),
            );
        }
        if listener.cluster.is_some() {
            self.report(
                format!("{at}.cluster"),
                Target::Key,
                format!("http listener `{name}` sets `cluster`, which only tcp listeners use"),
                "send HTTP traffic with a route instead: `routes: [ { cluster: NAME } ]`".into(),
            );
        }
        for (j, route) in listener.routes.iter().enumerate() {
            self.route(&format!("{at}.routes[{j}]"), route);
        }
    }

    fn tcp_listener(&mut self, i: usize, listener: &Listener) {
        let at = format!("listeners[{i}]");
        let name = &listener.name;
        match &listener.cluster {
            None => self.report(
                at.clone(),
                Target::Key,
                format!("tcp listener `{name}` has no `cluster`"),
                "add `cluster: NAME`: every connection is relayed to that cluster".into(),
            ),
            Some(cluster) => self.cluster_ref(&format!("{at}.cluster"), cluster),
        }
        if !listener.routes.is_empty() {
            self.report(
                format!("{at}.routes"),
                Target::Key,
                format!("tcp listener `{name}` has routes, which only http listeners use"),
                "remove `routes`, or set `protocol: http` to route HTTP requests".into(),
            );
        }
        for (key, set) in [
            ("normalize_path", listener.normalize_path.is_some()),
            ("merge_slashes", listener.merge_slashes.is_some()),
            (
                "path_with_escaped_slashes_action",
                listener.path_with_escaped_slashes_action.is_some(),
            ),
        ] {
            if set {
                self.report(
                    format!("{at}.{key}"),
                    Target::Key,
                    format!("tcp listener `{name}` sets `{key}`, which only http listeners use"),
                    "remove it: a tcp listener relays bytes and reads no request path".into(),
                );
            }
        }
    }

    /// An `hbone` listener: mutual TLS is required (the tunnel's peers are known by their
    /// SPIFFE IDs), it routes nothing itself, and its destinations must parse.
    fn hbone_listener(&mut self, i: usize, listener: &Listener) {
        let at = format!("listeners[{i}]");
        let name = &listener.name;
        match &listener.tls {
            None => self.report(
                at.clone(),
                Target::Key,
                format!("hbone listener `{name}` has no `tls`: HBONE tunnels run inside mutual TLS"),
                "add `tls: { cert, key, client_ca, allow }` (docs/security.md, \"HBONE\")".into(),
            ),
            Some(tls) if tls.client_ca.is_none() => self.report(
                format!("{at}.tls"),
                Target::Key,
                format!("hbone listener `{name}` does not ask for client certificates: anyone could open a tunnel"),
                "add `client_ca: PATH` and `allow:` with the SPIFFE IDs of the nodes that may tunnel in".into(),
            ),
            Some(_) => {}
        }
        self.unused_keys(
            &at,
            &format!("hbone listener `{name}`"),
            &[
                ("cluster", listener.cluster.is_some()),
                ("routes", !listener.routes.is_empty()),
                ("normalize_path", listener.normalize_path.is_some()),
                ("merge_slashes", listener.merge_slashes.is_some()),
                (
                    "path_with_escaped_slashes_action",
                    listener.path_with_escaped_slashes_action.is_some(),
                ),
            ],
            "remove it: each tunnel goes to the destination its CONNECT names, within `hbone.destinations`",
        );
        let Some(hbone) = &listener.hbone else {
            return;
        };
        for (k, text) in hbone.destinations.iter().enumerate() {
            if let Err(why) = crate::destination::Destination::parse(text) {
                self.report(
                    format!("{at}.hbone.destinations[{k}]"),
                    Target::Value,
                    why,
                    "write an address block (10.0.0.0/8), an IP (10.0.0.7) or an IP:PORT (10.0.0.7:8080)".into(),
                );
            }
        }
    }

    /// Reports each of `keys` (name, whether it is set) that `listener` (e.g. "qnp listener
    /// `kv`") sets but does not use, with the same `fix`.
    fn unused_keys(&mut self, at: &str, listener: &str, keys: &[(&str, bool)], fix: &str) {
        for (key, _) in keys.iter().filter(|(_, set)| *set) {
            self.report(
                format!("{at}.{key}"),
                Target::Key,
                format!("{listener} sets `{key}`, which it does not use"),
                fix.into(),
            );
        }
    }

    /// A `qnp` listener: local workers to dispatch to (concrete, distinct, not the listener
    /// itself, at most [`QNP_MAX_WORKERS`]) and one source of rules, bounded. What the rules
    /// say (their syntax, their queues, whether they fit the Matcher's tables) is checked when
    /// they are compiled, at load and by `flatmesh check` (`flatmesh_qnp::listener`).
    fn qnp_listener(&mut self, i: usize, listener: &Listener) {
        let at = format!("listeners[{i}]");
        let name = &listener.name;
        self.unused_keys(
            &at,
            &format!("qnp listener `{name}`"),
            &[
                ("cluster", listener.cluster.is_some()),
                ("routes", !listener.routes.is_empty()),
                ("tls", listener.tls.is_some()),
                ("authorization", listener.authorization.is_some()),
                ("limits", !listener.limits.is_empty()),
                ("normalize_path", listener.normalize_path.is_some()),
                ("merge_slashes", listener.merge_slashes.is_some()),
                (
                    "path_with_escaped_slashes_action",
                    listener.path_with_escaped_slashes_action.is_some(),
                ),
            ],
            "remove it: a qnp listener sends each request to one of `qnp.workers`, picked by `qnp.rules`",
        );
        let Some(qnp) = &listener.qnp else {
            self.report(
                at,
                Target::Key,
                format!("qnp listener `{name}` has no `qnp` section"),
                "add `qnp: { workers: [ 127.0.0.1:7001, 127.0.0.1:7002 ], rules_file: kv.rules }` (docs/qnp.md, \"QNP in the node\")".into(),
            );
            return;
        };
        let at = format!("{at}.qnp");
        if qnp.workers.is_empty() {
            self.report(
                format!("{at}.workers"),
                Target::Value,
                format!("qnp listener `{name}` has no workers"),
                "list the UDP addresses of the local workers, e.g. `workers: [ 127.0.0.1:7001 ]`; a rule's `-> Q` sends to the Q-th (from 0)".into(),
            );
        } else if qnp.workers.len() > QNP_MAX_WORKERS {
            self.report(
                format!("{at}.workers"),
                Target::Value,
                format!(
                    "qnp listener `{name}` has {} workers, more than the {QNP_MAX_WORKERS} a dispatcher can choose from",
                    qnp.workers.len()
                ),
                format!("list at most {QNP_MAX_WORKERS} workers"),
            );
        }
        for (k, worker) in qnp.workers.iter().enumerate() {
            let path = format!("{at}.workers[{k}]");
            if worker.ip().is_unspecified() || worker.port() == 0 {
                self.report(
                    path,
                    Target::Value,
                    format!("worker {worker} cannot be sent to"),
                    "write the worker's concrete IP and port, e.g. 127.0.0.1:7001".into(),
                );
            } else if let Some(first) = qnp.workers[..k].iter().position(|w| w == worker) {
                self.report_duplicate(
                    path,
                    format!("{at}.workers[{first}]"),
                    format!("worker {worker} is listed twice"),
                    "list each worker once: its position is the queue number rules send to".into(),
                );
            } else if addresses_clash(listener.address, *worker) {
                self.report(
                    path,
                    Target::Value,
                    format!(
                        "worker {worker} is the listener's own address {}: requests would loop",
                        listener.address
                    ),
                    "give the worker its own port".into(),
                );
            }
        }
        match (&qnp.rules, &qnp.rules_file) {
            (Some(_), Some(_)) => self.report(
                format!("{at}.rules_file"),
                Target::Key,
                format!("qnp listener `{name}` sets both `rules` and `rules_file`"),
                "keep one: the rules inline, or the path of a rule file".into(),
            ),
            (None, None) => self.report(
                at.clone(),
                Target::Key,
                format!("qnp listener `{name}` has no rules: every request would be dropped"),
                "add `rules: |` with lines such as `rule 1 0 0 \"a\" -> 0` and `default 1 0 -> 1`, or `rules_file: PATH` (docs/qnp.md, \"Skip-and-check rules\")".into(),
            ),
            (Some(text), None) if text.len() > QNP_MAX_RULES_BYTES => self.report(
                format!("{at}.rules"),
                Target::Value,
                format!(
                    "the rules are {} bytes, more than {QNP_MAX_RULES_BYTES}",
                    text.len()
                ),
                "the Matcher's tables hold 512 entries: keep the rules that far shorter".into(),
            ),
            (_, Some(path)) if path.as_os_str().is_empty() => self.report(
                format!("{at}.rules_file"),
                Target::Value,
                "qnp.rules_file is empty".into(),
                "write the path of the rule file".into(),
            ),
            _ => {}
        }
        self.positive_duration(&format!("{at}.idle_timeout"), qnp.idle_timeout);
        if qnp.max_sessions == 0 || qnp.max_sessions > QNP_MAX_SESSIONS {
            self.report(
                format!("{at}.max_sessions"),
                Target::Value,
                format!(
                    "qnp.max_sessions is {}: it must be between 1 and {QNP_MAX_SESSIONS}",
                    qnp.max_sessions
                ),
                "leave it out for the default, 4096".into(),
            );
        }
    }

    /// The `kernel:` section names listeners; they must exist and have the right protocol.
    fn kernel(&mut self) {
        let config = self.config;
        let Some(kernel) = &config.kernel else {
            return;
        };
        for (key, path) in [
            ("kernel.pin_dir", kernel.pin_dir.as_ref()),
            ("kernel.cgroup_root", kernel.cgroup_root.as_ref()),
            (
                "kernel.capture.cgroup",
                kernel.capture.as_ref().map(|c| &c.cgroup),
            ),
        ] {
            if let Some(path) = path.filter(|p| !p.is_absolute()) {
                self.report(
                    key,
                    Target::Value,
                    format!("{key} `{}` is not an absolute path", path.display()),
                    match key {
                        "kernel.pin_dir" => {
                            "use a directory on bpffs, e.g. /sys/fs/bpf/flatmesh".into()
                        }
                        _ => "use a cgroup v2 directory, e.g. /sys/fs/cgroup/unified/workloads"
                            .into(),
                    },
                );
            }
        }
        if let Some(capture) = &kernel.capture {
            for (i, service) in capture.services.iter().enumerate() {
                let at = format!("kernel.capture.services[{i}].address");
                if let Some(first) = capture.services[..i]
                    .iter()
                    .position(|s| s.address == service.address)
                {
                    self.report_duplicate(
                        at,
                        format!("kernel.capture.services[{first}].address"),
                        format!("service address {} is captured twice", service.address),
                        "list each service address once; it goes to one listener".into(),
                    );
                    continue;
                }
                // connect4 can only send an IPv4 connection to an IPv4 address (and connect6
                // an IPv6 one): a listener of the other family cannot take it, except a
                // dual-stack [::] listener, which takes IPv4 on 127.0.0.1 too.
                let listener = config.listeners.iter().find(|l| l.name == service.listener);
                if let Some(l) = listener {
                    let dual_stack = l.address.is_ipv6() && l.address.ip().is_unspecified();
                    if !dual_stack && l.address.is_ipv4() != service.address.is_ipv4() {
                        self.report(
                            at,
                            Target::Value,
                            format!(
                                "service {} and listener `{}` ({}) are of different address families",
                                service.address, l.name, l.address
                            ),
                            "capture each service to a listener of its own family, or bind the listener to [::] (dual stack)".into(),
                        );
                    }
                }
            }
            if capture.services.is_empty() {
                self.report(
                    "kernel.capture.services",
                    Target::Value,
                    "kernel.capture has no services: nothing would be captured".into(),
                    "list the service addresses to capture, e.g. `services: [ { address: 10.96.0.10:80, listener: web } ]`, or remove `capture`".into(),
                );
            }
            for (i, service) in capture.services.iter().enumerate() {
                self.listener_ref(
                    &format!("kernel.capture.services[{i}].listener"),
                    &service.listener,
                    None,
                );
                if !service.plaintext_ok {
                    self.captured_leaves_in_a_tunnel(i, service);
                }
            }
        }
        let http: Vec<&str> = config
            .listeners
            .iter()
            .filter(|l| l.protocol == ListenerProtocol::Http)
            .map(|l| l.name.as_str())
            .collect();
        match &kernel.l7_listener {
            Some(name) => {
                self.listener_ref("kernel.l7_listener", name, Some(ListenerProtocol::Http));
                if config.listeners.iter().any(|l| l.name == *name && l.tls.is_some()) {
                    self.report(
                        "kernel.l7_listener",
                        Target::Value,
                        format!("listener `{name}` terminates TLS: the kernel would see ciphertext"),
                        "name a plaintext http listener, or set `l7_dispatch: false`".into(),
                    );
                }
            }
            None if kernel.l7_dispatch && http.is_empty() => self.report(
                "kernel.l7_dispatch",
                Target::Value,
                "kernel.l7_dispatch is on but there is no `http` listener to dispatch".into(),
                "add an http listener, or set `l7_dispatch: false`".into(),
            ),
            None if kernel.l7_dispatch && http.len() > 1 => self.report(
                "kernel.l7_dispatch",
                Target::Value,
                format!(
                    "kernel.l7_dispatch is on and there are {} http listeners; the kernel decides one listener's routes",
                    http.len()
                ),
                format!("add `l7_listener: NAME` to the kernel section (one of: {})", http.join(", ")),
            ),
            None => {}
        }
    }

    /// Captured traffic leaves the node only inside a tunnel: every cluster the service's
    /// listener sends to either tunnels or has only loopback endpoints (services on this
    /// host), unless the service says `plaintext_ok`.
    fn captured_leaves_in_a_tunnel(&mut self, i: usize, service: &CapturedService) {
        let config = self.config;
        let Some(listener) = config.listeners.iter().find(|l| l.name == service.listener) else {
            return;
        };
        let mut targets: Vec<&str> = listener.cluster.iter().map(String::as_str).collect();
        for route in &listener.routes {
            targets.extend(route.cluster.as_deref());
            targets.extend(route.split.iter().flatten().map(|w| w.cluster.as_str()));
            targets.extend(route.mirror.as_ref().map(|m| m.cluster.as_str()));
        }
        targets.sort_unstable();
        targets.dedup();
        for name in targets {
            let Some(cluster) = config.clusters.iter().find(|c| c.name == name) else {
                continue;
            };
            if cluster.tunnel.is_some() {
                continue;
            }
            // An original_dst cluster goes wherever its allow-list lets it.
            let remote = cluster
                .endpoints
                .iter()
                .find(|e| !e.ip().is_loopback())
                .map(|e| format!("endpoint {e}"))
                .or_else(|| {
                    cluster
                        .allow
                        .iter()
                        .find(|c| !c.is_loopback())
                        .map(|c| format!("allow-list prefix {c}"))
                });
            if let Some(remote) = remote {
                self.report(
                    format!("kernel.capture.services[{i}].listener"),
                    Target::Value,
                    format!(
                        "captured connections to {} would leave the node in the clear: listener `{}` sends them to cluster `{name}`, whose {remote} is not on this host's loopback",
                        service.address, listener.name
                    ),
                    format!("give cluster `{name}` `tunnel: hbone` (with `tls`) so they leave inside HBONE, or add `plaintext_ok: true` to this service if its destination is outside the mesh"),
                );
            }
        }
    }

    /// `workloads:`: unique names, a SPIFFE ID each, exactly one way to match, and the
    /// certificate of each workload whose identity the node presents.
    fn workloads(&mut self) {
        let config = self.config;
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut matches: HashMap<String, usize> = HashMap::new();
        for (i, w) in config.workloads.iter().enumerate() {
            let at = format!("workloads[{i}]");
            let name = w.name.as_str();
            if name.trim().is_empty() {
                self.report(
                    format!("{at}.name"),
                    Target::Value,
                    "workload name is empty".into(),
                    "give the workload a short name such as `cart`; it labels metrics and logs"
                        .into(),
                );
            } else if let Some(first) = names.get(name) {
                self.report_duplicate(
                    format!("{at}.name"),
                    format!("workloads[{first}].name"),
                    format!("workload name `{name}` is used twice"),
                    "rename one of them: workload names must be unique".into(),
                );
            } else {
                names.insert(name, i);
            }
            if let Err(hint) = principal_pattern(&w.identity).and_then(|()| {
                if w.identity.ends_with("/*") {
                    Err("a workload has one identity, not a pattern".into())
                } else {
                    Ok(())
                }
            }) {
                self.report(
                    format!("{at}.identity"),
                    Target::Value,
                    format!("`{}` is not a SPIFFE ID: {hint}", w.identity),
                    "write spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/SERVICE_ACCOUNT".into(),
                );
            }
            let m = &w.matches;
            let kinds = [m.cgroup.is_some(), m.uid.is_some(), m.port.is_some()];
            if kinds.iter().filter(|k| **k).count() != 1 {
                self.report(
                    format!("{at}.match"),
                    Target::Value,
                    format!("workload `{name}` must be matched by exactly one of `cgroup`, `uid` and `port`"),
                    "write one, e.g. `match: { uid: 1001 }`; declare the workload twice (two names) to match it two ways".into(),
                );
                continue;
            }
            let key = match (&m.cgroup, m.uid, m.port) {
                (Some(cgroup), _, _) => {
                    if !cgroup.is_absolute() {
                        self.report(
                            format!("{at}.match.cgroup"),
                            Target::Value,
                            format!("cgroup `{}` is not an absolute path", cgroup.display()),
                            "use a cgroup v2 directory, e.g. /sys/fs/cgroup/unified/workloads/cart"
                                .into(),
                        );
                    }
                    if config
                        .kernel
                        .as_ref()
                        .and_then(|k| k.capture.as_ref())
                        .is_none()
                    {
                        self.report(
                            format!("{at}.match.cgroup"),
                            Target::Value,
                            format!("workload `{name}` is matched by cgroup, which only tier K can see (the kernel records each captured connection's cgroup)"),
                            "add `kernel: { capture: ... }` with a capture cgroup that holds this one, or match the workload by `uid`".into(),
                        );
                    }
                    format!("cgroup {}", cgroup.display())
                }
                (None, Some(uid), _) => format!("uid {uid}"),
                (None, None, Some(port)) => {
                    if port == 0 {
                        self.report(
                            format!("{at}.match.port"),
                            Target::Value,
                            "port 0 is no port a workload listens on".into(),
                            "write the port the workload listens on".into(),
                        );
                    }
                    format!("port {port}")
                }
                (None, None, None) => unreachable!("one kind is set: checked above"),
            };
            if let Some(first) = matches.get(&key) {
                self.report_duplicate(
                    format!("{at}.match"),
                    format!("workloads[{first}].match"),
                    format!(
                        "{key} already names workload `{}`",
                        config.workloads[*first].name
                    ),
                    "match each workload differently: a connection must name one workload".into(),
                );
            } else {
                matches.insert(key, i);
            }
            match (&w.cert, &w.key) {
                (Some(cert), Some(key)) => {
                    self.file_path(&format!("{at}.cert"), cert);
                    self.file_path(&format!("{at}.key"), key);
                }
                (None, None) if !w.is_client() => {}
                (cert, _) => self.report(
                    format!("{at}.{}", if cert.is_none() { "cert" } else { "key" }),
                    Target::Key,
                    format!("workload `{name}` needs both `cert` and `key`: the node presents its identity for the connections it makes"),
                    format!("issue one, e.g. `flatmesh ca issue --dir ca/ --id {} --out certs/{name}`, and give `cert: certs/{name}.pem` and `key: certs/{name}.key`", w.identity),
                ),
            }
        }
    }

    /// `path` names a listener; report it when it does not exist or has the wrong protocol.
    fn listener_ref(&mut self, path: &str, name: &str, protocol: Option<ListenerProtocol>) {
        let listeners = &self.config.listeners;
        match listeners.iter().find(|l| l.name == name) {
            Some(l) if protocol.is_none_or(|p| p == l.protocol) => {}
            Some(_) => self.report(
                path,
                Target::Value,
                format!("listener `{name}` is not an http listener"),
                "the kernel's L7 dispatch reads HTTP/1.1 and gRPC requests: name an `http` listener"
                    .into(),
            ),
            None => {
                let defined: Vec<&str> = listeners.iter().map(|l| l.name.as_str()).collect();
                self.report(
                    path,
                    Target::Value,
                    format!("unknown listener `{name}`"),
                    format!(
                        "{}defined listeners: {}",
                        suggest::did_you_mean(name, defined.iter().copied()),
                        defined.join(", ")
                    ),
                );
            }
        }
    }

    fn cluster_ref(&mut self, path: &str, name: &str) {
        let clusters = &self.config.clusters;
        if clusters.iter().any(|c| c.name == name) {
            return;
        }
        let hint = if clusters.is_empty() {
            "no clusters are defined: add one under `clusters:`".to_string()
        } else {
            let defined: Vec<&str> = clusters.iter().map(|c| c.name.as_str()).collect();
            format!(
                "{}defined clusters: {}",
                suggest::did_you_mean(name, defined.iter().copied()),
                defined.join(", ")
            )
        };
        let what = if path.contains(".routes[") {
            "route"
        } else {
            "listener"
        };
        self.report(
            path,
            Target::Value,
            format!("{what} references unknown cluster `{name}`"),
            hint,
        );
    }

    fn route(&mut self, at: &str, route: &Route) {
        if let Some(limit) = &route.rate_limit {
            self.rate_limit(&format!("{at}.rate_limit"), limit);
        }
        let actions: Vec<&str> = [
            route.cluster.as_ref().map(|_| "cluster"),
            route.split.as_ref().map(|_| "split"),
            route.direct_response.as_ref().map(|_| "direct_response"),
        ]
        .into_iter()
        .flatten()
        .collect();
        match actions.as_slice() {
            [] => self.report(
                at,
                Target::Key,
                "route has no action: it needs one of `cluster`, `split`, `direct_response`".into(),
                "add `cluster: NAME` to forward matching requests".into(),
            ),
            [_] => {}
            [first, second, ..] => self.report(
                format!("{at}.{second}"),
                Target::Key,
                format!("route sets both `{first}` and `{second}`"),
                "a route does exactly one thing: keep one of `cluster`, `split`, `direct_response`"
                    .into(),
            ),
        }

        if let Some(cluster) = &route.cluster {
            self.cluster_ref(&format!("{at}.cluster"), cluster);
        }
        if let Some(split) = &route.split {
            self.split(&format!("{at}.split"), split);
        }
        if let Some(response) = &route.direct_response {
            if !(100..=599).contains(&response.status) {
                self.report(
                    format!("{at}.direct_response.status"),
                    Target::Value,
                    format!(
                        "direct_response status {} is not an HTTP status",
                        response.status
                    ),
                    "use a status between 100 and 599, e.g. 200 or 404".into(),
                );
            }
        }
        if let Some(timeout) = route.timeout {
            self.positive_duration(&format!("{at}.timeout"), timeout);
        }
        self.upgrades(at, route);
        self.fault_and_mirror(at, route);
        self.route_match(&format!("{at}.match"), &route.matches);
        self.headers_to_add(
            &format!("{at}.request_headers_to_add"),
            &route.request_headers_to_add,
        );
        self.headers_to_add(
            &format!("{at}.response_headers_to_add"),
            &route.response_headers_to_add,
        );
        for (k, name) in route.request_headers_to_remove.iter().enumerate() {
            self.header_name(
                &format!("{at}.request_headers_to_remove[{k}]"),
                Target::Value,
                name,
                true,
            );
        }
        if let Some(retries) = &route.retries {
            if retries.attempts > MAX_RETRY_ATTEMPTS {
                self.report(
                    format!("{at}.retries.attempts"),
                    Target::Value,
                    format!(
                        "retries.attempts is {}: at most {MAX_RETRY_ATTEMPTS} retries are allowed",
                        retries.attempts
                    ),
                    "a few retries (1 to 3) are enough; more only multiply load on a failing upstream".into(),
                );
            }
            if retries.on.is_empty() {
                self.report(
                    format!("{at}.retries.on"),
                    Target::Value,
                    "retries.on is empty, so nothing would be retried".into(),
                    "list at least one of connect-failure, reset, 5xx, gateway-error, unavailable, resource-exhausted, cancelled, deadline-exceeded, or remove `retries`".into(),
                );
            }
            self.retry_policy(&format!("{at}.retries"), retries);
        }
    }

    /// `retries`' per-try timeout, backoff, budget and replay size.
    fn retry_policy(&mut self, at: &str, retries: &crate::RetryPolicy) {
        if let Some(per_try) = retries.per_try_timeout {
            self.positive_duration(&format!("{at}.per_try_timeout"), per_try);
        }
        if let Some(backoff) = &retries.backoff {
            self.positive_duration(&format!("{at}.backoff.base"), backoff.base);
            if let Some(max) = backoff.max {
                self.positive_duration(&format!("{at}.backoff.max"), max);
                if max < backoff.base {
                    self.report(
                        format!("{at}.backoff.max"),
                        Target::Value,
                        format!(
                            "{at}.backoff.max ({}) is shorter than backoff.base ({})",
                            crate::duration::format(&max),
                            crate::duration::format(&backoff.base)
                        ),
                        "make `max` at least `base` (the default is 10 × base)".into(),
                    );
                }
            }
        }
        if let Some(budget) = &retries.budget {
            if !(0.0..=MAX_RETRY_BUDGET_RATIO).contains(&budget.ratio) {
                self.report(
                    format!("{at}.budget.ratio"),
                    Target::Value,
                    format!(
                        "{at}.budget.ratio is {}: it must be between 0 and {MAX_RETRY_BUDGET_RATIO}",
                        budget.ratio
                    ),
                    "write a share of the requests, such as 0.2 (the default: retries add at most 20% load)".into(),
                );
            }
            if budget.min_per_s > MAX_RETRY_BUDGET_MIN_PER_S {
                self.report(
                    format!("{at}.budget.min_per_s"),
                    Target::Value,
                    format!(
                        "{at}.budget.min_per_s is {}: at most {MAX_RETRY_BUDGET_MIN_PER_S} are allowed",
                        budget.min_per_s
                    ),
                    "a few retries per second (the default is 10) keep low-traffic clusters retried".into(),
                );
            }
        }
        if let Some(size) = retries.max_replay_body {
            if size > MAX_REPLAY_BODY {
                self.report(
                    format!("{at}.max_replay_body"),
                    Target::Value,
                    format!(
                        "{at}.max_replay_body is {size}: at most {MAX_REPLAY_BODY} bytes (1 MiB) of a body are kept for a retry"
                    ),
                    "keep it small (the default is 65536): every request in flight to the route may hold this much".into(),
                );
            }
        }
    }

    /// `upgrades`: protocol names (`websocket`, `name/version`), on routes that forward.
    fn upgrades(&mut self, at: &str, route: &Route) {
        if !route.upgrades.is_empty() && route.direct_response.is_some() {
            self.report(
                format!("{at}.upgrades"),
                Target::Key,
                "route answers with `direct_response` but lists `upgrades`".into(),
                "an upgrade needs an upstream to switch protocols: remove `upgrades`, or forward with `cluster`".into(),
            );
        }
        for (k, protocol) in route.upgrades.iter().enumerate() {
            let path = format!("{at}.upgrades[{k}]");
            if protocol.eq_ignore_ascii_case("h2c") {
                self.report(
                    path,
                    Target::Value,
                    "`h2c` cannot be listed in `upgrades`".into(),
                    "the proxy drops `Upgrade: h2c` and serves the request as HTTP/1.1 (as Envoy does); HTTP/2 clients connect with prior knowledge".into(),
                );
            } else if !is_protocol(protocol) {
                self.report(
                    path,
                    Target::Value,
                    format!("`{protocol}` is not an upgrade protocol name"),
                    "write a protocol as an `Upgrade` header names it, e.g. `websocket` (RFC 9110 §7.8: a token, optionally `/version`)".into(),
                );
            }
        }
    }

    /// `fault` and `mirror`: shares of 0 to 100, an abort that says one status, a delay that
    /// is not zero, a mirror cluster that exists; only on routes that forward.
    fn fault_and_mirror(&mut self, at: &str, route: &Route) {
        if route.direct_response.is_some() {
            for (set, key) in [
                (route.fault.is_some(), "fault"),
                (route.mirror.is_some(), "mirror"),
            ] {
                if set {
                    self.report(
                        format!("{at}.{key}"),
                        Target::Key,
                        format!("route answers with `direct_response` but sets `{key}`"),
                        format!("`{key}` acts on requests the route forwards: remove it, or forward with `cluster`"),
                    );
                }
            }
        }
        if let Some(fault) = &route.fault {
            let at = format!("{at}.fault");
            if fault.abort.is_none() && fault.delay.is_none() {
                self.report(
                    &at,
                    Target::Key,
                    "fault has neither `abort` nor `delay`, so it does nothing".into(),
                    "add `abort: { status: 503, percent: 10 }` or `delay: { duration: 1s, percent: 10 }`, or remove `fault`".into(),
                );
            }
            if let Some(abort) = &fault.abort {
                self.fault_abort(&format!("{at}.abort"), abort);
            }
            if let Some(delay) = &fault.delay {
                self.positive_duration(&format!("{at}.delay.duration"), delay.duration);
                self.percent(&format!("{at}.delay.percent"), delay.percent);
            }
        }
        if let Some(mirror) = &route.mirror {
            self.cluster_ref(&format!("{at}.mirror.cluster"), &mirror.cluster);
            self.percent(&format!("{at}.mirror.percent"), mirror.percent);
        }
    }

    fn fault_abort(&mut self, at: &str, abort: &crate::FaultAbort) {
        match (abort.status, abort.grpc_status) {
            (Some(_), Some(_)) => self.report(
                format!("{at}.grpc_status"),
                Target::Key,
                "fault.abort sets both `status` and `grpc_status`".into(),
                "keep one: `status` (gRPC clients get it mapped to a gRPC status) or `grpc_status`"
                    .into(),
            ),
            (None, None) => self.report(
                at,
                Target::Key,
                "fault.abort has no `status` or `grpc_status`".into(),
                "add `status: 503` (an HTTP status) or `grpc_status: 14` (a gRPC status code)"
                    .into(),
            ),
            (Some(status), None) if !(200..=599).contains(&status) => self.report(
                format!("{at}.status"),
                Target::Value,
                format!("fault.abort.status {status} is not a final HTTP status"),
                "use a status between 200 and 599, e.g. 503".into(),
            ),
            (None, Some(code)) if code == 0 || code > crate::MAX_GRPC_STATUS => self.report(
                format!("{at}.grpc_status"),
                Target::Value,
                format!("fault.abort.grpc_status {code} is not a gRPC error status"),
                format!(
                    "use a code from 1 (CANCELLED) to {} (UNAUTHENTICATED), e.g. 14 (UNAVAILABLE)",
                    crate::MAX_GRPC_STATUS
                ),
            ),
            _ => {}
        }
        self.percent(&format!("{at}.percent"), abort.percent);
    }

    /// A share of requests: a number from 0 to 100.
    fn percent(&mut self, path: &str, value: f64) {
        if !(0.0..=100.0).contains(&value) {
            self.report(
                path,
                Target::Value,
                format!("{path} is {value}: a share of requests is a percentage"),
                "write a number from 0 to 100, e.g. 10 or 0.5".into(),
            );
        }
    }

    fn split(&mut self, at: &str, split: &[WeightedCluster]) {
        if split.is_empty() {
            self.report(
                at,
                Target::Value,
                "split is empty".into(),
                "list weighted clusters, e.g. `split: [ { cluster: api, weight: 90 }, { cluster: canary, weight: 10 } ]`".into(),
            );
        }
        let mut total: u64 = 0;
        for (k, part) in split.iter().enumerate() {
            self.cluster_ref(&format!("{at}[{k}].cluster"), &part.cluster);
            if part.weight == 0 {
                self.report(
                    format!("{at}[{k}].weight"),
                    Target::Value,
                    format!("split weight for `{}` is 0", part.cluster),
                    "weights must be at least 1; remove the entry to send it nothing".into(),
                );
            }
            total += u64::from(part.weight);
        }
        if total > MAX_TOTAL_WEIGHT {
            self.report(
                at,
                Target::Key,
                format!("split weights add up to {total}, more than {MAX_TOTAL_WEIGHT}"),
                "weights are relative: scale them down, e.g. 90 and 10".into(),
            );
        }
    }

    fn route_match(&mut self, at: &str, m: &RouteMatch) {
        if let Some(host) = &m.host {
            if let Err(hint) = check_host(host) {
                self.report(
                    format!("{at}.host"),
                    Target::Value,
                    format!("host `{host}` is not a host name or `*.suffix` wildcard"),
                    hint,
                );
            }
        }
        if let Some(path) = &m.path {
            let (key, value) = match path {
                PathMatch::Exact(p) => ("exact", p),
                PathMatch::Prefix(p) => ("prefix", p),
                PathMatch::Regex(p) => ("regex", p),
            };
            let here = format!("{at}.path.{key}");
            if key == "regex" {
                self.regex(&here, value);
            } else if !value.starts_with('/') {
                self.report(
                    here,
                    Target::Value,
                    format!("path {key} `{value}` does not start with `/`"),
                    format!("request paths always start with `/`: write `/{value}`"),
                );
            }
        }
        if let Some(method) = &m.method {
            self.method(&format!("{at}.method"), method);
        }
        for (k, header) in m.headers.iter().enumerate() {
            let here = format!("{at}.headers[{k}]");
            self.header_name(&format!("{here}.name"), Target::Value, &header.name, false);
            self.named_match(&here, header);
        }
        for (k, query) in m.query.iter().enumerate() {
            let here = format!("{at}.query[{k}]");
            if query.name.is_empty() {
                self.report(
                    format!("{here}.name"),
                    Target::Value,
                    "query parameter name is empty".into(),
                    "write the parameter's name, e.g. `name: version`".into(),
                );
            }
            self.named_match(&here, query);
        }
        if let Some(field) = &m.grpc_field {
            self.grpc_field(&format!("{at}.grpc_field"), field);
        }
    }

    fn grpc_field(&mut self, at: &str, f: &GrpcFieldMatch) {
        if f.number == 0 || f.number > GRPC_FIELD_NUMBER_MAX {
            self.report(
                format!("{at}.number"),
                Target::Value,
                format!(
                    "field number {} is not a protobuf field number",
                    f.number
                ),
                format!("field numbers run from 1 to {GRPC_FIELD_NUMBER_MAX}: write the number the .proto file gives the field"),
            );
        }
        match (&f.exact, &f.prefix) {
            (None, None) => self.report(
                at,
                Target::Key,
                format!("grpc_field {} has no condition", f.number),
                "add one of `exact` or `prefix`".into(),
            ),
            (Some(_), Some(_)) => self.report(
                format!("{at}.prefix"),
                Target::Key,
                format!("grpc_field {} sets both `exact` and `prefix`", f.number),
                "keep one of `exact` and `prefix`".into(),
            ),
            _ => {}
        }
    }

    fn named_match(&mut self, at: &str, m: &NamedMatch) {
        let set: Vec<&str> = [
            m.exact.as_ref().map(|_| "exact"),
            m.prefix.as_ref().map(|_| "prefix"),
            m.present.as_ref().map(|_| "present"),
            m.regex.as_ref().map(|_| "regex"),
        ]
        .into_iter()
        .flatten()
        .collect();
        match set.as_slice() {
            [] => self.report(
                at,
                Target::Key,
                format!("match on `{}` has no condition", m.name),
                "add one of `exact`, `prefix`, `present: true`, `regex`".into(),
            ),
            [_] => {}
            [first, second, ..] => self.report(
                format!("{at}.{second}"),
                Target::Key,
                format!("match on `{}` sets both `{first}` and `{second}`", m.name),
                "keep exactly one of `exact`, `prefix`, `present`, `regex`; use two entries to require both".into(),
            ),
        }
        if let Some(regex) = &m.regex {
            self.regex(&format!("{at}.regex"), regex);
        }
    }

    fn regex(&mut self, path: &str, pattern: &str) {
        if let Err(error) = regex::Regex::new(pattern) {
            self.report(
                path,
                Target::Value,
                format!(
                    "regex `{pattern}` does not compile: {}",
                    regex_reason(&error)
                ),
                "fix the pattern (Rust `regex` syntax: no look-around or backreferences)".into(),
            );
        }
    }

    fn method(&mut self, path: &str, method: &str) {
        const KNOWN: &[&str] = &[
            "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
        ];
        let upper = method.to_ascii_uppercase();
        if http::Method::from_bytes(method.as_bytes()).is_err() {
            self.report(
                path,
                Target::Value,
                format!("method `{method}` is not a valid HTTP method"),
                "write a method name such as GET or POST".into(),
            );
        } else if upper != method && KNOWN.contains(&upper.as_str()) {
            // Methods are case-sensitive: `get` would never match a real GET.
            self.report(
                path,
                Target::Value,
                format!("method `{method}` is lowercase, so it would never match `{upper}`"),
                format!("HTTP methods are case-sensitive: write `{upper}`"),
            );
        }
    }

    fn header_name(&mut self, path: &str, target: Target, name: &str, changes_it: bool) {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            self.report(
                path,
                target,
                format!("`{name}` is not a valid HTTP header name"),
                "header names are letters, digits and !#$%&'*+-.^_`|~ (no spaces or colons), e.g. `x-request-id`".into(),
            );
        } else if changes_it && HOP_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            self.report(
                path,
                target,
                format!("header `{name}` cannot be added or removed by a route"),
                "it frames the message or belongs to one hop; the proxy manages it itself".into(),
            );
        }
    }

    fn headers_to_add(&mut self, at: &str, headers: &BTreeMap<String, String>) {
        for (name, value) in headers {
            let path = format!("{at}.{name}");
            self.header_name(&path, Target::Key, name, true);
            if http::HeaderValue::from_str(value).is_err() {
                self.report(
                    path,
                    Target::Value,
                    format!("value of header `{name}` is not a valid HTTP header value"),
                    "header values are visible ASCII, spaces and tabs: no line breaks or control characters".into(),
                );
            }
        }
    }

    fn clusters(&mut self) {
        let config = self.config;
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, cluster) in config.clusters.iter().enumerate() {
            let at = format!("clusters[{i}]");
            let name = cluster.name.as_str();
            if name.trim().is_empty() {
                self.report(
                    format!("{at}.name"),
                    Target::Value,
                    "cluster name is empty".into(),
                    "give the cluster a short name such as `api`; routes refer to it by name"
                        .into(),
                );
            } else if let Some(first) = names.get(name) {
                self.report_duplicate(
                    format!("{at}.name"),
                    format!("clusters[{first}].name"),
                    format!("cluster name `{name}` is used twice"),
                    "rename one of them, or merge their endpoints: cluster names must be unique"
                        .into(),
                );
            } else {
                names.insert(name, i);
            }
            if cluster.kind == ClusterType::OriginalDst {
                self.original_dst(&at, cluster);
            } else if cluster.endpoints.is_empty() {
                self.report(
                    format!("{at}.endpoints"),
                    Target::Value,
                    format!("cluster `{name}` has no endpoints"),
                    "list at least one upstream address, e.g. `endpoints: [ 127.0.0.1:9001 ]` (or write `type: original_dst` with an `allow:` list to send each connection where its client dialled)"
                        .into(),
                );
            } else {
                for key in [
                    (!cluster.allow.is_empty()).then_some("allow"),
                    cluster.max_destinations.map(|_| "max_destinations"),
                ]
                .into_iter()
                .flatten()
                {
                    self.report(
                        format!("{at}.{key}"),
                        Target::Key,
                        format!("cluster `{name}` sets `{key}`, which only an `original_dst` cluster has"),
                        format!("write `type: original_dst` (and remove `endpoints`), or remove `{key}`"),
                    );
                }
            }
            for (k, endpoint) in cluster.endpoints.iter().enumerate() {
                if endpoint.port() == 0 || endpoint.ip().is_unspecified() {
                    self.report(
                        format!("{at}.endpoints[{k}]"),
                        Target::Value,
                        format!("endpoint {endpoint} cannot be connected to"),
                        "an endpoint needs a concrete IP address and a non-zero port, e.g. 127.0.0.1:9001".into(),
                    );
                }
            }
            if let Some(hash_on) = &cluster.hash_on {
                if !matches!(cluster.lb, LbPolicy::RingHash | LbPolicy::Maglev) {
                    self.report(
                        format!("{at}.hash_on"),
                        Target::Key,
                        format!("cluster `{name}` sets `hash_on` but its lb policy does not hash"),
                        "set `lb: ring_hash` or `lb: maglev`, or remove `hash_on`".into(),
                    );
                }
                self.header_name(
                    &format!("{at}.hash_on.header"),
                    Target::Value,
                    &hash_on.header,
                    false,
                );
            }
            if let Some(timeout) = cluster.connect_timeout {
                self.positive_duration(&format!("{at}.connect_timeout"), timeout);
            }
            if let Some(tls) = &cluster.tls {
                self.cluster_tls(&format!("{at}.tls"), tls);
            }
            self.cluster_tunnel(&at, cluster);
            if let Some(breaker) = &cluster.circuit_breaker {
                self.circuit_breaker(&format!("{at}.circuit_breaker"), breaker);
            }
            if let Some(outlier) = &cluster.outlier_detection {
                self.outlier_detection(&format!("{at}.outlier_detection"), outlier);
            }
            if let Some(check) = &cluster.health_check {
                self.health_check(&format!("{at}.health_check"), check, cluster.tls.is_some());
            }
            self.endpoint_weights(&at, cluster);
        }
        if let Some(locality) = self.config.node.as_ref().and_then(|n| n.locality.as_ref()) {
            self.locality("node.locality", locality);
        }
    }

    /// An `original_dst` cluster: an allow-list and no endpoints, and none of the settings
    /// that only mean something for a list of endpoints.
    fn original_dst(&mut self, at: &str, cluster: &Cluster) {
        let name = cluster.name.as_str();
        if cluster.allow.is_empty() {
            self.report(
                format!("{at}.type"),
                Target::Value,
                format!("cluster `{name}` is `type: original_dst` and has no `allow` list: it would forward to any address a client dials"),
                "list the destination prefixes it may forward to, e.g. `allow: [ 10.0.0.0/8 ]`".into(),
            );
        }
        if !cluster.endpoints.is_empty() {
            self.report(
                format!("{at}.endpoints"),
                Target::Key,
                format!("cluster `{name}` is `type: original_dst`: each connection goes to the address its client dialled, so it has no endpoints"),
                "remove `endpoints`, or remove `type: original_dst`".into(),
            );
        }
        if let Some(n) = cluster.max_destinations {
            if !(1..=MAX_DESTINATIONS).contains(&n) {
                self.report(
                    format!("{at}.max_destinations"),
                    Target::Value,
                    format!("max_destinations is {n}: it must be between 1 and {MAX_DESTINATIONS}"),
                    format!("leave it out for the default, {DEFAULT_MAX_DESTINATIONS}"),
                );
            }
        }
        if cluster.protocol == UpstreamProtocol::Http2 {
            self.report(
                format!("{at}.protocol"),
                Target::Value,
                format!("cluster `{name}` is `type: original_dst`, which speaks HTTP/1.1 (or bytes, from a tcp listener) upstream"),
                "remove `protocol: http2`".into(),
            );
        }
        let unsupported = [
            ("hash_on", cluster.hash_on.is_some()),
            ("tls", cluster.tls.is_some()),
            ("tunnel", cluster.tunnel.is_some()),
            ("tunnel_port", cluster.tunnel_port.is_some()),
            ("outlier_detection", cluster.outlier_detection.is_some()),
            ("health_check", cluster.health_check.is_some()),
            ("slow_start", cluster.slow_start.is_some()),
            (
                "overprovisioning_factor",
                cluster.overprovisioning_factor.is_some(),
            ),
        ];
        for (key, _) in unsupported.into_iter().filter(|(_, set)| *set) {
            self.report(
                format!("{at}.{key}"),
                Target::Key,
                format!("cluster `{name}` is `type: original_dst`: `{key}` applies to a list of endpoints, and it has none"),
                format!("remove `{key}`"),
            );
        }
    }

    /// Endpoint weights, priorities and localities, slow start and the overprovisioning
    /// factor (docs/resilience.md, "Weights, priorities and locality").
    fn endpoint_weights(&mut self, at: &str, cluster: &Cluster) {
        for (k, e) in cluster.endpoints.entries().iter().enumerate() {
            if !(1..=crate::endpoints::MAX_ENDPOINT_WEIGHT).contains(&e.weight) {
                self.report(
                    format!("{at}.endpoints[{k}].weight"),
                    Target::Value,
                    format!("endpoint weight {} is out of range", e.weight),
                    format!(
                        "write a weight from 1 to {} (as Envoy's load_balancing_weight); remove the endpoint to send it nothing",
                        crate::endpoints::MAX_ENDPOINT_WEIGHT
                    ),
                );
            }
            if e.priority > MAX_PRIORITY {
                self.report(
                    format!("{at}.endpoints[{k}].priority"),
                    Target::Value,
                    format!("endpoint priority {} is out of range", e.priority),
                    format!("write a priority from 0 (the highest) to {MAX_PRIORITY}"),
                );
            }
            if let Some(locality) = &e.locality {
                self.locality(&format!("{at}.endpoints[{k}].locality"), locality);
            }
        }
        if let Some(factor) = cluster.overprovisioning_factor {
            if !(1..=MAX_OVERPROVISIONING).contains(&factor) {
                self.report(
                    format!("{at}.overprovisioning_factor"),
                    Target::Value,
                    format!("overprovisioning_factor {factor} is out of range"),
                    format!("write a percentage from 1 to {MAX_OVERPROVISIONING}; the default, as in Envoy, is 140"),
                );
            }
        }
        if let Some(slow) = &cluster.slow_start {
            let here = format!("{at}.slow_start");
            self.positive_duration(&format!("{here}.window"), slow.window);
            if !(slow.aggression.is_finite() && slow.aggression > 0.0 && slow.aggression <= 100.0) {
                self.report(
                    format!("{here}.aggression"),
                    Target::Value,
                    format!("slow_start.aggression {} is out of range", slow.aggression),
                    "write a number above 0 and at most 100; 1.0 (the default) ramps linearly"
                        .into(),
                );
            }
            if slow.min_weight_percent > 100 {
                self.report(
                    format!("{here}.min_weight_percent"),
                    Target::Value,
                    format!(
                        "slow_start.min_weight_percent {} is over 100",
                        slow.min_weight_percent
                    ),
                    "write a percentage from 0 to 100 (the default is 10)".into(),
                );
            }
            if matches!(cluster.lb, LbPolicy::RingHash | LbPolicy::Maglev) {
                self.report(
                    here.clone(),
                    Target::Key,
                    format!("cluster `{}` sets `slow_start` but its lb policy hashes", cluster.name),
                    "slow start works with round_robin, random and least_request (as in Envoy); a hash keeps a key on its endpoint".into(),
                );
            }
        }
    }

    /// `region/zone/subzone`, or its leading parts.
    fn locality(&mut self, path: &str, locality: &str) {
        let parts: Vec<&str> = locality.split('/').collect();
        if parts.len() > 3 || parts.iter().any(|p| p.is_empty() || p.trim() != *p) {
            self.report(
                path,
                Target::Value,
                format!("locality `{locality}` is not region/zone/subzone"),
                "write up to three non-empty parts separated by `/`, e.g. `us-east1`, `us-east1/us-east1-b` or `us-east1/us-east1-b/rack7`".into(),
            );
        }
    }

    /// A listener's `rate_limit` (http only) and `connection_rate_limit` (tcp only).
    fn listener_rate_limits(&mut self, at: &str, listener: &Listener) {
        let name = &listener.name;
        if let Some(limit) = &listener.rate_limit {
            if listener.protocol == ListenerProtocol::Http {
                self.rate_limit(&format!("{at}.rate_limit"), limit);
            } else {
                self.report(
                    format!("{at}.rate_limit"),
                    Target::Key,
                    format!("listener `{name}` sets `rate_limit`, which only http listeners use"),
                    "a tcp listener limits new connections with `connection_rate_limit: { connections_per_s, burst }`".into(),
                );
            }
        }
        if let Some(limit) = &listener.connection_rate_limit {
            if listener.protocol == ListenerProtocol::Tcp {
                let at = format!("{at}.connection_rate_limit");
                self.rate_numbers(
                    &at,
                    "connections_per_s",
                    limit.connections_per_s,
                    limit.burst,
                );
            } else {
                self.report(
                    format!("{at}.connection_rate_limit"),
                    Target::Key,
                    format!("listener `{name}` sets `connection_rate_limit`, which only tcp listeners use"),
                    "an http listener limits requests with `rate_limit: { requests_per_s, burst }`".into(),
                );
            }
        }
    }

    /// A `rate_limit`: a positive rate and burst, and a key header that is a header name.
    fn rate_limit(&mut self, at: &str, limit: &crate::RateLimit) {
        self.rate_numbers(at, "requests_per_s", limit.requests_per_s, limit.burst);
        if let Some(crate::RateLimitKey::Header { header }) = &limit.key {
            self.header_name(&format!("{at}.key.header"), Target::Value, header, false);
        }
    }

    /// A rate of 0 (or a burst of 0) would refuse everything: say so rather than do it.
    fn rate_numbers(&mut self, at: &str, rate_key: &str, rate: u32, burst: Option<u32>) {
        if rate == 0 {
            self.report(
                format!("{at}.{rate_key}"),
                Target::Value,
                format!("{at}.{rate_key} is 0: every request would be refused"),
                "set a positive rate, or remove the limit".into(),
            );
        }
        if burst == Some(0) {
            self.report(
                format!("{at}.burst"),
                Target::Value,
                format!("{at}.burst is 0: every request would be refused"),
                format!("set at least 1 (the default is `{rate_key}`, one second's worth)"),
            );
        }
    }

    /// A limit of 0 would answer every request with an overflow; `max_retries: 0` is a
    /// meaningful "no retries".
    fn circuit_breaker(&mut self, at: &str, breaker: &crate::CircuitBreaker) {
        for (key, value) in [
            ("max_connections", breaker.max_connections),
            ("max_pending", breaker.max_pending),
            ("max_requests", breaker.max_requests),
        ] {
            if value == 0 {
                self.report(
                    format!("{at}.{key}"),
                    Target::Value,
                    format!("{at}.{key} is 0: every request would be refused as an overflow"),
                    "set a positive limit (the default is 1024), or remove the key".into(),
                );
            }
        }
    }

    fn outlier_detection(&mut self, at: &str, outlier: &crate::OutlierDetection) {
        self.positive_duration(&format!("{at}.interval"), outlier.interval);
        self.positive_duration(
            &format!("{at}.base_ejection_time"),
            outlier.base_ejection_time,
        );
        if outlier.max_ejection_percent > 100 {
            self.report(
                format!("{at}.max_ejection_percent"),
                Target::Value,
                format!(
                    "{at}.max_ejection_percent is {}: a share of the endpoints cannot pass 100",
                    outlier.max_ejection_percent
                ),
                "write a percentage from 0 to 100 (the default is 10)".into(),
            );
        }
        if outlier.failure_percentage.threshold > 100 {
            self.report(
                format!("{at}.failure_percentage.threshold"),
                Target::Value,
                format!(
                    "{at}.failure_percentage.threshold is {}: a percentage of failed requests cannot pass 100",
                    outlier.failure_percentage.threshold
                ),
                "write a percentage from 0 to 100 (the default is 85)".into(),
            );
        }
        for (kind, hosts) in [
            ("success_rate", outlier.success_rate.minimum_hosts),
            (
                "failure_percentage",
                outlier.failure_percentage.minimum_hosts,
            ),
        ] {
            if hosts == 0 {
                self.report(
                    format!("{at}.{kind}.minimum_hosts"),
                    Target::Value,
                    format!("{at}.{kind}.minimum_hosts is 0: the endpoints are judged against each other, so at least one is needed"),
                    "write 1 or more (the default is 5)".into(),
                );
            }
        }
        if outlier.consecutive_5xx == 0
            && outlier.consecutive_gateway_errors == 0
            && outlier.consecutive_connect_failures == 0
            && !outlier.success_rate.enforcing
            && !outlier.failure_percentage.enforcing
        {
            self.report(
                at.to_owned(),
                Target::Key,
                "outlier detection is on but every kind is off, so no endpoint is ever ejected"
                    .into(),
                "set `consecutive_5xx`, `consecutive_gateway_errors` or `consecutive_connect_failures` above 0, or `success_rate.enforcing` or `failure_percentage.enforcing` to true, or remove `outlier_detection`".into(),
            );
        }
    }

    fn health_check(&mut self, at: &str, check: &crate::HealthCheck, tls: bool) {
        let kinds = [
            ("http", check.http.is_some()),
            ("tcp", check.tcp.is_some()),
            ("grpc", check.grpc.is_some()),
        ];
        let set: Vec<&str> = kinds.iter().filter(|k| k.1).map(|k| k.0).collect();
        if set.len() != 1 {
            self.report(
                at.to_owned(),
                Target::Key,
                if set.is_empty() {
                    format!("{at} says how often to probe but not how: it has no `http`, `tcp` or `grpc`")
                } else {
                    format!("{at} has {}: a health check probes one way", set.join(" and "))
                },
                "keep exactly one of `http: { path: /healthz }`, `tcp: {}` or `grpc: {}`".into(),
            );
        }
        if tls && (check.http.is_some() || check.grpc.is_some()) {
            self.report(
                at.to_owned(),
                Target::Key,
                format!("{at}: http and grpc health checks are sent in cleartext, and this cluster's endpoints speak TLS"),
                "use `tcp: {}` for this cluster (a connection that opens passes)".into(),
            );
        }
        self.positive_duration(&format!("{at}.interval"), check.interval);
        self.positive_duration(&format!("{at}.timeout"), check.timeout);
        for (key, value) in [
            ("unhealthy_threshold", check.unhealthy_threshold),
            ("healthy_threshold", check.healthy_threshold),
        ] {
            if value == 0 {
                self.report(
                    format!("{at}.{key}"),
                    Target::Value,
                    format!("{at}.{key} is 0: it counts consecutive probes and needs at least one"),
                    "write 1 or more (the defaults are 3 failures and 2 passes)".into(),
                );
            }
        }
        if let Some(http) = &check.http {
            if !http.path.starts_with('/')
                || http.path.chars().any(|c| c.is_ascii_control() || c == ' ')
            {
                self.report(
                    format!("{at}.http.path"),
                    Target::Value,
                    format!("{at}.http.path `{}` is not a request path", http.path),
                    "write an absolute path such as `/healthz`".into(),
                );
            }
            if http.expect.0.is_empty()
                || http
                    .expect
                    .0
                    .iter()
                    .any(|(from, to)| from > to || *from < 100 || *to > 599)
            {
                self.report(
                    format!("{at}.http.expect"),
                    Target::Value,
                    format!(
                        "{at}.http.expect `{}` is not a status from 100 to 599 nor a range of them",
                        http.expect
                    ),
                    "write a status (`200`), a range (`\"200-299\"`) or a list of them".into(),
                );
            }
        }
    }

    /// The shape of a listener's `tls:`. The files themselves are read (and their certificates
    /// and the `allow` patterns checked) when the node loads the config.
    fn listener_tls(&mut self, at: &str, tls: &crate::ListenerTls) {
        self.file_path(&format!("{at}.cert"), &tls.cert);
        self.file_path(&format!("{at}.key"), &tls.key);
        if let Some(ca) = &tls.client_ca {
            self.file_path(&format!("{at}.client_ca"), ca);
            if tls.allow.is_empty() {
                self.report(
                    format!("{at}.client_ca"),
                    Target::Key,
                    "client certificates are verified, but no identity is allowed to connect".into(),
                    "add `allow:` with the SPIFFE IDs that may connect, e.g. `allow: [ spiffe://example.org/ns/shop/* ]` (`spiffe://example.org/*` for the whole trust domain)".into(),
                );
            }
        } else if !tls.allow.is_empty() {
            self.report(
                format!("{at}.allow"),
                Target::Key,
                "`allow` lists client identities, but without `client_ca` no client certificate is asked for".into(),
                "add `client_ca: PATH` (the ca.pem of `flatmesh ca init`), or remove `allow`".into(),
            );
        }
        if let Some(crl) = &tls.crl {
            self.file_path(&format!("{at}.crl"), crl);
            if tls.client_ca.is_none() {
                self.report(
                    format!("{at}.crl"),
                    Target::Key,
                    "`crl` revokes client certificates, but without `client_ca` no client certificate is asked for".into(),
                    "add `client_ca: PATH` (the ca.pem of `flatmesh ca init`), or remove `crl`".into(),
                );
            }
        }
    }

    /// `tunnel` needs the cluster's `tls` (the tunnel is mutual TLS), and `tunnel_port` a tunnel.
    fn cluster_tunnel(&mut self, at: &str, cluster: &Cluster) {
        let name = &cluster.name;
        match (cluster.tunnel, cluster.tunnel_port) {
            (Some(_), _) if cluster.tls.is_none() => self.report(
                format!("{at}.tunnel"),
                Target::Key,
                format!("cluster `{name}` tunnels (`tunnel: hbone`) without `tls`: HBONE tunnels run inside mutual TLS"),
                "add `tls: { ca, cert, key, server_ids }` with the peer nodes' SPIFFE IDs in `server_ids`".into(),
            ),
            (None, Some(_)) => self.report(
                format!("{at}.tunnel_port"),
                Target::Key,
                format!("cluster `{name}` sets `tunnel_port` but does not tunnel"),
                "add `tunnel: hbone`, or remove `tunnel_port`".into(),
            ),
            // Probes would go straight to the endpoints, past the tunnel.
            (Some(_), _) if cluster.health_check.is_some() => self.report(
                format!("{at}.tunnel"),
                Target::Key,
                format!("cluster `{name}` tunnels, and a tunnel cluster runs no health check yet"),
                "remove `health_check` from this cluster, or `tunnel`".into(),
            ),
            // The http path runs them on tunnelled connections as on direct ones; a tcp
            // listener's tunnelled relay does not yet.
            (Some(_), _)
                if cluster.circuit_breaker.is_some() || cluster.outlier_detection.is_some() =>
            {
                let tcp = self.config.listeners.iter().find(|l| {
                    l.protocol == ListenerProtocol::Tcp && l.cluster.as_deref() == Some(name)
                });
                if let Some(listener) = tcp {
                    self.report(
                        format!("{at}.tunnel"),
                        Target::Key,
                        format!("cluster `{name}` tunnels for tcp listener `{}`, whose tunnelled relay runs no circuit breaker or outlier detection yet", listener.name),
                        "remove `circuit_breaker` and `outlier_detection` from this cluster, or give the tcp listener a cluster of its own".into(),
                    )
                }
            }
            (Some(_), Some(0)) => self.report(
                format!("{at}.tunnel_port"),
                Target::Value,
                "tunnel_port 0 cannot be connected to".into(),
                format!("write the port the peers accept tunnels on (HBONE's is {})", crate::HBONE_PORT),
            ),
            _ => {}
        }
    }

    fn cluster_tls(&mut self, at: &str, tls: &crate::ClusterTls) {
        self.file_path(&format!("{at}.ca"), &tls.ca);
        if let Some(crl) = &tls.crl {
            self.file_path(&format!("{at}.crl"), crl);
        }
        match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => {
                self.file_path(&format!("{at}.cert"), cert);
                self.file_path(&format!("{at}.key"), key);
            }
            (None, None) => {}
            (Some(_), None) | (None, Some(_)) => self.report(
                at,
                Target::Key,
                "a client certificate needs both `cert` and `key`".into(),
                "give both (the PREFIX.pem and PREFIX.key of `flatmesh ca issue`), or neither"
                    .into(),
            ),
        }
        if tls.server_ids.is_empty() {
            self.report(
                format!("{at}.server_ids"),
                Target::Key,
                "no server identity to check: a TLS cluster must say whom it expects".into(),
                "list the endpoints' SPIFFE IDs, e.g. `server_ids: [ spiffe://example.org/ns/shop/sa/api ]` (or a `/*` pattern)".into(),
            );
        }
    }

    fn authorization(&mut self, at: &str, listener: &Listener, authz: &crate::Authorization) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        // Tunnels are authorized per stream, as connections: no request to match.
        let tcp = matches!(
            listener.protocol,
            ListenerProtocol::Tcp | ListenerProtocol::Hbone
        );
        for (i, policy) in authz.policies.iter().enumerate() {
            let at = format!("{at}.policies[{i}]");
            if policy.name.trim().is_empty() {
                self.report(
                    format!("{at}.name"),
                    Target::Value,
                    "the policy's name is empty".into(),
                    "name it, e.g. `deny-admin`: it labels metrics, logs and --explain".into(),
                );
            } else if let Some(first) = names.insert(&policy.name, i) {
                self.report_duplicate(
                    format!("{at}.name"),
                    format!(
                        "{}.policies[{first}].name",
                        at.rsplit_once(".policies").map_or("", |p| p.0)
                    ),
                    format!(
                        "policy name `{}` is used twice on this listener",
                        policy.name
                    ),
                    "rename one of them: a denied request names the policy that denied it".into(),
                );
            }
            if let Some(from) = &policy.from {
                for (k, principal) in from.principals.iter().enumerate() {
                    if let Err(why) = principal_pattern(principal) {
                        self.report(
                            format!("{at}.from.principals[{k}]"),
                            Target::Value,
                            format!("`{principal}` is not a SPIFFE ID or pattern: {why}"),
                            "write `spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/ACCOUNT`, or end it in `/*` for everything under it".into(),
                        );
                    }
                }
                for (k, ns) in from.namespaces.iter().enumerate() {
                    if ns.is_empty() || ns.contains('/') {
                        self.report(
                            format!("{at}.from.namespaces[{k}]"),
                            Target::Value,
                            format!("`{ns}` is not a namespace name"),
                            "give the namespace alone, e.g. `shop` (the `ns/shop` part of the caller's SPIFFE ID)".into(),
                        );
                    }
                }
            }
            if tcp && (policy.to.is_some() || !policy.when.is_empty()) {
                self.report(
                    at.to_string(),
                    Target::Key,
                    format!(
                        "policy `{}` matches requests (`to`/`when`), but `{}` is a {} listener: it sees connections, not requests",
                        policy.name, listener.name, if listener.protocol == ListenerProtocol::Hbone { "hbone" } else { "tcp" }
                    ),
                    "keep only `from` on a tcp listener's policies, or move the policy to an http listener".into(),
                );
            }
            if let Some(to) = &policy.to {
                for (k, method) in to.methods.iter().enumerate() {
                    self.method(&format!("{at}.to.methods[{k}]"), method);
                }
                for (k, path) in to.paths.iter().enumerate() {
                    if let Err(why) = wildcard(path).and_then(|()| {
                        if path.starts_with('/') || path.starts_with('*') {
                            Ok(())
                        } else {
                            Err("a path starts with `/`".to_string())
                        }
                    }) {
                        self.report(
                            format!("{at}.to.paths[{k}]"),
                            Target::Value,
                            format!("`{path}` is not a path pattern: {why}"),
                            "write an exact path `/admin`, a prefix `/admin/*`, a suffix `*.php`, or `*`".into(),
                        );
                    }
                }
                for (k, host) in to.hosts.iter().enumerate() {
                    if let Err(why) = wildcard(host) {
                        self.report(
                            format!("{at}.to.hosts[{k}]"),
                            Target::Value,
                            format!("`{host}` is not a host pattern: {why}"),
                            "write an exact host `api.example.org`, `*.example.org`, `api.*`, or `*`".into(),
                        );
                    }
                }
            }
            for (k, when) in policy.when.iter().enumerate() {
                self.header_name(
                    &format!("{at}.when[{k}].header"),
                    Target::Value,
                    &when.header,
                    false,
                );
                if when.values.is_empty() {
                    self.report(
                        format!("{at}.when[{k}].values"),
                        Target::Key,
                        "a `when` with no values never matches".into(),
                        "list the values, or `[ \"*\" ]` for any request that has the header"
                            .into(),
                    );
                }
                for (v, value) in when.values.iter().enumerate() {
                    if let Err(why) = wildcard(value) {
                        self.report(
                            format!("{at}.when[{k}].values[{v}]"),
                            Target::Value,
                            format!("`{value}` is not a value pattern: {why}"),
                            "write an exact value, `prefix*`, `*suffix`, or `*`".into(),
                        );
                    }
                }
            }
        }
    }

    fn file_path(&mut self, at: &str, path: &std::path::Path) {
        if path.as_os_str().is_empty() {
            self.report(
                at,
                Target::Value,
                "the file path is empty".into(),
                "give the path of a PEM file".into(),
            );
        }
    }
}

/// Two listen addresses clash when they share a port and either the same IP or
/// an unspecified one (0.0.0.0 / [::] takes the port on every address).
/// Port 0 asks the OS for a free port, so it never clashes (but see `listener_address`: two
/// listeners of one protocol on the same port-0 address would be one).
fn addresses_clash(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// `api.local` or `*.example.com`; on failure, the hint.
fn check_host(host: &str) -> Result<(), String> {
    let name = host.strip_prefix("*.").unwrap_or(host);
    if name.is_empty() {
        return Err(
            "write a host such as `api.local` or a wildcard such as `*.example.com`".into(),
        );
    }
    if name.contains('*') {
        return Err("only a leading `*.` wildcard is supported, e.g. `*.example.com`; leave `host` out to match any host".into());
    }
    if name.contains(':') {
        return Err("leave the port out: host matching ignores the port".into());
    }
    let valid_label = |label: &str| {
        !label.is_empty()
            && label
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    if !name.split('.').all(valid_label) {
        return Err("a host is dot-separated labels of letters, digits, `-` and `_`".into());
    }
    Ok(())
}

/// An RFC 9110 token: visible ASCII but delimiters.
/// An authorization pattern: exact, `prefix*`, `*suffix` or `*`.
fn wildcard(text: &str) -> Result<(), String> {
    let inner = text.strip_prefix('*').unwrap_or(text);
    let inner = inner.strip_suffix('*').unwrap_or(inner);
    if text.is_empty() {
        return Err("it is empty".into());
    }
    if inner.contains('*') || (text.len() > 1 && text.starts_with('*') && text.ends_with('*')) {
        return Err("a `*` may only be the first or the last character, not both".into());
    }
    Ok(())
}

/// A principal: a SPIFFE ID, or one ending in `/*`. Its parts are checked by the node's
/// identity code when it loads; here, the shape.
fn principal_pattern(text: &str) -> Result<(), String> {
    let Some(rest) = text.strip_prefix("spiffe://") else {
        return Err("it does not start with `spiffe://`".into());
    };
    let body = rest.strip_suffix("/*").unwrap_or(rest);
    if body.is_empty() || body.starts_with('/') {
        return Err("the trust domain is missing".into());
    }
    if body.contains('*') {
        return Err(
            "a `*` may only be the whole last segment, like spiffe://example.org/ns/shop/*".into(),
        );
    }
    Ok(())
}

fn is_token(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// An `Upgrade` protocol (RFC 9110 §7.8): `name` or `name/version`, both tokens.
fn is_protocol(text: &str) -> bool {
    match text.split_once('/') {
        Some((name, version)) => is_token(name) && is_token(version),
        None => is_token(text),
    }
}

/// The last line of a regex error: the short reason without the caret diagram.
fn regex_reason(error: &regex::Error) -> String {
    let text = error.to_string();
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().trim_start_matches("error: ").to_string())
        .unwrap_or(text)
}

/// `HOST:PORT`: a non-empty host (a name, an IPv4 address or a bracketed IPv6 address) and
/// a port from 1 to 65535.
fn is_host_port(text: &str) -> bool {
    let Some((host, port)) = text.rsplit_once(':') else {
        return false;
    };
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
        }
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collector_addresses_are_host_and_port() {
        for ok in [
            "127.0.0.1:4317",
            "jaeger:4317",
            "[::1]:4317",
            "otel-collector.obs.svc:4317",
        ] {
            assert!(is_host_port(ok), "{ok}");
        }
        for bad in [
            "",
            "jaeger",
            ":4317",
            "jaeger:0",
            "jaeger:99999",
            "::1:4317",
            "http://j:4317",
            "a b:1",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
    }

    #[test]
    fn config_built_in_code_is_checked_by_path() {
        let config = Config {
            admin: default_admin(),
            workers: None,
            access_log: None,
            tracing: None,
            limits: Limits::default(),
            drain_timeout: crate::model::DEFAULT_DRAIN_TIMEOUT,
            listeners: vec![Listener {
                name: "t".into(),
                address: SocketAddr::from(([127, 0, 0, 1], 7000)),
                protocol: ListenerProtocol::Tcp,
                routes: vec![],
                cluster: Some("nope".into()),
                limits: ListenerLimits::default(),
                normalize_path: None,
                merge_slashes: None,
                path_with_escaped_slashes_action: None,
                tls: None,
                authorization: None,
                hbone: None,
                rate_limit: None,
                connection_rate_limit: None,
                qnp: None,
            }],
            clusters: vec![],
            kernel: None,
            node: None,
            workloads: vec![],
        };
        let problems = validate(&config);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(
            problems[0].to_string(),
            "listeners[0].cluster: listener references unknown cluster `nope`\n  hint: no clusters are defined: add one under `clusters:`"
        );
    }

    #[test]
    fn address_clash_rules() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap_or_else(|e| panic!("{e}"));
        assert!(addresses_clash(a("127.0.0.1:80"), a("127.0.0.1:80")));
        assert!(addresses_clash(a("0.0.0.0:80"), a("127.0.0.1:80")));
        assert!(addresses_clash(a("[::1]:80"), a("[::]:80")));
        assert!(!addresses_clash(a("127.0.0.1:80"), a("127.0.0.2:80")));
        assert!(!addresses_clash(a("127.0.0.1:80"), a("127.0.0.1:81")));
        assert!(!addresses_clash(a("127.0.0.1:0"), a("127.0.0.1:0")));
    }
}
