//! flatmesh's config model -> xDS resources, for `flatmesh control` to serve to flatmesh nodes
//! and to Envoy.
//!
//! Every cluster becomes an EDS cluster over ADS with its ClusterLoadAssignment (so endpoint
//! changes are small EDS pushes), every HTTP listener an HTTP connection manager with RDS, and
//! every TCP listener a tcp_proxy. flatmesh routes are one ordered list with an optional host
//! condition; Envoy selects a virtual host first, so each distinct host becomes a virtual host
//! holding, in order, the routes for that host and the routes for any host, and the routes for
//! any host also form the `*` virtual host. A listener's or a cluster's `tls` becomes its TLS
//! transport socket ([`crate::tls`]), its `authorization` RBAC filters ([`crate::rbac`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers, cluster, CircuitBreakers, Cluster, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, data_source, socket_address, Address, AggregatedConfigSource,
    ApiVersion, ConfigSource, DataSource, HeaderValue, HeaderValueOption, Http2ProtocolOptions,
    SocketAddress,
};
use envoy_types::pb::envoy::config::core::v3::{Locality, RuntimeDouble};
use envoy_types::pb::envoy::config::endpoint::v3::{
    cluster_load_assignment, lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint,
    LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher, query_parameter_matcher, route, route_action, route_match, weighted_cluster,
    DirectResponseAction, HeaderMatcher, QueryParameterMatcher, RetryPolicy, Route, RouteAction,
    RouteConfiguration, RouteMatch, VirtualHost, WeightedCluster,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options, HttpProtocolOptions,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    metadata_matcher, string_matcher, value_matcher, MetadataMatcher, RegexMatcher, StringMatcher,
    ValueMatcher,
};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{self as pbuf, UInt32Value};
use flatmesh_config as model;

use crate::hbone;
use crate::local_ratelimit;
use crate::rbac;
use crate::resources::{pack, Resources};
use crate::tls;
use crate::to_model::{HCM_NAME, HTTP_OPTIONS_KEY, ROUTER_NAME, TCP_PROXY_NAME};

/// All resources for `config`.
pub fn resources(config: &model::Config) -> Resources {
    let mut out = Resources::default();
    for c in &config.clusters {
        out.clusters.insert(c.name.clone(), cluster(c, config));
        // An ORIGINAL_DST cluster has no endpoints to assign.
        if c.kind == model::ClusterType::OriginalDst {
            continue;
        }
        let mut assignment =
            weighted_assignment(&c.name, c.endpoints.entries(), c.overprovisioning_factor);
        if c.tunnel.is_some() {
            tunnel_endpoints(&mut assignment, c.tunnel_port.unwrap_or(model::HBONE_PORT));
        }
        out.endpoints.insert(c.name.clone(), assignment);
    }
    for l in &config.listeners {
        // A qnp listener dispatches to this node's own workers by QingNiao rules, which no
        // Envoy listener can say: it stays in the node's own config, as `workloads` do.
        if l.protocol == model::ListenerProtocol::Qnp {
            continue;
        }
        if l.protocol == model::ListenerProtocol::Hbone {
            // Its CONNECT route's ORIGINAL_DST cluster (crate::hbone, "Termination").
            let c = hbone_termination_cluster(l, config);
            out.clusters.insert(c.name.clone(), c);
        }
        out.listeners.insert(l.name.clone(), listener(l, config));
        if l.protocol == model::ListenerProtocol::Http {
            out.routes
                .insert(l.name.clone(), route_configuration(l, config));
        }
    }
    out
}

fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource::default(),
        )),
        ..Default::default()
    }
}

pub(crate) fn duration(d: Duration) -> pbuf::Duration {
    pbuf::Duration {
        // A valid model's durations are at most 365 days; saturate rather than wrap anyway.
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: d.subsec_nanos() as i32,
    }
}

pub fn socket_address(a: SocketAddr) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: a.ip().to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                a.port(),
            ))),
            ..Default::default()
        })),
    }
}

fn cluster(c: &model::Cluster, config: &model::Config) -> Cluster {
    let lb_policy = match c.lb {
        model::LbPolicy::RoundRobin => cluster::LbPolicy::RoundRobin,
        model::LbPolicy::LeastRequest => cluster::LbPolicy::LeastRequest,
        model::LbPolicy::Random => cluster::LbPolicy::Random,
        model::LbPolicy::RingHash => cluster::LbPolicy::RingHash,
        model::LbPolicy::Maglev => cluster::LbPolicy::Maglev,
    };
    let mut options = HashMap::new();
    // A tunnel cluster's protocol options are the tunnel's: HBONE is HTTP/2.
    let outer = if c.tunnel.is_some() {
        model::UpstreamProtocol::Http2
    } else {
        c.protocol
    };
    if outer == model::UpstreamProtocol::Http2 {
        options.insert(
            HTTP_OPTIONS_KEY.to_string(),
            pack(&HttpProtocolOptions {
                upstream_protocol_options: Some(
                    http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                        http_protocol_options::ExplicitHttpConfig {
                            protocol_config: Some(
                                http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(
                                    Http2ProtocolOptions::default(),
                                ),
                            ),
                        },
                    ),
                ),
                ..Default::default()
            }),
        );
    }
    if c.kind == model::ClusterType::OriginalDst {
        return original_dst_cluster(c, config);
    }
    Cluster {
        name: c.name.clone(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        connect_timeout: Some(duration(
            c.connect_timeout.unwrap_or(config.limits.connect_timeout),
        )),
        lb_policy: lb_policy as i32,
        typed_extension_protocol_options: options,
        transport_socket: c.tls.as_ref().map(|t| tls::upstream(t, outer)),
        metadata: (c.tunnel.is_some() && c.protocol == model::UpstreamProtocol::Http2)
            .then(hbone::inner_http2_metadata),
        circuit_breakers: c.circuit_breaker.as_ref().map(circuit_breakers),
        outlier_detection: c.outlier_detection.as_ref().map(outlier_detection),
        health_checks: c.health_check.iter().map(health_check).collect(),
        lb_config: lb_config(c),
        ..Default::default()
    }
}

/// An `original_dst` cluster as Envoy's ORIGINAL_DST one (`lb_policy: CLUSTER_PROVIDED`, no
/// endpoints), its allow-list and `max_destinations` in flatmesh's metadata
/// (`crate::original_dst`). Validation leaves it none of the endpoint settings.
fn original_dst_cluster(c: &model::Cluster, config: &model::Config) -> Cluster {
    Cluster {
        name: c.name.clone(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::OriginalDst as i32,
        )),
        connect_timeout: Some(duration(
            c.connect_timeout.unwrap_or(config.limits.connect_timeout),
        )),
        lb_policy: cluster::LbPolicy::ClusterProvided as i32,
        metadata: Some(crate::original_dst::metadata(&c.allow, c.max_destinations)),
        circuit_breakers: c.circuit_breaker.as_ref().map(circuit_breakers),
        ..Default::default()
    }
}

/// A circuit breaker as Envoy's thresholds of the default priority.
fn circuit_breakers(b: &model::CircuitBreaker) -> CircuitBreakers {
    let value = |value| Some(UInt32Value { value });
    CircuitBreakers {
        thresholds: vec![circuit_breakers::Thresholds {
            max_connections: value(b.max_connections),
            max_pending_requests: value(b.max_pending),
            max_requests: value(b.max_requests),
            max_retries: value(b.max_retries),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Outlier detection in Envoy's terms: each consecutive kind enforced (100%) when its
/// threshold is set, and connect failures as the local-origin kind (which Envoy counts apart
/// only with `split_external_local_origin_errors`), success rate and failure percentage
/// enforced at 100 or 0. `crate::to_model` reads it back.
fn outlier_detection(o: &model::OutlierDetection) -> OutlierDetection {
    let value = |value| Some(UInt32Value { value });
    let enforcing = |threshold: u32| value(if threshold > 0 { 100 } else { 0 });
    let split = o.consecutive_connect_failures > 0;
    OutlierDetection {
        consecutive_5xx: value(o.consecutive_5xx),
        enforcing_consecutive_5xx: enforcing(o.consecutive_5xx),
        consecutive_gateway_failure: value(o.consecutive_gateway_errors),
        enforcing_consecutive_gateway_failure: enforcing(o.consecutive_gateway_errors),
        split_external_local_origin_errors: split,
        consecutive_local_origin_failure: split.then_some(UInt32Value {
            value: o.consecutive_connect_failures,
        }),
        enforcing_consecutive_local_origin_failure: split.then_some(UInt32Value { value: 100 }),
        interval: Some(duration(o.interval)),
        base_ejection_time: Some(duration(o.base_ejection_time)),
        max_ejection_percent: value(o.max_ejection_percent),
        enforcing_success_rate: value(if o.success_rate.enforcing { 100 } else { 0 }),
        success_rate_minimum_hosts: value(o.success_rate.minimum_hosts),
        success_rate_request_volume: value(o.success_rate.request_volume),
        success_rate_stdev_factor: value(o.success_rate.stdev_factor),
        enforcing_failure_percentage: value(if o.failure_percentage.enforcing {
            100
        } else {
            0
        }),
        failure_percentage_threshold: value(o.failure_percentage.threshold),
        failure_percentage_minimum_hosts: value(o.failure_percentage.minimum_hosts),
        failure_percentage_request_volume: value(o.failure_percentage.request_volume),
        ..Default::default()
    }
}

/// A health check in Envoy's terms (each `expect` range as a half-open `Int64Range`);
/// `crate::to_model` reads it back.
fn health_check(h: &model::HealthCheck) -> envoy_types::pb::envoy::config::core::v3::HealthCheck {
    use envoy_types::pb::envoy::config::core::v3::health_check::{
        GrpcHealthCheck, HealthChecker, HttpHealthCheck, TcpHealthCheck,
    };
    use envoy_types::pb::envoy::r#type::v3::Int64Range;
    let checker = match h.kind() {
        model::HealthCheckKind::Http(http) => HealthChecker::HttpHealthCheck(HttpHealthCheck {
            path: http.path.clone(),
            expected_statuses: http
                .expect
                .0
                .iter()
                .map(|(from, to)| Int64Range {
                    start: i64::from(*from),
                    end: i64::from(*to) + 1,
                })
                .collect(),
            ..Default::default()
        }),
        model::HealthCheckKind::Tcp => HealthChecker::TcpHealthCheck(TcpHealthCheck::default()),
        model::HealthCheckKind::Grpc(g) => HealthChecker::GrpcHealthCheck(GrpcHealthCheck {
            service_name: g.service.clone(),
            ..Default::default()
        }),
    };
    envoy_types::pb::envoy::config::core::v3::HealthCheck {
        timeout: Some(duration(h.timeout)),
        interval: Some(duration(h.interval)),
        unhealthy_threshold: Some(UInt32Value {
            value: h.unhealthy_threshold,
        }),
        healthy_threshold: Some(UInt32Value {
            value: h.healthy_threshold,
        }),
        health_checker: Some(checker),
        ..Default::default()
    }
}

pub fn assignment(name: &str, endpoints: &[SocketAddr]) -> ClusterLoadAssignment {
    let entries: Vec<model::Endpoint> = endpoints
        .iter()
        .copied()
        .map(model::Endpoint::new)
        .collect();
    weighted_assignment(name, &entries, None)
}

/// A cluster's endpoints as Envoy's: one LocalityLbEndpoints per (priority, locality) in
/// the order they first appear, endpoint weights as `load_balancing_weight` (left out when
/// 1), and the overprovisioning factor as the policy's.
pub fn weighted_assignment(
    name: &str,
    endpoints: &[model::Endpoint],
    overprovisioning_factor: Option<u32>,
) -> ClusterLoadAssignment {
    let mut groups: Vec<LocalityLbEndpoints> = Vec::new();
    for e in endpoints {
        let locality = e.locality.as_deref().map(|l| {
            let mut parts = l.split('/').map(str::to_owned);
            Locality {
                region: parts.next().unwrap_or_default(),
                zone: parts.next().unwrap_or_default(),
                sub_zone: parts.next().unwrap_or_default(),
            }
        });
        let at = match groups
            .iter()
            .position(|g| g.priority == e.priority && g.locality == locality)
        {
            Some(at) => at,
            None => {
                groups.push(LocalityLbEndpoints {
                    priority: e.priority,
                    locality,
                    ..Default::default()
                });
                groups.len() - 1
            }
        };
        groups[at].lb_endpoints.push(LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(socket_address(e.address)),
                ..Default::default()
            })),
            load_balancing_weight: (e.weight != 1).then_some(UInt32Value { value: e.weight }),
            ..Default::default()
        });
    }
    if groups.is_empty() {
        groups.push(LocalityLbEndpoints::default());
    }
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: groups,
        policy: overprovisioning_factor.map(|value| cluster_load_assignment::Policy {
            overprovisioning_factor: Some(UInt32Value { value }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A tunnel cluster's endpoints as Envoy connects to them: each destination's own IP at the
/// tunnel port, with the destination in Istio's tunnel metadata (crate::hbone).
fn tunnel_endpoints(assignment: &mut ClusterLoadAssignment, tunnel_port: u16) {
    for e in assignment
        .endpoints
        .iter_mut()
        .flat_map(|g| g.lb_endpoints.iter_mut())
    {
        let Some(lb_endpoint::HostIdentifier::Endpoint(endpoint)) = &mut e.host_identifier else {
            continue;
        };
        let Some(destination) = endpoint
            .address
            .as_ref()
            .and_then(|a| crate::to_model::socket_addr(Some(a), "").ok())
        else {
            continue;
        };
        endpoint.address = Some(socket_address(hbone::peer(destination, tunnel_port)));
        e.metadata = Some(hbone::endpoint_metadata(destination));
    }
}

/// The ORIGINAL_DST cluster an hbone listener's CONNECT route delivers to: the destination is
/// the CONNECT's `:authority`.
fn hbone_termination_cluster(l: &model::Listener, config: &model::Config) -> Cluster {
    Cluster {
        name: hbone::termination_cluster(&l.name),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: cluster::LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(duration(config.limits.connect_timeout)),
        lb_config: Some(cluster::LbConfig::OriginalDstLbConfig(
            cluster::OriginalDstLbConfig {
                use_http_header: true,
                http_header_name: hbone::AUTHORITY.into(),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

/// Slow start as Envoy's `slow_start_config` in the policy's lb_config.
fn lb_config(c: &model::Cluster) -> Option<cluster::LbConfig> {
    let slow = c.slow_start.as_ref()?;
    let config = Some(cluster::SlowStartConfig {
        slow_start_window: Some(duration(slow.window)),
        aggression: Some(RuntimeDouble {
            default_value: slow.aggression,
            runtime_key: String::new(),
        }),
        min_weight_percent: Some(Percent {
            value: f64::from(slow.min_weight_percent),
        }),
    });
    match c.lb {
        model::LbPolicy::LeastRequest => Some(cluster::LbConfig::LeastRequestLbConfig(
            cluster::LeastRequestLbConfig {
                slow_start_config: config,
                ..Default::default()
            },
        )),
        // Envoy has slow start for round robin and least request; validation keeps it off
        // the hashing policies, and random is sent as round robin's config (Envoy's random
        // has no slow start and ignores it).
        _ => Some(cluster::LbConfig::RoundRobinLbConfig(
            cluster::RoundRobinLbConfig {
                slow_start_config: config,
            },
        )),
    }
}

fn listener(l: &model::Listener, config: &model::Config) -> Listener {
    let authorization = l.authorization.as_ref();
    // On a tcp listener the authorization's RBAC layers are network filters before tcp_proxy.
    let mut filters = match (l.protocol, authorization) {
        (model::ListenerProtocol::Tcp, Some(a)) => rbac::network_filters(a, &l.name),
        _ => Vec::new(),
    };
    // A connection_rate_limit is the network local rate limit, before tcp_proxy.
    if let Some(limit) = &l.connection_rate_limit {
        filters.push(Filter {
            name: local_ratelimit::NETWORK_NAME.into(),
            config_type: Some(filter::ConfigType::TypedConfig(pack(
                &local_ratelimit::network_config(&l.name, limit),
            ))),
        });
    }
    // The HTTP local rate limit, before the router: with the listener's bucket, or without
    // one so that the routes' own limits apply.
    let http_rate_limit = (l.rate_limit.is_some()
        || l.routes.iter().any(|r| r.rate_limit.is_some()))
    .then(|| local_ratelimit::http_config(&l.name, l.rate_limit.as_ref()))
    .flatten()
    .map(|c| HttpFilter {
        name: local_ratelimit::HTTP_NAME.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(pack(&c))),
        ..Default::default()
    });
    let router = HttpFilter {
        name: ROUTER_NAME.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(pack(
            &Router::default(),
        ))),
        ..Default::default()
    };
    let filter = match l.protocol {
        // Never sent (`resources` leaves qnp listeners out): no Envoy filter says QingNiao.
        model::ListenerProtocol::Qnp => Filter::default(),
        model::ListenerProtocol::Hbone => Filter {
            name: HCM_NAME.into(),
            config_type: Some(filter::ConfigType::TypedConfig(pack(
                &hbone_connection_manager(l, router),
            ))),
        },
        model::ListenerProtocol::Http => Filter {
            name: HCM_NAME.into(),
            config_type: Some(filter::ConfigType::TypedConfig(pack(
                &HttpConnectionManager {
                    stat_prefix: l.name.clone(),
                    // flatmesh matches a route's host without the port; so should Envoy.
                    strip_port_mode: Some(
                        http_connection_manager::StripPortMode::StripAnyHostPort(true),
                    ),
                    route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
                        config_source: Some(ads()),
                        route_config_name: l.name.clone(),
                    })),
                    // The authorization's RBAC layers, the fault filter (whose config
                    // is per route), then the router.
                    http_filters: authorization
                        .map(rbac::http_filters)
                        .unwrap_or_default()
                        .into_iter()
                        .chain(http_rate_limit)
                        .chain(crate::fault::filter_for(l))
                        .chain([router])
                        .collect(),
                    http2_protocol_options: http2_options(&l.limits),
                    // Unset keys stay unset, so the node applies its own defaults. proto3
                    // cannot say `merge_slashes: false`: that is the default too.
                    normalize_path: l.normalize_path.map(|value| pbuf::BoolValue { value }),
                    merge_slashes: l.merge_slashes.unwrap_or(false),
                    path_with_escaped_slashes_action: l
                        .path_with_escaped_slashes_action
                        .map_or(0, escaped_slashes),
                    ..Default::default()
                },
            ))),
        },
        model::ListenerProtocol::Tcp => Filter {
            name: TCP_PROXY_NAME.into(),
            config_type: Some(filter::ConfigType::TypedConfig(pack(&TcpProxy {
                stat_prefix: l.name.clone(),
                cluster_specifier: l.cluster.clone().map(tcp_proxy::ClusterSpecifier::Cluster),
                idle_timeout: l.limits.tcp_idle_timeout.map(duration),
                tunneling_config: l
                    .cluster
                    .as_deref()
                    .and_then(|name| config.cluster(name))
                    .filter(|c| c.tunnel.is_some())
                    .map(tunneling_config),
                ..Default::default()
            }))),
        },
    };
    filters.push(filter);
    // A listener's own connection cap has no field in Envoy's listener: it is not carried.
    Listener {
        name: l.name.clone(),
        address: Some(socket_address(l.address)),
        filter_chains: vec![FilterChain {
            filters,
            transport_socket: l.tls.as_ref().map(|t| tls::downstream(t, l.protocol)),
            ..Default::default()
        }],
        per_connection_buffer_limit_bytes: l.limits.per_connection_buffer_bytes.map(|n| {
            UInt32Value {
                value: u32::try_from(n).unwrap_or(u32::MAX),
            }
        }),
        ..Default::default()
    }
}

/// What a tcp listener's CONNECT to a tunnel cluster names: its one destination when it has
/// one (a plain Envoy then does what flatmesh does), else each endpoint's own (crate::hbone).
fn tunneling_config(c: &model::Cluster) -> tcp_proxy::TunnelingConfig {
    let hostname = match c.endpoints.entries() {
        [one] => one.address.to_string(),
        _ => hbone::DOWNSTREAM_LOCAL_ADDRESS.into(),
    };
    tcp_proxy::TunnelingConfig {
        hostname,
        ..Default::default()
    }
}

/// An hbone listener as Envoy terminates HBONE: HTTP/2 with CONNECT allowed, one route that
/// matches CONNECT and terminates it into the listener's ORIGINAL_DST cluster, the
/// destinations it may reach as that route's metadata (crate::hbone, "Termination").
fn hbone_connection_manager(l: &model::Listener, router: HttpFilter) -> HttpConnectionManager {
    let connect = || route_action::UpgradeConfig {
        upgrade_type: hbone::CONNECT.into(),
        ..Default::default()
    };
    let destinations = l
        .hbone
        .as_ref()
        .map(|h| h.destinations.as_slice())
        .unwrap_or_default();
    let route = Route {
        name: "hbone".into(),
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::ConnectMatcher(
                route_match::ConnectMatcher {},
            )),
            ..Default::default()
        }),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                hbone::termination_cluster(&l.name),
            )),
            upgrade_configs: vec![route_action::UpgradeConfig {
                connect_config: Some(route_action::upgrade_config::ConnectConfig::default()),
                ..connect()
            }],
            ..Default::default()
        })),
        metadata: (!destinations.is_empty()).then(|| hbone::destinations_metadata(destinations)),
        ..Default::default()
    };
    let mut h2 = http2_options(&l.limits).unwrap_or_default();
    h2.allow_connect = true;
    HttpConnectionManager {
        stat_prefix: l.name.clone(),
        codec_type: http_connection_manager::CodecType::Http2 as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
            RouteConfiguration {
                name: l.name.clone(),
                virtual_hosts: vec![VirtualHost {
                    name: "hbone".into(),
                    domains: vec!["*".into()],
                    routes: vec![route],
                    ..Default::default()
                }],
                ..Default::default()
            },
        )),
        upgrade_configs: vec![http_connection_manager::UpgradeConfig {
            upgrade_type: hbone::CONNECT.into(),
            ..Default::default()
        }],
        http_filters: l
            .authorization
            .as_ref()
            .map(rbac::http_filters)
            .unwrap_or_default()
            .into_iter()
            .chain([router])
            .collect(),
        http2_protocol_options: Some(h2),
        ..Default::default()
    }
}

/// A listener's HTTP/2 limits as the HTTP connection manager's `http2_protocol_options`.
fn http2_options(limits: &model::ListenerLimits) -> Option<Http2ProtocolOptions> {
    let value = |v: Option<u32>| v.map(|value| UInt32Value { value });
    let options = Http2ProtocolOptions {
        max_concurrent_streams: value(limits.http2_max_concurrent_streams),
        initial_stream_window_size: value(limits.http2_stream_window),
        initial_connection_window_size: value(limits.http2_connection_window),
        ..Default::default()
    };
    (options != Http2ProtocolOptions::default()).then_some(options)
}

fn escaped_slashes(action: model::EscapedSlashesAction) -> i32 {
    use http_connection_manager::PathWithEscapedSlashesAction as Escaped;
    (match action {
        model::EscapedSlashesAction::KeepUnchanged => Escaped::KeepUnchanged,
        model::EscapedSlashesAction::RejectRequest => Escaped::RejectRequest,
        model::EscapedSlashesAction::UnescapeAndRedirect => Escaped::UnescapeAndRedirect,
        model::EscapedSlashesAction::UnescapeAndForward => Escaped::UnescapeAndForward,
    }) as i32
}

fn route_configuration(l: &model::Listener, config: &model::Config) -> RouteConfiguration {
    // Distinct hosts in first-seen order.
    let mut hosts: Vec<&str> = Vec::new();
    for r in &l.routes {
        if let Some(h) = r.matches.host.as_deref() {
            if !hosts.contains(&h) {
                hosts.push(h);
            }
        }
    }
    let mut virtual_hosts: Vec<VirtualHost> = hosts
        .iter()
        .map(|h| VirtualHost {
            name: h.to_string(),
            domains: vec![h.to_string()],
            routes: l
                .routes
                .iter()
                .filter(|r| r.matches.host.as_deref().is_none_or(|rh| rh == *h))
                .map(|r| route(r, config))
                .collect(),
            ..Default::default()
        })
        .collect();
    virtual_hosts.push(VirtualHost {
        name: "any".into(),
        domains: vec!["*".into()],
        routes: l
            .routes
            .iter()
            .filter(|r| r.matches.host.is_none())
            .map(|r| route(r, config))
            .collect(),
        ..Default::default()
    });
    RouteConfiguration {
        name: l.name.clone(),
        virtual_hosts,
        ..Default::default()
    }
}

fn string_match(m: &model::NamedMatch) -> Option<StringMatcher> {
    let pattern = if let Some(v) = &m.exact {
        string_matcher::MatchPattern::Exact(v.clone())
    } else if let Some(v) = &m.prefix {
        string_matcher::MatchPattern::Prefix(v.clone())
    } else if let Some(v) = &m.regex {
        string_matcher::MatchPattern::SafeRegex(RegexMatcher {
            regex: v.clone(),
            ..Default::default()
        })
    } else {
        return None;
    };
    Some(StringMatcher {
        match_pattern: Some(pattern),
        ignore_case: false,
    })
}

/// The metadata "filter" a `grpc_field` condition travels under. Envoy has no match on the
/// request message; a metadata match on a filter no Envoy fills never holds, so an Envoy that
/// receives such a route leaves it unmatched rather than widening it.
pub(crate) const GRPC_FIELD_FILTER: &str = "flatmesh.grpc_field";

/// `grpc_field: { number: N, exact|prefix: V }` as `dynamic_metadata` on
/// [`GRPC_FIELD_FILTER`], path `[N]`.
fn grpc_field_matcher(f: &model::GrpcFieldMatch) -> MetadataMatcher {
    let pattern = match (&f.exact, &f.prefix) {
        (Some(v), _) => string_matcher::MatchPattern::Exact(v.clone()),
        (None, Some(v)) => string_matcher::MatchPattern::Prefix(v.clone()),
        // Validation requires one of the two; an empty prefix matches any value of the field.
        (None, None) => string_matcher::MatchPattern::Prefix(String::new()),
    };
    MetadataMatcher {
        filter: GRPC_FIELD_FILTER.into(),
        path: vec![metadata_matcher::PathSegment {
            segment: Some(metadata_matcher::path_segment::Segment::Key(
                f.number.to_string(),
            )),
        }],
        value: Some(ValueMatcher {
            match_pattern: Some(value_matcher::MatchPattern::StringMatch(StringMatcher {
                match_pattern: Some(pattern),
                ignore_case: false,
            })),
        }),
        invert: false,
    }
}

fn headers_to_add(headers: &std::collections::BTreeMap<String, String>) -> Vec<HeaderValueOption> {
    headers
        .iter()
        .map(|(key, value)| HeaderValueOption {
            header: Some(HeaderValue {
                key: key.clone(),
                value: value.clone(),
                ..Default::default()
            }),
            // flatmesh sets a header (replacing any value), Envoy's OVERWRITE_IF_EXISTS_OR_ADD.
            append_action: 2,
            ..Default::default()
        })
        .collect()
}

fn route(r: &model::Route, config: &model::Config) -> Route {
    let mut m = RouteMatch {
        path_specifier: Some(match &r.matches.path {
            Some(model::PathMatch::Exact(p)) => route_match::PathSpecifier::Path(p.clone()),
            Some(model::PathMatch::Prefix(p)) => route_match::PathSpecifier::Prefix(p.clone()),
            Some(model::PathMatch::Regex(p)) => {
                route_match::PathSpecifier::SafeRegex(RegexMatcher {
                    regex: p.clone(),
                    ..Default::default()
                })
            }
            None => route_match::PathSpecifier::Prefix("/".into()),
        }),
        ..Default::default()
    };
    if let Some(method) = &r.matches.method {
        m.headers.push(HeaderMatcher {
            name: ":method".into(),
            header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
                StringMatcher {
                    match_pattern: Some(string_matcher::MatchPattern::Exact(method.clone())),
                    ignore_case: false,
                },
            )),
            ..Default::default()
        });
    }
    for h in &r.matches.headers {
        m.headers.push(HeaderMatcher {
            name: h.name.clone(),
            header_match_specifier: Some(match string_match(h) {
                Some(s) => header_matcher::HeaderMatchSpecifier::StringMatch(s),
                None => header_matcher::HeaderMatchSpecifier::PresentMatch(true),
            }),
            ..Default::default()
        });
    }
    for q in &r.matches.query {
        m.query_parameters.push(QueryParameterMatcher {
            name: q.name.clone(),
            query_parameter_match_specifier: Some(match string_match(q) {
                Some(s) => query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(s),
                None => query_parameter_matcher::QueryParameterMatchSpecifier::PresentMatch(true),
            }),
        });
    }
    if let Some(field) = &r.matches.grpc_field {
        m.dynamic_metadata.push(grpc_field_matcher(field));
    }
    let action = if let Some(dr) = &r.direct_response {
        route::Action::DirectResponse(DirectResponseAction {
            status: u32::from(dr.status),
            body: (!dr.body.is_empty()).then(|| DataSource {
                specifier: Some(data_source::Specifier::InlineString(dr.body.clone())),
                ..Default::default()
            }),
            ..Default::default()
        })
    } else {
        let mut a = RouteAction {
            timeout: r.timeout.map(duration),
            upgrade_configs: r
                .upgrades
                .iter()
                .map(|kind| route_action::UpgradeConfig {
                    upgrade_type: kind.clone(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let targets: Vec<&str> = if let Some(split) = &r.split {
            a.cluster_specifier = Some(route_action::ClusterSpecifier::WeightedClusters(
                WeightedCluster {
                    clusters: split
                        .iter()
                        .map(|w| weighted_cluster::ClusterWeight {
                            name: w.cluster.clone(),
                            weight: Some(UInt32Value { value: w.weight }),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                },
            ));
            split.iter().map(|w| w.cluster.as_str()).collect()
        } else {
            let c = r.cluster.clone().unwrap_or_default();
            a.cluster_specifier = Some(route_action::ClusterSpecifier::Cluster(c));
            r.cluster.iter().map(String::as_str).collect()
        };
        if let Some(mirror) = &r.mirror {
            a.request_mirror_policies = vec![crate::fault::mirror_policy(mirror)];
        }
        if let Some(retry) = &r.retries {
            a.retry_policy = Some(RetryPolicy {
                retry_on: retry
                    .on
                    .iter()
                    .map(|on| on.as_str())
                    .collect::<Vec<_>>()
                    .join(","),
                num_retries: Some(UInt32Value {
                    value: retry.attempts,
                }),
                per_try_timeout: retry.per_try_timeout.map(duration),
                retry_back_off: retry.backoff.as_ref().map(|b| {
                    envoy_types::pb::envoy::config::route::v3::retry_policy::RetryBackOff {
                        base_interval: Some(duration(b.base)),
                        max_interval: b.max.map(duration),
                    }
                }),
                ..Default::default()
            });
        }
        // flatmesh hashes per cluster; Envoy hashes per route: put the header on the route.
        if let Some(header) = targets
            .iter()
            .filter_map(|t| config.cluster(t))
            .find_map(|c| c.hash_on.as_ref())
        {
            a.hash_policy.push(route_action::HashPolicy {
                policy_specifier: Some(route_action::hash_policy::PolicySpecifier::Header(
                    route_action::hash_policy::Header {
                        header_name: header.header.clone(),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            });
        } else if targets
            .iter()
            .filter_map(|t| config.cluster(t))
            .any(|c| matches!(c.lb, model::LbPolicy::RingHash | model::LbPolicy::Maglev))
        {
            // Without a header flatmesh hashes the client address; Envoy would pick at random.
            a.hash_policy.push(route_action::HashPolicy {
                policy_specifier: Some(
                    route_action::hash_policy::PolicySpecifier::ConnectionProperties(
                        route_action::hash_policy::ConnectionProperties { source_ip: true },
                    ),
                ),
                ..Default::default()
            });
        }
        route::Action::Route(a)
    };
    Route {
        name: r.name.clone().unwrap_or_default(),
        r#match: Some(m),
        action: Some(action),
        request_headers_to_add: headers_to_add(&r.request_headers_to_add),
        request_headers_to_remove: r.request_headers_to_remove.clone(),
        response_headers_to_add: headers_to_add(&r.response_headers_to_add),
        typed_per_filter_config: r
            .fault
            .iter()
            .map(|f| {
                (
                    crate::fault::FAULT_FILTER_NAME.to_string(),
                    pack(&crate::fault::http_fault(f)),
                )
            })
            .chain(
                r.rate_limit
                    .as_ref()
                    .and_then(|limit| {
                        local_ratelimit::http_config(
                            r.name.as_deref().unwrap_or("route"),
                            Some(limit),
                        )
                    })
                    .map(|c| (local_ratelimit::HTTP_NAME.to_owned(), pack(&c))),
            )
            .collect(),
        ..Default::default()
    }
}
