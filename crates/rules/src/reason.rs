//! Why a rule runs where it runs: the one vocabulary every lowering, `--explain` and `/rules` use.

use serde::Serialize;

use crate::RouteId;

/// Why a tier decides a rule, or why it hands the rule to a more capable tier. Route-level
/// reasons (what the rule needs) come before table-level ones (what the table has room for).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    // What the tier does.
    /// Tier K decides the route on a connection's first request.
    KernelDecides,
    /// Tier K splices a tcp listener's connections.
    KernelSplices,
    /// Tier K's sk_reuseport program dispatches a qnp listener's requests by its Matcher image.
    KernelDispatchesQnp,
    /// The NIC image decides the route.
    ImageDecides,

    // What the route needs that only the user tier has.
    HostMatch,
    HeaderMatch,
    QueryMatch,
    /// A condition on the first gRPC message (`grpc_field`).
    GrpcFieldMatch,
    RegexPath,
    /// A path longer than the tier compares.
    PathTooLong {
        max: usize,
    },
    /// A method longer than the kernel compares.
    MethodTooLong {
        max: usize,
    },
    /// The path holds `?`, a space, CR or LF, which no request path does.
    PathNeverMatches,
    /// A non-empty path that does not start with `/`: only `OPTIONS *` could match it.
    PathNotOrigin,
    /// The listener normalises paths and this exact path is not normal: no normalised request
    /// path equals it, so the route never matches.
    PathNotNormal,
    /// The listener normalises paths; the image compares the path as received, so it decides
    /// exact paths only.
    PathNormalized,
    /// An exact path with `%`, `//` or a dot segment: tier K decides plain paths only.
    PathNotPlain,
    Split,
    DirectResponse,
    HeaderRewrite,
    Retries,
    Timeout,
    /// The route injects faults (`fault:`): drawn and answered or delayed per request.
    Fault,
    /// The route mirrors requests (`mirror:`): a copy goes to another cluster.
    Mirror,
    /// The route's cluster hashes on a request header.
    HashOn,
    /// The cluster originates TLS: the proxy encrypts what goes to it.
    UpstreamTls,
    /// The listener terminates TLS: every lower tier sees ciphertext.
    ListenerTls,
    /// The cluster tunnels its connections (HBONE): only the user tier speaks HTTP/2 CONNECT.
    Tunnel,
    /// An hbone listener: each CONNECT stream is relayed by the user tier.
    HboneListener,
    /// The listener has authorization policies, which the user tier runs.
    Authorization,
    /// The listener has a `rate_limit`, which the user tier counts on every request.
    ListenerRateLimit,
    /// The route has a `rate_limit`, which the user tier counts on every request.
    RateLimit,

    // Why tier K splices none of an http listener's connections: a spliced connection
    // carries every later request to the first one's endpoint, so the kernel splices only
    // where every request the connection could carry gets that same answer.
    /// Another route of the listener needs the user tier, and a spliced connection could
    /// carry its requests.
    SpliceRoute {
        route: RouteId,
    },
    /// The listener's routes lead to more than one cluster.
    SpliceClusters,
    /// The one cluster has several endpoints, balanced per request.
    SpliceEndpoints {
        endpoints: usize,
    },
    /// The one cluster has health checks, outlier detection or its own circuit breaker,
    /// which act on every request.
    SpliceClusterChecks,
    /// No route takes every request (no method and no path condition): a later request the
    /// user tier answers 404 would reach the cluster.
    SpliceNoCatchAll,
    /// The listener normalises paths: the user tier rewrites, refuses or redirects some
    /// requests' paths, which a spliced connection forwards as received.
    SplicePaths,
    /// The access log records every request, which a spliced connection would not.
    AccessLog,

    // What the config asks for.
    NoKernelSection,
    NoL7Dispatch,
    /// The kernel decides the routes of another http listener (`kernel.l7_listener`).
    OtherL7Listener,
    TcpSpliceOff,

    // What the tables hold.
    /// An earlier route's entry takes every request this route could match.
    Shadowed {
        by: RouteId,
    },
    /// The kernel's route table is full.
    KernelTableFull {
        entries: usize,
    },
    /// The NIC image is full.
    ImageFull {
        entries: usize,
    },
    /// The listener's app has used every check state of the image.
    ImageStates {
        max: usize,
    },
    /// Image queues are 8 bits: routes from this index on get none.
    QueueRange {
        max_route: usize,
    },
    /// Image app ids are 8 bits: listeners from this index on get none.
    AppIdRange {
        max_listener: usize,
    },
}

impl Reason {
    /// Whether the reason is about the route itself rather than the table or the config:
    /// a route-level reason is the one worth showing when both apply.
    pub fn is_route_level(self) -> bool {
        !matches!(
            self,
            Reason::NoKernelSection
                | Reason::NoL7Dispatch
                | Reason::OtherL7Listener
                | Reason::TcpSpliceOff
                | Reason::ListenerTls
                | Reason::HboneListener
                | Reason::KernelDispatchesQnp
                | Reason::Authorization
                | Reason::ListenerRateLimit
                | Reason::SpliceRoute { .. }
                | Reason::SpliceClusters
                | Reason::SpliceEndpoints { .. }
                | Reason::SpliceClusterChecks
                | Reason::SpliceNoCatchAll
                | Reason::SplicePaths
                | Reason::AccessLog
                | Reason::Shadowed { .. }
                | Reason::KernelTableFull { .. }
                | Reason::ImageFull { .. }
                | Reason::ImageStates { .. }
                | Reason::QueueRange { .. }
                | Reason::AppIdRange { .. }
        )
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::KernelDecides => f.write_str(
                "decided in the kernel (sk_skb) on the first request, the connection then spliced: every request the listener takes gets this one answer",
            ),
            Reason::KernelSplices => {
                f.write_str("L4 only: spliced in the kernel (sk_skb), kernel.tcp_splice")
            }
            Reason::KernelDispatchesQnp => f.write_str(
                "dispatched in the kernel (sk_reuseport) by the listener's Matcher image, one lookup walk per first packet; user space if the program cannot load",
            ),
            Reason::ImageDecides => f.write_str("decided by the NIC image"),
            Reason::HostMatch => f.write_str("host match needs the full request head"),
            Reason::HeaderMatch => f.write_str("header match needs the full request head"),
            Reason::QueryMatch => f.write_str("query match needs URL decoding"),
            Reason::GrpcFieldMatch => {
                f.write_str("grpc_field match needs the first gRPC message, which the user tier reads")
            }
            Reason::RegexPath => f.write_str("regex runs only in the user tier"),
            Reason::PathTooLong { max } => write!(f, "path longer than the {max} bytes compared"),
            Reason::MethodTooLong { max } => {
                write!(f, "method longer than the {max} bytes the kernel compares")
            }
            Reason::PathNeverMatches => f.write_str(
                "its path holds `?`, a space, CR or LF, which no request path does: it never matches",
            ),
            Reason::PathNotOrigin => {
                f.write_str("path does not start with `/`: only `OPTIONS *` could match it")
            }
            Reason::PathNotNormal => f.write_str(
                "the listener normalises paths and this one is not normal: no request path matches it",
            ),
            Reason::PathNormalized => f.write_str(
                "the listener normalises paths and the image reads them as received: it decides exact paths only",
            ),
            Reason::PathNotPlain => f.write_str(
                "the kernel decides plain paths only (no `%`, `//` or dot segment), and this one is not",
            ),
            Reason::Split => f.write_str("weighted split is picked per request by the user tier"),
            Reason::DirectResponse => f.write_str("direct response is answered by the user tier"),
            Reason::HeaderRewrite => f.write_str("header rewrite needs the user tier"),
            Reason::Retries => f.write_str("retries need the user tier"),
            Reason::Timeout => f.write_str("per-request timeout needs the user tier"),
            Reason::Fault => f.write_str("fault injection runs in the user tier"),
            Reason::Mirror => f.write_str(
                "mirroring runs in the user tier (it copies the request to another cluster)",
            ),
            Reason::HashOn => f.write_str(
                "its cluster hashes on a request header, which the kernel does not read",
            ),
            Reason::UpstreamTls => f.write_str(
                "its cluster originates TLS, which only the user tier does",
            ),
            Reason::Tunnel => f.write_str(
                "its cluster tunnels (HBONE: HTTP/2 CONNECT inside mutual TLS), which only the user tier does",
            ),
            Reason::HboneListener => f.write_str(
                "an hbone listener: its CONNECT streams arrive inside mutual TLS and HTTP/2, which only the user tier reads",
            ),
            Reason::ListenerTls => f.write_str(
                "the listener terminates TLS: only the user tier sees the requests in the clear",
            ),
            Reason::Authorization => f.write_str(
                "the listener has authorization policies, which only the user tier runs",
            ),
            Reason::ListenerRateLimit => f.write_str(
                "the listener has a rate_limit, which only the user tier counts",
            ),
            Reason::RateLimit => f.write_str("the route has a rate_limit, which only the user tier counts"),
            Reason::SpliceRoute { route } => write!(
                f,
                "route {route} of the listener needs the user tier, and a spliced connection could carry its requests: the kernel splices none of the listener's connections"
            ),
            Reason::SpliceClusters => f.write_str(
                "the listener's routes lead to more than one cluster: a spliced connection would send every later request to the first one's, so the kernel splices none",
            ),
            Reason::SpliceEndpoints { endpoints } => write!(
                f,
                "its cluster has {endpoints} endpoints, balanced per request: a spliced connection would keep the first one's, so the kernel splices none"
            ),
            Reason::SpliceClusterChecks => f.write_str(
                "its cluster has a health check, outlier detection or its own circuit_breaker, which act on every request: the kernel splices none",
            ),
            Reason::SpliceNoCatchAll => f.write_str(
                "no route of the listener takes every request (no method and no path condition: `prefix: /` misses `OPTIONS *`): a later request the user tier answers 404 would reach the cluster, so the kernel splices none",
            ),
            Reason::SplicePaths => f.write_str(
                "the listener normalises paths (normalize_path, merge_slashes or path_with_escaped_slashes_action; a deny route turns them on): the user tier rewrites, refuses or redirects some paths, which a spliced connection would forward as received, so the kernel splices none",
            ),
            Reason::AccessLog => f.write_str(
                "the access log records every request, which a spliced connection would not: the kernel splices none",
            ),
            Reason::NoKernelSection => f.write_str("the config has no `kernel:` section"),
            Reason::NoL7Dispatch => f.write_str("kernel.l7_dispatch is off"),
            Reason::OtherL7Listener => {
                f.write_str("the kernel decides the routes of kernel.l7_listener only")
            }
            Reason::TcpSpliceOff => f.write_str("L4 only: the user L4 relay (kernel.tcp_splice is off)"),
            Reason::Shadowed { by } => write!(
                f,
                "route {by}'s entry comes first and takes every request this route could match"
            ),
            Reason::KernelTableFull { entries } => {
                write!(f, "the kernel's route table ({entries} entries) is full")
            }
            Reason::ImageFull { entries } => {
                write!(f, "the NIC image ({entries} entries) is full")
            }
            Reason::ImageStates { max } => write!(
                f,
                "the listener's app used the image's {max} check states"
            ),
            Reason::QueueRange { max_route } => write!(
                f,
                "image queues are 8 bits: only routes 0..={max_route} get one"
            ),
            Reason::AppIdRange { max_listener } => write!(
                f,
                "image app ids are 8 bits: only listeners 0..={max_listener} get one"
            ),
        }
    }
}

impl Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}
