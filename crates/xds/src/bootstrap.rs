//! Import of an Envoy v3 bootstrap file (YAML or JSON): `static_resources` listeners and
//! clusters, and the admin address, within the subset flatmesh runs.
//!
//! The file is read into a JSON tree and walked field by field into envoy-types messages, which
//! then go through the same [`crate::to_model`] translation as xDS pushes. Every key the walker
//! does not take is an error that names it with its full path, e.g.
//! `static_resources.clusters[0] ("api").outlier_detection`. (envoy-types generates no serde
//! support, so a hand-written walker is what gives the exact field names.)

use std::collections::HashMap;
use std::path::Path;

use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers, cluster, CircuitBreakers, Cluster, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, data_source, socket_address, transport_socket, Address, ConfigSource,
    DataSource, HeaderValue, HeaderValueOption, Http1ProtocolOptions, Http2ProtocolOptions,
    SocketAddress, TransportSocket,
};
use envoy_types::pb::envoy::config::core::v3::{Locality, RuntimeDouble};
use envoy_types::pb::envoy::config::endpoint::v3::{
    cluster_load_assignment, lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint,
    LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, rbac, Permission, Policy, Principal, Rbac as Rules,
};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher, query_parameter_matcher, route, route_action, route_match, weighted_cluster,
    DirectResponseAction, HeaderMatcher, QueryParameterMatcher, RetryPolicy, Route, RouteAction,
    RouteConfiguration, RouteMatch, VirtualHost, WeightedCluster,
};
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::{fault_delay, FaultDelay};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    fault_abort, FaultAbort, HttpFault,
};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, subject_alt_name_matcher, tls_parameters, CertificateValidationContext,
    CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, SubjectAltNameMatcher, TlsCertificate,
    TlsParameters, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options, HttpProtocolOptions,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    path_matcher, string_matcher, PathMatcher, RegexMatcher, StringMatcher,
};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::envoy::r#type::v3::{fractional_percent::DenominatorType, FractionalPercent};
use envoy_types::pb::google::protobuf::{Any, BoolValue, Duration, UInt32Value};
use flatmesh_config::{Admin, AdminAddress, Config};
use prost::Name;
use serde_json::{Map, Value};

use crate::error::{Result, XdsError};
use crate::resources::{pack, Resources};

/// Read an Envoy bootstrap file and translate it into a flatmesh config.
pub fn load(path: &Path) -> Result<Config> {
    let text = std::fs::read_to_string(path).map_err(|source| XdsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, &path.display().to_string())
}

/// Translate bootstrap text (YAML or JSON); `origin` names it in errors.
pub fn parse(text: &str, origin: &str) -> Result<Config> {
    let value: Value = serde_norway::from_str(text).map_err(|e| XdsError::Syntax {
        origin: origin.to_string(),
        why: e.to_string(),
    })?;
    let (resources, node) = bootstrap(value).map_err(|e| match e {
        XdsError::Resource { at, why } => XdsError::Resource {
            at: format!("{origin}: {at}"),
            why,
        },
        other => other,
    })?;
    let mut base = empty_config();
    if let Some(admin) = node.admin {
        base.admin = admin;
    }
    if let Some(max) = node.max_connections {
        base.limits.max_connections = max;
    }
    if let Some(locality) = node.locality {
        base.node = Some(flatmesh_config::Node {
            locality: Some(locality),
        });
    }
    crate::to_model::Translator::default()
        .translate_resolved(&resources, &base, &node.secrets)
        .map_err(|e| match e {
            XdsError::Resource { at, why } => XdsError::Resource {
                at: format!("{origin}: {at}"),
                why,
            },
            other => other,
        })
}

/// A config with flatmesh's defaults and nothing to serve yet. Built through serde so that every
/// section keeps the default a config file gets when it leaves the section out.
pub fn empty_config() -> Config {
    serde_json::from_value(serde_json::json!({}))
        .unwrap_or_else(|e| unreachable!("every config field has a default: {e}"))
}

/// What a bootstrap says about the node itself, beside its resources.
#[derive(Debug, Default)]
pub struct NodeSettings {
    pub admin: Option<Admin>,
    /// The overload manager's `global_downstream_max_connections`: `limits.max_connections`.
    pub max_connections: Option<usize>,
    /// `node.locality` as `region/zone/subzone`: the config's `node.locality`.
    pub locality: Option<String>,
    /// `static_resources.secrets`, which SDS references in the TLS contexts name.
    pub secrets: StaticSecrets,
}

/// The overload manager's resource monitor that caps the node's client connections.
const DOWNSTREAM_CONNECTIONS: &str = "envoy.resource_monitors.global_downstream_max_connections";
const DOWNSTREAM_CONNECTIONS_TYPE: &str = "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig";

/// The overload manager: only its cap on client connections, which is flatmesh's
/// `limits.max_connections` (the memory budget and the rest are flatmesh's own `limits`).
fn overload_manager(v: Value) -> Result<Option<usize>> {
    let mut o = Obj::new(v, "overload_manager")?;
    let mut max = None;
    for (i, m) in o.list("resource_monitors")?.into_iter().enumerate() {
        let mut m = Obj::named(m, &o.at(&format!("resource_monitors[{i}]")))?;
        let name = m.string("name")?.unwrap_or_default();
        if name != DOWNSTREAM_CONNECTIONS {
            return Err(XdsError::resource(
                m.at("name"),
                format!("`{name}` is not supported; flatmesh takes `{DOWNSTREAM_CONNECTIONS}` (its memory budget is limits.memory_budget_bytes in the node config)"),
            ));
        }
        let mut tc = m
            .obj("typed_config")?
            .ok_or_else(|| XdsError::resource(m.at("typed_config"), "is missing"))?;
        match tc.string("@type")? {
            Some(t) if t == DOWNSTREAM_CONNECTIONS_TYPE => {}
            other => {
                return Err(XdsError::resource(
                    tc.at("@type"),
                    format!("is {other:?}; write {DOWNSTREAM_CONNECTIONS_TYPE}"),
                ))
            }
        }
        let at = tc.at("max_active_downstream_connections");
        let n = tc
            .take("max_active_downstream_connections")
            .as_ref()
            .and_then(number)
            .filter(|n| *n > 0)
            .ok_or_else(|| XdsError::resource(at, "must be a positive whole number"))?;
        max = Some(usize::try_from(n).unwrap_or(usize::MAX));
        tc.finish()?;
        m.finish()?;
    }
    o.finish()?;
    Ok(max)
}

/// The static resources of a bootstrap and what it says about the node.
pub fn bootstrap(value: Value) -> Result<(Resources, NodeSettings)> {
    let mut root = Obj::new(value, "")?;
    let mut resources = Resources::default();
    let mut secrets = StaticSecrets::default();
    let mut admin = None;
    let max_connections = match root.take("overload_manager") {
        Some(v) => overload_manager(v)?,
        None => None,
    };
    if let Some(v) = root.take("admin") {
        let mut a = Obj::new(v, "admin")?;
        // Envoy's admin access log is about Envoy's admin page; flatmesh's admin logs nothing.
        a.take("access_log_path");
        a.take("access_log");
        if let Some(v) = a.take("address") {
            admin = Some(admin_address(v, "admin.address")?);
        }
        a.finish()?;
    }
    // The node's identity matters only to a control plane; its locality to load balancing.
    let mut locality = None;
    if let Some(mut node) = root.obj("node")? {
        if let Some(mut l) = node.obj("locality")? {
            let at = l.path.clone();
            let parts = [
                l.string("region")?.unwrap_or_default(),
                l.string("zone")?.unwrap_or_default(),
                l.string("sub_zone")?.unwrap_or_default(),
            ];
            l.finish()?;
            locality = crate::to_model::locality(
                &Locality {
                    region: parts[0].clone(),
                    zone: parts[1].clone(),
                    sub_zone: parts[2].clone(),
                },
                &at,
            )?;
        }
    }
    if let Some(v) = root.take("static_resources") {
        let mut s = Obj::new(v, "static_resources")?;
        for (i, v) in s.list("listeners")?.into_iter().enumerate() {
            let l = listener(v, &format!("static_resources.listeners[{i}]"))?;
            resources.listeners.insert(l.name.clone(), l);
        }
        for (i, v) in s.list("clusters")?.into_iter().enumerate() {
            let c = cluster(v, &format!("static_resources.clusters[{i}]"))?;
            resources.clusters.insert(c.name.clone(), c);
        }
        secrets = static_secrets(s.list("secrets")?, "static_resources.secrets")?;
        s.finish()?;
    }
    root.finish()?;
    Ok((
        resources,
        NodeSettings {
            admin,
            max_connections,
            locality,
            secrets,
        },
    ))
}

/// A JSON object being taken apart; whatever is left at [`Obj::finish`] is unsupported.
struct Obj {
    path: String,
    map: Map<String, Value>,
}

impl Obj {
    fn new(value: Value, path: &str) -> Result<Obj> {
        match value {
            Value::Object(map) => Ok(Obj {
                path: path.to_string(),
                map,
            }),
            Value::Null => Ok(Obj {
                path: path.to_string(),
                map: Map::new(),
            }),
            other => Err(XdsError::resource(
                display(path),
                format!("must be a mapping, found {}", kind(&other)),
            )),
        }
    }

    /// Like [`Obj::new`], and names the object after its `name` field in later errors.
    fn named(value: Value, path: &str) -> Result<Obj> {
        let mut obj = Obj::new(value, path)?;
        if let Some(Value::String(name)) = obj.map.get("name") {
            obj.path = format!("{path} (\"{name}\")");
        }
        Ok(obj)
    }

    fn at(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key)
    }

    fn obj(&mut self, key: &str) -> Result<Option<Obj>> {
        let at = self.at(key);
        self.take(key).map(|v| Obj::new(v, &at)).transpose()
    }

    fn string(&mut self, key: &str) -> Result<Option<String>> {
        let at = self.at(key);
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(XdsError::resource(
                at,
                format!("must be a string, found {}", kind(&other)),
            )),
        }
    }

    fn u32(&mut self, key: &str) -> Result<Option<u32>> {
        let at = self.at(key);
        match self.take(key) {
            None => Ok(None),
            Some(v) => number(&v)
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    XdsError::resource(at, "must be a whole number from 0 to 4294967295")
                }),
        }
    }

    fn bool(&mut self, key: &str) -> Result<Option<bool>> {
        let at = self.at(key);
        match self.take(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(other) => Err(XdsError::resource(
                at,
                format!("must be true or false, found {}", kind(&other)),
            )),
        }
    }

    fn duration(&mut self, key: &str) -> Result<Option<Duration>> {
        let at = self.at(key);
        self.string(key)?
            .map(|s| {
                parse_duration(&s).ok_or_else(|| {
                    XdsError::resource(
                        at,
                        format!("`{s}` is not a duration; write seconds with an `s`, e.g. `0.25s`"),
                    )
                })
            })
            .transpose()
    }

    fn list(&mut self, key: &str) -> Result<Vec<Value>> {
        let at = self.at(key);
        match self.take(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => Ok(items),
            Some(other) => Err(XdsError::resource(
                at,
                format!("must be a list, found {}", kind(&other)),
            )),
        }
    }

    /// A list of strings: each entry that is not one is refused with its index.
    fn strings(&mut self, key: &str) -> Result<Vec<String>> {
        let at = self.at(key);
        self.list(key)?
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s),
                other => Err(XdsError::resource(
                    format!("{at}[{i}]"),
                    format!("must be a string, found {}", kind(&other)),
                )),
            })
            .collect()
    }

    fn finish(self) -> Result<()> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(key) => Err(XdsError::resource(
                self.at(key),
                "is not supported by flatmesh's Envoy import; remove it (docs/xds.md lists the supported subset)",
            )),
        }
    }
}

fn display(path: &str) -> String {
    if path.is_empty() {
        "the bootstrap".into()
    } else {
        path.to_string()
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// Protobuf JSON writes 64-bit and wrapper numbers as strings too.
fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Protobuf JSON durations: `1.5s`, `0.25s`, `5s`.
fn parse_duration(s: &str) -> Option<Duration> {
    let seconds = s.strip_suffix('s')?;
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, ""));
    if fraction.len() > 9 || !fraction.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let seconds: i64 = whole.parse().ok().filter(|s| *s >= 0)?;
    let nanos: i32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse().ok()?
    };
    Some(Duration { seconds, nanos })
}

/// Envoy's admin address: a socket address, or a pipe (a Unix socket) with its mode.
fn admin_address(v: Value, path: &str) -> Result<Admin> {
    if v.get("pipe").is_none() {
        let addr = address(v, path)?;
        return Ok(Admin::from(crate::to_model::socket_addr(
            Some(&addr),
            path,
        )?));
    }
    let mut a = Obj::new(v, path)?;
    let mut p = a
        .obj("pipe")?
        .ok_or_else(|| XdsError::resource(path, "needs a socket_address or a pipe"))?;
    let socket = p
        .string("path")?
        .ok_or_else(|| XdsError::resource(p.at("path"), "needs the socket's path"))?;
    if socket.starts_with('@') {
        return Err(XdsError::resource(
            p.at("path"),
            format!("`{socket}` is an abstract socket, which any local user can reach; give a filesystem path"),
        ));
    }
    // Envoy's mode 0 means "not set": flatmesh's default, owner only, applies.
    let mode = p.u32("mode")?.filter(|m| *m != 0);
    p.finish()?;
    a.finish()?;
    Ok(Admin {
        address: AdminAddress::Unix(socket.into()),
        mode,
        ..Admin::default()
    })
}

fn address(v: Value, path: &str) -> Result<Address> {
    let mut a = Obj::new(v, path)?;
    let mut s = a
        .obj("socket_address")?
        .ok_or_else(|| XdsError::resource(path, "needs a socket_address"))?;
    let mut sa = SocketAddress {
        address: s.string("address")?.unwrap_or_default(),
        ..Default::default()
    };
    if let Some(port) = s.u32("port_value")? {
        sa.port_specifier = Some(socket_address::PortSpecifier::PortValue(port));
    }
    if let Some(p) = s.string("protocol")? {
        if p != "TCP" {
            return Err(XdsError::resource(
                s.at("protocol"),
                format!("{p} is not supported; flatmesh listens and connects over TCP"),
            ));
        }
    }
    s.finish()?;
    a.finish()?;
    Ok(Address {
        address: Some(address::Address::SocketAddress(sa)),
    })
}

fn typed_config(v: Value, path: &str) -> Result<Any> {
    let mut o = Obj::new(v, path)?;
    let type_name = o.string("@type")?.ok_or_else(|| {
        XdsError::resource(path, "needs `@type`, e.g. type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager")
    })?;
    let any = if type_name == HttpConnectionManager::type_url() {
        pack(&http_connection_manager(&mut o)?)
    } else if type_name == TcpProxy::type_url() {
        let mut t = TcpProxy {
            stat_prefix: o.string("stat_prefix")?.unwrap_or_default(),
            ..Default::default()
        };
        if let Some(c) = o.string("cluster")? {
            t.cluster_specifier = Some(tcp_proxy::ClusterSpecifier::Cluster(c));
        }
        t.idle_timeout = o.duration("idle_timeout")?;
        if let Some(mut tc) = o.obj("tunneling_config")? {
            t.tunneling_config = Some(tcp_proxy::TunnelingConfig {
                hostname: tc.string("hostname")?.unwrap_or_default(),
                use_post: tc.bool("use_post")?.unwrap_or(false),
                post_path: tc.string("post_path")?.unwrap_or_default(),
                propagate_response_headers: tc.bool("propagate_response_headers")?.unwrap_or(false),
                ..Default::default()
            });
            tc.finish()?;
        }
        pack(&t)
    } else if type_name == Router::type_url() {
        pack(&Router::default())
    } else if type_name == HttpProtocolOptions::type_url() {
        pack(&http_protocol_options_of(&mut o)?)
    } else if type_name == HttpFault::type_url() {
        pack(&http_fault_of(&mut o)?)
    } else if type_name == HttpRbac::type_url() {
        let rules = o.obj("rules")?.map(rbac_rules_of).transpose()?;
        match rules {
            Some(rules) => crate::rbac::pack_with_rules(&HttpRbac::default(), &rules),
            None => pack(&HttpRbac::default()),
        }
    } else if crate::local_ratelimit::is_http(&Any {
        type_url: type_name.clone(),
        value: Vec::new(),
    }) {
        pack(&http_local_ratelimit_of(&mut o)?)
    } else if crate::local_ratelimit::is_network(&Any {
        type_url: type_name.clone(),
        value: Vec::new(),
    }) {
        pack(&network_local_ratelimit_of(&mut o)?)
    } else if type_name == NetworkRbac::type_url() {
        let filter = NetworkRbac {
            stat_prefix: o.string("stat_prefix")?.unwrap_or_default(),
            ..Default::default()
        };
        match o.obj("rules")?.map(rbac_rules_of).transpose()? {
            Some(rules) => crate::rbac::pack_with_rules(&filter, &rules),
            None => pack(&filter),
        }
    } else {
        return Err(XdsError::resource(
            o.at("@type"),
            format!("`{type_name}` is not supported; flatmesh runs the HTTP connection manager (with the RBAC, local rate limit and router filters), tcp_proxy, network RBAC and the network local rate limit"),
        ));
    };
    o.finish()?;
    Ok(any)
}

fn listener(v: Value, path: &str) -> Result<Listener> {
    let mut o = Obj::named(v, path)?;
    let mut l = Listener {
        name: o.string("name")?.unwrap_or_default(),
        stat_prefix: o.string("stat_prefix")?.unwrap_or_default(),
        ..Default::default()
    };
    if l.name.is_empty() {
        return Err(XdsError::resource(
            o.at("name"),
            "is missing; every listener needs a name",
        ));
    }
    if let Some(a) = o.take("address") {
        l.address = Some(address(a, &o.at("address"))?);
    }
    l.per_connection_buffer_limit_bytes = o
        .u32("per_connection_buffer_limit_bytes")?
        .map(|value| UInt32Value { value });
    for (i, v) in o.list("filter_chains")?.into_iter().enumerate() {
        let mut c = Obj::new(v, &o.at(&format!("filter_chains[{i}]")))?;
        let mut chain = FilterChain {
            name: c.string("name")?.unwrap_or_default(),
            ..Default::default()
        };
        for (k, v) in c.list("filters")?.into_iter().enumerate() {
            let mut f = Obj::new(v, &c.at(&format!("filters[{k}]")))?;
            let mut filter = Filter {
                name: f.string("name")?.unwrap_or_default(),
                ..Default::default()
            };
            if let Some(tc) = f.take("typed_config") {
                filter.config_type = Some(filter::ConfigType::TypedConfig(typed_config(
                    tc,
                    &f.at("typed_config"),
                )?));
            }
            f.finish()?;
            chain.filters.push(filter);
        }
        if let Some(ts) = c.take("transport_socket") {
            chain.transport_socket = Some(transport_socket(ts, &c.at("transport_socket"))?);
        }
        c.finish()?;
        l.filter_chains.push(chain);
    }
    o.finish()?;
    Ok(l)
}

fn http_connection_manager(o: &mut Obj) -> Result<HttpConnectionManager> {
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::CodecType;
    let mut h = HttpConnectionManager {
        stat_prefix: o.string("stat_prefix")?.unwrap_or_default(),
        ..Default::default()
    };
    if let Some(codec) = o.string("codec_type")? {
        h.codec_type = CodecType::from_str_name(&codec).ok_or_else(|| {
            XdsError::resource(
                o.at("codec_type"),
                format!("`{codec}` is not a codec type; use AUTO, HTTP1 or HTTP2"),
            )
        })? as i32;
    }
    if let Some(strip) = o.bool("strip_any_host_port")? {
        h.strip_port_mode = Some(http_connection_manager::StripPortMode::StripAnyHostPort(
            strip,
        ));
    }
    h.strip_matching_host_port = o.bool("strip_matching_host_port")?.unwrap_or(false);
    if let Some(mut h2) = o.obj("http2_protocol_options")? {
        let value = |v: Option<u32>| v.map(|value| UInt32Value { value });
        h.http2_protocol_options = Some(Http2ProtocolOptions {
            max_concurrent_streams: value(h2.u32("max_concurrent_streams")?),
            initial_stream_window_size: value(h2.u32("initial_stream_window_size")?),
            initial_connection_window_size: value(h2.u32("initial_connection_window_size")?),
            allow_connect: h2.bool("allow_connect")?.unwrap_or(false),
            ..Default::default()
        });
        h2.finish()?;
    }
    h.normalize_path = o.bool("normalize_path")?.map(|value| BoolValue { value });
    h.merge_slashes = o.bool("merge_slashes")?.unwrap_or(false);
    if let Some(action) = o.string("path_with_escaped_slashes_action")? {
        h.path_with_escaped_slashes_action =
            http_connection_manager::PathWithEscapedSlashesAction::from_str_name(&action)
                .ok_or_else(|| {
                    XdsError::resource(
                        o.at("path_with_escaped_slashes_action"),
                        format!("`{action}` is not one of KEEP_UNCHANGED, REJECT_REQUEST, UNESCAPE_AND_REDIRECT, UNESCAPE_AND_FORWARD"),
                    )
                })? as i32;
    }
    for (i, v) in o.list("upgrade_configs")?.into_iter().enumerate() {
        let mut u = Obj::new(v, &o.at(&format!("upgrade_configs[{i}]")))?;
        h.upgrade_configs
            .push(http_connection_manager::UpgradeConfig {
                upgrade_type: u.string("upgrade_type")?.unwrap_or_default(),
                enabled: u.bool("enabled")?.map(|value| BoolValue { value }),
                ..Default::default()
            });
        u.finish()?;
    }
    if let Some(rc) = o.take("route_config") {
        h.route_specifier = Some(http_connection_manager::RouteSpecifier::RouteConfig(
            route_configuration(rc, &o.at("route_config"))?,
        ));
    }
    for (i, v) in o.list("http_filters")?.into_iter().enumerate() {
        let mut f = Obj::new(v, &o.at(&format!("http_filters[{i}]")))?;
        let mut filter = HttpFilter {
            name: f.string("name")?.unwrap_or_default(),
            ..Default::default()
        };
        if let Some(tc) = f.take("typed_config") {
            filter.config_type = Some(http_filter::ConfigType::TypedConfig(typed_config(
                tc,
                &f.at("typed_config"),
            )?));
        }
        f.finish()?;
        h.http_filters.push(filter);
    }
    Ok(h)
}

/// An RBAC filter's `rules` (a listener's authorization, [`crate::rbac`]).
fn rbac_rules_of(mut o: Obj) -> Result<Rules> {
    let mut rules = Rules::default();
    if let Some(action) = o.string("action")? {
        rules.action = rbac::Action::from_str_name(&action).ok_or_else(|| {
            XdsError::resource(
                o.at("action"),
                format!("`{action}` is not an RBAC action; write ALLOW or DENY"),
            )
        })? as i32;
    }
    if let Some(policies) = o.obj("policies")? {
        let at = policies.path.clone();
        for (name, v) in policies.map {
            let mut p = Obj::new(v, &format!("{at}.{name}"))?;
            let mut policy = Policy::default();
            for (i, v) in p.list("permissions")?.into_iter().enumerate() {
                policy
                    .permissions
                    .push(permission_of(v, &p.at(&format!("permissions[{i}]")))?);
            }
            for (i, v) in p.list("principals")?.into_iter().enumerate() {
                policy
                    .principals
                    .push(principal_of(v, &p.at(&format!("principals[{i}]")))?);
            }
            p.finish()?;
            rules.policies.insert(name, policy);
        }
    }
    o.finish()?;
    Ok(rules)
}

fn permission_of(v: Value, path: &str) -> Result<Permission> {
    use permission::Rule;
    let mut o = Obj::new(v, path)?;
    let set = |o: &mut Obj, key: &str| -> Result<Option<permission::Set>> {
        let Some(mut s) = o.obj(key)? else {
            return Ok(None);
        };
        let rules = s
            .list("rules")?
            .into_iter()
            .enumerate()
            .map(|(i, v)| permission_of(v, &s.at(&format!("rules[{i}]"))))
            .collect::<Result<_>>()?;
        s.finish()?;
        Ok(Some(permission::Set { rules }))
    };
    let rule = if let Some(any) = o.bool("any")? {
        Some(Rule::Any(any))
    } else if let Some(s) = set(&mut o, "and_rules")? {
        Some(Rule::AndRules(s))
    } else if let Some(s) = set(&mut o, "or_rules")? {
        Some(Rule::OrRules(s))
    } else if let Some(h) = o.take("header") {
        Some(Rule::Header(header_matcher_of(h, &o.at("header"))?))
    } else if let Some(mut u) = o.obj("url_path")? {
        let path = u
            .take("path")
            .map(|v| string_matcher_of(v, &u.at("path")))
            .transpose()?;
        u.finish()?;
        Some(Rule::UrlPath(PathMatcher {
            rule: path.map(path_matcher::Rule::Path),
        }))
    } else {
        None
    };
    o.finish()?;
    Ok(Permission { rule })
}

fn principal_of(v: Value, path: &str) -> Result<Principal> {
    use principal::Identifier;
    let mut o = Obj::new(v, path)?;
    let set = |o: &mut Obj, key: &str| -> Result<Option<principal::Set>> {
        let Some(mut s) = o.obj(key)? else {
            return Ok(None);
        };
        let ids = s
            .list("ids")?
            .into_iter()
            .enumerate()
            .map(|(i, v)| principal_of(v, &s.at(&format!("ids[{i}]"))))
            .collect::<Result<_>>()?;
        s.finish()?;
        Ok(Some(principal::Set { ids }))
    };
    let identifier = if let Some(any) = o.bool("any")? {
        Some(Identifier::Any(any))
    } else if let Some(s) = set(&mut o, "and_ids")? {
        Some(Identifier::AndIds(s))
    } else if let Some(s) = set(&mut o, "or_ids")? {
        Some(Identifier::OrIds(s))
    } else if let Some(mut a) = o.obj("authenticated")? {
        let principal_name = a
            .take("principal_name")
            .map(|v| string_matcher_of(v, &a.at("principal_name")))
            .transpose()?;
        a.finish()?;
        Some(Identifier::Authenticated(principal::Authenticated {
            principal_name,
        }))
    } else {
        None
    };
    o.finish()?;
    Ok(Principal { identifier })
}

fn route_configuration(v: Value, path: &str) -> Result<RouteConfiguration> {
    let mut o = Obj::named(v, path)?;
    let mut rc = RouteConfiguration {
        name: o.string("name")?.unwrap_or_default(),
        ..Default::default()
    };
    for (i, v) in o.list("virtual_hosts")?.into_iter().enumerate() {
        let mut vo = Obj::named(v, &o.at(&format!("virtual_hosts[{i}]")))?;
        let mut vh = VirtualHost {
            name: vo.string("name")?.unwrap_or_default(),
            ..Default::default()
        };
        vh.domains.extend(vo.strings("domains")?);
        for (k, r) in vo.list("routes")?.into_iter().enumerate() {
            vh.routes
                .push(route_of(r, &vo.at(&format!("routes[{k}]")))?);
        }
        vo.finish()?;
        rc.virtual_hosts.push(vh);
    }
    o.finish()?;
    Ok(rc)
}

fn route_of(v: Value, path: &str) -> Result<Route> {
    let mut o = Obj::named(v, path)?;
    let mut r = Route {
        name: o.string("name")?.unwrap_or_default(),
        ..Default::default()
    };
    if let Some(m) = o.obj("match")? {
        r.r#match = Some(route_match_of(m)?);
    }
    if let Some(mut a) = o.obj("route")? {
        r.action = Some(route::Action::Route(route_action_of(&mut a)?));
        a.finish()?;
    }
    if let Some(mut d) = o.obj("direct_response")? {
        let mut dr = DirectResponseAction {
            status: d.u32("status")?.unwrap_or(0),
            ..Default::default()
        };
        if let Some(mut body) = d.obj("body")? {
            let specifier = if let Some(s) = body.string("inline_string")? {
                data_source::Specifier::InlineString(s)
            } else {
                return Err(XdsError::resource(
                    body.at("inline_string"),
                    "is missing; flatmesh takes a direct response body as inline_string",
                ));
            };
            body.finish()?;
            dr.body = Some(DataSource {
                specifier: Some(specifier),
                ..Default::default()
            });
        }
        d.finish()?;
        r.action = Some(route::Action::DirectResponse(dr));
    }
    r.request_headers_to_add = header_options(
        o.list("request_headers_to_add")?,
        &o.at("request_headers_to_add"),
    )?;
    r.response_headers_to_add = header_options(
        o.list("response_headers_to_add")?,
        &o.at("response_headers_to_add"),
    )?;
    r.request_headers_to_remove
        .extend(o.strings("request_headers_to_remove")?);
    if let Some(per_filter) = o.obj("typed_per_filter_config")? {
        let at = per_filter.path.clone();
        for (name, v) in per_filter.map {
            let config = typed_config(v, &format!("{at}[\"{name}\"]"))?;
            r.typed_per_filter_config.insert(name, config);
        }
    }
    r.metadata = o.obj("metadata")?.map(metadata_of).transpose()?;
    o.finish()?;
    Ok(r)
}

// Fault injection and mirroring (`crate::fault` maps them onto flatmesh's routes).

/// The fault filter's config (an `HTTPFault`): an abort and a delay, each with its share.
fn http_fault_of(o: &mut Obj) -> Result<HttpFault> {
    let mut f = HttpFault::default();
    if let Some(mut a) = o.obj("abort")? {
        let error_type = if let Some(s) = a.u32("http_status")? {
            Some(fault_abort::ErrorType::HttpStatus(s))
        } else if let Some(code) = a.u32("grpc_status")? {
            Some(fault_abort::ErrorType::GrpcStatus(code))
        } else {
            a.obj("header_abort")?
                .map(|_| fault_abort::ErrorType::HeaderAbort(Default::default()))
        };
        f.abort = Some(FaultAbort {
            percentage: a.obj("percentage")?.map(fractional_of).transpose()?,
            error_type,
            ..Default::default()
        });
        a.finish()?;
    }
    if let Some(mut d) = o.obj("delay")? {
        let specifier = match d.duration("fixed_delay")? {
            Some(t) => Some(fault_delay::FaultDelaySecifier::FixedDelay(t)),
            None => d
                .obj("header_delay")?
                .map(|_| fault_delay::FaultDelaySecifier::HeaderDelay(Default::default())),
        };
        f.delay = Some(FaultDelay {
            percentage: d.obj("percentage")?.map(fractional_of).transpose()?,
            fault_delay_secifier: specifier,
        });
        d.finish()?;
    }
    Ok(f)
}

/// `{ numerator, denominator: HUNDRED | TEN_THOUSAND | MILLION }` (HUNDRED when left out).
fn fractional_of(mut o: Obj) -> Result<FractionalPercent> {
    let numerator = o.u32("numerator")?.unwrap_or(0);
    let at = o.at("denominator");
    let denominator = match o.string("denominator")?.as_deref() {
        None | Some("HUNDRED") => DenominatorType::Hundred,
        Some("TEN_THOUSAND") => DenominatorType::TenThousand,
        Some("MILLION") => DenominatorType::Million,
        Some(other) => {
            return Err(XdsError::resource(
                at,
                format!("`{other}` is not HUNDRED, TEN_THOUSAND or MILLION"),
            ))
        }
    };
    o.finish()?;
    Ok(FractionalPercent {
        numerator,
        denominator: denominator as i32,
    })
}

/// A route action's `request_mirror_policies[i]`: the cluster and the share mirrored.
fn mirror_policy_of(v: Value, path: &str) -> Result<route_action::RequestMirrorPolicy> {
    let mut o = Obj::new(v, path)?;
    let mut p = route_action::RequestMirrorPolicy {
        cluster: o.string("cluster")?.unwrap_or_default(),
        ..Default::default()
    };
    p.runtime_fraction = o
        .obj("runtime_fraction")?
        .map(runtime_percent_of)
        .transpose()?;
    o.finish()?;
    Ok(p)
}

/// Envoy's `token_bucket`.
fn token_bucket_of(mut o: Obj) -> Result<envoy_types::pb::envoy::r#type::v3::TokenBucket> {
    let tb = envoy_types::pb::envoy::r#type::v3::TokenBucket {
        max_tokens: o.u32("max_tokens")?.unwrap_or(0),
        tokens_per_fill: o.u32("tokens_per_fill")?.map(|value| UInt32Value { value }),
        fill_interval: o.duration("fill_interval")?,
    };
    o.finish()?;
    Ok(tb)
}

/// A `RuntimeFractionalPercent` (`{ default_value: { numerator, denominator }, runtime_key }`).
fn runtime_percent_of(mut o: Obj) -> Result<RuntimeFractionalPercent> {
    let mut out = RuntimeFractionalPercent {
        runtime_key: o.string("runtime_key")?.unwrap_or_default(),
        ..Default::default()
    };
    out.default_value = o.obj("default_value")?.map(fractional_of).transpose()?;
    o.finish()?;
    Ok(out)
}

/// `envoy.filters.http.local_ratelimit`'s config: what `crate::local_ratelimit` maps.
fn http_local_ratelimit_of(
    o: &mut Obj,
) -> Result<envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit>
{
    Ok(
        envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit {
            stat_prefix: o.string("stat_prefix")?.unwrap_or_default(),
            token_bucket: o.obj("token_bucket")?.map(token_bucket_of).transpose()?,
            filter_enabled: o
                .obj("filter_enabled")?
                .map(runtime_percent_of)
                .transpose()?,
            filter_enforced: o
                .obj("filter_enforced")?
                .map(runtime_percent_of)
                .transpose()?,
            rate_limited_as_resource_exhausted: o
                .bool("rate_limited_as_resource_exhausted")?
                .unwrap_or(false),
            enable_retry_after_header: o.bool("enable_retry_after_header")?.unwrap_or(false),
            ..Default::default()
        },
    )
}

/// `envoy.filters.network.local_ratelimit`'s config.
fn network_local_ratelimit_of(
    o: &mut Obj,
) -> Result<envoy_types::pb::envoy::extensions::filters::network::local_ratelimit::v3::LocalRateLimit>
{
    Ok(
        envoy_types::pb::envoy::extensions::filters::network::local_ratelimit::v3::LocalRateLimit {
            stat_prefix: o.string("stat_prefix")?.unwrap_or_default(),
            token_bucket: o.obj("token_bucket")?.map(token_bucket_of).transpose()?,
            ..Default::default()
        },
    )
}

fn header_options(list: Vec<Value>, path: &str) -> Result<Vec<HeaderValueOption>> {
    let mut out = Vec::new();
    for (i, v) in list.into_iter().enumerate() {
        let mut o = Obj::new(v, &format!("{path}[{i}]"))?;
        let mut h = o
            .obj("header")?
            .ok_or_else(|| XdsError::resource(o.at("header"), "is missing"))?;
        let header = HeaderValue {
            key: h.string("key")?.unwrap_or_default(),
            value: h.string("value")?.unwrap_or_default(),
            ..Default::default()
        };
        h.finish()?;
        o.take("append_action");
        let append = o.bool("append")?;
        o.finish()?;
        out.push(HeaderValueOption {
            header: Some(header),
            append: append.map(|value| BoolValue { value }),
            ..Default::default()
        });
    }
    Ok(out)
}

fn regex_of(v: Value, path: &str) -> Result<RegexMatcher> {
    let mut o = Obj::new(v, path)?;
    o.take("google_re2"); // the engine; flatmesh's regexes are RE2-compatible
    let regex = o
        .string("regex")?
        .ok_or_else(|| XdsError::resource(o.at("regex"), "is missing"))?;
    o.finish()?;
    Ok(RegexMatcher {
        regex,
        ..Default::default()
    })
}

fn string_matcher_of(v: Value, path: &str) -> Result<StringMatcher> {
    let mut o = Obj::new(v, path)?;
    let mut m = StringMatcher {
        ignore_case: o.bool("ignore_case")?.unwrap_or(false),
        ..Default::default()
    };
    if let Some(s) = o.string("exact")? {
        m.match_pattern = Some(string_matcher::MatchPattern::Exact(s));
    } else if let Some(s) = o.string("prefix")? {
        m.match_pattern = Some(string_matcher::MatchPattern::Prefix(s));
    } else if let Some(s) = o.string("suffix")? {
        m.match_pattern = Some(string_matcher::MatchPattern::Suffix(s));
    } else if let Some(r) = o.take("safe_regex") {
        m.match_pattern = Some(string_matcher::MatchPattern::SafeRegex(regex_of(
            r,
            &o.at("safe_regex"),
        )?));
    }
    o.finish()?;
    Ok(m)
}

fn header_matcher_of(v: Value, path: &str) -> Result<HeaderMatcher> {
    let mut h = Obj::new(v, path)?;
    let mut hm = HeaderMatcher {
        name: h.string("name")?.unwrap_or_default(),
        invert_match: h.bool("invert_match")?.unwrap_or(false),
        ..Default::default()
    };
    use header_matcher::HeaderMatchSpecifier as S;
    hm.header_match_specifier = if let Some(s) = h.string("exact_match")? {
        Some(S::ExactMatch(s))
    } else if let Some(s) = h.string("prefix_match")? {
        Some(S::PrefixMatch(s))
    } else if let Some(s) = h.string("suffix_match")? {
        Some(S::SuffixMatch(s))
    } else if let Some(r) = h.take("safe_regex_match") {
        Some(S::SafeRegexMatch(regex_of(r, &h.at("safe_regex_match"))?))
    } else if let Some(b) = h.bool("present_match")? {
        Some(S::PresentMatch(b))
    } else if let Some(s) = h.take("string_match") {
        Some(S::StringMatch(string_matcher_of(s, &h.at("string_match"))?))
    } else {
        None
    };
    h.finish()?;
    Ok(hm)
}

fn route_match_of(mut o: Obj) -> Result<RouteMatch> {
    let mut m = RouteMatch::default();
    if let Some(p) = o.string("prefix")? {
        m.path_specifier = Some(route_match::PathSpecifier::Prefix(p));
    } else if let Some(p) = o.string("path")? {
        m.path_specifier = Some(route_match::PathSpecifier::Path(p));
    } else if let Some(r) = o.take("safe_regex") {
        m.path_specifier = Some(route_match::PathSpecifier::SafeRegex(regex_of(
            r,
            &o.at("safe_regex"),
        )?));
    } else if let Some(c) = o.obj("connect_matcher")? {
        c.finish()?;
        m.path_specifier = Some(route_match::PathSpecifier::ConnectMatcher(
            route_match::ConnectMatcher {},
        ));
    }
    if let Some(c) = o.bool("case_sensitive")? {
        m.case_sensitive = Some(BoolValue { value: c });
    }
    for (i, v) in o.list("headers")?.into_iter().enumerate() {
        m.headers
            .push(header_matcher_of(v, &o.at(&format!("headers[{i}]")))?);
    }
    for (i, v) in o.list("query_parameters")?.into_iter().enumerate() {
        let mut q = Obj::new(v, &o.at(&format!("query_parameters[{i}]")))?;
        let mut qm = QueryParameterMatcher {
            name: q.string("name")?.unwrap_or_default(),
            ..Default::default()
        };
        use query_parameter_matcher::QueryParameterMatchSpecifier as S;
        qm.query_parameter_match_specifier = if let Some(s) = q.take("string_match") {
            Some(S::StringMatch(string_matcher_of(s, &q.at("string_match"))?))
        } else {
            q.bool("present_match")?.map(S::PresentMatch)
        };
        q.finish()?;
        m.query_parameters.push(qm);
    }
    o.finish()?;
    Ok(m)
}

fn route_action_of(o: &mut Obj) -> Result<RouteAction> {
    let mut a = RouteAction::default();
    if let Some(c) = o.string("cluster")? {
        a.cluster_specifier = Some(route_action::ClusterSpecifier::Cluster(c));
    } else if let Some(mut w) = o.obj("weighted_clusters")? {
        let mut wc = WeightedCluster::default();
        if let Some(t) = w.u32("total_weight")? {
            wc.total_weight = Some(UInt32Value { value: t });
        }
        for (i, v) in w.list("clusters")?.into_iter().enumerate() {
            let mut c = Obj::new(v, &w.at(&format!("clusters[{i}]")))?;
            wc.clusters.push(weighted_cluster::ClusterWeight {
                name: c.string("name")?.unwrap_or_default(),
                weight: c.u32("weight")?.map(|value| UInt32Value { value }),
                ..Default::default()
            });
            c.finish()?;
        }
        w.finish()?;
        a.cluster_specifier = Some(route_action::ClusterSpecifier::WeightedClusters(wc));
    }
    a.timeout = o.duration("timeout")?;
    for (i, v) in o.list("upgrade_configs")?.into_iter().enumerate() {
        let mut u = Obj::new(v, &o.at(&format!("upgrade_configs[{i}]")))?;
        let connect_config = match u.obj("connect_config")? {
            Some(mut c) => {
                let config = route_action::upgrade_config::ConnectConfig {
                    allow_post: c.bool("allow_post")?.unwrap_or(false),
                    ..Default::default()
                };
                c.finish()?;
                Some(config)
            }
            None => None,
        };
        a.upgrade_configs.push(route_action::UpgradeConfig {
            upgrade_type: u.string("upgrade_type")?.unwrap_or_default(),
            enabled: u.bool("enabled")?.map(|value| BoolValue { value }),
            connect_config,
        });
        u.finish()?;
    }
    if let Some(mut r) = o.obj("retry_policy")? {
        a.retry_policy = Some(RetryPolicy {
            retry_on: r.string("retry_on")?.unwrap_or_default(),
            num_retries: r.u32("num_retries")?.map(|value| UInt32Value { value }),
            per_try_timeout: r.duration("per_try_timeout")?,
            retry_back_off: match r.obj("retry_back_off")? {
                Some(mut b) => {
                    let back_off =
                        envoy_types::pb::envoy::config::route::v3::retry_policy::RetryBackOff {
                            base_interval: b.duration("base_interval")?,
                            max_interval: b.duration("max_interval")?,
                        };
                    b.finish()?;
                    Some(back_off)
                }
                None => None,
            },
            ..Default::default()
        });
        r.finish()?;
    }
    for (i, v) in o.list("request_mirror_policies")?.into_iter().enumerate() {
        let here = o.at(&format!("request_mirror_policies[{i}]"));
        a.request_mirror_policies.push(mirror_policy_of(v, &here)?);
    }
    for (i, v) in o.list("hash_policy")?.into_iter().enumerate() {
        let mut h = Obj::new(v, &o.at(&format!("hash_policy[{i}]")))?;
        let mut header = h.obj("header")?.ok_or_else(|| {
            XdsError::resource(
                h.at("header"),
                "is missing; flatmesh hashes on a request header",
            )
        })?;
        let name = header.string("header_name")?.unwrap_or_default();
        header.finish()?;
        h.finish()?;
        a.hash_policy.push(route_action::HashPolicy {
            policy_specifier: Some(route_action::hash_policy::PolicySpecifier::Header(
                route_action::hash_policy::Header {
                    header_name: name,
                    ..Default::default()
                },
            )),
            ..Default::default()
        });
    }
    Ok(a)
}

fn cluster(v: Value, path: &str) -> Result<Cluster> {
    let mut o = Obj::named(v, path)?;
    let mut c = Cluster {
        name: o.string("name")?.unwrap_or_default(),
        ..Default::default()
    };
    if c.name.is_empty() {
        return Err(XdsError::resource(
            o.at("name"),
            "is missing; every cluster needs a name",
        ));
    }
    if let Some(t) = o.string("type")? {
        let t = cluster::DiscoveryType::from_str_name(&t).ok_or_else(|| {
            XdsError::resource(
                o.at("type"),
                format!("`{t}` is not a cluster type; use STATIC or EDS"),
            )
        })?;
        if t == cluster::DiscoveryType::Eds {
            return Err(XdsError::resource(
                o.at("type"),
                "EDS takes endpoints from a control plane, which a static import has not; make the cluster STATIC with a load_assignment, or serve it over xDS (flatmesh node --xds)",
            ));
        }
        c.cluster_discovery_type = Some(cluster::ClusterDiscoveryType::Type(t as i32));
    }
    c.connect_timeout = o.duration("connect_timeout")?;
    // An ORIGINAL_DST cluster's idle-host sweep (flatmesh bounds its destinations instead).
    c.cleanup_interval = o.duration("cleanup_interval")?;
    if let Some(p) = o.string("lb_policy")? {
        c.lb_policy = cluster::LbPolicy::from_str_name(&p).ok_or_else(|| {
            XdsError::resource(o.at("lb_policy"), format!("`{p}` is not a load-balancing policy; use ROUND_ROBIN, LEAST_REQUEST, RING_HASH, MAGLEV or RANDOM"))
        })? as i32;
    }
    // DNS settings mean nothing for IP addresses (the only ones flatmesh takes); accepted because
    // Envoy's examples set them everywhere.
    o.string("dns_lookup_family")?;
    o.duration("dns_refresh_rate")?;
    o.bool("respect_dns_ttl")?;
    if o.take("http2_protocol_options").is_some() {
        c.http2_protocol_options = Some(Http2ProtocolOptions::default());
    }
    if let Some(options) = o.obj("typed_extension_protocol_options")? {
        let mut map = HashMap::new();
        let at = options.path.clone();
        for (key, v) in options.map {
            map.insert(key.clone(), typed_config(v, &format!("{at}[\"{key}\"]"))?);
        }
        c.typed_extension_protocol_options = map;
    }
    if let Some(la) = o.obj("load_assignment")? {
        c.load_assignment = Some(load_assignment(la)?);
    }
    if let Some(mut od) = o.obj("original_dst_lb_config")? {
        c.lb_config = Some(cluster::LbConfig::OriginalDstLbConfig(
            cluster::OriginalDstLbConfig {
                use_http_header: od.bool("use_http_header")?.unwrap_or(false),
                http_header_name: od.string("http_header_name")?.unwrap_or_default(),
                ..Default::default()
            },
        ));
        od.finish()?;
    }
    c.metadata = o.obj("metadata")?.map(metadata_of).transpose()?;
    if let Some(rr) = o.obj("round_robin_lb_config")? {
        c.lb_config = Some(cluster::LbConfig::RoundRobinLbConfig(
            cluster::RoundRobinLbConfig {
                slow_start_config: slow_start_config(rr)?,
            },
        ));
    }
    if let Some(lr) = o.obj("least_request_lb_config")? {
        c.lb_config = Some(cluster::LbConfig::LeastRequestLbConfig(
            cluster::LeastRequestLbConfig {
                slow_start_config: slow_start_config(lr)?,
                ..Default::default()
            },
        ));
    }
    if let Some(ts) = o.take("transport_socket") {
        c.transport_socket = Some(transport_socket(ts, &o.at("transport_socket"))?);
    }
    if let Some(b) = o.obj("circuit_breakers")? {
        c.circuit_breakers = Some(circuit_breakers(b)?);
    }
    if let Some(od) = o.obj("outlier_detection")? {
        c.outlier_detection = Some(outlier_detection(od)?);
    }
    let at = o.at("health_checks");
    for (i, v) in o.list("health_checks")?.into_iter().enumerate() {
        c.health_checks
            .push(health_check(Obj::new(v, &format!("{at}[{i}]"))?)?);
    }
    o.finish()?;
    Ok(c)
}

/// An optional whole number as protobuf's wrapper.
fn wrapped_u32(o: &mut Obj, key: &str) -> Result<Option<UInt32Value>> {
    Ok(o.u32(key)?.map(|value| UInt32Value { value }))
}

/// A cluster's `circuit_breakers`; which thresholds flatmesh honours is decided in
/// `crate::to_model`, as for xDS.
fn circuit_breakers(mut o: Obj) -> Result<CircuitBreakers> {
    use envoy_types::pb::envoy::config::core::v3::RoutingPriority;
    let mut out = CircuitBreakers::default();
    for (i, v) in o.list("thresholds")?.into_iter().enumerate() {
        let mut t = Obj::new(v, &o.at(&format!("thresholds[{i}]")))?;
        let priority = match t.string("priority")? {
            None => RoutingPriority::Default,
            Some(p) => RoutingPriority::from_str_name(&p).ok_or_else(|| {
                XdsError::resource(
                    t.at("priority"),
                    format!("`{p}` is not a routing priority; use DEFAULT or HIGH"),
                )
            })?,
        };
        out.thresholds.push(circuit_breakers::Thresholds {
            priority: priority as i32,
            max_connections: wrapped_u32(&mut t, "max_connections")?,
            max_pending_requests: wrapped_u32(&mut t, "max_pending_requests")?,
            max_requests: wrapped_u32(&mut t, "max_requests")?,
            max_retries: wrapped_u32(&mut t, "max_retries")?,
            track_remaining: t.bool("track_remaining")?.unwrap_or(false),
            ..Default::default()
        });
        t.finish()?;
    }
    o.finish()?;
    Ok(out)
}

/// A cluster's `outlier_detection`: the fields of the kinds flatmesh runs; what they mean is
/// decided in `crate::to_model`, as for xDS.
fn outlier_detection(mut o: Obj) -> Result<OutlierDetection> {
    let mut out = OutlierDetection {
        consecutive_5xx: wrapped_u32(&mut o, "consecutive_5xx")?,
        enforcing_consecutive_5xx: wrapped_u32(&mut o, "enforcing_consecutive_5xx")?,
        consecutive_gateway_failure: wrapped_u32(&mut o, "consecutive_gateway_failure")?,
        enforcing_consecutive_gateway_failure: wrapped_u32(
            &mut o,
            "enforcing_consecutive_gateway_failure",
        )?,
        split_external_local_origin_errors: o
            .bool("split_external_local_origin_errors")?
            .unwrap_or(false),
        consecutive_local_origin_failure: wrapped_u32(&mut o, "consecutive_local_origin_failure")?,
        enforcing_consecutive_local_origin_failure: wrapped_u32(
            &mut o,
            "enforcing_consecutive_local_origin_failure",
        )?,
        max_ejection_percent: wrapped_u32(&mut o, "max_ejection_percent")?,
        enforcing_success_rate: wrapped_u32(&mut o, "enforcing_success_rate")?,
        success_rate_minimum_hosts: wrapped_u32(&mut o, "success_rate_minimum_hosts")?,
        success_rate_request_volume: wrapped_u32(&mut o, "success_rate_request_volume")?,
        success_rate_stdev_factor: wrapped_u32(&mut o, "success_rate_stdev_factor")?,
        enforcing_failure_percentage: wrapped_u32(&mut o, "enforcing_failure_percentage")?,
        failure_percentage_threshold: wrapped_u32(&mut o, "failure_percentage_threshold")?,
        failure_percentage_minimum_hosts: wrapped_u32(&mut o, "failure_percentage_minimum_hosts")?,
        failure_percentage_request_volume: wrapped_u32(
            &mut o,
            "failure_percentage_request_volume",
        )?,
        ..Default::default()
    };
    out.interval = o.duration("interval")?;
    out.base_ejection_time = o.duration("base_ejection_time")?;
    out.max_ejection_time = o.duration("max_ejection_time")?;
    out.always_eject_one_host = o
        .bool("always_eject_one_host")?
        .map(|value| BoolValue { value });
    o.finish()?;
    Ok(out)
}

/// A cluster's health check: the probes and fields flatmesh runs; what they mean (and what
/// of them it refuses) is decided in `crate::to_model`, as for xDS.
fn health_check(mut o: Obj) -> Result<envoy_types::pb::envoy::config::core::v3::HealthCheck> {
    use envoy_types::pb::envoy::config::core::v3::health_check::{
        GrpcHealthCheck, HealthChecker, HttpHealthCheck, TcpHealthCheck,
    };
    use envoy_types::pb::envoy::r#type::v3::Int64Range;
    let mut out = envoy_types::pb::envoy::config::core::v3::HealthCheck {
        timeout: o.duration("timeout")?,
        interval: o.duration("interval")?,
        unhealthy_threshold: wrapped_u32(&mut o, "unhealthy_threshold")?,
        healthy_threshold: wrapped_u32(&mut o, "healthy_threshold")?,
        ..Default::default()
    };
    if let Some(mut h) = o.obj("http_health_check")? {
        let mut http = HttpHealthCheck {
            path: h.string("path")?.unwrap_or_default(),
            ..Default::default()
        };
        let at = h.at("expected_statuses");
        for (i, v) in h.list("expected_statuses")?.into_iter().enumerate() {
            let mut r = Obj::new(v, &format!("{at}[{i}]"))?;
            let mut bound = |key: &str| -> Result<i64> {
                let here = r.at(key);
                r.take(key)
                    .as_ref()
                    .and_then(number)
                    .and_then(|n| i64::try_from(n).ok())
                    .ok_or_else(|| XdsError::resource(here, "must be a whole number"))
            };
            let (start, end) = (bound("start")?, bound("end")?);
            r.finish()?;
            http.expected_statuses.push(Int64Range { start, end });
        }
        h.finish()?;
        out.health_checker = Some(HealthChecker::HttpHealthCheck(http));
    } else if let Some(t) = o.obj("tcp_health_check")? {
        t.finish()?;
        out.health_checker = Some(HealthChecker::TcpHealthCheck(TcpHealthCheck::default()));
    } else if let Some(mut g) = o.obj("grpc_health_check")? {
        let grpc = GrpcHealthCheck {
            service_name: g.string("service_name")?.unwrap_or_default(),
            ..Default::default()
        };
        g.finish()?;
        out.health_checker = Some(HealthChecker::GrpcHealthCheck(grpc));
    }
    o.finish()?;
    Ok(out)
}

fn http_protocol_options_of(o: &mut Obj) -> Result<HttpProtocolOptions> {
    use http_protocol_options::explicit_http_config::ProtocolConfig;
    let mut out = HttpProtocolOptions::default();
    if let Some(mut e) = o.obj("explicit_http_config")? {
        let config = if e.take("http2_protocol_options").is_some() {
            Some(ProtocolConfig::Http2ProtocolOptions(
                Http2ProtocolOptions::default(),
            ))
        } else if e.take("http_protocol_options").is_some() {
            Some(ProtocolConfig::HttpProtocolOptions(
                Http1ProtocolOptions::default(),
            ))
        } else {
            None
        };
        e.finish()?;
        out.upstream_protocol_options = Some(
            http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                http_protocol_options::ExplicitHttpConfig {
                    protocol_config: config,
                },
            ),
        );
    }
    Ok(out)
}

/// A `metadata` (`filter_metadata` only): each namespace's JSON tree as a protobuf Struct.
/// Which keys mean something is for the translation to say ([`crate::hbone`]).
fn metadata_of(mut o: Obj) -> Result<envoy_types::pb::envoy::config::core::v3::Metadata> {
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value as PbValue};
    fn value(v: Value) -> PbValue {
        let kind = match v {
            Value::Null => Kind::NullValue(0),
            Value::Bool(b) => Kind::BoolValue(b),
            Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
            Value::String(s) => Kind::StringValue(s),
            Value::Array(a) => Kind::ListValue(ListValue {
                values: a.into_iter().map(value).collect(),
            }),
            Value::Object(m) => Kind::StructValue(Struct {
                fields: m.into_iter().map(|(k, v)| (k, value(v))).collect(),
            }),
        };
        PbValue { kind: Some(kind) }
    }
    let mut out = envoy_types::pb::envoy::config::core::v3::Metadata::default();
    if let Some(filters) = o.obj("filter_metadata")? {
        for (key, v) in filters.map {
            let Value::Object(fields) = v else {
                return Err(XdsError::resource(
                    format!("{}[\"{key}\"]", filters.path),
                    "is not a mapping",
                ));
            };
            out.filter_metadata.insert(
                key,
                Struct {
                    fields: fields.into_iter().map(|(k, v)| (k, value(v))).collect(),
                },
            );
        }
    }
    o.finish()?;
    Ok(out)
}

fn load_assignment(mut o: Obj) -> Result<ClusterLoadAssignment> {
    let mut cla = ClusterLoadAssignment {
        cluster_name: o.string("cluster_name")?.unwrap_or_default(),
        ..Default::default()
    };
    for (i, v) in o.list("endpoints")?.into_iter().enumerate() {
        let mut g = Obj::new(v, &o.at(&format!("endpoints[{i}]")))?;
        let mut group = LocalityLbEndpoints {
            priority: g.u32("priority")?.unwrap_or(0),
            load_balancing_weight: wrapped_u32(&mut g, "load_balancing_weight")?,
            ..Default::default()
        };
        if let Some(mut l) = g.obj("locality")? {
            group.locality = Some(Locality {
                region: l.string("region")?.unwrap_or_default(),
                zone: l.string("zone")?.unwrap_or_default(),
                sub_zone: l.string("sub_zone")?.unwrap_or_default(),
            });
            l.finish()?;
        }
        for (k, v) in g.list("lb_endpoints")?.into_iter().enumerate() {
            let mut e = Obj::new(v, &g.at(&format!("lb_endpoints[{k}]")))?;
            let mut ep = Obj::new(
                e.take("endpoint")
                    .ok_or_else(|| XdsError::resource(e.at("endpoint"), "is missing"))?,
                &e.at("endpoint"),
            )?;
            let address = ep
                .take("address")
                .map(|a| address(a, &ep.at("address")))
                .transpose()?;
            ep.finish()?;
            let weight = e.u32("load_balancing_weight")?;
            let metadata = e.obj("metadata")?.map(metadata_of).transpose()?;
            e.finish()?;
            group.lb_endpoints.push(LbEndpoint {
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address,
                    ..Default::default()
                })),
                load_balancing_weight: weight.map(|value| UInt32Value { value }),
                metadata,
                ..Default::default()
            });
        }
        g.finish()?;
        cla.endpoints.push(group);
    }
    if let Some(mut p) = o.obj("policy")? {
        cla.policy = Some(cluster_load_assignment::Policy {
            overprovisioning_factor: wrapped_u32(&mut p, "overprovisioning_factor")?,
            ..Default::default()
        });
        p.finish()?;
    }
    o.finish()?;
    Ok(cla)
}

/// A cluster's `round_robin_lb_config` / `least_request_lb_config`: their slow start (the
/// other knobs are left for [`Obj::finish`] to refuse, or for the translation to judge).
fn slow_start_config(mut o: Obj) -> Result<Option<cluster::SlowStartConfig>> {
    let Some(mut s) = o.obj("slow_start_config")? else {
        o.finish()?;
        return Ok(None);
    };
    let mut config = cluster::SlowStartConfig {
        slow_start_window: s.duration("slow_start_window")?,
        ..Default::default()
    };
    let float = |v: Option<Value>, at: String| -> Result<Option<f64>> {
        v.map(|v| {
            v.as_f64()
                .ok_or_else(|| XdsError::resource(at, "must be a number"))
        })
        .transpose()
    };
    if let Some(mut a) = s.obj("aggression")? {
        let at = a.at("default_value");
        config.aggression = Some(RuntimeDouble {
            default_value: float(a.take("default_value"), at)?.unwrap_or(1.0),
            runtime_key: a.string("runtime_key")?.unwrap_or_default(),
        });
        a.finish()?;
    }
    if let Some(mut p) = s.obj("min_weight_percent")? {
        let at = p.at("value");
        config.min_weight_percent = Some(Percent {
            value: float(p.take("value"), at)?.unwrap_or(0.0),
        });
        p.finish()?;
    }
    s.finish()?;
    o.finish()?;
    Ok(Some(config))
}

/// A listener's or a cluster's `transport_socket`: TLS (its context walked into the message, which
/// [`crate::tls`] then judges) or Envoy's plaintext raw_buffer.
fn transport_socket(v: Value, path: &str) -> Result<TransportSocket> {
    let mut o = Obj::new(v, path)?;
    let name = o.string("name")?.unwrap_or_default();
    let mut tc = o.obj("typed_config")?.ok_or_else(|| {
        XdsError::resource(
            o.at("typed_config"),
            format!(
                "is missing; write one with \"@type\": {}",
                DownstreamTlsContext::type_url()
            ),
        )
    })?;
    let type_name = tc.string("@type")?.unwrap_or_default();
    let any = if type_name == DownstreamTlsContext::type_url() {
        let context = DownstreamTlsContext {
            require_client_certificate: tc
                .bool("require_client_certificate")?
                .map(|value| BoolValue { value }),
            common_tls_context: tc
                .obj("common_tls_context")?
                .map(common_tls_context_of)
                .transpose()?,
            ..Default::default()
        };
        pack(&context)
    } else if type_name == UpstreamTlsContext::type_url() {
        let context = UpstreamTlsContext {
            sni: tc.string("sni")?.unwrap_or_default(),
            common_tls_context: tc
                .obj("common_tls_context")?
                .map(common_tls_context_of)
                .transpose()?,
            ..Default::default()
        };
        pack(&context)
    } else if type_name == RawBuffer::type_url() {
        pack(&RawBuffer::default())
    } else {
        return Err(XdsError::resource(
            tc.at("@type"),
            format!(
                "`{type_name}` is not supported; flatmesh's transport sockets are TLS ({} on listeners, {} on clusters) and raw_buffer",
                DownstreamTlsContext::type_url(),
                UpstreamTlsContext::type_url()
            ),
        ));
    };
    tc.finish()?;
    o.finish()?;
    Ok(TransportSocket {
        name,
        config_type: Some(transport_socket::ConfigType::TypedConfig(any)),
    })
}

fn common_tls_context_of(mut o: Obj) -> Result<CommonTlsContext> {
    let mut c = CommonTlsContext::default();
    for (i, v) in o.list("tls_certificates")?.into_iter().enumerate() {
        let mut t = Obj::new(v, &o.at(&format!("tls_certificates[{i}]")))?;
        c.tls_certificates.push(TlsCertificate {
            certificate_chain: t
                .take("certificate_chain")
                .map(|v| data_source_of(v, &t.at("certificate_chain")))
                .transpose()?,
            private_key: t
                .take("private_key")
                .map(|v| data_source_of(v, &t.at("private_key")))
                .transpose()?,
            ..Default::default()
        });
        t.finish()?;
    }
    // Secrets by name: over ADS, or from static_resources.secrets.
    for (i, v) in o
        .list("tls_certificate_sds_secret_configs")?
        .into_iter()
        .enumerate()
    {
        c.tls_certificate_sds_secret_configs
            .push(sds_secret_config_of(
                v,
                &o.at(&format!("tls_certificate_sds_secret_configs[{i}]")),
            )?);
    }
    if let Some(v) = o.take("validation_context_sds_secret_config") {
        c.validation_context_type = Some(
            common_tls_context::ValidationContextType::ValidationContextSdsSecretConfig(
                sds_secret_config_of(v, &o.at("validation_context_sds_secret_config"))?,
            ),
        );
    }
    if let Some(mut combined) = o.obj("combined_validation_context")? {
        let default_validation_context = combined
            .obj("default_validation_context")?
            .map(validation_context_of)
            .transpose()?;
        let validation_context_sds_secret_config = combined
            .take("validation_context_sds_secret_config")
            .map(|v| sds_secret_config_of(v, &combined.at("validation_context_sds_secret_config")))
            .transpose()?;
        combined.finish()?;
        c.validation_context_type = Some(
            common_tls_context::ValidationContextType::CombinedValidationContext(
                common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context,
                    validation_context_sds_secret_config,
                    ..Default::default()
                },
            ),
        );
    }
    if let Some(v) = o.obj("validation_context")? {
        c.validation_context_type = Some(
            common_tls_context::ValidationContextType::ValidationContext(validation_context_of(v)?),
        );
    }
    c.alpn_protocols.extend(o.strings("alpn_protocols")?);
    if let Some(mut p) = o.obj("tls_params")? {
        let mut params = TlsParameters::default();
        for (key, field) in [
            (
                "tls_minimum_protocol_version",
                &mut params.tls_minimum_protocol_version,
            ),
            (
                "tls_maximum_protocol_version",
                &mut params.tls_maximum_protocol_version,
            ),
        ] {
            if let Some(v) = p.string(key)? {
                *field = tls_parameters::TlsProtocol::from_str_name(&v).ok_or_else(|| {
                    XdsError::resource(
                        p.at(key),
                        format!("`{v}` is not a TLS version; write TLSv1_2 or TLSv1_3"),
                    )
                })? as i32;
            }
        }
        params.cipher_suites.extend(p.strings("cipher_suites")?);
        p.finish()?;
        c.tls_params = Some(params);
    }
    o.finish()?;
    Ok(c)
}

/// A `validation_context`: the roots and the URI SAN matchers.
fn validation_context_of(mut v: Obj) -> Result<CertificateValidationContext> {
    let mut vc = CertificateValidationContext {
        trusted_ca: v
            .take("trusted_ca")
            .map(|d| data_source_of(d, &v.at("trusted_ca")))
            .transpose()?,
        ..Default::default()
    };
    for (i, m) in v
        .list("match_typed_subject_alt_names")?
        .into_iter()
        .enumerate()
    {
        let mut m = Obj::new(m, &v.at(&format!("match_typed_subject_alt_names[{i}]")))?;
        let mut matcher = SubjectAltNameMatcher::default();
        if let Some(t) = m.string("san_type")? {
            matcher.san_type =
                subject_alt_name_matcher::SanType::from_str_name(&t).ok_or_else(|| {
                    XdsError::resource(
                        m.at("san_type"),
                        format!("`{t}` is not a SAN type; write URI (a SPIFFE ID)"),
                    )
                })? as i32;
        }
        matcher.matcher = m
            .take("matcher")
            .map(|s| string_matcher_of(s, &m.at("matcher")))
            .transpose()?;
        m.finish()?;
        vc.match_typed_subject_alt_names.push(matcher);
    }
    v.finish()?;
    Ok(vc)
}

/// An SDS secret config: its name, and `sds_config: { ads: {} }` if given (any other source is
/// refused here, by its key).
fn sds_secret_config_of(v: Value, path: &str) -> Result<SdsSecretConfig> {
    let mut o = Obj::new(v, path)?;
    let name = o.string("name")?.unwrap_or_default();
    let sds_config = match o.obj("sds_config")? {
        Some(mut source) => {
            let ads = source.obj("ads")?;
            if let Some(v) = source.string("resource_api_version")? {
                if v != "V3" {
                    return Err(XdsError::resource(
                        source.at("resource_api_version"),
                        format!("`{v}` is not supported; write V3 or leave it out"),
                    ));
                }
            }
            let Some(ads) = ads else {
                return Err(XdsError::resource(
                    source.path.clone(),
                    "only `ads: {}` is supported (the secret comes on the node's ADS stream); for files, put the secret in static_resources.secrets and leave sds_config out",
                ));
            };
            ads.finish()?;
            source.finish()?;
            Some(ConfigSource {
                config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
                    Default::default(),
                )),
                ..Default::default()
            })
        }
        None => None,
    };
    o.finish()?;
    Ok(SdsSecretConfig { name, sds_config })
}

/// `static_resources.secrets`: each a `tls_certificate` (certificate_chain, private_key) or a
/// `validation_context` (trusted_ca) given as files, which SDS references in the listeners and
/// clusters name.
fn static_secrets(list: Vec<Value>, path: &str) -> Result<StaticSecrets> {
    let mut secrets = StaticSecrets::default();
    for (i, v) in list.into_iter().enumerate() {
        let mut o = Obj::new(v, &format!("{path}[{i}]"))?;
        let name = o.string("name")?.unwrap_or_default();
        if name.is_empty() {
            return Err(XdsError::resource(
                o.at("name"),
                "is missing; SDS references name the secret",
            ));
        }
        let file = |d: Option<Value>, at: String| -> Result<std::path::PathBuf> {
            let d =
                d.ok_or_else(|| XdsError::resource(&at, "is missing; give { filename: PATH }"))?;
            match data_source_of(d, &at)?.specifier {
                Some(data_source::Specifier::Filename(f)) if !f.is_empty() => Ok(f.into()),
                _ => Err(XdsError::resource(
                    at,
                    "only { filename: PATH } is supported in a static secret: write the PEM to a file",
                )),
            }
        };
        if secrets.certificates.contains_key(&name) || secrets.roots.contains_key(&name) {
            return Err(XdsError::resource(
                o.at("name"),
                format!("`{name}` is given twice"),
            ));
        }
        if let Some(mut t) = o.obj("tls_certificate")? {
            let cert = file(t.take("certificate_chain"), t.at("certificate_chain"))?;
            let key = file(t.take("private_key"), t.at("private_key"))?;
            t.finish()?;
            secrets.certificates.insert(name, (cert, key));
        } else if let Some(mut v) = o.obj("validation_context")? {
            let ca = file(v.take("trusted_ca"), v.at("trusted_ca"))?;
            if v.take("match_typed_subject_alt_names").is_some() {
                return Err(XdsError::resource(
                    v.at("match_typed_subject_alt_names"),
                    "is not taken from a secret: flatmesh takes the SPIFFE IDs from the TLS context; put them in combined_validation_context.default_validation_context",
                ));
            }
            v.finish()?;
            secrets.roots.insert(name, ca);
        } else {
            return Err(XdsError::resource(
                o.path.clone(),
                "has neither tls_certificate nor validation_context; those are the secrets flatmesh takes",
            ));
        }
        o.finish()?;
    }
    Ok(secrets)
}

/// The bootstrap's static secrets, by name.
#[derive(Debug, Default)]
pub struct StaticSecrets {
    certificates: HashMap<String, (std::path::PathBuf, std::path::PathBuf)>,
    roots: HashMap<String, std::path::PathBuf>,
}

impl crate::tls::SecretFiles for StaticSecrets {
    fn certificate(&self, name: &str) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
        self.certificates.get(name).cloned()
    }
    fn trusted_ca(&self, name: &str) -> Option<std::path::PathBuf> {
        self.roots.get(name).cloned()
    }
}

/// A DataSource. Only `filename` translates; the others are kept for the translation to refuse
/// by name (`inline_bytes` keeps its base64 text undecoded: it is never used).
fn data_source_of(v: Value, path: &str) -> Result<DataSource> {
    let mut o = Obj::new(v, path)?;
    let specifier = if let Some(f) = o.string("filename")? {
        Some(data_source::Specifier::Filename(f))
    } else if let Some(s) = o.string("inline_string")? {
        Some(data_source::Specifier::InlineString(s))
    } else if let Some(b) = o.string("inline_bytes")? {
        Some(data_source::Specifier::InlineBytes(b.into_bytes()))
    } else {
        o.string("environment_variable")?
            .map(data_source::Specifier::EnvironmentVariable)
    };
    o.finish()?;
    Ok(DataSource {
        specifier,
        ..Default::default()
    })
}
