//! Envoy's local rate limits ↔ flatmesh's rate limits (docs/resilience.md, "Rate limits").
//!
//! - `envoy.filters.http.local_ratelimit` in the HTTP connection manager's filters, with a
//!   `token_bucket`: the listener's `rate_limit`; without one, it only lets routes have theirs.
//! - the same filter's config in a route's `typed_per_filter_config`: the route's `rate_limit`
//!   (Envoy applies it only when the connection manager runs the filter; so does the import).
//! - `envoy.filters.network.local_ratelimit` before `tcp_proxy`: the listener's
//!   `connection_rate_limit`.
//!
//! A token bucket maps when it refills a whole number of tokens per second
//! (`tokens_per_fill / fill_interval`): `requests_per_s`, with `max_tokens` as the burst.
//! Envoy's local rate limit is per Envoy instance (its workers share the bucket) and refills
//! in steps every `fill_interval`; flatmesh's refills continuously at the same average rate.
//! A keyed flatmesh limit has no such Envoy filter and is not served (docs/resilience.md).

use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit as HttpLocalRateLimit;
use envoy_types::pb::envoy::extensions::filters::network::local_ratelimit::v3::LocalRateLimit as NetworkLocalRateLimit;
use envoy_types::pb::envoy::r#type::v3::{fractional_percent, FractionalPercent, TokenBucket};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use flatmesh_config as model;

use crate::error::{Result, XdsError};
use crate::to_model::{duration, reject_rest, unpack};

pub const HTTP_NAME: &str = "envoy.filters.http.local_ratelimit";
pub const NETWORK_NAME: &str = "envoy.filters.network.local_ratelimit";

/// Whether `any` is the HTTP local rate limit's config.
pub fn is_http(any: &Any) -> bool {
    any.type_url == <HttpLocalRateLimit as prost::Name>::type_url()
}

/// Whether `any` is the network local rate limit's config.
pub fn is_network(any: &Any) -> bool {
    any.type_url == <NetworkLocalRateLimit as prost::Name>::type_url()
}

/// `requests_per_s` and `burst` of an Envoy token bucket.
fn bucket(tb: TokenBucket, at: &str) -> Result<(u32, u32)> {
    let per_fill = tb.tokens_per_fill.map_or(1, |v| v.value);
    let Some(fill) = tb.fill_interval else {
        return Err(XdsError::resource(
            format!("{at}.fill_interval"),
            "is missing: a token bucket needs it",
        ));
    };
    let fill = duration(&fill, &format!("{at}.fill_interval"))?;
    if tb.max_tokens == 0 || per_fill == 0 || fill.is_zero() {
        return Err(XdsError::resource(
            at,
            "max_tokens, tokens_per_fill and fill_interval must be positive (a bucket that never fills refuses everything; remove the filter instead)",
        ));
    }
    let per_s = u128::from(per_fill) * 1_000_000_000;
    let nanos = fill.as_nanos();
    let rate = u32::try_from(per_s / nanos)
        .ok()
        .filter(|_| per_s % nanos == 0);
    match rate {
        Some(rate) if rate > 0 => Ok((rate, tb.max_tokens)),
        _ => Err(XdsError::resource(
            at,
            format!(
                "refills {per_fill} tokens every {}, which is not a whole number of requests per second; flatmesh's rate_limit counts requests_per_s",
                model::duration::format(&fill)
            ),
        )),
    }
}

/// `true` for 100%, `false` for 0% or unset (Envoy's default: the filter is off, or only
/// counts); any other share is refused.
fn all_or_none(p: Option<RuntimeFractionalPercent>, at: &str) -> Result<bool> {
    let Some(p) = p else {
        return Ok(false);
    };
    let share = p
        .default_value
        .map_or((0, 0), |f| (f.numerator, f.denominator));
    let whole = match fractional_percent::DenominatorType::try_from(share.1) {
        Ok(fractional_percent::DenominatorType::Hundred) => 100,
        Ok(fractional_percent::DenominatorType::TenThousand) => 10_000,
        Ok(fractional_percent::DenominatorType::Million) => 1_000_000,
        Err(_) => 0,
    };
    match share.0 {
        0 => Ok(false),
        n if n == whole => Ok(true),
        _ => Err(XdsError::resource(
            at,
            "flatmesh limits all requests or none: write 100% (or remove the limit)",
        )),
    }
}

/// An HTTP local rate limit config (a connection manager's filter or a route's
/// `typed_per_filter_config`): the limit it enforces, `None` when it enforces none.
pub fn http(any: &Any, at: &str) -> Result<Option<model::RateLimit>> {
    let mut rest: HttpLocalRateLimit = unpack(any, at)?;
    rest.stat_prefix.clear();
    let tb = rest.token_bucket.take();
    let enabled = all_or_none(rest.filter_enabled.take(), &format!("{at}.filter_enabled"))?;
    let enforced = all_or_none(
        rest.filter_enforced.take(),
        &format!("{at}.filter_enforced"),
    )?;
    // flatmesh always answers gRPC clients RESOURCE_EXHAUSTED and always sends retry-after.
    rest.rate_limited_as_resource_exhausted = false;
    rest.enable_retry_after_header = false;
    if rest.status.is_some_and(|s| s.code == 429) {
        rest.status = None;
    }
    reject_rest(&rest, at)?;
    match tb {
        Some(tb) if enabled && enforced => {
            let (rate, burst) = bucket(tb, &format!("{at}.token_bucket"))?;
            Ok(Some(model::RateLimit {
                requests_per_s: rate,
                burst: Some(burst),
                key: None,
            }))
        }
        _ => Ok(None),
    }
}

/// A network local rate limit before `tcp_proxy`: the listener's `connection_rate_limit`.
pub fn network(any: &Any, at: &str) -> Result<model::ConnectionRateLimit> {
    let mut rest: NetworkLocalRateLimit = unpack(any, at)?;
    rest.stat_prefix.clear();
    if rest
        .runtime_enabled
        .as_ref()
        .is_some_and(|f| f.default_value.is_none_or(|v| v.value))
    {
        rest.runtime_enabled = None;
    }
    let Some(tb) = rest.token_bucket.take() else {
        return Err(XdsError::resource(
            format!("{at}.token_bucket"),
            "is missing: the network local rate limit needs one",
        ));
    };
    reject_rest(&rest, at)?;
    let (rate, burst) = bucket(tb, &format!("{at}.token_bucket"))?;
    Ok(model::ConnectionRateLimit {
        connections_per_s: rate,
        burst: Some(burst),
    })
}

/// Envoy's token bucket for `limit`: `burst` tokens, `requests_per_s` every second.
fn token_bucket(rate: u32, burst: u32) -> TokenBucket {
    TokenBucket {
        max_tokens: burst,
        tokens_per_fill: Some(UInt32Value { value: rate }),
        fill_interval: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 1,
            nanos: 0,
        }),
    }
}

fn all() -> Option<RuntimeFractionalPercent> {
    Some(RuntimeFractionalPercent {
        default_value: Some(FractionalPercent {
            numerator: 100,
            denominator: fractional_percent::DenominatorType::Hundred as i32,
        }),
        runtime_key: String::new(),
    })
}

/// The HTTP filter's config for an unkeyed `limit` (a keyed one has no Envoy counterpart:
/// `None`), or with no `limit` a filter without a bucket, which lets routes have theirs.
pub fn http_config(
    stat_prefix: &str,
    limit: Option<&model::RateLimit>,
) -> Option<HttpLocalRateLimit> {
    let mut config = HttpLocalRateLimit {
        stat_prefix: stat_prefix.into(),
        ..Default::default()
    };
    if let Some(limit) = limit {
        if limit.key.is_some() {
            return None;
        }
        config.token_bucket = Some(token_bucket(limit.requests_per_s, limit.burst()));
        config.filter_enabled = all();
        config.filter_enforced = all();
    }
    Some(config)
}

/// The network filter's config for a tcp listener's `connection_rate_limit`.
pub fn network_config(
    stat_prefix: &str,
    limit: &model::ConnectionRateLimit,
) -> NetworkLocalRateLimit {
    NetworkLocalRateLimit {
        stat_prefix: stat_prefix.into(),
        token_bucket: Some(token_bucket(
            limit.connections_per_s,
            limit.as_rate_limit().burst(),
        )),
        ..Default::default()
    }
}

/// Takes a route's local rate limit out of its `typed_per_filter_config`, if it has one; the
/// other filters' configs stay there for their readers (the fault filter's), which refuse
/// what nobody reads.
pub fn route_config(
    configs: &mut std::collections::HashMap<String, Any>,
    at: &str,
) -> Result<Option<model::RateLimit>> {
    let Some(any) = configs.remove(HTTP_NAME) else {
        return Ok(None);
    };
    let here = format!("{at}.typed_per_filter_config[{HTTP_NAME}]");
    if !is_http(&any) {
        return Err(XdsError::resource(
            here,
            format!(
                "is a {}, not the local rate limit's LocalRateLimit",
                any.type_url
            ),
        ));
    }
    http(&any, &here)
}
