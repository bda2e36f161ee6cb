//! xDS resources -> flatmesh's config model ([`flatmesh_config::Config`]), the same model the
//! YAML file becomes. Only the subset flatmesh runs is accepted; anything else is an error that
//! names the resource and the field (it becomes the NACK's `error_detail`).
//!
//! Envoy picks a virtual host by its domains first, then a route inside it. flatmesh routes are
//! one ordered list per listener with an optional host condition, so virtual hosts are flattened
//! most-specific domain first (exact, then `*.suffix` longest first, then `*`), and every
//! non-wildcard host ends in a 404 route so a request never falls through into another host's
//! routes, exactly as in Envoy. TLS transport sockets are [`crate::tls`]'s.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::mem::take;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, data_source, socket_address, Address, DataSource, HeaderValueOption,
    Http2ProtocolOptions,
};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher, query_parameter_matcher, route, route_action, route_match, HeaderMatcher,
    RouteConfiguration,
};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options, HttpProtocolOptions,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    metadata_matcher, string_matcher, value_matcher, MetadataMatcher, StringMatcher,
};
use envoy_types::pb::google::protobuf::Any;
use flatmesh_config as model;
use prost::{Message, Name};

use crate::error::{Result, XdsError};
use crate::resources::Resources;
use crate::unset::set_fields;

pub const HCM_NAME: &str = "envoy.filters.network.http_connection_manager";
pub const TCP_PROXY_NAME: &str = "envoy.filters.network.tcp_proxy";
pub const ROUTER_NAME: &str = "envoy.filters.http.router";
pub const HTTP_OPTIONS_KEY: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// Build the node's config: `base` (admin, limits, workers and any static listeners/clusters
/// from `--config`) plus everything in `resources`.
///
/// Listeners whose RDS route configuration has not arrived yet are left out until it does
/// (Envoy's listener warming). A cluster that routes name but that does not exist (yet) becomes
/// a cluster without endpoints, which answers 503 like Envoy's `cluster_not_found_response_code`.
///
/// A one-off translation; the xDS client keeps a [`Translator`] so that an update re-translates
/// only the resources it changed.
pub fn translate(resources: &Resources, base: &model::Config) -> Result<model::Config> {
    Translator::default().translate(resources, base)
}

/// Translates [`Resources`] into configs and remembers each resource's translation, keyed by
/// the resource itself (and the route configuration or assignment it draws on). The next
/// translation re-does only the listeners and clusters whose inputs changed: an EDS push that
/// moves one cluster's endpoints re-translates that cluster, not the thousand others. The
/// assembled config is still validated as a whole, so nothing about the result differs from a
/// fresh [`translate`].
#[derive(Debug, Default)]
pub struct Translator {
    listeners: HashMap<String, ListenerEntry>,
    clusters: HashMap<String, ClusterEntry>,
}

#[derive(Debug)]
struct ListenerEntry {
    input: Listener,
    /// The RDS route configuration it was built from (None: inline routes or not arrived).
    routes: Option<RouteConfiguration>,
    /// None while its RDS route configuration has not arrived (warming).
    output: Option<model::Listener>,
    hashes: Vec<HashUse>,
    /// Its tcp_proxy's tunnel, if it tunnels.
    tunnel: Option<crate::hbone::TunnelUse>,
}

#[derive(Debug)]
struct ClusterEntry {
    input: Cluster,
    assignment: Option<ClusterLoadAssignment>,
    /// None: an hbone listener's termination cluster, no cluster of flatmesh's.
    output: Option<model::Cluster>,
}

/// A route's `hash_policy` header for one of its clusters; `at` names the route.
#[derive(Debug, Clone)]
struct HashUse {
    cluster: String,
    header: String,
    at: String,
}

impl Translator {
    /// Like [`translate`], reusing what earlier calls translated. A TLS context that names an
    /// SDS secret is refused: nothing provides secrets here (see [`Translator::translate_with`]).
    pub fn translate(
        &mut self,
        resources: &Resources,
        base: &model::Config,
    ) -> Result<model::Config> {
        self.translate_resolved(resources, base, &crate::tls::NoSecrets)
    }

    /// Like [`Translator::translate`], with the SDS secrets of `secrets`; one that is not there
    /// is an error (a bootstrap's static secrets must all be given).
    pub fn translate_resolved(
        &mut self,
        resources: &Resources,
        base: &model::Config,
        secrets: &dyn crate::tls::SecretFiles,
    ) -> Result<model::Config> {
        let (config, waiting) = self.translate_with(resources, base, secrets)?;
        match waiting.into_iter().next() {
            None => Ok(config),
            Some((secret, who)) => Err(XdsError::resource(
                who.into_iter().next().unwrap_or_default(),
                format!("names the SDS secret `{secret}`, which is not given: add it to static_resources.secrets with its files, or take the secret over ADS (flatmesh node --xds --sds-dir DIR)"),
            )),
        }
    }

    /// Like [`Translator::translate`], with the SDS secrets whose files `secrets` has. A listener
    /// or cluster waiting for a secret not held yet is left out (see
    /// [`crate::tls::resolve_secrets`]); the second value says who waits for what.
    pub fn translate_with(
        &mut self,
        resources: &Resources,
        base: &model::Config,
        secrets: &dyn crate::tls::SecretFiles,
    ) -> Result<(model::Config, crate::tls::Waiting)> {
        let mut config = base.clone();
        // Names from the --config file, which pushed resources may not reuse.
        let static_listeners: BTreeSet<String> =
            base.listeners.iter().map(|l| l.name.clone()).collect();
        let static_clusters: BTreeSet<String> =
            base.clusters.iter().map(|c| c.name.clone()).collect();
        let mut hash_headers: BTreeMap<String, String> = BTreeMap::new();
        let mut tunnels = Vec::new();
        for l in resources.listeners.values() {
            let rds = rds_of(l);
            let routes = rds.as_ref().and_then(|name| resources.routes.get(name));
            let fresh = self
                .listeners
                .get(&l.name)
                .is_none_or(|e| e.input != *l || e.routes.as_ref() != routes);
            if fresh {
                let mut hashes = Vec::new();
                let mut tunnel = None;
                let output = listener(l, &resources.routes, &mut hashes, &mut tunnel)?;
                self.listeners.insert(
                    l.name.clone(),
                    ListenerEntry {
                        input: l.clone(),
                        routes: routes.cloned(),
                        output,
                        hashes,
                        tunnel,
                    },
                );
            }
            let Some(entry) = self.listeners.get(&l.name) else {
                continue;
            };
            tunnels.extend(entry.tunnel.clone());
            for h in &entry.hashes {
                match hash_headers.get(&h.cluster) {
                    Some(previous) if *previous != h.header => {
                        return Err(XdsError::resource(
                            h.at.clone(),
                            format!("cluster `{}` is hashed on `{previous}` by another route; flatmesh hashes a cluster on one header", h.cluster),
                        ))
                    }
                    Some(_) => {}
                    None => {
                        hash_headers.insert(h.cluster.clone(), h.header.clone());
                    }
                }
            }
            if let Some(listener) = &entry.output {
                if static_listeners.contains(&listener.name) {
                    return Err(XdsError::resource(
                        format!("Listener \"{}\"", l.name),
                        "name: a listener of this name is already in the --config file; rename one",
                    ));
                }
                config.listeners.push(listener.clone());
            }
        }
        for c in resources.clusters.values() {
            let assignment = eds_name(c).and_then(|name| resources.endpoints.get(&name));
            let fresh = self
                .clusters
                .get(&c.name)
                .is_none_or(|e| e.input != *c || e.assignment.as_ref() != assignment);
            if fresh {
                let output = cluster(c, &resources.endpoints)?;
                self.clusters.insert(
                    c.name.clone(),
                    ClusterEntry {
                        input: c.clone(),
                        assignment: assignment.cloned(),
                        output,
                    },
                );
            }
            let Some(output) = self.clusters.get(&c.name).and_then(|e| e.output.as_ref()) else {
                continue;
            };
            if static_clusters.contains(&output.name) {
                return Err(XdsError::resource(
                    format!("Cluster \"{}\"", c.name),
                    "name: a cluster of this name is already in the --config file; rename one",
                ));
            }
            config.clusters.push(output.clone());
        }
        // Per-endpoint tunnels first: they ask whether the endpoints carry their destinations,
        // which a fixed hostname then gives a cluster that had none.
        tunnels.sort_by_key(|t| t.hostname != crate::hbone::Hostname::PerEndpoint);
        for tunnel in &tunnels {
            if let Some(c) = config
                .clusters
                .iter_mut()
                .find(|c| c.name == tunnel.cluster)
            {
                crate::hbone::apply(c, tunnel)?;
            }
        }
        for (cluster_name, header) in hash_headers {
            if let Some(c) = config.clusters.iter_mut().find(|c| c.name == cluster_name) {
                if matches!(c.lb, model::LbPolicy::RingHash | model::LbPolicy::Maglev) {
                    c.hash_on = Some(model::HashOn { header });
                }
            }
        }
        add_missing_clusters(&mut config);
        let waiting = crate::tls::resolve_secrets(&mut config, secrets);
        check(&config)?;
        // Forget what is no longer held.
        self.listeners
            .retain(|name, _| resources.listeners.contains_key(name));
        self.clusters
            .retain(|name, _| resources.clusters.contains_key(name));
        Ok((config, waiting))
    }
}

/// The RDS route configuration name a listener's (single) HTTP connection manager asks for.
fn rds_of(l: &Listener) -> Option<String> {
    l.filter_chains
        .iter()
        .flat_map(|c| c.filters.iter())
        .find_map(rds_name)
}

/// Validate with the same rules as a config file, minus two that xDS legitimately breaks:
/// a node may have no listeners yet, and an EDS cluster may have no endpoints (it answers 503).
pub fn check(config: &model::Config) -> Result<()> {
    let problems: Vec<String> = flatmesh_config::validate::validate(config)
        .into_iter()
        .filter(|p| p.path != "listeners" && !is_endpoints_list(&p.path))
        .map(|p| {
            format!(
                "{}: {} ({})",
                describe_path(config, &p.path),
                p.message,
                p.hint
            )
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(XdsError::Invalid(problems.join("; ")))
    }
}

fn is_endpoints_list(path: &str) -> bool {
    path.strip_prefix("clusters[")
        .and_then(|rest| rest.strip_suffix("].endpoints"))
        .is_some_and(|index| index.chars().all(|c| c.is_ascii_digit()))
}

/// `listeners[2].routes[0].cluster` -> `listener "web" routes[0].cluster`: names beat indexes.
fn describe_path(config: &model::Config, path: &str) -> String {
    let named = |prefix: &str, kind: &str, name_of: &dyn Fn(usize) -> Option<String>| {
        let rest = path.strip_prefix(prefix)?;
        let (index, tail) = rest.split_once(']')?;
        let name = name_of(index.parse().ok()?)?;
        Some(format!("{kind} \"{name}\"{}", tail.replacen('.', " ", 1)))
    };
    named("listeners[", "listener", &|i| {
        config.listeners.get(i).map(|l| l.name.clone())
    })
    .or_else(|| {
        named("clusters[", "cluster", &|i| {
            config.clusters.get(i).map(|c| c.name.clone())
        })
    })
    .unwrap_or_else(|| path.to_string())
}

fn add_missing_clusters(config: &mut model::Config) {
    let known: BTreeSet<String> = config.clusters.iter().map(|c| c.name.clone()).collect();
    let mut wanted = BTreeSet::new();
    for l in &config.listeners {
        wanted.extend(l.cluster.iter().cloned());
        for r in &l.routes {
            wanted.extend(r.cluster.iter().cloned());
            wanted.extend(r.split.iter().flatten().map(|w| w.cluster.clone()));
        }
    }
    for name in wanted.difference(&known) {
        config.clusters.push(model::Cluster {
            name: name.clone(),
            kind: model::ClusterType::Static,
            allow: Vec::new(),
            max_destinations: None,
            lb: model::LbPolicy::RoundRobin,
            endpoints: Default::default(),
            protocol: model::UpstreamProtocol::Http1,
            hash_on: None,
            connect_timeout: None,
            tls: None,
            tunnel: None,
            tunnel_port: None,
            circuit_breaker: None,
            outlier_detection: None,
            health_check: None,
            slow_start: None,
            overprovisioning_factor: None,
        });
    }
}

/// Fails with the names of every field of `rest` still set: flatmesh does not run them.
pub(crate) fn reject_rest<T: std::fmt::Debug + Default + PartialEq>(
    rest: &T,
    at: &str,
) -> Result<()> {
    let fields = set_fields(rest);
    if fields.is_empty() {
        return Ok(());
    }
    Err(XdsError::resource(
        at,
        format!(
            "{} {} not supported by flatmesh; remove {} (docs/xds.md lists the supported subset)",
            fields.join(", "),
            if fields.len() == 1 { "is" } else { "are" },
            if fields.len() == 1 { "it" } else { "them" },
        ),
    ))
}

pub(crate) fn unpack<M: Message + Name + Default>(any: &Any, at: &str) -> Result<M> {
    M::decode(any.value.as_slice())
        .map_err(|e| XdsError::resource(at, format!("is not a valid {}: {e}", M::full_name())))
}

pub(crate) fn duration(
    d: &envoy_types::pb::google::protobuf::Duration,
    at: &str,
) -> Result<Duration> {
    if d.seconds < 0 || d.nanos < 0 {
        return Err(XdsError::resource(
            at,
            "is negative; write a positive duration such as 2s",
        ));
    }
    if d.nanos >= 1_000_000_000 {
        return Err(XdsError::resource(
            at,
            "has nanos of a second or more, which is not a valid google.protobuf.Duration",
        ));
    }
    let d = Duration::new(d.seconds as u64, d.nanos as u32);
    if d > flatmesh_config::duration::MAX {
        return Err(XdsError::resource(
            at,
            format!(
                "is {}s, longer than {}, the longest duration flatmesh accepts; write a shorter one",
                d.as_secs(),
                flatmesh_config::duration::MAX_TEXT
            ),
        ));
    }
    Ok(d)
}

/// An IP socket address. flatmesh resolves no DNS names, so a host name is an error.
pub(crate) fn socket_addr(a: Option<&Address>, at: &str) -> Result<SocketAddr> {
    let Some(Address {
        address: Some(address::Address::SocketAddress(sa)),
    }) = a
    else {
        return Err(XdsError::resource(
            at,
            "needs a socket_address (pipes and internal addresses are not supported)",
        ));
    };
    let mut rest = sa.clone();
    let ip: IpAddr = take(&mut rest.address).parse().map_err(|_| {
        XdsError::resource(
            format!("{at}.socket_address.address"),
            format!(
                "`{}` is not an IP address; flatmesh does not resolve DNS names, so write an IP such as 127.0.0.1",
                sa.address
            ),
        )
    })?;
    let port = match rest.port_specifier.take() {
        Some(socket_address::PortSpecifier::PortValue(p)) => u16::try_from(p).map_err(|_| {
            XdsError::resource(
                format!("{at}.socket_address.port_value"),
                format!("{p} is not a port (0-65535)"),
            )
        })?,
        Some(socket_address::PortSpecifier::NamedPort(_)) => {
            return Err(XdsError::resource(
                format!("{at}.socket_address.named_port"),
                "named ports are not supported; write port_value",
            ))
        }
        None => 0,
    };
    reject_rest(&rest, &format!("{at}.socket_address"))?;
    Ok(SocketAddr::new(ip, port))
}

/// The RDS route configuration a listener filter asks for, if any.
pub fn rds_name(f: &Filter) -> Option<String> {
    let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
        return None;
    };
    if any.type_url != HttpConnectionManager::type_url() {
        return None;
    }
    match HttpConnectionManager::decode(any.value.as_slice())
        .ok()?
        .route_specifier?
    {
        http_connection_manager::RouteSpecifier::Rds(rds) => Some(rds.route_config_name),
        _ => None,
    }
}

/// The ClusterLoadAssignment name an EDS cluster asks for, if it is one.
pub fn eds_name(c: &Cluster) -> Option<String> {
    if c.cluster_discovery_type
        != Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        ))
    {
        return None;
    }
    let service = c
        .eds_cluster_config
        .as_ref()
        .map(|e| e.service_name.clone())
        .unwrap_or_default();
    Some(if service.is_empty() {
        c.name.clone()
    } else {
        service
    })
}

fn listener(
    l: &Listener,
    routes: &BTreeMap<String, RouteConfiguration>,
    hash_headers: &mut Vec<HashUse>,
    tunnel: &mut Option<crate::hbone::TunnelUse>,
) -> Result<Option<model::Listener>> {
    let at = format!("Listener \"{}\"", l.name);
    let mut rest = l.clone();
    let name = take(&mut rest.name);
    let address = socket_addr(rest.address.take().as_ref(), &format!("{at}: address"))?;
    rest.stat_prefix.clear(); // statistics are named after the listener
    rest.traffic_direction = 0; // informational only
    let mut limits = model::ListenerLimits {
        per_connection_buffer_bytes: rest
            .per_connection_buffer_limit_bytes
            .take()
            .map(|v| v.value as usize),
        ..Default::default()
    };
    let mut chains = take(&mut rest.filter_chains);
    reject_rest(&rest, &at)?;
    if chains.len() != 1 {
        return Err(XdsError::resource(
            format!("{at}: filter_chains"),
            format!(
                "has {} filter chains; flatmesh runs exactly one per listener (no filter_chain_match)",
                chains.len()
            ),
        ));
    }
    let mut chain = chains.remove(0);
    let mut filters = take(&mut chain.filters);
    let transport_socket = chain.transport_socket.take();
    chain.name.clear();
    reject_rest(&chain, &format!("{at}: filter_chains[0]"))?;
    let Some(f) = filters.pop() else {
        return Err(XdsError::resource(
            format!("{at}: filter_chains[0].filters"),
            format!("is empty; flatmesh runs {HCM_NAME} or {TCP_PROXY_NAME}"),
        ));
    };
    // Before the last filter only RBAC may come (a tcp listener's authorization).
    let mut network_rbac = crate::rbac::Layers::default();
    let mut connection_rate_limit = None;
    for (i, f) in filters.iter().enumerate() {
        let here = format!("{at}: filter_chains[0].filters[{i}].typed_config");
        match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any)) if any.type_url == NetworkRbac::type_url() => {
                network_rbac.network(any, &here)?
            }
            Some(filter::ConfigType::TypedConfig(any)) if crate::local_ratelimit::is_network(any) => {
                connection_rate_limit = Some(crate::local_ratelimit::network(any, &here)?);
            }
            _ => {
                return Err(XdsError::resource(
                    format!("{at}: filter_chains[0].filters[{i}]"),
                    format!(
                        "network filter `{}` is not supported; flatmesh runs {HCM_NAME} or {TCP_PROXY_NAME}, after {} (a tcp listener's authorization)",
                        f.name,
                        crate::rbac::NETWORK_RBAC_NAME
                    ),
                ))
            }
        }
    }
    let network_rbac = network_rbac.finish();
    let last = filters.len();
    let at_filter = format!("{at}: filter_chains[0].filters[{last}].typed_config");
    let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
        return Err(XdsError::resource(
            at_filter,
            "is missing (or is a config_discovery); flatmesh needs the filter's typed_config inline",
        ));
    };
    if any.type_url == HttpConnectionManager::type_url() {
        let mut hcm: HttpConnectionManager = unpack(any, &at_filter)?;
        let mut allow_connect = false;
        if let Some(mut h2) = hcm.http2_protocol_options.take() {
            allow_connect = take(&mut h2.allow_connect);
            http2_limits(
                h2,
                &mut limits,
                &format!("{at_filter}.http2_protocol_options"),
            )?;
        }
        if connection_rate_limit.is_some() {
            return Err(XdsError::resource(
                format!("{at}: filter_chains[0].filters"),
                format!(
                    "{} on an http listener is not supported: flatmesh limits requests there; write {} in the connection manager's http_filters",
                    crate::local_ratelimit::NETWORK_NAME,
                    crate::local_ratelimit::HTTP_NAME
                ),
            ));
        }
        if network_rbac.is_some() {
            return Err(XdsError::resource(
                format!("{at}: filter_chains[0].filters[0]"),
                format!(
                    "{} on an http listener is not supported: flatmesh decides per request there; write the policies as the HTTP filter {} before the router",
                    crate::rbac::NETWORK_RBAC_NAME,
                    crate::rbac::HTTP_RBAC_NAME
                ),
            ));
        }
        let Some((config, mut options)) = http_routes(hcm, routes, &at_filter)? else {
            return Ok(None);
        };
        if let Some(destinations) = hbone_termination(&config, &options, &at_filter)? {
            return Ok(Some(model::Listener {
                name,
                address,
                protocol: model::ListenerProtocol::Hbone,
                routes: Vec::new(),
                cluster: None,
                limits,
                normalize_path: None,
                merge_slashes: None,
                path_with_escaped_slashes_action: None,
                tls: listener_tls(
                    transport_socket.as_ref(),
                    model::ListenerProtocol::Hbone,
                    &at,
                )?,
                authorization: options.authorization.take(),
                hbone: (!destinations.is_empty()).then_some(model::HboneListener { destinations }),
                rate_limit: None,
                connection_rate_limit: None,
                qnp: None,
            }));
        }
        if allow_connect {
            return Err(XdsError::resource(
                format!("{at_filter}.http2_protocol_options.allow_connect"),
                "is not supported on an http listener (WebSocket over HTTP/2); flatmesh takes CONNECT only on an hbone listener, whose route matches it (connect_matcher)",
            ));
        }
        let tls = listener_tls(
            transport_socket.as_ref(),
            model::ListenerProtocol::Http,
            &at,
        )?;
        let mut routes = flatten(
            &config,
            &options.upgrades,
            options.fault.as_ref(),
            hash_headers,
        )?;
        // As in Envoy, a route's local rate limit applies only where the connection manager
        // runs the filter.
        if !options.local_ratelimit {
            for r in &mut routes {
                r.rate_limit = None;
            }
        }
        Ok(Some(model::Listener {
            name,
            address,
            protocol: model::ListenerProtocol::Http,
            routes,
            cluster: None,
            limits,
            normalize_path: options.normalize_path,
            merge_slashes: options.merge_slashes,
            path_with_escaped_slashes_action: options.escaped_slashes,
            tls,
            authorization: options.authorization.take(),
            hbone: None,
            rate_limit: options.rate_limit.take(),
            connection_rate_limit: None,
            qnp: None,
        }))
    } else if any.type_url == TcpProxy::type_url() {
        let mut tcp: TcpProxy = unpack(any, &at_filter)?;
        tcp.stat_prefix.clear();
        let cluster = match tcp.cluster_specifier.take() {
            Some(tcp_proxy::ClusterSpecifier::Cluster(c)) => c,
            Some(tcp_proxy::ClusterSpecifier::WeightedClusters(_)) => {
                return Err(XdsError::resource(
                    format!("{at_filter}.weighted_clusters"),
                    "weighted tcp_proxy clusters are not supported; name one cluster",
                ))
            }
            None => {
                return Err(XdsError::resource(
                    format!("{at_filter}.cluster"),
                    "is missing: a tcp_proxy needs the cluster it relays to",
                ))
            }
        };
        if let Some(idle) = tcp.idle_timeout.take() {
            let at = format!("{at_filter}.idle_timeout");
            let idle = duration(&idle, &at)?;
            if idle.is_zero() {
                return Err(XdsError::resource(
                    at,
                    "is 0s, which turns the idle timeout off; flatmesh always has one: write a long one, such as 24h",
                ));
            }
            limits.tcp_idle_timeout = Some(idle);
        }
        if let Some(mut t) = tcp.tunneling_config.take() {
            let here = format!("{at_filter}.tunneling_config");
            let hostname =
                crate::hbone::hostname(&take(&mut t.hostname), &format!("{here}.hostname"))?;
            reject_rest(&t, &here)?;
            *tunnel = Some(crate::hbone::TunnelUse {
                cluster: cluster.clone(),
                hostname,
                at: here,
            });
        }
        reject_rest(&tcp, &at_filter)?;
        let tls = listener_tls(transport_socket.as_ref(), model::ListenerProtocol::Tcp, &at)?;
        Ok(Some(model::Listener {
            name,
            address,
            protocol: model::ListenerProtocol::Tcp,
            routes: Vec::new(),
            cluster: Some(cluster),
            limits,
            normalize_path: None,
            merge_slashes: None,
            path_with_escaped_slashes_action: None,
            tls,
            authorization: network_rbac,
            hbone: None,
            rate_limit: None,
            connection_rate_limit,
            qnp: None,
        }))
    } else {
        Err(XdsError::resource(
            at_filter,
            format!(
                "`{}` is not supported; flatmesh runs {HCM_NAME} and {TCP_PROXY_NAME}",
                any.type_url
            ),
        ))
    }
}

/// A filter chain's `transport_socket` as the listener's `tls` (`at` names the listener).
fn listener_tls(
    socket: Option<&envoy_types::pb::envoy::config::core::v3::TransportSocket>,
    protocol: model::ListenerProtocol,
    at: &str,
) -> Result<Option<model::ListenerTls>> {
    match socket {
        Some(socket) => crate::tls::listener_tls(
            socket,
            protocol,
            &format!("{at}: filter_chains[0].transport_socket"),
        ),
        None => Ok(None),
    }
}

/// An HTTP connection manager that terminates HBONE (crate::hbone, "Termination"): one
/// virtual host for `*` with one route that matches CONNECT and terminates it. Its
/// destinations, or None when no route matches CONNECT (an http listener).
fn hbone_termination(
    config: &RouteConfiguration,
    options: &HcmOptions,
    at: &str,
) -> Result<Option<Vec<String>>> {
    let is_connect = |r: &envoy_types::pb::envoy::config::route::v3::Route| {
        matches!(
            r.r#match.as_ref().and_then(|m| m.path_specifier.as_ref()),
            Some(route_match::PathSpecifier::ConnectMatcher(_))
        )
    };
    if !config
        .virtual_hosts
        .iter()
        .any(|v| v.routes.iter().any(is_connect))
    {
        return Ok(None);
    }
    let hcm_at = at;
    let at = format!("{at}.route_config");
    let shape = "an hbone listener has one virtual host, domains [\"*\"], with one route: { match: { connect_matcher: {} }, route: { cluster: ..., upgrade_configs: [ { upgrade_type: CONNECT, connect_config: {} } ] } }";
    let [vh] = config.virtual_hosts.as_slice() else {
        return Err(XdsError::resource(
            format!("{at}.virtual_hosts"),
            format!("has {} virtual hosts; {shape}", config.virtual_hosts.len()),
        ));
    };
    let at = format!("{at}.virtual_hosts[0]");
    let mut vh = vh.clone();
    if vh.domains != ["*"] {
        return Err(XdsError::resource(
            format!("{at}.domains"),
            format!("is {:?}; {shape} (the destinations it reaches are `hbone.destinations`, in the route's metadata `{}`)", vh.domains, crate::hbone::FLATMESH_METADATA_KEY),
        ));
    }
    let [route] = take(&mut vh.routes).try_into().map_err(
        |routes: Vec<envoy_types::pb::envoy::config::route::v3::Route>| {
            XdsError::resource(
                format!("{at}.routes"),
                format!("has {} routes; {shape}", routes.len()),
            )
        },
    )?;
    vh.name.clear();
    vh.domains.clear();
    reject_rest(&vh, &at)?;
    let at = format!("{at}.routes[0]");
    let mut route = route;
    route.name.clear();
    let destinations = crate::hbone::take_destinations(&mut route.metadata, &at)?;
    if let Some(mut m) = route.r#match.take() {
        m.path_specifier = None;
        reject_rest(&m, &format!("{at}.match"))?;
    }
    let Some(route::Action::Route(mut a)) = route.action.take() else {
        return Err(XdsError::resource(
            at,
            format!("does not route the CONNECT; {shape}"),
        ));
    };
    let terminates = take(&mut a.upgrade_configs).into_iter().any(|mut u| {
        let connect = u.upgrade_type.eq_ignore_ascii_case(crate::hbone::CONNECT)
            && u.enabled.take().is_none_or(|b| b.value)
            && u.connect_config.take() == Some(Default::default());
        u.upgrade_type.clear();
        connect && u == Default::default()
    });
    if !terminates {
        return Err(XdsError::resource(
            format!("{at}.route.upgrade_configs"),
            format!("does not terminate CONNECT (or asks for more, such as allow_post or a PROXY protocol header); {shape}"),
        ));
    }
    // Envoy sends the bytes to this cluster (an ORIGINAL_DST one, by `:authority`); flatmesh's
    // hbone listener delivers to the `:authority` itself.
    a.cluster_specifier = None;
    reject_rest(&a, &format!("{at}.route"))?;
    reject_rest(&route, &at)?;
    if !options
        .upgrades
        .iter()
        .any(|(kind, enabled)| *enabled && kind.eq_ignore_ascii_case(crate::hbone::CONNECT))
    {
        return Err(XdsError::resource(
            format!("{hcm_at}.upgrade_configs"),
            "does not enable CONNECT; an hbone listener's connection manager says upgrade_configs: [ { upgrade_type: CONNECT } ]",
        ));
    }
    if options.fault.is_some() || options.local_ratelimit {
        return Err(XdsError::resource(
            format!("{hcm_at}.http_filters"),
            "an hbone listener runs only RBAC (its authorization) and the router",
        ));
    }
    Ok(Some(destinations))
}

/// An HTTP connection manager's `http2_protocol_options`: the stream cap and the windows it
/// grants clients become the listener's limits; anything else is unsupported.
fn http2_limits(
    mut h2: Http2ProtocolOptions,
    limits: &mut model::ListenerLimits,
    at: &str,
) -> Result<()> {
    limits.http2_max_concurrent_streams = h2.max_concurrent_streams.take().map(|v| v.value);
    limits.http2_stream_window = h2.initial_stream_window_size.take().map(|v| v.value);
    limits.http2_connection_window = h2.initial_connection_window_size.take().map(|v| v.value);
    reject_rest(&h2, at)
}

/// What an HTTP connection manager says about its listener besides the routes.
#[derive(Debug, Default)]
struct HcmOptions {
    normalize_path: Option<bool>,
    /// proto3's `false` is unset: the listener's default applies.
    merge_slashes: Option<bool>,
    escaped_slashes: Option<model::EscapedSlashesAction>,
    /// `upgrade_configs`: each type, and whether it is enabled by default.
    upgrades: Vec<(String, bool)>,
    /// The RBAC filters before the router.
    authorization: Option<model::Authorization>,
    /// The fault filter before the router (`crate::fault`).
    fault: Option<crate::fault::FaultFilter>,
    /// The connection manager runs the local rate limit filter (routes' own limits apply).
    local_ratelimit: bool,
    /// Its token bucket: the listener's `rate_limit`.
    rate_limit: Option<model::RateLimit>,
}

/// The HTTP connection manager's options and route configuration (inline, or by RDS name).
/// `None` means the RDS resource has not arrived yet.
fn http_routes(
    mut hcm: HttpConnectionManager,
    routes: &BTreeMap<String, RouteConfiguration>,
    at: &str,
) -> Result<Option<(RouteConfiguration, HcmOptions)>> {
    use http_connection_manager::PathWithEscapedSlashesAction as Escaped;
    hcm.stat_prefix.clear();
    let mut options = HcmOptions {
        normalize_path: hcm.normalize_path.take().map(|b| b.value),
        merge_slashes: take(&mut hcm.merge_slashes).then_some(true),
        ..HcmOptions::default()
    };
    options.escaped_slashes =
        match Escaped::try_from(take(&mut hcm.path_with_escaped_slashes_action)) {
            Ok(Escaped::ImplementationSpecificDefault) => None,
            Ok(Escaped::KeepUnchanged) => Some(model::EscapedSlashesAction::KeepUnchanged),
            Ok(Escaped::RejectRequest) => Some(model::EscapedSlashesAction::RejectRequest),
            Ok(Escaped::UnescapeAndRedirect) => {
                Some(model::EscapedSlashesAction::UnescapeAndRedirect)
            }
            Ok(Escaped::UnescapeAndForward) => {
                Some(model::EscapedSlashesAction::UnescapeAndForward)
            }
            Err(_) => {
                return Err(XdsError::resource(
                    format!("{at}.path_with_escaped_slashes_action"),
                    "is not a PathWithEscapedSlashesAction",
                ))
            }
        };
    for (i, mut u) in take(&mut hcm.upgrade_configs).into_iter().enumerate() {
        let here = format!("{at}.upgrade_configs[{i}]");
        let kind = take(&mut u.upgrade_type);
        let enabled = u.enabled.take().is_none_or(|b| b.value);
        if !u.filters.is_empty() {
            return Err(XdsError::resource(
                format!("{here}.filters"),
                "is not supported: an upgraded connection is a byte tunnel in flatmesh; remove it",
            ));
        }
        reject_rest(&u, &here)?;
        options.upgrades.push((kind, enabled));
    }
    if !matches!(hcm.codec_type, 0..=2) {
        return Err(XdsError::resource(
            format!("{at}.codec_type"),
            "only AUTO, HTTP1 and HTTP2 are supported (no HTTP/3)",
        ));
    }
    hcm.codec_type = 0; // flatmesh serves HTTP/1.1 and h2c on every HTTP listener
                        // flatmesh matches hosts without their port, which is what both of these ask for.
    hcm.strip_matching_host_port = false;
    if matches!(
        hcm.strip_port_mode,
        Some(http_connection_manager::StripPortMode::StripAnyHostPort(_))
    ) {
        hcm.strip_port_mode = None;
    }
    let mut rbac = crate::rbac::Layers::default();
    let mut router_seen = false;
    for (i, f) in take(&mut hcm.http_filters).into_iter().enumerate() {
        let here = format!("{at}.http_filters[{i}]");
        if let Some(
            envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter::ConfigType::TypedConfig(any),
        ) = &f.config_type
        {
            if any.type_url == envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault::type_url() {
                if router_seen || options.fault.is_some() {
                    return Err(XdsError::resource(
                        here,
                        format!("the fault filter must come once, before {ROUTER_NAME}"),
                    ));
                }
                options.fault = Some(crate::fault::FaultFilter {
                    name: f.name.clone(),
                    default: crate::fault::fault_of(any, &format!("{here}.typed_config"))?,
                });
                continue;
            }
            if any.type_url == HttpRbac::type_url() {
                if router_seen {
                    return Err(XdsError::resource(
                        here,
                        format!("{} after the router never runs; put it before {ROUTER_NAME}", crate::rbac::HTTP_RBAC_NAME),
                    ));
                }
                rbac.http(any, &format!("{here}.typed_config"))?;
                continue;
            }
            if crate::local_ratelimit::is_http(any) && !router_seen {
                options.rate_limit =
                    crate::local_ratelimit::http(any, &format!("{here}.typed_config"))?;
                options.local_ratelimit = true;
                continue;
            }
        }
        let is_router = match &f.config_type {
            Some(
                envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter::ConfigType::TypedConfig(any),
            ) if any.type_url == Router::type_url() => {
                let router: Router = unpack(any, &here)?;
                reject_rest(&router, &format!("{here}.typed_config"))?;
                true
            }
            None => f.name == ROUTER_NAME,
            _ => false,
        };
        if !is_router {
            return Err(XdsError::resource(
                here,
                format!(
                    "HTTP filter `{}` is not supported; flatmesh runs only {} (a listener's authorization), {} (rate limits) and {ROUTER_NAME} (its routes do the rest)",
                    f.name,
                    crate::rbac::HTTP_RBAC_NAME,
                    crate::local_ratelimit::HTTP_NAME
                ),
            ));
        }
        router_seen = true;
    }
    options.authorization = rbac.finish();
    let config = match hcm.route_specifier.take() {
        Some(http_connection_manager::RouteSpecifier::RouteConfig(rc)) => rc,
        Some(http_connection_manager::RouteSpecifier::Rds(rds)) => {
            match routes.get(&rds.route_config_name) {
                Some(rc) => rc.clone(),
                None => return Ok(None),
            }
        }
        _ => {
            return Err(XdsError::resource(
                format!("{at}.route_specifier"),
                "needs `route_config` or `rds` (scoped routes are not supported)",
            ))
        }
    };
    reject_rest(&hcm, at)?;
    Ok(Some((config, options)))
}

/// A virtual host's domain, ranked: exact names first, then `*.suffix` by length, then `*`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Domain {
    Exact(String),
    Suffix(std::cmp::Reverse<usize>, String),
    Any,
}

fn domain(d: &str, at: &str) -> Result<Domain> {
    let host = d.split(':').next().unwrap_or(d); // host matching ignores the port
    if host == "*" {
        Ok(Domain::Any)
    } else if let Some(suffix) = host.strip_prefix("*.") {
        Ok(Domain::Suffix(
            std::cmp::Reverse(suffix.len()),
            host.to_string(),
        ))
    } else if host.contains('*') {
        Err(XdsError::resource(
            at,
            format!("domain `{d}`: only `*`, exact names and `*.suffix` wildcards are supported"),
        ))
    } else {
        Ok(Domain::Exact(host.to_ascii_lowercase()))
    }
}

/// A route configuration as one ordered list of routes; `upgrades` are the connection
/// manager's `upgrade_configs` (type, enabled), which a route's own override.
fn flatten(
    rc: &RouteConfiguration,
    upgrades: &[(String, bool)],
    fault: Option<&crate::fault::FaultFilter>,
    hash_headers: &mut Vec<HashUse>,
) -> Result<Vec<model::Route>> {
    let at = format!("RouteConfiguration \"{}\"", rc.name);
    let mut rest = rc.clone();
    let vhosts = take(&mut rest.virtual_hosts);
    rest.name.clear();
    rest.validate_clusters = None; // flatmesh never rejects a route for a missing cluster (503)
    reject_rest(&rest, &at)?;
    let mut by_domain: BTreeMap<Domain, Vec<model::Route>> = BTreeMap::new();
    for (v, vh) in vhosts.into_iter().enumerate() {
        let at_vh = format!("{at}: virtual_hosts[{v}] (\"{}\")", vh.name);
        let mut rest = vh.clone();
        rest.name.clear();
        let domains = take(&mut rest.domains);
        let routes = take(&mut rest.routes);
        reject_rest(&rest, &at_vh)?;
        let mut translated = Vec::with_capacity(routes.len());
        for (r, route) in routes.iter().enumerate() {
            translated.push(self::route(
                route,
                &format!("{at_vh}.routes[{r}]"),
                upgrades,
                fault,
                hash_headers,
            )?);
        }
        if domains.is_empty() {
            return Err(XdsError::resource(
                format!("{at_vh}.domains"),
                "is empty; list the hosts it serves, or `*`",
            ));
        }
        for d in &domains {
            let key = domain(d, &format!("{at_vh}.domains"))?;
            if by_domain.contains_key(&key) {
                return Err(XdsError::resource(
                    format!("{at_vh}.domains"),
                    format!("domain `{d}` is already served by another virtual host"),
                ));
            }
            by_domain.insert(key, translated.clone());
        }
    }
    let mut out = Vec::new();
    for (d, routes) in by_domain {
        let host = match &d {
            Domain::Exact(h) | Domain::Suffix(_, h) => Some(h.clone()),
            Domain::Any => None,
        };
        for mut r in routes {
            r.matches.host = host.clone();
            // Route names are per listener; a host group repeats a virtual host's routes.
            if let (Some(name), Some(h)) = (&r.name, &host) {
                r.name = Some(format!("{h}/{name}"));
            }
            out.push(r);
        }
        if host.is_some() {
            out.push(not_found(host));
        }
    }
    if out.is_empty() {
        out.push(not_found(None));
    }
    Ok(out)
}

fn not_found(host: Option<String>) -> model::Route {
    model::Route {
        name: None,
        matches: model::RouteMatch {
            host,
            ..Default::default()
        },
        cluster: None,
        split: None,
        direct_response: Some(model::DirectResponse {
            status: 404,
            body: String::new(),
        }),
        timeout: None,
        request_headers_to_add: BTreeMap::new(),
        request_headers_to_remove: Vec::new(),
        response_headers_to_add: BTreeMap::new(),
        retries: None,
        fault: None,
        mirror: None,
        upgrades: Vec::new(),
        rate_limit: None,
    }
}

fn route(
    r: &envoy_types::pb::envoy::config::route::v3::Route,
    at: &str,
    upgrades: &[(String, bool)],
    fault: Option<&crate::fault::FaultFilter>,
    hash_headers: &mut Vec<HashUse>,
) -> Result<model::Route> {
    let mut rest = r.clone();
    let name = take(&mut rest.name);
    let matches = route_match(rest.r#match.take(), &format!("{at}.match"))?;
    let mut out = not_found(None);
    out.name = (!name.is_empty()).then_some(name);
    out.matches = matches;
    out.direct_response = None;
    out.request_headers_to_add = headers_to_add(
        &take(&mut rest.request_headers_to_add),
        &format!("{at}.request_headers_to_add"),
    )?;
    out.response_headers_to_add = headers_to_add(
        &take(&mut rest.response_headers_to_add),
        &format!("{at}.response_headers_to_add"),
    )?;
    out.request_headers_to_remove = take(&mut rest.request_headers_to_remove);
    out.rate_limit = crate::local_ratelimit::route_config(&mut rest.typed_per_filter_config, at)?;
    match rest.action.take() {
        Some(route::Action::Route(action)) => route_action(
            action,
            &mut out,
            &format!("{at}.route"),
            upgrades,
            hash_headers,
        )?,
        Some(route::Action::DirectResponse(dr)) => {
            let at_dr = format!("{at}.direct_response");
            let mut dr_rest = dr.clone();
            let status = u16::try_from(dr_rest.status).map_err(|_| {
                XdsError::resource(format!("{at_dr}.status"), "is not an HTTP status")
            })?;
            let body = match dr_rest.body.take() {
                Some(ds) => data_source_text(&ds, &format!("{at_dr}.body"))?,
                None => String::new(),
            };
            dr_rest.status = 0;
            reject_rest(&dr_rest, &at_dr)?;
            out.direct_response = Some(model::DirectResponse { status, body });
        }
        _ => {
            return Err(XdsError::resource(
                at,
                "action: only `route` and `direct_response` are supported (no redirect or filter_action)",
            ))
        }
    }
    route_fault(
        &mut out,
        take(&mut rest.typed_per_filter_config),
        fault,
        &format!("{at}.typed_per_filter_config"),
    )?;
    reject_rest(&rest, at)?;
    Ok(out)
}

/// A route's fault: its own config for the connection manager's fault filter, else the
/// filter's. A direct response is answered before any fault, as flatmesh runs them.
fn route_fault(
    out: &mut model::Route,
    per_filter: HashMap<String, Any>,
    filter: Option<&crate::fault::FaultFilter>,
    at: &str,
) -> Result<()> {
    let mut own = None;
    for (name, any) in per_filter {
        let here = format!("{at}[\"{name}\"]");
        match filter {
            Some(f) if f.name == name => own = Some(crate::fault::fault_of(&any, &here)?),
            _ => {
                return Err(XdsError::resource(
                    here,
                    "only the fault filter of the connection manager's http_filters takes a per-route config",
                ))
            }
        }
    }
    let fault = match own {
        Some(own) => own,
        None => filter.and_then(|f| f.default.clone()),
    };
    if out.direct_response.is_none() {
        out.fault = fault;
    }
    Ok(())
}

fn data_source_text(ds: &DataSource, at: &str) -> Result<String> {
    match &ds.specifier {
        Some(data_source::Specifier::InlineString(s)) => Ok(s.clone()),
        Some(data_source::Specifier::InlineBytes(b)) => String::from_utf8(b.clone())
            .map_err(|_| XdsError::resource(at, "inline_bytes is not UTF-8 text")),
        None => Ok(String::new()),
        _ => Err(XdsError::resource(
            at,
            "only inline_string and inline_bytes are supported (no files or environment variables)",
        )),
    }
}

fn headers_to_add(list: &[HeaderValueOption], at: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (i, h) in list.iter().enumerate() {
        let mut rest = h.clone();
        let Some(mut header) = rest.header.take() else {
            return Err(XdsError::resource(
                format!("{at}[{i}].header"),
                "is missing",
            ));
        };
        rest.append = None;
        rest.append_action = 0; // flatmesh sets the header (one value), whatever the action
        reject_rest(&rest, &format!("{at}[{i}]"))?;
        let key = take(&mut header.key).to_ascii_lowercase();
        let value = if header.raw_value.is_empty() {
            take(&mut header.value)
        } else {
            String::from_utf8(take(&mut header.raw_value)).map_err(|_| {
                XdsError::resource(format!("{at}[{i}].header.raw_value"), "is not UTF-8 text")
            })?
        };
        header.value.clear();
        reject_rest(&header, &format!("{at}[{i}].header"))?;
        out.insert(key, value);
    }
    Ok(out)
}

fn route_match(
    m: Option<envoy_types::pb::envoy::config::route::v3::RouteMatch>,
    at: &str,
) -> Result<model::RouteMatch> {
    let Some(mut rest) = m else {
        return Err(XdsError::resource(
            at,
            "is missing; use `prefix: /` to match every request",
        ));
    };
    let path = match rest.path_specifier.take() {
        Some(route_match::PathSpecifier::Prefix(p)) if p.is_empty() || p == "/" => None,
        Some(route_match::PathSpecifier::Prefix(p)) => Some(model::PathMatch::Prefix(p)),
        Some(route_match::PathSpecifier::Path(p)) => Some(model::PathMatch::Exact(p)),
        Some(route_match::PathSpecifier::SafeRegex(r)) => Some(model::PathMatch::Regex(r.regex)),
        None => None,
        Some(_) => {
            return Err(XdsError::resource(
                at,
                "path: only prefix, path and safe_regex are supported",
            ))
        }
    };
    let mut out = model::RouteMatch {
        path,
        ..Default::default()
    };
    if rest.case_sensitive.take().is_some_and(|c| !c.value) {
        return Err(XdsError::resource(
            format!("{at}.case_sensitive"),
            "false is not supported: flatmesh matches paths case-sensitively",
        ));
    }
    for (i, h) in take(&mut rest.headers).iter().enumerate() {
        let here = format!("{at}.headers[{i}]");
        if h.name == ":method" {
            match header_condition(h, &here)? {
                model::NamedMatch {
                    exact: Some(method),
                    ..
                } => out.method = Some(method),
                _ => {
                    return Err(XdsError::resource(
                        here,
                        "`:method` can only be matched exactly",
                    ))
                }
            }
        } else if h.name.starts_with(':') {
            return Err(XdsError::resource(
                format!("{here}.name"),
                format!(
                    "pseudo-header `{}` cannot be matched; match the path or method instead",
                    h.name
                ),
            ));
        } else {
            out.headers.push(header_condition(h, &here)?);
        }
    }
    for (i, q) in take(&mut rest.query_parameters).iter().enumerate() {
        let here = format!("{at}.query_parameters[{i}]");
        let mut named = named(&q.name);
        match &q.query_parameter_match_specifier {
            Some(query_parameter_matcher::QueryParameterMatchSpecifier::PresentMatch(true)) => {
                named.present = Some(true)
            }
            Some(query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(s)) => {
                string_condition(s, &mut named, &format!("{here}.string_match"))?
            }
            _ => {
                return Err(XdsError::resource(
                    here,
                    "needs string_match or present_match: true",
                ))
            }
        }
        out.query.push(named);
    }
    for (i, d) in take(&mut rest.dynamic_metadata).into_iter().enumerate() {
        let here = format!("{at}.dynamic_metadata[{i}]");
        if out.grpc_field.is_some() {
            return Err(XdsError::resource(
                here,
                "a route matches on one grpc_field at most",
            ));
        }
        out.grpc_field = Some(grpc_field_condition(d, &here)?);
    }
    reject_rest(&rest, at)?;
    Ok(out)
}

/// flatmesh's `grpc_field` condition from its `dynamic_metadata` form (see
/// `from_model::GRPC_FIELD_FILTER`); any other metadata match is refused.
fn grpc_field_condition(mut d: MetadataMatcher, at: &str) -> Result<model::GrpcFieldMatch> {
    if d.filter != crate::from_model::GRPC_FIELD_FILTER {
        return Err(XdsError::resource(
            format!("{at}.filter"),
            format!(
                "metadata matches are not supported, except flatmesh's `{}`",
                crate::from_model::GRPC_FIELD_FILTER
            ),
        ));
    }
    let number = match d.path.as_slice() {
        [metadata_matcher::PathSegment {
            segment: Some(metadata_matcher::path_segment::Segment::Key(key)),
        }] => key
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=model::GRPC_FIELD_NUMBER_MAX).contains(n)),
        _ => None,
    }
    .ok_or_else(|| {
        XdsError::resource(
            format!("{at}.path"),
            "must be one key, the protobuf field number (1..=536870911)",
        )
    })?;
    let mut out = model::GrpcFieldMatch {
        number,
        exact: None,
        prefix: None,
    };
    let pattern = match d.value.take().and_then(|v| v.match_pattern) {
        Some(value_matcher::MatchPattern::StringMatch(s)) if !s.ignore_case => s.match_pattern,
        _ => None,
    };
    match pattern {
        Some(string_matcher::MatchPattern::Exact(v)) => out.exact = Some(v),
        Some(string_matcher::MatchPattern::Prefix(v)) => out.prefix = Some(v),
        _ => {
            return Err(XdsError::resource(
                format!("{at}.value"),
                "must be a case-sensitive exact or prefix string match",
            ))
        }
    }
    if d.invert {
        return Err(XdsError::resource(
            format!("{at}.invert"),
            "is not supported for a grpc_field match",
        ));
    }
    Ok(out)
}

fn named(name: &str) -> model::NamedMatch {
    model::NamedMatch {
        name: name.to_string(),
        exact: None,
        prefix: None,
        present: None,
        regex: None,
    }
}

fn header_condition(h: &HeaderMatcher, at: &str) -> Result<model::NamedMatch> {
    let mut rest = h.clone();
    let mut out = named(&take(&mut rest.name).to_ascii_lowercase());
    match rest.header_match_specifier.take() {
        Some(header_matcher::HeaderMatchSpecifier::ExactMatch(v)) => out.exact = Some(v),
        Some(header_matcher::HeaderMatchSpecifier::PrefixMatch(v)) => out.prefix = Some(v),
        Some(header_matcher::HeaderMatchSpecifier::SafeRegexMatch(r)) => out.regex = Some(r.regex),
        Some(header_matcher::HeaderMatchSpecifier::PresentMatch(true)) => out.present = Some(true),
        Some(header_matcher::HeaderMatchSpecifier::StringMatch(s)) => {
            string_condition(&s, &mut out, &format!("{at}.string_match"))?
        }
        None => out.present = Some(true),
        Some(_) => return Err(XdsError::resource(
            at,
            "only exact, prefix, safe_regex, present and string_match header matches are supported",
        )),
    }
    reject_rest(&rest, at)?;
    Ok(out)
}

fn string_condition(s: &StringMatcher, out: &mut model::NamedMatch, at: &str) -> Result<()> {
    if s.ignore_case {
        return Err(XdsError::resource(
            format!("{at}.ignore_case"),
            "is not supported: flatmesh compares values case-sensitively",
        ));
    }
    match &s.match_pattern {
        Some(string_matcher::MatchPattern::Exact(v)) => out.exact = Some(v.clone()),
        Some(string_matcher::MatchPattern::Prefix(v)) => out.prefix = Some(v.clone()),
        Some(string_matcher::MatchPattern::SafeRegex(r)) => out.regex = Some(r.regex.clone()),
        _ => {
            return Err(XdsError::resource(
                at,
                "only exact, prefix and safe_regex string matches are supported",
            ))
        }
    }
    Ok(())
}

fn route_action(
    mut a: envoy_types::pb::envoy::config::route::v3::RouteAction,
    out: &mut model::Route,
    at: &str,
    upgrades: &[(String, bool)],
    hash_headers: &mut Vec<HashUse>,
) -> Result<()> {
    // Envoy's rule: the route's own `upgrade_configs` win, type by type; a type the route
    // does not name is allowed where the connection manager enables it.
    let mut allowed: Vec<String> = upgrades
        .iter()
        .filter(|(_, enabled)| *enabled)
        .map(|(kind, _)| kind.to_ascii_lowercase())
        .collect();
    for (i, mut u) in take(&mut a.upgrade_configs).into_iter().enumerate() {
        let here = format!("{at}.upgrade_configs[{i}]");
        let kind = take(&mut u.upgrade_type).to_ascii_lowercase();
        let enabled = u.enabled.take().is_none_or(|b| b.value);
        if u.connect_config.is_some() {
            return Err(XdsError::resource(
                format!("{here}.connect_config"),
                "is not supported: flatmesh does not terminate CONNECT; use a tcp listener for tunnels",
            ));
        }
        reject_rest(&u, &here)?;
        allowed.retain(|k| *k != kind);
        if enabled {
            allowed.push(kind);
        }
    }
    allowed.sort();
    allowed.dedup();
    out.upgrades = allowed;
    match a.cluster_specifier.take() {
        Some(route_action::ClusterSpecifier::Cluster(c)) => out.cluster = Some(c),
        Some(route_action::ClusterSpecifier::WeightedClusters(mut w)) => {
            let mut split = Vec::new();
            for (i, mut cw) in take(&mut w.clusters).into_iter().enumerate() {
                let here = format!("{at}.weighted_clusters.clusters[{i}]");
                let weight = cw.weight.take().map(|w| w.value).unwrap_or(0);
                let cluster = take(&mut cw.name);
                reject_rest(&cw, &here)?;
                split.push(model::WeightedCluster { cluster, weight });
            }
            w.total_weight = None; // the weights themselves decide the shares
            reject_rest(&w, &format!("{at}.weighted_clusters"))?;
            out.split = Some(split);
        }
        _ => {
            return Err(XdsError::resource(
                at,
                "cluster_specifier: only `cluster` and `weighted_clusters` are supported",
            ))
        }
    }
    if let Some(t) = a.timeout.take() {
        let t = duration(&t, &format!("{at}.timeout"))?;
        // Envoy's 0s means "no timeout"; flatmesh always has one, so keep the node's default.
        out.timeout = (!t.is_zero()).then_some(t);
    }
    if let Some(retry) = a.retry_policy.take() {
        out.retries = retry_policy(retry, &format!("{at}.retry_policy"))?;
    }
    for (i, h) in take(&mut a.hash_policy).into_iter().enumerate() {
        let here = format!("{at}.hash_policy[{i}]");
        let mut rest = h.clone();
        rest.terminal = false; // flatmesh hashes on one thing, so the first policy is the last
        let header = match rest.policy_specifier.take() {
            Some(route_action::hash_policy::PolicySpecifier::Header(mut h)) => {
                let name = take(&mut h.header_name);
                reject_rest(&h, &format!("{here}.header"))?;
                name
            }
            // flatmesh's own fallback when a cluster has no hash header: the client address.
            Some(route_action::hash_policy::PolicySpecifier::ConnectionProperties(p))
                if p.source_ip =>
            {
                reject_rest(&rest, &here)?;
                continue;
            }
            _ => {
                return Err(XdsError::resource(
                    here,
                    "only `header` and `connection_properties: { source_ip: true }` hash policies are supported",
                ))
            }
        };
        reject_rest(&rest, &here)?;
        let targets: Vec<String> = out
            .cluster
            .iter()
            .cloned()
            .chain(out.split.iter().flatten().map(|w| w.cluster.clone()))
            .collect();
        let header = header.to_ascii_lowercase();
        // Within one listener; across listeners, Translator::translate checks the same rule.
        if let Some(other) = hash_headers
            .iter()
            .find(|h| targets.contains(&h.cluster) && h.header != header)
        {
            return Err(XdsError::resource(
                here,
                format!(
                    "cluster `{}` is hashed on `{}` by another route; flatmesh hashes a cluster on one header",
                    other.cluster, other.header
                ),
            ));
        }
        for cluster in targets {
            hash_headers.push(HashUse {
                cluster,
                header: header.clone(),
                at: here.clone(),
            });
        }
    }
    out.mirror = crate::fault::mirror_of(
        take(&mut a.request_mirror_policies),
        &format!("{at}.request_mirror_policies"),
    )?;
    a.cluster_not_found_response_code = 0; // flatmesh answers 503, Envoy's default
    reject_rest(&a, at)
}

fn cluster(
    c: &Cluster,
    assignments: &BTreeMap<String, ClusterLoadAssignment>,
) -> Result<Option<model::Cluster>> {
    let at = format!("Cluster \"{}\"", c.name);
    if is_hbone_termination(c) {
        return Ok(None);
    }
    let mut rest = c.clone();
    let name = take(&mut rest.name);
    let eds = eds_name(c);
    // ORIGINAL_DST: the allow-list and max_destinations (crate::original_dst).
    let mut original = None;
    let (endpoints, overprovisioning_factor, tunnel_port) = match rest.cluster_discovery_type.take()
    {
        Some(cluster::ClusterDiscoveryType::Type(t))
            if t == cluster::DiscoveryType::OriginalDst as i32 =>
        {
            let cla = rest.load_assignment.take().unwrap_or_default();
            if !cla.endpoints.is_empty() {
                return Err(XdsError::resource(
                    format!("{at}: load_assignment"),
                    "lists endpoints, but an ORIGINAL_DST cluster sends each connection where its client was going; remove them",
                ));
            }
            // flatmesh bounds the destinations it keeps connections to by
            // max_destinations and their idle time instead (docs/config.md).
            rest.cleanup_interval = None;
            original = Some(crate::original_dst::take(&mut rest.metadata, &at)?);
            Default::default()
        }
        None | Some(cluster::ClusterDiscoveryType::Type(0)) => {
            let cla = rest.load_assignment.take().unwrap_or_default();
            endpoints(&cla, &format!("{at}: load_assignment"))?
        }
        Some(cluster::ClusterDiscoveryType::Type(3)) => {
            rest.eds_cluster_config = None;
            rest.load_assignment = None; // Envoy ignores it for EDS clusters too
            let service = eds.unwrap_or_default();
            match assignments.get(&service) {
                Some(cla) => endpoints(
                    cla,
                    &format!("ClusterLoadAssignment \"{}\"", cla.cluster_name),
                )?,
                None => Default::default(), // not arrived yet: 503 until it does
            }
        }
        // Envoy resolves a DNS cluster's addresses; an IP address resolves to itself, and that
        // is what flatmesh takes (Envoy's own examples write STRICT_DNS with 127.0.0.1).
        Some(cluster::ClusterDiscoveryType::Type(t @ (1 | 2))) => {
            rest.dns_refresh_rate = None;
            rest.dns_failure_refresh_rate = None;
            rest.respect_dns_ttl = false;
            let cla = rest.load_assignment.take().unwrap_or_default();
            let found = endpoints(&cla, &format!("{at}: load_assignment"))?;
            if t == 2 && found.0.len() > 1 {
                return Err(XdsError::resource(
                    format!("{at}: load_assignment"),
                    "a LOGICAL_DNS cluster has exactly one endpoint; list several under STATIC or STRICT_DNS",
                ));
            }
            found
        }
        Some(cluster::ClusterDiscoveryType::Type(t)) => {
            let kind = cluster::DiscoveryType::try_from(t)
                .map(|t| t.as_str_name())
                .unwrap_or("unknown");
            return Err(XdsError::resource(
                format!("{at}: type"),
                format!("{kind} is not supported; use STATIC, EDS, or STRICT_DNS/LOGICAL_DNS with IP addresses"),
            ));
        }
        Some(cluster::ClusterDiscoveryType::ClusterType(t)) => {
            return Err(XdsError::resource(
                format!("{at}: cluster_type"),
                format!(
                    "custom cluster type `{}` is not supported; use STATIC or EDS",
                    t.name
                ),
            ))
        }
    };
    let lb = match cluster::LbPolicy::try_from(take(&mut rest.lb_policy)) {
        // What Envoy requires of an ORIGINAL_DST cluster: the destination is the client's.
        Ok(cluster::LbPolicy::ClusterProvided | cluster::LbPolicy::RoundRobin)
            if original.is_some() =>
        {
            model::LbPolicy::RoundRobin
        }
        Ok(other) if original.is_some() => {
            return Err(XdsError::resource(
                format!("{at}: lb_policy"),
                format!(
                    "{} does not apply to an ORIGINAL_DST cluster, whose destination is each connection's own; write CLUSTER_PROVIDED",
                    other.as_str_name()
                ),
            ))
        }
        Ok(cluster::LbPolicy::RoundRobin) => model::LbPolicy::RoundRobin,
        Ok(cluster::LbPolicy::LeastRequest) => model::LbPolicy::LeastRequest,
        Ok(cluster::LbPolicy::RingHash) => model::LbPolicy::RingHash,
        Ok(cluster::LbPolicy::Random) => model::LbPolicy::Random,
        Ok(cluster::LbPolicy::Maglev) => model::LbPolicy::Maglev,
        Ok(other) => {
            return Err(XdsError::resource(
                format!("{at}: lb_policy"),
                format!(
                "{} is not supported; use ROUND_ROBIN, LEAST_REQUEST, RING_HASH, MAGLEV or RANDOM",
                other.as_str_name()
            ),
            ))
        }
        Err(_) => return Err(XdsError::resource(
            format!("{at}: lb_policy"),
            "is not a known policy; use ROUND_ROBIN, LEAST_REQUEST, RING_HASH, MAGLEV or RANDOM",
        )),
    };
    let mut slow = None;
    if let Some(mut lb_config) = rest.lb_config.take() {
        // Slow start maps onto the cluster's `slow_start`.
        let config = match &mut lb_config {
            cluster::LbConfig::LeastRequestLbConfig(x) => x.slow_start_config.take(),
            cluster::LbConfig::RoundRobinLbConfig(x) => x.slow_start_config.take(),
            _ => None,
        };
        if let Some(config) = config {
            slow = slow_start(&config, &format!("{at}: lb_config.slow_start_config"))?;
        }
        // Tuning knobs (ring sizes, choice counts) have flatmesh's fixed values; only their
        // defaults are accepted so a config never silently behaves differently.
        let set = match &lb_config {
            cluster::LbConfig::RingHashLbConfig(x) => set_fields(x),
            cluster::LbConfig::MaglevLbConfig(x) => set_fields(x),
            cluster::LbConfig::LeastRequestLbConfig(x) => set_fields(x),
            cluster::LbConfig::RoundRobinLbConfig(x) => set_fields(x),
            // Only its defaults: the destination is the connection's original one (not a
            // header's, nor another port).
            cluster::LbConfig::OriginalDstLbConfig(x) if original.is_some() => set_fields(x),
            cluster::LbConfig::OriginalDstLbConfig(_) => vec!["original_dst_lb_config".into()],
        };
        if !set.is_empty() {
            return Err(XdsError::resource(
                format!("{at}: lb_config"),
                format!(
                    "{} not supported; flatmesh uses fixed load-balancer parameters",
                    set.join(", ")
                ),
            ));
        }
    }
    let connect_timeout = match rest.connect_timeout.take() {
        Some(d) => Some(duration(&d, &format!("{at}: connect_timeout"))?),
        None => None,
    };
    let mut protocol = model::UpstreamProtocol::Http1;
    if rest.http2_protocol_options.take().is_some() {
        protocol = model::UpstreamProtocol::Http2;
    }
    let mut options = take(&mut rest.typed_extension_protocol_options);
    if let Some(any) = options.remove(HTTP_OPTIONS_KEY) {
        let here = format!("{at}: typed_extension_protocol_options[\"{HTTP_OPTIONS_KEY}\"]");
        let mut o: HttpProtocolOptions = unpack(&any, &here)?;
        match o.upstream_protocol_options.take() {
            Some(http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(e)) => {
                match e.protocol_config {
                    Some(http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(_)) => {
                        protocol = model::UpstreamProtocol::Http2
                    }
                    Some(http_protocol_options::explicit_http_config::ProtocolConfig::HttpProtocolOptions(_)) | None => {}
                    Some(_) => {
                        return Err(XdsError::resource(
                            format!("{here}.explicit_http_config"),
                            "HTTP/3 upstreams are not supported; use http_protocol_options or http2_protocol_options",
                        ))
                    }
                }
            }
            None => {}
            Some(_) => {
                return Err(XdsError::resource(
                    here,
                    "only explicit_http_config is supported (flatmesh does not mirror the downstream protocol)",
                ))
            }
        }
        reject_rest(&o, &here)?;
    }
    if let Some(key) = options.keys().next() {
        return Err(XdsError::resource(
            format!("{at}: typed_extension_protocol_options[\"{key}\"]"),
            format!("is not supported; only {HTTP_OPTIONS_KEY} is"),
        ));
    }
    // A tunnel cluster's protocol options are the tunnel's (HBONE is HTTP/2); the protocol
    // inside its tunnels is in flatmesh's metadata.
    let outer = protocol;
    if tunnel_port.is_some() {
        if outer != model::UpstreamProtocol::Http2 {
            return Err(XdsError::resource(
                format!("{at}: typed_extension_protocol_options"),
                format!("is not HTTP/2, but the endpoints carry HBONE tunnel destinations: HBONE is HTTP/2 CONNECT; set {HTTP_OPTIONS_KEY} explicit_http_config.http2_protocol_options"),
            ));
        }
        protocol = crate::hbone::take_inner_protocol(&mut rest.metadata, &at)?;
        if rest.transport_socket.is_none() {
            return Err(XdsError::resource(
                format!("{at}: transport_socket"),
                "is missing, but the endpoints carry HBONE tunnel destinations: HBONE runs inside mutual TLS; give an UpstreamTlsContext",
            ));
        }
    }
    let tls = match rest.transport_socket.take() {
        Some(socket) => {
            crate::tls::cluster_tls(&socket, outer, &format!("{at}: transport_socket"))?
        }
        None => None,
    };
    let circuit_breaker = match rest.circuit_breakers.take() {
        Some(b) => circuit_breaker(b, &format!("{at}: circuit_breakers"))?,
        None => None,
    };
    let outlier_detection = match rest.outlier_detection.take() {
        Some(o) => Some(outlier_detection(o, &format!("{at}: outlier_detection"))?),
        None => None,
    };
    let health_check = match take(&mut rest.health_checks).as_slice() {
        [] => None,
        [one] => Some(health_check(one, &format!("{at}: health_checks[0]"))?),
        [_, _, ..] => {
            return Err(XdsError::resource(
                format!("{at}: health_checks[1]"),
                "is a second health check; flatmesh runs one per cluster",
            ))
        }
    };
    rest.alt_stat_name.clear();
    rest.dns_lookup_family = 0; // DNS settings mean nothing for IP endpoints
    reject_rest(&rest, &at)?;
    let (kind, allow, max_destinations) = match original {
        Some((allow, max)) => (model::ClusterType::OriginalDst, allow, max),
        None => (model::ClusterType::Static, Vec::new(), None),
    };
    Ok(Some(model::Cluster {
        name,
        kind,
        allow,
        max_destinations,
        lb,
        endpoints,
        protocol,
        hash_on: None,
        connect_timeout,
        tls,
        tunnel: tunnel_port.map(|_| model::Tunnel::Hbone),
        tunnel_port: tunnel_port.filter(|p| *p != model::HBONE_PORT),
        circuit_breaker,
        outlier_detection,
        health_check,
        slow_start: slow,
        overprovisioning_factor,
    }))
}

/// An hbone listener's ORIGINAL_DST cluster, which delivers each CONNECT to its `:authority`
/// (crate::hbone, "Termination"): the hbone listener does that itself, so it is no cluster
/// of flatmesh's.
fn is_hbone_termination(c: &Cluster) -> bool {
    let original_dst = matches!(
        c.cluster_discovery_type,
        Some(cluster::ClusterDiscoveryType::Type(t)) if t == cluster::DiscoveryType::OriginalDst as i32
    );
    let by_authority = matches!(
        &c.lb_config,
        Some(cluster::LbConfig::OriginalDstLbConfig(o))
            if o.use_http_header && o.http_header_name.eq_ignore_ascii_case(crate::hbone::AUTHORITY)
    );
    original_dst && by_authority
}

/// Envoy's health check as the cluster's: an HTTP check's path and expected statuses (its
/// half-open ranges made inclusive), a TCP check that only connects, a gRPC check's service
/// name, the timing and the thresholds (flatmesh's defaults for those left out; Envoy
/// requires them). What would change the probe is refused by name.
fn health_check(
    check: &envoy_types::pb::envoy::config::core::v3::HealthCheck,
    at: &str,
) -> Result<model::HealthCheck> {
    use envoy_types::pb::envoy::config::core::v3::health_check::HealthChecker;
    let mut rest = check.clone();
    let kind = match rest.health_checker.take() {
        Some(HealthChecker::HttpHealthCheck(mut http)) => {
            let here = format!("{at}.http_health_check");
            let path = take(&mut http.path);
            let mut expect = Vec::new();
            for (i, range) in take(&mut http.expected_statuses).into_iter().enumerate() {
                let status = |v: i64| u16::try_from(v).ok().filter(|s| (100..=599).contains(s));
                match (status(range.start), status(range.end - 1)) {
                    (Some(from), Some(to)) if from <= to => expect.push((from, to)),
                    _ => {
                        return Err(XdsError::resource(
                            format!("{here}.expected_statuses[{i}]"),
                            "is not a range of HTTP statuses from 100 to 599 (start inclusive, end exclusive)",
                        ))
                    }
                }
            }
            reject_rest(&http, &here)?;
            model::HealthCheckKind::Http(model::HttpHealthCheck {
                path,
                expect: if expect.is_empty() {
                    model::ExpectStatus::default()
                } else {
                    model::ExpectStatus(expect)
                },
            })
        }
        Some(HealthChecker::TcpHealthCheck(tcp)) => {
            reject_rest(&tcp, &format!("{at}.tcp_health_check"))?;
            model::HealthCheckKind::Tcp
        }
        Some(HealthChecker::GrpcHealthCheck(mut grpc)) => {
            let service = take(&mut grpc.service_name);
            reject_rest(&grpc, &format!("{at}.grpc_health_check"))?;
            model::HealthCheckKind::Grpc(model::GrpcHealthCheck { service })
        }
        Some(HealthChecker::CustomHealthCheck(_)) => {
            return Err(XdsError::resource(
                format!("{at}.custom_health_check"),
                "is not supported; use http_health_check, tcp_health_check or grpc_health_check",
            ))
        }
        None => {
            return Err(XdsError::resource(
                at,
                "says how often to probe but not how; give http_health_check, tcp_health_check or grpc_health_check",
            ))
        }
    };
    let mut out = model::HealthCheck::new(kind);
    if let Some(d) = rest.interval.take() {
        out.interval = duration(&d, &format!("{at}.interval"))?;
    }
    if let Some(d) = rest.timeout.take() {
        out.timeout = duration(&d, &format!("{at}.timeout"))?;
    }
    if let Some(v) = rest.unhealthy_threshold.take() {
        out.unhealthy_threshold = v.value;
    }
    if let Some(v) = rest.healthy_threshold.take() {
        out.healthy_threshold = v.value;
    }
    reject_rest(&rest, at)?;
    Ok(out)
}

/// Envoy's `retry_policy` as the route's retries: `retry_on` (the causes flatmesh knows),
/// `num_retries`, `per_try_timeout` and `retry_back_off`. `None` when it names no cause.
fn retry_policy(
    mut retry: envoy_types::pb::envoy::config::route::v3::RetryPolicy,
    here: &str,
) -> Result<Option<model::RetryPolicy>> {
    let mut on = Vec::new();
    for cause in take(&mut retry.retry_on).split(',').map(str::trim) {
        on.push(match cause {
            "connect-failure" => model::RetryOn::ConnectFailure,
            "reset" => model::RetryOn::Reset,
            "5xx" => model::RetryOn::Status5xx,
            "gateway-error" => model::RetryOn::GatewayError,
            "unavailable" => model::RetryOn::Unavailable,
            "resource-exhausted" => model::RetryOn::ResourceExhausted,
            "cancelled" => model::RetryOn::Cancelled,
            "deadline-exceeded" => model::RetryOn::DeadlineExceeded,
            "" => continue,
            other => {
                return Err(XdsError::resource(
                    format!("{here}.retry_on"),
                    format!("`{other}` is not supported; use connect-failure, reset, 5xx, gateway-error, unavailable, resource-exhausted, cancelled or deadline-exceeded"),
                ))
            }
        });
    }
    let attempts = retry.num_retries.take().map(|n| n.value).unwrap_or(1);
    let per_try_timeout = match retry.per_try_timeout.take() {
        Some(t) => {
            let t = duration(&t, &format!("{here}.per_try_timeout"))?;
            // Envoy's 0s: no per-try timeout.
            (!t.is_zero()).then_some(t)
        }
        None => None,
    };
    let backoff = match retry.retry_back_off.take() {
        Some(mut b) => {
            let at = format!("{here}.retry_back_off");
            let base = match b.base_interval.take() {
                Some(d) => duration(&d, &format!("{at}.base_interval"))?,
                None => {
                    return Err(XdsError::resource(
                        format!("{at}.base_interval"),
                        "is required (Envoy's too); write one such as 25ms",
                    ))
                }
            };
            let max = match b.max_interval.take() {
                Some(d) => Some(duration(&d, &format!("{at}.max_interval"))?),
                None => None,
            };
            reject_rest(&b, &at)?;
            Some(model::RetryBackoff { base, max })
        }
        None => None,
    };
    reject_rest(&retry, here)?;
    Ok((!on.is_empty()).then_some(model::RetryPolicy {
        attempts,
        on,
        per_try_timeout,
        backoff,
        budget: None,
        max_replay_body: None,
    }))
}

/// Envoy's thresholds of the default priority as the cluster's circuit breaker; Envoy's
/// defaults for what they leave out. Thresholds of the high priority are accepted and have
/// no effect: no flatmesh route asks for that priority.
fn circuit_breaker(
    breakers: envoy_types::pb::envoy::config::cluster::v3::CircuitBreakers,
    at: &str,
) -> Result<Option<model::CircuitBreaker>> {
    use envoy_types::pb::envoy::config::core::v3::RoutingPriority;
    let mut rest = breakers;
    let mut out = None;
    for (i, t) in take(&mut rest.thresholds).into_iter().enumerate() {
        let here = format!("{at}.thresholds[{i}]");
        if t.priority == RoutingPriority::High as i32 {
            continue;
        }
        if t.priority != RoutingPriority::Default as i32 {
            return Err(XdsError::resource(
                format!("{here}.priority"),
                "is not a known priority; use DEFAULT (or HIGH, which flatmesh routes never ask for)",
            ));
        }
        if out.is_some() {
            return Err(XdsError::resource(
                here,
                "is a second threshold of the DEFAULT priority; give one",
            ));
        }
        let mut t = t;
        if t.retry_budget.is_some() {
            // Not a field-for-field match: Envoy's budget caps retries in flight against
            // requests in flight, per cluster; flatmesh's caps retries per second against
            // requests per second, set on the route (counted per cluster).
            return Err(XdsError::resource(
                format!("{here}.retry_budget"),
                "has no flatmesh equivalent field: flatmesh budgets retries per second against requests per second (Linkerd's model), set per route; remove it and give the routes `retries.budget: { ratio, min_per_s }` (the default is 20% + 10/s)",
            ));
        }
        let defaults = model::CircuitBreaker::default();
        let limit = |v: Option<envoy_types::pb::google::protobuf::UInt32Value>, default| {
            v.map_or(default, |v| v.value)
        };
        out = Some(model::CircuitBreaker {
            max_connections: limit(t.max_connections.take(), defaults.max_connections),
            max_pending: limit(t.max_pending_requests.take(), defaults.max_pending),
            max_requests: limit(t.max_requests.take(), defaults.max_requests),
            max_retries: limit(t.max_retries.take(), defaults.max_retries),
        });
        t.priority = 0;
        t.track_remaining = false; // statistics only
        reject_rest(&t, &here)?;
    }
    reject_rest(&rest, at)?;
    Ok(out)
}

/// Envoy's outlier detection as the cluster's: its consecutive kinds (each only if enforced
/// at 100% or not at all: flatmesh does not eject by chance), connect failures as the
/// local-origin kind when Envoy counts that apart, success rate and failure percentage (the
/// same 0-or-100 rule), and Envoy's defaults for what it leaves out. The local-origin
/// variants of success rate and failure percentage are not supported.
fn outlier_detection(
    od: envoy_types::pb::envoy::config::cluster::v3::OutlierDetection,
    at: &str,
) -> Result<model::OutlierDetection> {
    use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
    let mut rest = od;
    let defaults = model::OutlierDetection::default();
    let value = |v: Option<UInt32Value>, default: u32| v.map_or(default, |v| v.value);
    // Whether a kind is on: enforced at 100, or off at 0 (its `enforcing_*` left out: Envoy's
    // default for the kind).
    let switched = |enforcing: Option<UInt32Value>, default: u32, key: &str| -> Result<bool> {
        match value(enforcing, default) {
            0 => Ok(false),
            100 => Ok(true),
            _ => Err(XdsError::resource(
                format!("{at}.enforcing_{key}"),
                "is neither 0 nor 100; flatmesh ejects every endpoint that reaches a threshold, or none",
            )),
        }
    };
    // The threshold of a consecutive kind, 0 when it is not enforced.
    let enforced = |threshold: Option<UInt32Value>,
                    enforcing: Option<UInt32Value>,
                    default_enforcing: u32,
                    key: &str|
     -> Result<u32> {
        Ok(if switched(enforcing, default_enforcing, key)? {
            value(threshold, 5)
        } else {
            0
        })
    };
    let consecutive_5xx = enforced(
        rest.consecutive_5xx.take(),
        rest.enforcing_consecutive_5xx.take(),
        100,
        "consecutive_5xx",
    )?;
    let consecutive_gateway_errors = enforced(
        rest.consecutive_gateway_failure.take(),
        rest.enforcing_consecutive_gateway_failure.take(),
        0,
        "consecutive_gateway_failure",
    )?;
    let local_origin = enforced(
        rest.consecutive_local_origin_failure.take(),
        rest.enforcing_consecutive_local_origin_failure.take(),
        100,
        "consecutive_local_origin_failure",
    )?;
    let consecutive_connect_failures = if take(&mut rest.split_external_local_origin_errors) {
        local_origin
    } else {
        0
    };
    let interval = match rest.interval.take() {
        Some(d) => duration(&d, &format!("{at}.interval"))?,
        None => defaults.interval,
    };
    let base_ejection_time = match rest.base_ejection_time.take() {
        Some(d) => duration(&d, &format!("{at}.base_ejection_time"))?,
        None => defaults.base_ejection_time,
    };
    let max_ejection_percent = value(
        rest.max_ejection_percent.take(),
        defaults.max_ejection_percent,
    );
    if let Some(d) = rest.max_ejection_time.take() {
        if duration(&d, &format!("{at}.max_ejection_time"))? != Duration::from_secs(300) {
            return Err(XdsError::resource(
                format!("{at}.max_ejection_time"),
                "is not supported; flatmesh caps ejections at Envoy's default, 300s (or the base ejection time if longer)",
            ));
        }
    }
    if rest.always_eject_one_host.take() == Some(BoolValue { value: true }) {
        return Err(XdsError::resource(
            format!("{at}.always_eject_one_host"),
            "is not supported; raise max_ejection_percent instead",
        ));
    }
    // The interval kinds: on when enforced at 100 (success rate's default), off at 0.
    let sr_defaults = model::SuccessRate::default();
    let success_rate = model::SuccessRate {
        enforcing: switched(rest.enforcing_success_rate.take(), 100, "success_rate")?,
        minimum_hosts: value(
            rest.success_rate_minimum_hosts.take(),
            sr_defaults.minimum_hosts,
        ),
        request_volume: value(
            rest.success_rate_request_volume.take(),
            sr_defaults.request_volume,
        ),
        stdev_factor: value(
            rest.success_rate_stdev_factor.take(),
            sr_defaults.stdev_factor,
        ),
    };
    let fp_defaults = model::FailurePercentage::default();
    let failure_percentage = model::FailurePercentage {
        enforcing: switched(
            rest.enforcing_failure_percentage.take(),
            0,
            "failure_percentage",
        )?,
        threshold: value(
            rest.failure_percentage_threshold.take(),
            fp_defaults.threshold,
        ),
        minimum_hosts: value(
            rest.failure_percentage_minimum_hosts.take(),
            fp_defaults.minimum_hosts,
        ),
        request_volume: value(
            rest.failure_percentage_request_volume.take(),
            fp_defaults.request_volume,
        ),
    };
    // Local-origin variants switched off explicitly are as good as unset.
    for off in [
        &mut rest.enforcing_local_origin_success_rate,
        &mut rest.enforcing_failure_percentage_local_origin,
    ] {
        if *off == Some(UInt32Value { value: 0 }) {
            *off = None;
        }
    }
    reject_rest(&rest, at)?;
    Ok(model::OutlierDetection {
        consecutive_5xx,
        consecutive_gateway_errors,
        consecutive_connect_failures,
        interval,
        base_ejection_time,
        max_ejection_percent,
        success_rate,
        failure_percentage,
    })
}

/// The endpoints of an assignment that take traffic (Envoy skips unhealthy and draining
/// hosts), each with its weight, its group's priority and locality; and the policy's
/// overprovisioning factor. A group's own `load_balancing_weight` is accepted and, as in
/// Envoy without `locality_weighted_lb_config`, has no effect.
/// A cluster's endpoints as flatmesh's: the endpoints, the overprovisioning factor, and the
/// tunnel port when the endpoints carry HBONE tunnel destinations (crate::hbone): then the
/// flatmesh endpoints are those destinations.
type AssignedEndpoints = (model::Endpoints, Option<u32>, Option<u16>);

fn endpoints(cla: &ClusterLoadAssignment, at: &str) -> Result<AssignedEndpoints> {
    let mut rest = cla.clone();
    rest.cluster_name.clear();
    let mut overprovisioning = None;
    if let Some(mut policy) = rest.policy.take() {
        let here = format!("{at}.policy");
        overprovisioning = policy.overprovisioning_factor.take().map(|f| f.value);
        if overprovisioning == Some(0) {
            return Err(XdsError::resource(
                format!("{here}.overprovisioning_factor"),
                "is 0: no priority level would ever take traffic; leave it out for Envoy's 140",
            ));
        }
        policy.endpoint_stale_after = None; // flatmesh keeps the last assignment until a new one
        reject_rest(&policy, &here)?;
    }
    let mut out = Vec::new();
    // Whether the endpoints tunnel (and to which port), decided by the first one.
    let mut tunnel: Option<Option<u16>> = None;
    for (i, group) in take(&mut rest.endpoints).into_iter().enumerate() {
        let here = format!("{at}.endpoints[{i}]");
        let mut group_rest = group.clone();
        let priority = take(&mut group_rest.priority);
        if priority > model::validate::MAX_PRIORITY {
            return Err(XdsError::resource(
                format!("{here}.priority"),
                format!(
                    "is {priority}; flatmesh takes priorities 0 to {}",
                    model::validate::MAX_PRIORITY
                ),
            ));
        }
        let locality = match group_rest.locality.take() {
            Some(l) => locality(&l, &format!("{here}.locality"))?,
            None => None,
        };
        group_rest.load_balancing_weight = None;
        for (k, lb) in take(&mut group_rest.lb_endpoints).into_iter().enumerate() {
            let here = format!("{here}.lb_endpoints[{k}]");
            let mut lb_rest = lb.clone();
            let weight = lb_rest
                .load_balancing_weight
                .take()
                .map(|w| w.value)
                .unwrap_or(1);
            if !(1..=model::endpoints::MAX_ENDPOINT_WEIGHT).contains(&weight) {
                return Err(XdsError::resource(
                    format!("{here}.load_balancing_weight"),
                    format!(
                        "is {weight}; flatmesh takes endpoint weights from 1 to {}",
                        model::endpoints::MAX_ENDPOINT_WEIGHT
                    ),
                ));
            }
            // UNKNOWN (0) and HEALTHY (1) take traffic, as in Envoy; DEGRADED (5) too.
            let healthy = matches!(lb_rest.health_status, 0 | 1 | 5);
            lb_rest.health_status = 0;
            let Some(lb_endpoint::HostIdentifier::Endpoint(mut endpoint)) =
                lb_rest.host_identifier.take()
            else {
                return Err(XdsError::resource(
                    here,
                    "needs an `endpoint` (named endpoints are not supported)",
                ));
            };
            let mut address = socket_addr(
                endpoint.address.take().as_ref(),
                &format!("{here}.endpoint.address"),
            )?;
            let destination =
                crate::hbone::take_endpoint_destination(&mut lb_rest.metadata, address, &here)?;
            let port = destination.map(|_| address.port());
            match tunnel {
                None => tunnel = Some(port),
                Some(first) if first != port => {
                    return Err(XdsError::resource(
                        format!("{here}.metadata"),
                        match (first, port) {
                            (Some(p), Some(q)) => format!("tunnels to port {q}, but the first endpoint to port {p}: a cluster's tunnels go to one port"),
                            _ => "differs from the first endpoint's: either every endpoint of a cluster carries its tunnel destination (`envoy.filters.listener.original_dst`), or none".into(),
                        },
                    ));
                }
                Some(_) => {}
            }
            if let Some(d) = destination {
                address = d;
            }
            lb_rest.metadata = None; // other metadata means nothing to flatmesh
            endpoint.hostname.clear();
            reject_rest(&endpoint, &format!("{here}.endpoint"))?;
            reject_rest(&lb_rest, &here)?;
            if healthy {
                out.push(model::Endpoint {
                    address,
                    weight,
                    priority,
                    locality: locality.clone(),
                });
            }
        }
        reject_rest(&group_rest, &here)?;
    }
    reject_rest(&rest, at)?;
    Ok((out.into(), overprovisioning, tunnel.flatten()))
}

/// Envoy's locality as flatmesh's `region/zone/subzone` (its leading parts that are set).
pub(crate) fn locality(
    l: &envoy_types::pb::envoy::config::core::v3::Locality,
    at: &str,
) -> Result<Option<String>> {
    let parts = [&l.region, &l.zone, &l.sub_zone];
    let set = parts.iter().take_while(|p| !p.is_empty()).count();
    if parts[set..].iter().any(|p| !p.is_empty()) {
        return Err(XdsError::resource(
            at,
            "sets a zone or sub_zone without the parts before it; flatmesh matches localities region first",
        ));
    }
    if parts.iter().any(|p| p.contains('/')) {
        return Err(XdsError::resource(
            at,
            "has a `/` in a part; flatmesh writes localities as region/zone/subzone",
        ));
    }
    Ok((set > 0).then(|| {
        parts[..set]
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join("/")
    }))
}

/// Envoy's `slow_start_config` as the cluster's `slow_start`.
fn slow_start(config: &cluster::SlowStartConfig, at: &str) -> Result<Option<model::SlowStart>> {
    let mut rest = config.clone();
    let Some(window) = rest.slow_start_window.take() else {
        // Envoy: no window, no slow start.
        return Ok(None);
    };
    let window = duration(&window, &format!("{at}.slow_start_window"))?;
    let aggression = match rest.aggression.take() {
        Some(a) => {
            if !a.runtime_key.is_empty() {
                return Err(XdsError::resource(
                    format!("{at}.aggression.runtime_key"),
                    "runtime keys are not supported; give default_value alone",
                ));
            }
            a.default_value
        }
        None => 1.0,
    };
    let min_weight_percent = match rest.min_weight_percent.take() {
        Some(p) if (0.0..=100.0).contains(&p.value) => p.value.round() as u32,
        Some(p) => {
            return Err(XdsError::resource(
                format!("{at}.min_weight_percent"),
                format!("is {}; write a percentage from 0 to 100", p.value),
            ))
        }
        None => 10,
    };
    reject_rest(&rest, at)?;
    Ok(Some(model::SlowStart {
        window,
        aggression,
        min_weight_percent,
    }))
}
