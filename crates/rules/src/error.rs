//! The one error type of this crate: why a config could not be compiled into a RuleProgram.
//!
//! The config crate validates first, so most of these should never be seen by a user; they
//! still say what to fix because `compile` may be called on configs built in code or from xDS.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RulesError {
    #[error("route `{route}` names cluster `{cluster}`, which is not defined: add it under `clusters:` or fix the name")]
    UnknownCluster { route: String, cluster: String },

    #[error("tcp listener `{listener}` names cluster `{cluster}`, which is not defined: add it under `clusters:` or fix the name")]
    UnknownTcpCluster { listener: String, cluster: String },

    #[error("listener `{listener}`, authorization policy `{policy}`: {what}")]
    BadPolicy {
        listener: String,
        policy: String,
        what: String,
    },

    #[error("tcp listener `{listener}` has no `cluster`: a tcp listener forwards every connection to one cluster, so set `cluster: NAME`")]
    TcpWithoutCluster { listener: String },

    #[error(
        "route `{route}` sets {found}: set exactly one of `cluster`, `split` or `direct_response`"
    )]
    ActionCount { route: String, found: String },

    #[error("route `{route}` has a split whose weights sum to {total}: give at least one cluster a weight above 0, and keep the sum at most {max}")]
    SplitWeights { route: String, total: u64, max: u64 },

    #[error("route `{route}`: {what} regex `{pattern}` does not compile ({reason}); fix the pattern (syntax: https://docs.rs/regex/#syntax)")]
    BadRegex {
        route: String,
        what: String,
        pattern: String,
        reason: String,
    },

    #[error("listener `{listener}`: the {count} path regexes together are too large to compile ({reason}); use fewer or simpler regexes, or prefix/exact paths")]
    RegexSetTooLarge {
        listener: String,
        count: usize,
        reason: String,
    },

    #[error("route `{route}`: method `{method}` is not a valid HTTP method token; write it like `GET` or `POST`")]
    BadMethod { route: String, method: String },

    #[error("route `{route}`: `{name}` is not a valid header name; use letters, digits and `-` only, e.g. `x-request-id`")]
    BadHeaderName { route: String, name: String },

    #[error("route `{route}`: the value of header `{name}` is not a valid header value (control characters or newlines); remove them")]
    BadHeaderValue { route: String, name: String },

    #[error("route `{route}`: {what} `{name}` must set exactly one of `exact`, `prefix`, `present` or `regex` (it sets {count})")]
    MatcherKind {
        route: String,
        what: String,
        name: String,
        count: usize,
    },

    #[error("route `{route}`: grpc_field {number} must be a protobuf field number (1..=536870911) with exactly one of `exact` or `prefix`")]
    BadGrpcField { route: String, number: u32 },

    #[error("route `{route}`: direct_response status {status} is not a valid HTTP status; use 100..=999, e.g. 200 or 503")]
    BadStatus { route: String, status: u16 },

    #[error("route `{route}`: host pattern `{host}` is not valid; write an exact host (`api.local`) or a wildcard suffix (`*.example.com`)")]
    BadHost { route: String, host: String },

    #[error("{what} name `{name}` is used twice; give each {what} a unique name")]
    DuplicateName { what: &'static str, name: String },

    #[error("listener `{listener}` has {count} routes; at most {max} are supported, merge routes or split them across listeners")]
    TooManyRoutes {
        listener: String,
        count: usize,
        max: usize,
    },

    /// Skip-and-check rules that do not fit the Matcher's tables (the text says by how much).
    #[error("{0}")]
    TableFull(String),

    #[error("bad table image: {0}; recompile it with `flatmesh qnp rules compile` (an http listeners' image: `flatmesh check --nic-image`)")]
    BadImage(String),
}
