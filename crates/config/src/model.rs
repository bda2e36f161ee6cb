//! The config model: what a flatmesh node is told to do.
//!
//! These types are both the YAML schema (serde, unknown keys rejected) and the
//! in-memory model that `flatmesh-rules` compiles and `flatmesh-proxy` runs.
//! The field names are a contract (see issue 2): extend, never rename.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::admin::{Admin, AdminAddress};

/// A whole node configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Admin endpoint: /metrics, /ready, /config, /rules, /listeners, POST /reload. Written as
    /// an address or as a mapping with its access settings (`crate::admin`).
    #[serde(default, deserialize_with = "crate::admin::deserialize")]
    pub admin: Admin,
    /// Worker threads, one per core. `None` means "number of cores".
    #[serde(default)]
    pub workers: Option<usize>,
    /// Access log as JSON lines. `None` means no access log.
    #[serde(default)]
    pub access_log: Option<AccessLog>,
    /// Distributed tracing: spans of proxied requests exported over OTLP/gRPC
    /// (docs/observability.md, "Tracing"). `None` means no tracing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<Tracing>,
    /// Limits that protect workers from bad or slow clients.
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub listeners: Vec<Listener>,
    #[serde(default)]
    pub clusters: Vec<Cluster>,
    /// Tier K (eBPF). Absent: the node runs on the user tiers only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<Kernel>,
    /// How long a draining node (SIGTERM, SIGINT or `POST /drain`) lets in-flight requests
    /// and connections finish before it closes what is left and exits (docs/resilience.md,
    /// "Graceful drain").
    #[serde(default = "default_drain_timeout", with = "crate::duration")]
    pub drain_timeout: Duration,
    /// What the node knows about itself (its locality, for locality-aware load balancing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<Node>,
    /// The workloads on this node: which local processes' connections the node carries on
    /// their behalf, and the identity it presents for each (docs/security.md, "Workloads").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workloads: Vec<Workload>,
}

/// One workload on this node (ztunnel's "workload" of a node): its SPIFFE identity, the
/// certificate the node presents for it in HBONE tunnels, and how the node recognises it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Labels the workload in metrics and logs.
    pub name: String,
    /// `spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/SERVICE_ACCOUNT`: what the node presents for it.
    pub identity: String,
    /// PEM: the workload's certificate (an SVID of `identity`), then its chain. Needed to
    /// present the identity, so by `cgroup` and `uid` workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<std::path::PathBuf>,
    /// PEM: the certificate's private key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<std::path::PathBuf>,
    /// How the node knows the workload: exactly one of the keys.
    #[serde(rename = "match")]
    pub matches: WorkloadMatch,
}

/// `match:` of a workload. `cgroup` and `uid` name the client of a connection the node
/// accepts (a captured or direct connection to a node listener); `port` names the local
/// workload that listens on it (the destination of an HBONE stream the node delivers).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadMatch {
    /// cgroup v2 directory the client process is in (needs tier K with `kernel.capture`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<std::path::PathBuf>,
    /// The client process's user id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The port the workload listens on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

impl Workload {
    /// Whether the workload is known as the client of connections (by `cgroup` or `uid`),
    /// so the node presents its identity.
    pub fn is_client(&self) -> bool {
        self.matches.cgroup.is_some() || self.matches.uid.is_some()
    }
}

/// ztunnel's default grace period; Kubernetes gives a pod 30 s between SIGTERM and SIGKILL.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

fn default_drain_timeout() -> Duration {
    DEFAULT_DRAIN_TIMEOUT
}

/// The `node:` section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// `region/zone/subzone` (or its leading parts): within a priority, the endpoints whose
    /// locality matches it most closely take the traffic while enough of them are healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<String>,
}

/// The `kernel:` section: which eBPF mechanisms the node attaches (docs/kernel.md).
/// Without root or kernel support the node logs one line and runs on the user tiers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kernel {
    /// bpffs directory for this node's pins; default `/sys/fs/bpf/flatmesh`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin_dir: Option<std::path::PathBuf>,
    /// cgroup v2 directory whose sockets the node sees; default the cgroup v2 root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_root: Option<std::path::PathBuf>,
    /// Send workloads' connections to service addresses to the node's listeners.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<Capture>,
    /// Shorten local hops (app <-> node, node <-> local backend) with sockops + sk_msg.
    #[serde(default = "yes")]
    pub redirect: bool,
    /// Splice `tcp` listeners' connections to their upstream in the kernel (sk_skb), so the
    /// node's user-space relay never sees the bytes.
    #[serde(default = "yes")]
    pub tcp_splice: bool,
    /// Decide an `http` listener's first request in the kernel and splice the connection.
    /// Routing becomes per connection: later requests on it go to the same backend.
    #[serde(default)]
    pub l7_dispatch: bool,
    /// The `http` listener whose routes the kernel decides; needed when there are several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l7_listener: Option<String>,
    /// Also attach the sk_skb stream parser (strparser mode); off by default (docs/kernel.md).
    #[serde(default)]
    pub l7_stream_parser: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capture {
    /// cgroup v2 directory of the workloads whose connections are captured.
    pub cgroup: std::path::PathBuf,
    /// Service addresses (VIPs) and the listener each is sent to.
    pub services: Vec<CapturedService>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapturedService {
    /// What workloads connect to, e.g. `10.96.0.10:80`.
    pub address: SocketAddr,
    /// The node listener that takes those connections.
    pub listener: String,
    /// Let captured connections leave the node in the clear: without it, every cluster the
    /// listener sends to must tunnel (`tunnel: hbone`) or have only loopback endpoints, so
    /// captured traffic into the mesh leaves the node only inside HBONE.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plaintext_ok: bool,
}

/// The default admin settings: `127.0.0.1:15000`, no token.
pub fn default_admin() -> Admin {
    Admin::default()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLog {
    /// `stdout`, `stderr`, or a file path (appended).
    pub path: String,
    /// Lines waiting for the writer take at most this many bytes; when the sink is slower
    /// than the traffic, further lines are dropped (and counted), never waited for.
    #[serde(default = "default_access_log_queue_bytes")]
    pub queue_bytes: usize,
    /// Longer request fields (path, method, ...) are cut to this many bytes, marked `...`.
    #[serde(default = "default_access_log_max_field_bytes")]
    pub max_field_bytes: usize,
}

pub const DEFAULT_ACCESS_LOG_QUEUE_BYTES: usize = 8 * 1024 * 1024;
pub const DEFAULT_ACCESS_LOG_MAX_FIELD_BYTES: usize = 2048;

/// Distributed tracing (docs/observability.md, "Tracing").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tracing {
    /// The OTLP/gRPC collector, `HOST:PORT` (Jaeger and the OpenTelemetry Collector listen
    /// on 4317).
    pub otlp: String,
    /// The share of new traces the node samples, 0.0 to 1.0. A request that arrives with a
    /// sampling decision keeps it; a request that ends in 5xx is exported whatever the draw.
    #[serde(default = "default_tracing_sample")]
    pub sample: f64,
    /// `service.name` of the node's spans.
    #[serde(default = "default_tracing_service_name")]
    pub service_name: String,
    /// Spans waiting for the exporter; when the collector is slower than the traffic (or
    /// gone), further spans are dropped and counted, never waited for.
    #[serde(default = "default_tracing_queue")]
    pub queue: usize,
}

pub const DEFAULT_TRACING_SAMPLE: f64 = 0.01;
pub const DEFAULT_TRACING_SERVICE_NAME: &str = "flatmesh";
pub const DEFAULT_TRACING_QUEUE: usize = 4096;

fn default_tracing_sample() -> f64 {
    DEFAULT_TRACING_SAMPLE
}
fn default_tracing_service_name() -> String {
    DEFAULT_TRACING_SERVICE_NAME.into()
}
fn default_tracing_queue() -> usize {
    DEFAULT_TRACING_QUEUE
}

fn default_access_log_queue_bytes() -> usize {
    DEFAULT_ACCESS_LOG_QUEUE_BYTES
}
fn default_access_log_max_field_bytes() -> usize {
    DEFAULT_ACCESS_LOG_MAX_FIELD_BYTES
}

/// Protection limits. Every field has a safe default (docs/config.md, "limits").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request header block accepted; larger gets 431.
    pub max_header_bytes: usize,
    /// A client must send its full request head within this time.
    #[serde(with = "crate::duration")]
    pub header_read_timeout: Duration,
    /// A downstream connection that moves no byte for this long is closed (HTTP listeners).
    /// Covers long-lived gRPC streams too, hence a default as long as Envoy's stream idle timeout.
    #[serde(with = "crate::duration")]
    pub idle_timeout: Duration,
    /// Upstream TCP connect timeout.
    #[serde(with = "crate::duration")]
    pub connect_timeout: Duration,
    /// Default per-request timeout for routes that set none.
    #[serde(with = "crate::duration")]
    pub request_timeout: Duration,
    /// Downstream connections open at once on the whole node, every listener together
    /// (Envoy's overload manager `global_downstream_max_connections`). A listener can cap
    /// its own share lower with `listeners[].limits.max_connections`.
    pub max_connections: usize,
    /// Upstream connections one client connection may hold at once (an HTTP/2 client's
    /// streams to HTTP/1.1 clusters); further streams wait for one to end.
    pub max_upstream_per_downstream: usize,
    /// File descriptors the data plane leaves free: the admin port, listening sockets, log
    /// files. Connections past `RLIMIT_NOFILE - reserved_fds` sockets are refused.
    pub reserved_fds: usize,
    /// Streams an HTTP/2 client may have open at once on one connection.
    pub http2_max_concurrent_streams: u32,
    /// HTTP/2 flow-control window the node grants each client stream (what a client may
    /// send ahead), and the most response bytes the node queues for one stream.
    pub http2_stream_window: u32,
    /// HTTP/2 flow-control window the node grants each client connection.
    pub http2_connection_window: u32,
    /// Response bytes the node may hold queued for one client connection, all its streams
    /// together (Envoy's `per_connection_buffer_limit_bytes`).
    pub per_connection_buffer_bytes: usize,
    /// Bytes the node may hold in connection buffers for all clients together (Envoy's
    /// overload manager). Over it, new connections and new HTTP/2 streams are refused.
    pub memory_budget_bytes: usize,
    /// An HTTP/2 stream whose client takes none of the response data the node holds for it
    /// for this long is reset, which frees its buffers and its upstream connection.
    #[serde(with = "crate::duration")]
    pub stream_stall_timeout: Duration,
    /// A TCP relay (`tcp` listener) or an upgraded HTTP connection (WebSocket tunnel) that
    /// moves no byte either way for this long is closed (Envoy's tcp_proxy `idle_timeout`).
    #[serde(with = "crate::duration")]
    pub tcp_idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 64 * 1024,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(15),
            max_connections: 10_000,
            max_upstream_per_downstream: 100,
            reserved_fds: 128,
            http2_max_concurrent_streams: 100,
            http2_stream_window: 64 * 1024,
            http2_connection_window: 1024 * 1024,
            per_connection_buffer_bytes: 1024 * 1024,
            memory_budget_bytes: 1024 * 1024 * 1024,
            stream_stall_timeout: Duration::from_secs(60),
            tcp_idle_timeout: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    pub name: String,
    pub address: SocketAddr,
    pub protocol: ListenerProtocol,
    /// HTTP listeners: routes tried in order, first match wins.
    #[serde(default)]
    pub routes: Vec<Route>,
    /// TCP listeners: the cluster every connection goes to.
    #[serde(default)]
    pub cluster: Option<String>,
    /// This listener's own limits, over the node's `limits` (the ones Envoy sets per
    /// listener, and a connection cap of its own).
    #[serde(default, skip_serializing_if = "ListenerLimits::is_empty")]
    pub limits: ListenerLimits,
    /// HTTP listeners: remove dot segments and decode unreserved `%xx` escapes before
    /// matching and forwarding (Envoy's `normalize_path`). Unset: on when the listener has a
    /// route that denies (a `direct_response` of 400 or more) (see [`Listener::path_defaults_on`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalize_path: Option<bool>,
    /// HTTP listeners: collapse runs of `/` into one (Envoy's `merge_slashes`). Unset: as
    /// `normalize_path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge_slashes: Option<bool>,
    /// HTTP listeners: what a path with `%2F` or `%5C` gets (Envoy's
    /// `path_with_escaped_slashes_action`). Unset: `reject_request` when the listener has a
    /// route that denies, else `keep_unchanged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_with_escaped_slashes_action: Option<EscapedSlashesAction>,
    /// Terminate TLS on this listener (mutual TLS with `client_ca`). The relay or the HTTP
    /// codecs then run on the decrypted stream; the kernel tier never decides such a listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTls>,
    /// Who may do what on this listener (Istio's AuthorizationPolicy, per listener).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization: Option<Authorization>,
    /// `hbone` listeners: where their CONNECT streams may go (docs/security.md, "HBONE").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbone: Option<HboneListener>,
    /// HTTP listeners: requests per second the listener admits, before any route is matched
    /// (docs/resilience.md, "Rate limits").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
    /// TCP listeners: connections per second the listener admits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_rate_limit: Option<ConnectionRateLimit>,
    /// `qnp` listeners: the local workers and the rules that pick one for each request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qnp: Option<QnpListener>,
}

/// Local workers a `qnp` listener can dispatch to: the kernel dispatcher's socket array holds
/// this many (`flatmesh_qnp::kernel_rsd::MAX_WORKERS`).
pub const QNP_MAX_WORKERS: usize = 64;
/// Bytes of skip-and-check rules a `qnp` listener may carry, inline or in its file. The
/// Matcher's tables hold 512 entries, far fewer rules than fit in this.
pub const QNP_MAX_RULES_BYTES: usize = 1 << 20;
/// Client sessions a `qnp` listener may hold per worker thread, at most.
pub const QNP_MAX_SESSIONS: usize = 65_536;

/// A `qnp` listener's `qnp:` section (docs/qnp.md, "QNP in the node").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QnpListener {
    /// The local workers' UDP addresses, in queue order: a rule's `-> Q` sends to
    /// `workers[Q]`.
    pub workers: Vec<SocketAddr>,
    /// The skip-and-check rules, in the syntax `flatmesh qnp rules compile` reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<String>,
    /// The same, in a file (read at load and at every reload).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules_file: Option<std::path::PathBuf>,
    /// A client's session with a worker (the node's socket towards it) closes after this long
    /// without a packet either way (Envoy's udp_proxy `idle_timeout`).
    #[serde(default = "default_qnp_idle_timeout", with = "crate::duration")]
    pub idle_timeout: Duration,
    /// Client sessions each worker thread of the node holds for this listener; a packet that
    /// would open one more is dropped (and counted).
    #[serde(default = "default_qnp_max_sessions")]
    pub max_sessions: usize,
}

fn default_qnp_idle_timeout() -> Duration {
    Duration::from_secs(60)
}

fn default_qnp_max_sessions() -> usize {
    4096
}

/// An `hbone` listener's `hbone:`: the destinations its tunnels may reach. Without it (or
/// with an empty list) a tunnel reaches loopback addresses only, so the listener is never an
/// open relay.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HboneListener {
    /// Each an address block (`10.0.0.0/8`, `::1/128`), a bare IP (every port) or an
    /// `IP:PORT`; a CONNECT's `:authority` must fall in one.
    #[serde(default)]
    pub destinations: Vec<String>,
}

/// How a cluster carries its connections to its endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tunnel {
    /// One HTTP/2 CONNECT stream per connection, inside mutual TLS to the endpoint's node
    /// (ztunnel's HBONE).
    Hbone,
}

/// The conventional HBONE port (ztunnel's).
pub const HBONE_PORT: u16 = 15008;

/// A listener's `authorization:` (docs/security.md, "Authorization"). A request (or, on a
/// `tcp` listener, a connection) is denied when a `deny` policy matches; otherwise, when the
/// listener has `allow` policies or `default: deny`, it is allowed only if an `allow` policy
/// matches. Istio's order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Authorization {
    /// What a request no policy matches gets, when there is no `allow` policy.
    #[serde(default)]
    pub default: AuthzDefault,
    #[serde(default)]
    pub policies: Vec<AuthzPolicy>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthzDefault {
    #[default]
    #[serde(alias = "ALLOW")]
    Allow,
    #[serde(alias = "DENY")]
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthzAction {
    #[serde(alias = "ALLOW")]
    Allow,
    #[serde(alias = "DENY")]
    Deny,
}

/// One policy: it matches when every part it has matches (`from`, `to`, each `when`); a list
/// inside a part matches when any of its entries does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthzPolicy {
    /// Labels the policy in metrics, logs and `--explain`.
    pub name: String,
    pub action: AuthzAction,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<AuthzFrom>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<AuthzTo>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub when: Vec<AuthzWhen>,
}

/// Who the caller is: its verified SPIFFE ID (a TLS listener with `client_ca`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthzFrom {
    /// SPIFFE IDs, or patterns ending in `/*`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<String>,
    /// The `ns/NAMESPACE` part of the caller's SPIFFE ID.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
}

/// What the request asks for (http listeners). Paths and hosts: exact, `prefix*`, `*suffix`
/// or `*`; paths are matched after the listener's normalisation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthzTo {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
}

/// A request header with one of `values` (exact, `prefix*`, `*suffix` or `*`: present).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthzWhen {
    pub header: String,
    pub values: Vec<String>,
}

/// A listener's `tls:` (docs/security.md, "Mutual TLS").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// PEM: the listener's certificate, then its chain (`flatmesh ca issue` writes this).
    pub cert: std::path::PathBuf,
    /// PEM: the certificate's private key.
    pub key: std::path::PathBuf,
    /// PEM: the roots client certificates must chain to. Set: a client certificate is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<std::path::PathBuf>,
    /// SPIFFE IDs, or `spiffe://TD/ns/NS/*` patterns (`spiffe://TD/*`: the whole trust
    /// domain), that may connect. Required with `client_ca`: nobody is admitted by default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// PEM: certificate revocation lists (`flatmesh ca revoke` writes `DIR/crl.pem`); a client
    /// certificate one of them lists is refused. Needs `client_ca`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crl: Option<std::path::PathBuf>,
}

/// A cluster's `tls:`: the node originates TLS to the cluster's endpoints and checks who they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterTls {
    /// PEM: the roots the endpoints' certificates must chain to.
    pub ca: std::path::PathBuf,
    /// PEM: the node's client certificate and chain, for endpoints that ask for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<std::path::PathBuf>,
    /// PEM: the client certificate's private key (with `cert`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<std::path::PathBuf>,
    /// SPIFFE IDs or patterns the endpoints must present; at least one.
    pub server_ids: Vec<String>,
    /// The server name sent in the ClientHello; by default none (SPIFFE peers are checked by
    /// ID, not by DNS name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
    /// PEM: certificate revocation lists; an endpoint certificate one of them lists is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crl: Option<std::path::PathBuf>,
}

/// A listener's `limits:`: each key set here replaces the node's for this listener's
/// connections (docs/config.md, "Listeners").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerLimits {
    /// Client connections this listener may have open at once; at most, and by default,
    /// `limits.max_connections` (the node's cap applies first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Envoy's listener `per_connection_buffer_limit_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_connection_buffer_bytes: Option<usize>,
    /// Envoy's `http2_protocol_options.max_concurrent_streams`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http2_max_concurrent_streams: Option<u32>,
    /// Envoy's `http2_protocol_options.initial_stream_window_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http2_stream_window: Option<u32>,
    /// Envoy's `http2_protocol_options.initial_connection_window_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http2_connection_window: Option<u32>,
    /// Envoy's tcp_proxy `idle_timeout`.
    #[serde(
        default,
        with = "crate::duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub tcp_idle_timeout: Option<Duration>,
}

impl ListenerLimits {
    pub fn is_empty(&self) -> bool {
        *self == ListenerLimits::default()
    }
}

impl Limits {
    /// The limits of `listener`'s connections: the node's, with the listener's own over them.
    /// (`max_connections` stays the node's: the listener's cap is counted apart.)
    pub fn for_listener(&self, listener: &Listener) -> Limits {
        let own = &listener.limits;
        Limits {
            per_connection_buffer_bytes: own
                .per_connection_buffer_bytes
                .unwrap_or(self.per_connection_buffer_bytes),
            http2_max_concurrent_streams: own
                .http2_max_concurrent_streams
                .unwrap_or(self.http2_max_concurrent_streams),
            http2_stream_window: own.http2_stream_window.unwrap_or(self.http2_stream_window),
            http2_connection_window: own
                .http2_connection_window
                .unwrap_or(self.http2_connection_window),
            tcp_idle_timeout: own.tcp_idle_timeout.unwrap_or(self.tcp_idle_timeout),
            ..self.clone()
        }
    }
}

/// What a request path with an escaped slash (`%2F`, `%2f`) or backslash (`%5C`, `%5c`) gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EscapedSlashesAction {
    /// Matched and forwarded as it came.
    KeepUnchanged,
    /// Answered 400.
    RejectRequest,
    /// Answered 307 with the path unescaped, so the client asks again with plain slashes.
    UnescapeAndRedirect,
    /// Unescaped, then matched and forwarded.
    UnescapeAndForward,
}

/// A listener's path normalisation, every option resolved (docs/config.md, "Paths").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PathOptions {
    pub normalize_path: bool,
    pub merge_slashes: bool,
    pub escaped_slashes: EscapedSlashesAction,
}

impl PathOptions {
    /// Paths as received: nothing is changed (Envoy's defaults).
    pub const RAW: PathOptions = PathOptions {
        normalize_path: false,
        merge_slashes: false,
        escaped_slashes: EscapedSlashesAction::KeepUnchanged,
    };
    /// What a listener with a deny (`direct_response`) route gets unless it says otherwise.
    pub const STRICT: PathOptions = PathOptions {
        normalize_path: true,
        merge_slashes: true,
        escaped_slashes: EscapedSlashesAction::RejectRequest,
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerProtocol {
    /// HTTP/1.1 and HTTP/2 (h2c prior knowledge) on one port; gRPC rides on HTTP/2.
    Http,
    /// Plain L4 relay.
    Tcp,
    /// HBONE tunnels in: HTTP/2 CONNECT streams over mutual TLS, each relayed to the
    /// destination its `:authority` names.
    Hbone,
    /// QingNiao requests over UDP (docs/qnp.md), each dispatched to a local worker by
    /// skip-and-check rules: in the kernel when tier K is attached, else in user space.
    Qnp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Optional name used in metrics and `--explain`; defaults to `<listener>/<index>`.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "match", default)]
    pub matches: RouteMatch,
    // Exactly one of `cluster`, `split`, `direct_response` (checked by validation).
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default)]
    pub split: Option<Vec<WeightedCluster>>,
    #[serde(default)]
    pub direct_response: Option<DirectResponse>,
    /// Whole-request timeout; exceeded gives 504.
    #[serde(default, with = "crate::duration::option")]
    pub timeout: Option<Duration>,
    #[serde(default)]
    pub request_headers_to_add: BTreeMap<String, String>,
    #[serde(default)]
    pub request_headers_to_remove: Vec<String>,
    #[serde(default)]
    pub response_headers_to_add: BTreeMap<String, String>,
    #[serde(default)]
    pub retries: Option<RetryPolicy>,
    /// Faults injected into a share of the route's requests (Envoy's HTTP fault filter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<Fault>,
    /// A copy of a share of the route's requests, sent fire-and-forget to another cluster
    /// (Envoy's `request_mirror_policies`, one per route).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<Mirror>,
    /// Protocol upgrades the route lets through (`Upgrade` header values such as `websocket`,
    /// compared case-insensitively; Envoy's `upgrade_configs`). A request asking for any other
    /// upgrade gets 403. After a `101` the connection is a byte tunnel, out of the rules' reach.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upgrades: Vec<String>,
    /// Requests per second this route admits, after it matched (docs/resilience.md,
    /// "Rate limits").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
}

/// A request rate limit (a route's or an http listener's `rate_limit`), exact for the node as
/// a whole: one token bucket shared by every worker, or one per key value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// The rate the bucket refills at: requests admitted per second, sustained.
    pub requests_per_s: u32,
    /// The bucket's size: requests admitted at once after a quiet spell. Default: one
    /// second's worth (`requests_per_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// One bucket per client address or per value of a header, instead of one for all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<RateLimitKey>,
}

impl RateLimit {
    /// The bucket's size in force.
    pub fn burst(&self) -> u32 {
        self.burst.unwrap_or(self.requests_per_s)
    }
}

/// What a keyed rate limit tells its buckets apart by: `key: client_address` or
/// `key: { header: x-user }` (a request without the header shares one bucket with the others
/// that lack it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RateLimitKey {
    Named(RateLimitKeyName),
    Header { header: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitKeyName {
    ClientAddress,
}

/// The most key values a keyed rate limit keeps a bucket for; past it a new value takes the
/// place of the fullest bucket of its set (docs/resilience.md, "Rate limits").
pub const RATE_LIMIT_MAX_KEYS: usize = 4096;

/// A tcp listener's `connection_rate_limit`: new connections per second, for the node as a
/// whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionRateLimit {
    pub connections_per_s: u32,
    /// Connections admitted at once after a quiet spell. Default: `connections_per_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

impl ConnectionRateLimit {
    /// The same limit as a [`RateLimit`] without a key: both run on one kind of bucket.
    pub fn as_rate_limit(&self) -> RateLimit {
        RateLimit {
            requests_per_s: self.connections_per_s,
            burst: self.burst,
            key: None,
        }
    }
}

/// All conditions must hold for a route to match. An empty match matches everything.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteMatch {
    /// Exact host (`api.local`) or wildcard suffix (`*.example.com`). Port is ignored.
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub path: Option<PathMatch>,
    /// HTTP method, e.g. `GET`.
    #[serde(default)]
    pub method: Option<String>,
    #[serde(default)]
    pub headers: Vec<NamedMatch>,
    /// Query parameters.
    #[serde(default)]
    pub query: Vec<NamedMatch>,
    /// A field of the request's first gRPC message (papers/003: the proxy reads the message,
    /// not only the head). Only gRPC requests (`content-type: application/grpc...`) can match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_field: Option<GrpcFieldMatch>,
}

/// `grpc_field: { number: 1, exact: alice }`: field `number` of the first gRPC message's
/// protobuf, a string/bytes field (compared as bytes) or a varint field (compared as its
/// unsigned decimal text). Exactly one of `exact` and `prefix` is set (checked by validation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcFieldMatch {
    pub number: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// The largest protobuf field number (2^29 - 1).
pub const GRPC_FIELD_NUMBER_MAX: u32 = (1 << 29) - 1;

/// Written as a one-key map: `{ prefix: /api }`. (serde_norway reads a plain
/// externally tagged enum only from a YAML tag like `!prefix /api`, so reading
/// goes through [`PathMatchRepr`]; writing stays `{"prefix": "/api"}` in JSON.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", try_from = "PathMatchRepr")]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
    Regex(String),
}

/// The YAML shape of [`PathMatch`]: exactly one of the three keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathMatchRepr {
    #[serde(default)]
    pub exact: Option<String>,
    #[serde(default)]
    pub prefix: Option<String>,
    #[serde(default)]
    pub regex: Option<String>,
}

impl TryFrom<PathMatchRepr> for PathMatch {
    type Error = String;

    fn try_from(repr: PathMatchRepr) -> Result<Self, String> {
        match (repr.exact, repr.prefix, repr.regex) {
            (Some(p), None, None) => Ok(PathMatch::Exact(p)),
            (None, Some(p), None) => Ok(PathMatch::Prefix(p)),
            (None, None, Some(p)) => Ok(PathMatch::Regex(p)),
            (None, None, None) => Err(PATH_MATCH_NONE.to_string()),
            _ => Err(PATH_MATCH_MANY.to_string()),
        }
    }
}

pub(crate) const PATH_MATCH_NONE: &str =
    "path match is empty: it needs one of `exact`, `prefix`, `regex`";
pub(crate) const PATH_MATCH_MANY: &str =
    "path match sets more than one of `exact`, `prefix`, `regex`: a path match is exactly one of them";

/// A header or query-parameter condition. Exactly one of `exact`, `prefix`,
/// `present`, `regex` is set (checked by validation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedMatch {
    pub name: String,
    #[serde(default)]
    pub exact: Option<String>,
    #[serde(default)]
    pub prefix: Option<String>,
    #[serde(default)]
    pub present: Option<bool>,
    #[serde(default)]
    pub regex: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedCluster {
    pub cluster: String,
    pub weight: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirectResponse {
    pub status: u16,
    #[serde(default)]
    pub body: String,
}

/// `fault:` on a route: an abort, a delay, or both (the delay first, then the abort, as in
/// Envoy: a request both hit is answered with the abort after the delay).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort: Option<FaultAbort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay: Option<FaultDelay>,
}

/// Answer a share of the requests at once, without forwarding them. Exactly one of `status`
/// (an HTTP status; a gRPC client gets it mapped to a gRPC status) and `grpc_status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultAbort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_status: Option<u16>,
    /// The share of requests aborted, 0 to 100 (default 100).
    #[serde(default = "default_percent")]
    pub percent: f64,
}

/// Hold a share of the requests for `duration` before forwarding them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultDelay {
    #[serde(with = "crate::duration")]
    pub duration: Duration,
    /// The share of requests delayed, 0 to 100 (default 100).
    #[serde(default = "default_percent")]
    pub percent: f64,
}

/// `mirror:` on a route: a copy of a share of the requests goes to `cluster`, its answer
/// dropped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mirror {
    pub cluster: String,
    /// The share of requests mirrored, 0 to 100 (default 100).
    #[serde(default = "default_percent")]
    pub percent: f64,
}

fn default_percent() -> f64 {
    100.0
}

/// The largest gRPC status code (`UNAUTHENTICATED`).
pub const MAX_GRPC_STATUS: u16 = 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Extra attempts after the first (default 1).
    #[serde(default = "default_retry_attempts")]
    pub attempts: u32,
    /// When to retry: `connect-failure`, `reset`, `5xx`, `gateway-error` (502/503/504), and
    /// the gRPC statuses `unavailable`, `resource-exhausted`, `cancelled`, `deadline-exceeded`.
    #[serde(default = "default_retry_on")]
    pub on: Vec<RetryOn>,
    /// Bounds each try; absent: only the route's timeout bounds the tries (all together).
    /// A try that runs out of it is a failure that is retried.
    #[serde(
        default,
        with = "crate::duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub per_try_timeout: Option<Duration>,
    /// The wait between tries; absent: the defaults of [`RetryBackoff`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<RetryBackoff>,
    /// The share of requests the cluster's retries may be; absent: the defaults of
    /// [`RetryBudget`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<RetryBudget>,
    /// A request body of a declared length up to this many bytes is kept while it is sent,
    /// and sent again on a retry; a longer (or chunked) body is sent once, never retried.
    /// Default [`DEFAULT_MAX_REPLAY_BODY`], at most `validate::MAX_REPLAY_BODY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_replay_body: Option<u64>,
}

/// What `retries.max_replay_body` is when the route leaves it out: 64 KiB.
pub const DEFAULT_MAX_REPLAY_BODY: u64 = 64 * 1024;

impl RetryPolicy {
    /// The backoff in force: the configured one, else the defaults.
    pub fn backoff(&self) -> RetryBackoff {
        self.backoff.clone().unwrap_or_default()
    }

    /// The budget in force: the configured one, else the defaults.
    pub fn budget(&self) -> RetryBudget {
        self.budget.clone().unwrap_or_default()
    }

    /// The longest request body a retry may send again.
    pub fn max_replay_body(&self) -> u64 {
        self.max_replay_body.unwrap_or(DEFAULT_MAX_REPLAY_BODY)
    }
}

/// Exponential backoff with full jitter between tries (Envoy's `retry_back_off`): before
/// retry n (from 1) the driver waits a random time in `[0, min(max, base × 2^(n-1)))`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBackoff {
    /// Default 25ms (Envoy's).
    #[serde(default = "default_backoff_base", with = "crate::duration")]
    pub base: Duration,
    /// Default 10 × `base` (Envoy's).
    #[serde(
        default,
        with = "crate::duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub max: Option<Duration>,
}

fn default_backoff_base() -> Duration {
    Duration::from_millis(25)
}

impl Default for RetryBackoff {
    fn default() -> Self {
        RetryBackoff {
            base: default_backoff_base(),
            max: None,
        }
    }
}

impl RetryBackoff {
    /// The longest wait: `max`, else 10 × `base`.
    pub fn max(&self) -> Duration {
        self.max.unwrap_or(self.base.saturating_mul(10))
    }
}

/// Linkerd's retry budget, per cluster and node: over a sliding window of 10 s, the
/// cluster's retries may be at most `ratio` × its requests, plus `min_per_s` per second.
/// A retry over it is not made: the answer or failure in hand goes back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBudget {
    /// Default 0.2.
    #[serde(default = "default_budget_ratio")]
    pub ratio: f64,
    /// Default 10.
    #[serde(default = "default_budget_min_per_s")]
    pub min_per_s: u32,
}

fn default_budget_ratio() -> f64 {
    0.2
}
fn default_budget_min_per_s() -> u32 {
    10
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            ratio: default_budget_ratio(),
            min_per_s: default_budget_min_per_s(),
        }
    }
}

fn default_retry_attempts() -> u32 {
    1
}
fn default_retry_on() -> Vec<RetryOn> {
    vec![RetryOn::ConnectFailure]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RetryOn {
    ConnectFailure,
    Reset,
    #[serde(rename = "5xx")]
    Status5xx,
    GatewayError,
    /// gRPC status 14 in the answer's headers (a trailers-only answer).
    Unavailable,
    /// gRPC status 8.
    ResourceExhausted,
    /// gRPC status 1.
    Cancelled,
    /// gRPC status 4.
    DeadlineExceeded,
}

impl RetryOn {
    /// The gRPC status code this names, for the gRPC ones.
    pub fn grpc_status(self) -> Option<u32> {
        match self {
            RetryOn::Cancelled => Some(1),
            RetryOn::DeadlineExceeded => Some(4),
            RetryOn::ResourceExhausted => Some(8),
            RetryOn::Unavailable => Some(14),
            _ => None,
        }
    }

    /// The name the config (and Envoy's `retry_on`) spells it with.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryOn::ConnectFailure => "connect-failure",
            RetryOn::Reset => "reset",
            RetryOn::Status5xx => "5xx",
            RetryOn::GatewayError => "gateway-error",
            RetryOn::Unavailable => "unavailable",
            RetryOn::ResourceExhausted => "resource-exhausted",
            RetryOn::Cancelled => "cancelled",
            RetryOn::DeadlineExceeded => "deadline-exceeded",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    /// `static` (the default): the `endpoints` listed; `original_dst`: each connection or
    /// request goes to the address its client first dialled (see [`ClusterType`]).
    #[serde(
        default,
        rename = "type",
        skip_serializing_if = "ClusterType::is_static"
    )]
    pub kind: ClusterType,
    /// `original_dst` clusters: the destinations they may forward to (required).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<crate::cidr::Cidr>,
    /// `original_dst` clusters: the most distinct destinations whose idle connections a
    /// worker keeps pooled (default [`DEFAULT_MAX_DESTINATIONS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_destinations: Option<u32>,
    #[serde(default)]
    pub lb: LbPolicy,
    /// Addresses, or `{ address, weight, priority, locality }` mappings (none for an
    /// `original_dst` cluster).
    #[serde(default)]
    pub endpoints: crate::endpoints::Endpoints,
    /// Upstream protocol for HTTP traffic; default http1.
    #[serde(default)]
    pub protocol: UpstreamProtocol,
    /// ring_hash / maglev: what to hash. Falls back to the client address.
    #[serde(default)]
    pub hash_on: Option<HashOn>,
    /// Overrides `limits.connect_timeout` for this cluster.
    #[serde(default, with = "crate::duration::option")]
    pub connect_timeout: Option<Duration>,
    /// Originate (mutual) TLS to the endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClusterTls>,
    /// Carry each connection inside a tunnel to the endpoint's node (needs `tls`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<Tunnel>,
    /// The port the endpoints' nodes accept tunnels on; default [`HBONE_PORT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel_port: Option<u16>,
    /// Limits on what the node sends the cluster at once (Envoy's `circuit_breakers`);
    /// absent: the defaults of [`CircuitBreaker`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_breaker: Option<CircuitBreaker>,
    /// Ejects endpoints that keep failing (Envoy's `outlier_detection`); absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier_detection: Option<OutlierDetection>,
    /// Probes each endpoint and takes those that fail out of load balancing (Envoy's
    /// `health_checks`); absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// Ramps up the share of an endpoint that just came back (Envoy's `slow_start_config`);
    /// absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_start: Option<SlowStart>,
    /// How much headroom a priority level is assumed to have, in percent (Envoy's
    /// `overprovisioning_factor`): a level takes all its share while healthy/total ×
    /// this ≥ 100%. Default 140.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overprovisioning_factor: Option<u32>,
}

/// How a cluster finds where to send.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterType {
    /// Its `endpoints`, by its load-balancing policy.
    #[default]
    Static,
    /// The address the client first dialled, before iptables REDIRECT/TPROXY or tier K's
    /// capture sent the connection to the node (Envoy's `ORIGINAL_DST`), within `allow`.
    OriginalDst,
}

impl ClusterType {
    pub fn is_static(&self) -> bool {
        *self == ClusterType::Static
    }
}

/// An `original_dst` cluster's default `max_destinations`.
pub const DEFAULT_MAX_DESTINATIONS: u32 = 1024;

/// Envoy's default overprovisioning factor, in percent.
pub const DEFAULT_OVERPROVISIONING: u32 = 140;

/// A cluster's slow start (Envoy's `slow_start_config`): for `window` after an endpoint comes
/// back (passes its health check again, ends its ejection, or is new in a config update),
/// its weight is scaled by max(min_weight_percent, (time since / window)^(1/aggression)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlowStart {
    #[serde(with = "crate::duration")]
    pub window: Duration,
    /// 1.0 (the default) ramps linearly; higher ramps faster at first.
    #[serde(default = "default_aggression")]
    pub aggression: f64,
    /// The least share of its weight a ramping endpoint gets, in percent (default 10).
    #[serde(default = "default_min_weight_percent")]
    pub min_weight_percent: u32,
}

fn default_aggression() -> f64 {
    1.0
}
fn default_min_weight_percent() -> u32 {
    10
}

impl Cluster {
    /// An `original_dst` cluster's `max_destinations` in force.
    pub fn destinations_bound(&self) -> u32 {
        self.max_destinations.unwrap_or(DEFAULT_MAX_DESTINATIONS)
    }

    /// The overprovisioning factor in force, in percent.
    pub fn overprovisioning(&self) -> u32 {
        self.overprovisioning_factor
            .unwrap_or(DEFAULT_OVERPROVISIONING)
    }

    /// The circuit breaker in force: the configured one, else the defaults.
    pub fn breaker(&self) -> CircuitBreaker {
        self.circuit_breaker.clone().unwrap_or_default()
    }
}

/// A cluster's circuit breaker, per node (all workers together). Each limit has Envoy's
/// meaning and default; a request over one is answered 503 at once, never queued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreaker {
    /// Open connections to all endpoints of the cluster.
    #[serde(default = "default_breaker_limit")]
    pub max_connections: u32,
    /// Requests waiting for a new connection to the cluster to open.
    #[serde(default = "default_breaker_limit")]
    pub max_pending: u32,
    /// Requests outstanding to the cluster.
    #[serde(default = "default_breaker_limit")]
    pub max_requests: u32,
    /// Retries outstanding to the cluster; a retry over it is not made.
    #[serde(default = "default_breaker_retries")]
    pub max_retries: u32,
}

fn default_breaker_limit() -> u32 {
    1024
}
fn default_breaker_retries() -> u32 {
    3
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        CircuitBreaker {
            max_connections: default_breaker_limit(),
            max_pending: default_breaker_limit(),
            max_requests: default_breaker_limit(),
            max_retries: default_breaker_retries(),
        }
    }
}

/// A cluster's outlier detection, with Envoy's semantics: an endpoint with N consecutive
/// failures of one kind is ejected for `base_ejection_time` × the times it has been ejected;
/// no more than `max_ejection_percent` of the endpoints are out at once. A threshold of 0
/// turns that kind off. Every `interval` the endpoints' success rates and failure
/// percentages over it are judged too (`success_rate`, on by default as in Envoy, and
/// `failure_percentage`, off by default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierDetection {
    /// Consecutive 5xx answers (and failures to get one: reset, timeout, no connection).
    #[serde(default = "default_consecutive_5xx")]
    pub consecutive_5xx: u32,
    /// Consecutive 502/503/504 answers (and failures to get one); off by default, as
    /// Envoy enforces none of them by default.
    #[serde(default)]
    pub consecutive_gateway_errors: u32,
    /// Consecutive connections that could not be opened.
    #[serde(default = "default_consecutive_5xx")]
    pub consecutive_connect_failures: u32,
    /// How often an endpoint that stays in has its ejection count lowered by one.
    #[serde(default = "default_outlier_interval", with = "crate::duration")]
    pub interval: Duration,
    /// An ejection lasts this × the number of times the endpoint has been ejected.
    #[serde(default = "default_base_ejection_time", with = "crate::duration")]
    pub base_ejection_time: Duration,
    /// The most of the cluster's endpoints, in percent, that may be out at once. As in Envoy,
    /// an ejection that would pass it is not made: the default 10% ejects nothing in a
    /// cluster of fewer than ten endpoints.
    #[serde(default = "default_max_ejection_percent")]
    pub max_ejection_percent: u32,
    #[serde(default)]
    pub success_rate: SuccessRate,
    #[serde(default)]
    pub failure_percentage: FailurePercentage,
}

/// Success-rate outlier detection (Envoy's `success_rate_*`): every `interval`, among the
/// endpoints that took at least `request_volume` requests in it, when there are at least
/// `minimum_hosts` of them, an endpoint whose success rate is below mean − stdev_factor/1000
/// × the standard deviation is ejected. A success is any answer below 500.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SuccessRate {
    /// Whether it ejects (Envoy's `enforcing_success_rate` at 100, its default, or 0).
    pub enforcing: bool,
    pub minimum_hosts: u32,
    pub request_volume: u32,
    /// In thousandths, as Envoy's: 1900 is 1.9 standard deviations.
    pub stdev_factor: u32,
}

impl Default for SuccessRate {
    fn default() -> Self {
        SuccessRate {
            enforcing: true,
            minimum_hosts: 5,
            request_volume: 100,
            stdev_factor: 1900,
        }
    }
}

/// Failure-percentage outlier detection (Envoy's `failure_percentage_*`): every `interval`,
/// among the endpoints that took at least `request_volume` requests in it, when there are at
/// least `minimum_hosts` of them, an endpoint whose share of failed requests is at least
/// `threshold` percent is ejected. Off by default, as in Envoy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailurePercentage {
    /// Whether it ejects (Envoy's `enforcing_failure_percentage` at 100, or 0, its default).
    pub enforcing: bool,
    pub threshold: u32,
    pub minimum_hosts: u32,
    pub request_volume: u32,
}

impl Default for FailurePercentage {
    fn default() -> Self {
        FailurePercentage {
            enforcing: false,
            threshold: 85,
            minimum_hosts: 5,
            request_volume: 50,
        }
    }
}

fn default_consecutive_5xx() -> u32 {
    5
}
fn default_outlier_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_base_ejection_time() -> Duration {
    Duration::from_secs(30)
}
fn default_max_ejection_percent() -> u32 {
    10
}

impl Default for OutlierDetection {
    fn default() -> Self {
        OutlierDetection {
            consecutive_5xx: default_consecutive_5xx(),
            consecutive_gateway_errors: 0,
            consecutive_connect_failures: default_consecutive_5xx(),
            interval: default_outlier_interval(),
            base_ejection_time: default_base_ejection_time(),
            max_ejection_percent: default_max_ejection_percent(),
            success_rate: SuccessRate::default(),
            failure_percentage: FailurePercentage::default(),
        }
    }
}

/// A cluster's active health check: every `interval` (plus up to 10% jitter) the node probes
/// each endpoint, bounded by `timeout`. An endpoint starts healthy, is taken out of load
/// balancing after `unhealthy_threshold` consecutive failed probes and back in after
/// `healthy_threshold` consecutive passes. Exactly one of `http`, `tcp`, `grpc`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpHealthCheck>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<TcpHealthCheck>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcHealthCheck>,
    #[serde(default = "default_health_interval", with = "crate::duration")]
    pub interval: Duration,
    #[serde(default = "default_health_timeout", with = "crate::duration")]
    pub timeout: Duration,
    #[serde(default = "default_unhealthy_threshold")]
    pub unhealthy_threshold: u32,
    #[serde(default = "default_healthy_threshold")]
    pub healthy_threshold: u32,
}

fn default_health_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_health_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_unhealthy_threshold() -> u32 {
    3
}
fn default_healthy_threshold() -> u32 {
    2
}

impl HealthCheck {
    /// A health check of `kind` with every other setting at its default.
    pub fn new(kind: HealthCheckKind) -> HealthCheck {
        let mut check = HealthCheck {
            http: None,
            tcp: None,
            grpc: None,
            interval: default_health_interval(),
            timeout: default_health_timeout(),
            unhealthy_threshold: default_unhealthy_threshold(),
            healthy_threshold: default_healthy_threshold(),
        };
        match kind {
            HealthCheckKind::Http(h) => check.http = Some(h),
            HealthCheckKind::Tcp => check.tcp = Some(TcpHealthCheck {}),
            HealthCheckKind::Grpc(g) => check.grpc = Some(g),
        }
        check
    }

    /// The probe, once validation has made sure exactly one is set (`tcp` if none is).
    pub fn kind(&self) -> HealthCheckKind {
        match (&self.http, &self.grpc) {
            (Some(h), _) => HealthCheckKind::Http(h.clone()),
            (None, Some(g)) => HealthCheckKind::Grpc(g.clone()),
            (None, None) => HealthCheckKind::Tcp,
        }
    }
}

/// What a health check sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthCheckKind {
    Http(HttpHealthCheck),
    Tcp,
    Grpc(GrpcHealthCheck),
}

/// `GET path` over HTTP/1.1; the endpoint passes when the status is one of `expect`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpHealthCheck {
    pub path: String,
    /// Default 200.
    #[serde(default)]
    pub expect: ExpectStatus,
}

/// A connection that opens passes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpHealthCheck {}

/// `grpc.health.v1.Health/Check` over HTTP/2 (cleartext); SERVING passes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcHealthCheck {
    /// The service asked about; empty (the default) asks about the server as a whole.
    #[serde(default)]
    pub service: String,
}

/// The statuses an HTTP health check accepts, as inclusive ranges. YAML: a status (`204`),
/// a range (`"200-299"`) or a list of either (`[200, "300-302"]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectStatus(pub Vec<(u16, u16)>);

impl Default for ExpectStatus {
    fn default() -> Self {
        ExpectStatus(vec![(200, 200)])
    }
}

impl ExpectStatus {
    pub fn accepts(&self, status: u16) -> bool {
        self.0
            .iter()
            .any(|(from, to)| (*from..=*to).contains(&status))
    }
}

impl std::fmt::Display for ExpectStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (from, to)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if from == to {
                write!(f, "{from}")?;
            } else {
                write!(f, "{from}-{to}")?;
            }
        }
        Ok(())
    }
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum ExpectOne {
    Code(u16),
    Range(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ExpectYaml {
    One(ExpectOne),
    Many(Vec<ExpectOne>),
}

impl ExpectOne {
    fn range(self) -> Result<(u16, u16), String> {
        match self {
            ExpectOne::Code(c) => Ok((c, c)),
            ExpectOne::Range(s) => {
                let parse = |t: &str| t.trim().parse::<u16>().ok();
                let parsed = match s.split_once('-') {
                    Some((a, b)) => parse(a).zip(parse(b)),
                    None => parse(&s).map(|c| (c, c)),
                };
                parsed.ok_or_else(|| {
                    format!("`{s}` is not a status nor a range of statuses like \"200-299\"")
                })
            }
        }
    }
}

impl Serialize for ExpectStatus {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let one = |(from, to): (u16, u16)| {
            if from == to {
                ExpectOne::Code(from)
            } else {
                ExpectOne::Range(format!("{from}-{to}"))
            }
        };
        match self.0.as_slice() {
            [only] => one(*only).serialize(s),
            all => all.iter().map(|r| one(*r)).collect::<Vec<_>>().serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ExpectStatus {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let items = match ExpectYaml::deserialize(d)? {
            ExpectYaml::One(one) => vec![one],
            ExpectYaml::Many(many) => many,
        };
        items
            .into_iter()
            .map(ExpectOne::range)
            .collect::<Result<Vec<_>, _>>()
            .map(ExpectStatus)
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LbPolicy {
    #[default]
    RoundRobin,
    LeastRequest,
    Random,
    RingHash,
    Maglev,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamProtocol {
    #[default]
    Http1,
    Http2,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HashOn {
    /// Request header whose value is hashed, e.g. `x-user`.
    pub header: String,
}

impl Config {
    /// Number of workers to run: the configured count, else the number of cores.
    pub fn worker_count(&self) -> usize {
        self.workers
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            })
            .max(1)
    }

    /// The `http` listener whose first requests tier K decides: `kernel.l7_listener`, or
    /// the only http listener. `None` when `kernel.l7_dispatch` is off.
    pub fn kernel_l7_listener(&self) -> Option<&str> {
        let k = self.kernel.as_ref().filter(|k| k.l7_dispatch)?;
        let name = k.l7_listener.as_deref().or_else(|| {
            self.listeners
                .iter()
                .find(|l| l.protocol == ListenerProtocol::Http)
                .map(|l| l.name.as_str())
        })?;
        // The kernel reads requests in the clear: a listener that terminates TLS is not one.
        self.listeners
            .iter()
            .any(|l| l.name == name && l.tls.is_none())
            .then_some(name)
    }

    /// Whether tier K splices `tcp` listeners' connections.
    pub fn kernel_tcp_splice(&self) -> bool {
        self.kernel.as_ref().is_some_and(|k| k.tcp_splice)
    }

    pub fn cluster(&self, name: &str) -> Option<&Cluster> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// The config as pretty JSON, for the admin `/config` endpoint. Durations are
    /// written as `2s`/`250ms` and path matches as `{"prefix": "/api"}`, the same
    /// shape the YAML takes, so the output parses back into an equal `Config`.
    pub fn to_json(&self) -> String {
        // Serializing these types cannot fail (all map keys are strings); if it ever
        // did, say so in the JSON rather than panicking in the admin server.
        serde_json::to_string_pretty(self).unwrap_or_else(|error| {
            serde_json::json!({ "error": format!("config could not be serialized: {error}") })
                .to_string()
        })
    }
}

impl Listener {
    /// Whether the listener has a route that denies (answers itself with a `direct_response`
    /// of 400 or more, a 403 say): then a path that walks around it matters, and path
    /// normalisation defaults on. A `/healthz` answered 200 denies nothing.
    pub fn path_defaults_on(&self) -> bool {
        let route_denies = self
            .routes
            .iter()
            .any(|r| r.direct_response.as_ref().is_some_and(|d| d.status >= 400));
        // A policy on paths is a deny too (a `deny` one, or an `allow` one that leaves the
        // rest out): no spelling of a path may walk around it.
        let policy_on_paths = self.authorization.as_ref().is_some_and(|a| {
            a.policies
                .iter()
                .any(|p| p.to.as_ref().is_some_and(|t| !t.paths.is_empty()))
        });
        route_denies || policy_on_paths
    }

    /// The listener's path normalisation: each key as set, else its default.
    pub fn path_options(&self) -> PathOptions {
        let default = if self.path_defaults_on() {
            PathOptions::STRICT
        } else {
            PathOptions::RAW
        };
        PathOptions {
            normalize_path: self.normalize_path.unwrap_or(default.normalize_path),
            merge_slashes: self.merge_slashes.unwrap_or(default.merge_slashes),
            escaped_slashes: self
                .path_with_escaped_slashes_action
                .unwrap_or(default.escaped_slashes),
        }
    }
}

impl Route {
    /// The route's display name: its own, or `<listener>/<index>`.
    pub fn display_name(&self, listener: &str, index: usize) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("{listener}/{index}"))
    }
}
