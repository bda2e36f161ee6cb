//! The one error type of an upstream exchange, whichever codec ran it (Pingora's
//! `pingora-error` is the model): where the failure came from, what it was, whether sending
//! the request again is safe, and whether the connection came from the pool. The retry
//! driver ([`super::retry`]) reads it to decide on another try; [`super::reply`] turns it
//! into the answer the client gets.

use std::fmt;
use std::io;
use std::net::SocketAddr;

use crate::resilience::Overflow;

/// Where a failure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Opening a connection to the endpoint.
    Connect,
    /// The endpoint, on an open connection.
    Upstream,
    /// The client: its request cannot go on, or it went away.
    Downstream,
    /// The proxy itself: it has nowhere to send the request.
    Internal,
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No connection to the endpoint could be made (refused, unreachable, timed out).
    ConnectFailed,
    /// The endpoint reset or closed the connection before a complete answer.
    Closed,
    /// The route's timeout passed before an answer.
    Timeout,
    /// The route's `retries.per_try_timeout` passed before this try's answer.
    PerTryTimeout,
    /// The endpoint's answer is not valid HTTP.
    InvalidResponse,
    /// The client's request body broke off or is malformed (a bad chunk size, say).
    RequestBody,
    /// The request body moved no byte for the idle timeout before it was complete: the
    /// client stopped sending, or the endpoint stopped reading.
    UploadStalled,
    /// The request cannot be sent on as it is; says which part.
    UnusableRequest(&'static str),
    /// The client went away before its request was sent: nobody is left to answer.
    ClientGone,
    /// The cluster has no endpoint to send to.
    NoEndpoint,
    /// The cluster's circuit breaker refused the request: says which limit.
    Overflow(Overflow),
    /// An `original_dst` cluster may not send the request where its client was going
    /// (`crate::original_dst`): the HTTP status to answer with.
    DestinationRefused(u16),
}

/// A failed upstream exchange.
#[derive(Debug, Clone)]
pub struct UpstreamError {
    pub source: Source,
    pub kind: Kind,
    /// Sending the request again cannot repeat an effect of it: the endpoint never got it
    /// (no connection was made, or a pooled connection failed before any byte of an answer,
    /// which means the endpoint had closed it while it sat idle).
    pub retry_safe: bool,
    /// The exchange ran on a connection taken from the pool rather than opened for it.
    pub reused: bool,
    /// The endpoint the exchange was sent to (set by the retry driver).
    pub endpoint: Option<SocketAddr>,
    /// What happened, in words, for the reply and the log.
    pub detail: String,
}

impl UpstreamError {
    fn new(source: Source, kind: Kind, detail: String) -> Self {
        UpstreamError {
            source,
            kind,
            retry_safe: false,
            reused: false,
            endpoint: None,
            detail,
        }
    }

    /// No connection could be opened: the request never left.
    pub fn connect(err: impl fmt::Display) -> Self {
        UpstreamError {
            retry_safe: true,
            ..Self::new(Source::Connect, Kind::ConnectFailed, err.to_string())
        }
    }

    /// The endpoint failed or closed before a complete answer. `reused`: on a pooled
    /// connection; `answered`: some bytes of an answer had arrived.
    pub fn closed(err: impl fmt::Display, reused: bool, answered: bool) -> Self {
        UpstreamError {
            reused,
            retry_safe: reused && !answered,
            ..Self::new(Source::Upstream, Kind::Closed, err.to_string())
        }
    }

    /// The endpoint's answer is not valid HTTP.
    pub fn invalid(why: impl Into<String>) -> Self {
        Self::new(Source::Upstream, Kind::InvalidResponse, why.into())
    }

    /// The route's timeout passed.
    pub fn timeout() -> Self {
        Self::new(Source::Upstream, Kind::Timeout, String::new())
    }

    /// The route's per-try timeout, `per_try`, passed.
    pub fn per_try_timeout(per_try: std::time::Duration) -> Self {
        Self::new(
            Source::Upstream,
            Kind::PerTryTimeout,
            format!(
                "no answer within the per-try timeout of {} (retries.per_try_timeout)",
                flatmesh_config::duration::format(&per_try)
            ),
        )
    }

    /// The client's body broke off or is malformed.
    pub fn request_body(why: impl fmt::Display) -> Self {
        Self::new(Source::Downstream, Kind::RequestBody, why.to_string())
    }

    /// The request body stalled for `idle` before it was complete.
    pub fn upload_stalled(idle: std::time::Duration) -> Self {
        Self::new(
            Source::Downstream,
            Kind::UploadStalled,
            format!(
                "no byte of the request body moved for {} (limits.idle_timeout)",
                flatmesh_config::duration::format(&idle)
            ),
        )
    }

    /// The request cannot be sent on: `what` names the part (the target, the head).
    pub fn unusable_request(what: &'static str) -> Self {
        Self::new(
            Source::Downstream,
            Kind::UnusableRequest(what),
            String::new(),
        )
    }

    /// The client went away.
    pub fn client_gone(err: io::Error) -> Self {
        Self::new(Source::Downstream, Kind::ClientGone, err.to_string())
    }

    /// The cluster has no endpoint.
    pub fn no_endpoint() -> Self {
        Self::new(Source::Internal, Kind::NoEndpoint, String::new())
    }

    /// An `original_dst` cluster refused the request's destination.
    pub fn destination_refused(refused: &crate::original_dst::Refused) -> Self {
        Self::new(
            Source::Internal,
            Kind::DestinationRefused(refused.status()),
            refused.to_string(),
        )
    }

    /// The cluster's circuit breaker refused: its `kind` limit is reached.
    pub fn overflow(kind: Overflow) -> Self {
        Self::new(Source::Internal, Kind::Overflow(kind), String::new())
    }

    /// A pooled connection the endpoint had closed while idle: not a failure of the
    /// endpoint, worth one more try on a fresh connection.
    pub fn is_stale_connection(&self) -> bool {
        self.reused && self.retry_safe
    }

    /// The detail with the endpoint it came from: `endpoint 10.0.0.1:80: connection refused`.
    pub fn located(&self) -> String {
        match self.endpoint {
            Some(endpoint) => format!("endpoint {endpoint}: {}", self.detail),
            None => self.detail.clone(),
        }
    }
}

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({:?}): {}", self.kind, self.source, self.located())
    }
}
