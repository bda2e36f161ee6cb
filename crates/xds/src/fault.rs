//! Fault injection and mirroring both ways between Envoy and flatmesh: Envoy's HTTP fault
//! filter (`envoy.filters.http.fault`, an `HTTPFault` in the connection manager's filters and
//! per route in `typed_per_filter_config`) is a route's `fault:`; a route action's
//! `request_mirror_policies` (one) is its `mirror:`.
//!
//! Envoy's percentages are `FractionalPercent`s (numerator over 100, 10,000 or 1,000,000; an
//! absent one is 0 %, as in Envoy); flatmesh's are percentages, written back over a million.
//! What flatmesh does not run is refused by name: header-controlled faults
//! (`header_abort`, `header_delay`), faults limited to some requests (`headers`,
//! `upstream_cluster`, `downstream_nodes`), `max_active_faults`, `response_rate_limit`, a
//! mirror chosen by header, several mirrors. The `*_runtime` keys are accepted: flatmesh has
//! no runtime, so the configured values apply, as in Envoy when the runtime leaves a key unset.

use std::mem::take;

use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
use envoy_types::pb::envoy::config::route::v3::route_action::RequestMirrorPolicy;
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::{fault_delay, FaultDelay};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    fault_abort, FaultAbort, HttpFault,
};
use envoy_types::pb::envoy::r#type::v3::fractional_percent::DenominatorType;
use envoy_types::pb::envoy::r#type::v3::FractionalPercent;
use envoy_types::pb::google::protobuf::Any;
use flatmesh_config as model;
use prost::Name as _;

use crate::error::{Result, XdsError};
use crate::to_model::{duration, reject_rest, unpack};

/// The fault filter's usual name in a connection manager's `http_filters`.
pub const FAULT_FILTER_NAME: &str = "envoy.filters.http.fault";

/// The fault filter of a connection manager: its name (the key of its per-route configs) and
/// the fault it injects on routes that set none of their own.
#[derive(Debug, Clone, Default)]
pub(crate) struct FaultFilter {
    pub name: String,
    pub default: Option<model::Fault>,
}

/// A `FractionalPercent` as a percentage (over 100 % counts as 100 %, as Envoy caps it).
fn percent_of(p: Option<FractionalPercent>, at: &str) -> Result<f64> {
    let Some(p) = p else {
        return Ok(0.0);
    };
    let over = match DenominatorType::try_from(p.denominator) {
        Ok(DenominatorType::Hundred) => 100.0,
        Ok(DenominatorType::TenThousand) => 10_000.0,
        Ok(DenominatorType::Million) => 1_000_000.0,
        Err(_) => {
            return Err(XdsError::resource(
                format!("{at}.denominator"),
                "is not HUNDRED, TEN_THOUSAND or MILLION",
            ))
        }
    };
    Ok((f64::from(p.numerator) / over * 100.0).min(100.0))
}

/// A percentage as a `FractionalPercent` over a million (flatmesh's shares are that fine).
fn fractional(percent: f64) -> FractionalPercent {
    FractionalPercent {
        numerator: (percent.clamp(0.0, 100.0) * 10_000.0).round() as u32,
        denominator: DenominatorType::Million as i32,
    }
}

/// An `HTTPFault` (the filter's own config or a route's) as a route's fault; `None` when it
/// injects nothing (no abort and no delay).
pub(crate) fn fault_of(any: &Any, at: &str) -> Result<Option<model::Fault>> {
    if any.type_url != HttpFault::type_url() {
        return Err(XdsError::resource(
            at,
            format!(
                "is a `{}`; the fault filter's config is an HTTPFault",
                any.type_url
            ),
        ));
    }
    let mut f: HttpFault = unpack(any, at)?;
    let abort = match f.abort.take() {
        Some(a) => Some(abort_of(a, &format!("{at}.abort"))?),
        None => None,
    };
    let delay = match f.delay.take() {
        Some(d) => Some(delay_of(d, &format!("{at}.delay"))?),
        None => None,
    };
    // No runtime in flatmesh: the configured values apply.
    for key in [
        &mut f.delay_percent_runtime,
        &mut f.abort_percent_runtime,
        &mut f.delay_duration_runtime,
        &mut f.abort_http_status_runtime,
        &mut f.max_active_faults_runtime,
        &mut f.response_rate_limit_percent_runtime,
        &mut f.abort_grpc_status_runtime,
    ] {
        key.clear();
    }
    f.disable_downstream_cluster_stats = false;
    reject_rest(&f, at)?;
    Ok((abort.is_some() || delay.is_some()).then_some(model::Fault { abort, delay }))
}

fn abort_of(mut a: FaultAbort, at: &str) -> Result<model::FaultAbort> {
    let percent = percent_of(a.percentage.take(), &format!("{at}.percentage"))?;
    let (status, grpc_status) = match a.error_type.take() {
        Some(fault_abort::ErrorType::HttpStatus(s)) => match u16::try_from(s) {
            Ok(s) if (200..=599).contains(&s) => (Some(s), None),
            _ => {
                return Err(XdsError::resource(
                    format!("{at}.http_status"),
                    format!("{s} is not an HTTP status from 200 to 599"),
                ))
            }
        },
        Some(fault_abort::ErrorType::GrpcStatus(code)) => match u16::try_from(code) {
            Ok(c) if (1..=model::MAX_GRPC_STATUS).contains(&c) => (None, Some(c)),
            _ => {
                return Err(XdsError::resource(
                    format!("{at}.grpc_status"),
                    format!("{code} is not a gRPC error status (1 to 16)"),
                ))
            }
        },
        Some(fault_abort::ErrorType::HeaderAbort(_)) => return Err(XdsError::resource(
            format!("{at}.header_abort"),
            "is not supported: flatmesh's faults are configured, not asked for by request headers",
        )),
        None => {
            return Err(XdsError::resource(
                at,
                "needs `http_status` or `grpc_status`",
            ))
        }
    };
    reject_rest(&a, at)?;
    Ok(model::FaultAbort {
        status,
        grpc_status,
        percent,
    })
}

fn delay_of(mut d: FaultDelay, at: &str) -> Result<model::FaultDelay> {
    let percent = percent_of(d.percentage.take(), &format!("{at}.percentage"))?;
    let duration = match d.fault_delay_secifier.take() {
        Some(fault_delay::FaultDelaySecifier::FixedDelay(t)) => {
            duration(&t, &format!("{at}.fixed_delay"))?
        }
        Some(fault_delay::FaultDelaySecifier::HeaderDelay(_)) => return Err(XdsError::resource(
            format!("{at}.header_delay"),
            "is not supported: flatmesh's faults are configured, not asked for by request headers",
        )),
        None => return Err(XdsError::resource(at, "needs `fixed_delay`")),
    };
    reject_rest(&d, at)?;
    Ok(model::FaultDelay { duration, percent })
}

/// A route action's `request_mirror_policies` as its mirror (flatmesh mirrors to one cluster).
pub(crate) fn mirror_of(
    policies: Vec<RequestMirrorPolicy>,
    at: &str,
) -> Result<Option<model::Mirror>> {
    let mut policies = policies.into_iter();
    let Some(mut p) = policies.next() else {
        return Ok(None);
    };
    if policies.next().is_some() {
        return Err(XdsError::resource(
            at,
            "lists several mirrors; flatmesh mirrors a route to one cluster",
        ));
    }
    let at = format!("{at}[0]");
    if p.cluster.is_empty() {
        return Err(XdsError::resource(
            format!("{at}.cluster"),
            "is missing (a mirror chosen by `cluster_header` is not supported)",
        ));
    }
    // Envoy mirrors every request when there is no runtime_fraction.
    let percent = match p.runtime_fraction.take() {
        Some(mut f) => {
            f.runtime_key.clear(); // no runtime in flatmesh: the default applies
            let percent = percent_of(f.default_value.take(), &format!("{at}.runtime_fraction"))?;
            reject_rest(&f, &format!("{at}.runtime_fraction"))?;
            percent
        }
        None => 100.0,
    };
    p.trace_sampled = None; // flatmesh traces no request, mirrored or not
    let cluster = take(&mut p.cluster);
    reject_rest(&p, &at)?;
    Ok(Some(model::Mirror { cluster, percent }))
}

/// A route's fault as the fault filter's per-route config.
pub(crate) fn http_fault(f: &model::Fault) -> HttpFault {
    HttpFault {
        abort: f.abort.as_ref().map(|a| FaultAbort {
            percentage: Some(fractional(a.percent)),
            error_type: Some(match (a.status, a.grpc_status) {
                (_, Some(code)) => fault_abort::ErrorType::GrpcStatus(u32::from(code)),
                (status, None) => {
                    fault_abort::ErrorType::HttpStatus(u32::from(status.unwrap_or(503)))
                }
            }),
            ..Default::default()
        }),
        delay: f.delay.as_ref().map(|d| FaultDelay {
            percentage: Some(fractional(d.percent)),
            fault_delay_secifier: Some(fault_delay::FaultDelaySecifier::FixedDelay(
                envoy_types::pb::google::protobuf::Duration {
                    seconds: d.duration.as_secs() as i64,
                    nanos: d.duration.subsec_nanos() as i32,
                },
            )),
        }),
        ..Default::default()
    }
}

/// A route's mirror as a request mirror policy.
pub(crate) fn mirror_policy(m: &model::Mirror) -> RequestMirrorPolicy {
    RequestMirrorPolicy {
        cluster: m.cluster.clone(),
        runtime_fraction: Some(RuntimeFractionalPercent {
            default_value: Some(fractional(m.percent)),
            runtime_key: String::new(),
        }),
        ..Default::default()
    }
}

/// The fault filter a listener needs in its connection manager: one, with an empty config,
/// when any of its routes injects faults (the faults themselves are per route).
pub(crate) fn filter_for(
    l: &model::Listener,
) -> Option<
    envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter,
> {
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
        http_filter, HttpFilter,
    };
    l.routes
        .iter()
        .any(|r| r.fault.is_some())
        .then(|| HttpFilter {
            name: FAULT_FILTER_NAME.into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(
                crate::resources::pack(&HttpFault::default()),
            )),
            ..Default::default()
        })
}
