//! HBONE in Envoy's terms: the names and the metadata that [`crate::from_model`] writes and
//! [`crate::to_model`] reads (docs/xds.md, "HBONE").
//!
//! **Origination.** A cluster with `tunnel: hbone` is, in Envoy, an HTTP/2 cluster
//! (`HttpProtocolOptions` with `explicit_http_config.http2_protocol_options`) with an
//! `UpstreamTlsContext`, whose endpoints are the peers' tunnel ports; a `tcp_proxy` in front of
//! it carries each connection as a CONNECT (`tunneling_config`). What the CONNECT names:
//! - a fixed `IP:PORT` in `tunneling_config.hostname`: the cluster's endpoints must all be that
//!   IP (flatmesh tunnels to the destination's own address at the tunnel port, as ztunnel does),
//!   so the flatmesh cluster has that one destination;
//! - `%DOWNSTREAM_LOCAL_ADDRESS%`, with each endpoint's destination in Istio's tunnel metadata
//!   (`filter_metadata["envoy.filters.listener.original_dst"].local`). That is how Istio writes a
//!   waypoint's endpoints; Istio's internal listener turns that metadata into the downstream
//!   local address, which flatmesh reads directly.
//!
//! flatmesh writes the metadata on every tunnel endpoint (so the cluster says it tunnels, for
//! http routes too), and a fixed hostname when the cluster has one endpoint, which a plain Envoy
//! runs exactly as flatmesh does.
//!
//! **Termination.** A `protocol: hbone` listener is, in Envoy, an HTTP connection manager on a
//! mutual-TLS filter chain with `upgrade_configs: [{ upgrade_type: CONNECT }]` and one route that
//! matches CONNECT (`connect_matcher`) and terminates it (`upgrade_configs: [{ upgrade_type:
//! CONNECT, connect_config: {} }]`) into an `ORIGINAL_DST` cluster that takes the destination
//! from `:authority`. The listener's `hbone.destinations` travel as that route's metadata
//! (`filter_metadata["flatmesh.hbone"].destinations`); without it a tunnel reaches loopback only.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

use crate::error::{Result, XdsError};

/// Istio's key for an endpoint's tunnel destination (the original_dst listener filter's).
pub const TUNNEL_METADATA_KEY: &str = "envoy.filters.listener.original_dst";
/// The field of [`TUNNEL_METADATA_KEY`] that holds the destination `IP:PORT`.
pub const TUNNEL_METADATA_FIELD: &str = "local";
/// flatmesh's own metadata: an hbone route's `destinations`, a tunnel cluster's inner `protocol`.
pub const FLATMESH_METADATA_KEY: &str = "flatmesh.hbone";
/// The tunneling hostname that names each connection's own destination.
pub const DOWNSTREAM_LOCAL_ADDRESS: &str = "%DOWNSTREAM_LOCAL_ADDRESS%";
/// The upgrade type of HBONE's CONNECT.
pub const CONNECT: &str = "CONNECT";
/// The header an hbone listener's ORIGINAL_DST cluster takes the destination from.
pub const AUTHORITY: &str = ":authority";

/// The name of the ORIGINAL_DST cluster an hbone listener's CONNECT route goes to.
pub fn termination_cluster(listener: &str) -> String {
    format!("{listener}.hbone")
}

/// Where a tunnel to `destination` goes: the destination's own IP at the tunnel port.
pub fn peer(destination: SocketAddr, tunnel_port: u16) -> SocketAddr {
    SocketAddr::new(destination.ip(), tunnel_port)
}

fn metadata(key: &str, field: &str, value: Kind) -> Metadata {
    let mut fields = std::collections::BTreeMap::new();
    fields.insert(field.to_string(), Value { kind: Some(value) });
    let mut m = Metadata::default();
    m.filter_metadata.insert(
        key.to_string(),
        Struct {
            fields: fields.into_iter().collect(),
        },
    );
    m
}

/// A tunnel endpoint's metadata: its destination, in Istio's terms.
pub fn endpoint_metadata(destination: SocketAddr) -> Metadata {
    metadata(
        TUNNEL_METADATA_KEY,
        TUNNEL_METADATA_FIELD,
        Kind::StringValue(destination.to_string()),
    )
}

/// A tunnel cluster's metadata when the protocol inside its tunnels is HTTP/2 (the cluster's
/// own `HttpProtocolOptions` are the tunnel's, always HTTP/2).
pub fn inner_http2_metadata() -> Metadata {
    metadata(
        FLATMESH_METADATA_KEY,
        "protocol",
        Kind::StringValue("http2".into()),
    )
}

/// An hbone route's metadata: the destinations its tunnels may reach.
pub fn destinations_metadata(destinations: &[String]) -> Metadata {
    metadata(
        FLATMESH_METADATA_KEY,
        "destinations",
        Kind::ListValue(ListValue {
            values: destinations
                .iter()
                .map(|d| Value {
                    kind: Some(Kind::StringValue(d.clone())),
                })
                .collect(),
        }),
    )
}

/// Takes `key`.`field` out of `m` (dropping `key` when it is left empty).
pub(crate) fn take_field(m: &mut Option<Metadata>, key: &str, field: &str) -> Option<Value> {
    let meta = m.as_mut()?;
    let s = meta.filter_metadata.get_mut(key)?;
    let value = s.fields.remove(field);
    if s.fields.is_empty() {
        meta.filter_metadata.remove(key);
    }
    if meta == &Metadata::default() {
        *m = None;
    }
    value
}

pub(crate) fn string(value: Value, at: &str) -> Result<String> {
    match value.kind {
        Some(Kind::StringValue(s)) => Ok(s),
        _ => Err(XdsError::resource(at, "is not a string")),
    }
}

/// An `IP:PORT` that a tunnel names (a CONNECT's `:authority`).
pub fn destination(text: &str, at: &str) -> Result<SocketAddr> {
    text.parse().map_err(|_| {
        XdsError::resource(
            at,
            format!("is `{text}`, not an IP:PORT: an HBONE tunnel names its destination's address (flatmesh does not resolve names)"),
        )
    })
}

/// An endpoint's tunnel destination, taken out of its metadata (the other metadata of an
/// endpoint stays, and is dropped by the caller as before). `address` is where Envoy
/// connects: it must be the destination's own IP.
pub fn take_endpoint_destination(
    m: &mut Option<Metadata>,
    address: SocketAddr,
    at: &str,
) -> Result<Option<SocketAddr>> {
    let here =
        format!("{at}.metadata.filter_metadata[\"{TUNNEL_METADATA_KEY}\"].{TUNNEL_METADATA_FIELD}");
    let Some(value) = take_field(m, TUNNEL_METADATA_KEY, TUNNEL_METADATA_FIELD) else {
        return Ok(None);
    };
    let d = destination(&string(value, &here)?, &here)?;
    if d.ip() != address.ip() {
        return Err(XdsError::resource(
            here,
            format!("is {d}, but the endpoint's address is {address}: flatmesh tunnels to the destination's own IP at the tunnel port; make the endpoint {}", peer(d, address.port())),
        ));
    }
    Ok(Some(d))
}

/// A tunnel cluster's inner protocol from its metadata: HTTP/2 when it says so, else HTTP/1.1.
pub fn take_inner_protocol(
    m: &mut Option<Metadata>,
    at: &str,
) -> Result<flatmesh_config::UpstreamProtocol> {
    let here = format!("{at}.metadata.filter_metadata[\"{FLATMESH_METADATA_KEY}\"].protocol");
    match take_field(m, FLATMESH_METADATA_KEY, "protocol") {
        None => Ok(flatmesh_config::UpstreamProtocol::Http1),
        Some(v) => match string(v, &here)?.as_str() {
            "http2" => Ok(flatmesh_config::UpstreamProtocol::Http2),
            "http1" => Ok(flatmesh_config::UpstreamProtocol::Http1),
            other => Err(XdsError::resource(
                here,
                format!("is `{other}`; write http1 or http2"),
            )),
        },
    }
}

/// An hbone route's destinations from its metadata (none: loopback only).
pub fn take_destinations(m: &mut Option<Metadata>, at: &str) -> Result<Vec<String>> {
    let here = format!("{at}.metadata.filter_metadata[\"{FLATMESH_METADATA_KEY}\"].destinations");
    match take_field(m, FLATMESH_METADATA_KEY, "destinations") {
        None => Ok(Vec::new()),
        Some(Value {
            kind: Some(Kind::ListValue(list)),
        }) => list
            .values
            .into_iter()
            .enumerate()
            .map(|(i, v)| string(v, &format!("{here}[{i}]")))
            .collect(),
        Some(_) => Err(XdsError::resource(
            here,
            "is not a list of address blocks, IPs or IP:PORTs",
        )),
    }
}

/// What a tcp_proxy's `tunneling_config.hostname` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hostname {
    /// One fixed destination.
    Fixed(SocketAddr),
    /// Each connection's own: the cluster's endpoints carry their destinations.
    PerEndpoint,
}

/// A tcp listener's tunnel through a cluster, checked against the cluster once both are known.
#[derive(Debug, Clone)]
pub struct TunnelUse {
    pub cluster: String,
    pub hostname: Hostname,
    /// Names the `tunneling_config`.
    pub at: String,
}

/// Reads a `tunneling_config.hostname` (`at` names it).
pub fn hostname(text: &str, at: &str) -> Result<Hostname> {
    if text == DOWNSTREAM_LOCAL_ADDRESS {
        return Ok(Hostname::PerEndpoint);
    }
    if text.contains('%') {
        return Err(XdsError::resource(
            at,
            format!("is `{text}`; flatmesh takes a fixed IP:PORT or {DOWNSTREAM_LOCAL_ADDRESS} (with the endpoints' destinations in their `{TUNNEL_METADATA_KEY}` metadata) here"),
        ));
    }
    Ok(Hostname::Fixed(destination(text, at)?))
}

/// Makes `cluster` what `tunnel` says: a tunnel cluster. A cluster that is not one yet (its
/// endpoints carry no destinations) takes the fixed destination; its endpoints must all be
/// that destination's IP at one tunnel port.
pub fn apply(cluster: &mut flatmesh_config::Cluster, tunnel: &TunnelUse) -> Result<()> {
    use flatmesh_config as model;
    let at = format!("{}.hostname", tunnel.at);
    match (&tunnel.hostname, cluster.tunnel.is_some()) {
        (Hostname::PerEndpoint, true) => Ok(()),
        (Hostname::PerEndpoint, false) => Err(XdsError::resource(
            at,
            format!("is {DOWNSTREAM_LOCAL_ADDRESS}, but the endpoints of cluster `{}` carry no destination: give each endpoint its destination in metadata (filter_metadata: {{ {TUNNEL_METADATA_KEY}: {{ {TUNNEL_METADATA_FIELD}: IP:PORT }} }}), or write a fixed IP:PORT", cluster.name),
        )),
        (Hostname::Fixed(d), true) => {
            let destinations: Vec<SocketAddr> =
                cluster.endpoints.entries().iter().map(|e| e.address).collect();
            if destinations.iter().all(|e| e == d) {
                Ok(())
            } else {
                Err(XdsError::resource(
                    at,
                    format!("is {d}, but the endpoints of cluster `{}` name other destinations in their metadata; write {DOWNSTREAM_LOCAL_ADDRESS}", cluster.name),
                ))
            }
        }
        (Hostname::Fixed(d), false) => {
            let entries = cluster.endpoints.entries();
            let Some(first) = entries.first() else {
                return Ok(()); // not arrived yet (EDS): the tunnel is made when they do
            };
            let port = first.address.port();
            if let Some(other) = entries
                .iter()
                .find(|e| e.address.ip() != d.ip() || e.address.port() != port)
            {
                return Err(XdsError::resource(
                    at,
                    format!("is {d}, but cluster `{}` has endpoint {}: flatmesh tunnels to the destination's own IP at one tunnel port, so every endpoint must be {}", cluster.name, other.address, peer(*d, port)),
                ));
            }
            let mut endpoint = first.clone();
            endpoint.address = *d;
            cluster.endpoints = vec![endpoint].into();
            cluster.tunnel = Some(model::Tunnel::Hbone);
            cluster.tunnel_port = (port != model::HBONE_PORT).then_some(port);
            // The cluster's HTTP/2 options were the tunnel's; a tcp relay has no inner protocol.
            cluster.protocol = model::UpstreamProtocol::Http1;
            Ok(())
        }
    }
}
