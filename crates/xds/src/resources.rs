//! The xDS resources a node holds, by type, and the Any wrapping they travel in.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::google::protobuf::Any;
use prost::{Message, Name};

use crate::error::{Result, XdsError};

pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
/// SDS: certificates, keys and trust bundles, per node (docs/security.md, "SDS").
pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// The four resource types, in the order a server should send them (CDS, EDS, LDS, RDS), so a
/// cluster exists before the endpoints and routes that use it.
pub const ORDER: [&str; 4] = [CLUSTER, ENDPOINT, LISTENER, ROUTE];

/// A short name for logs: `LDS`, `RDS`, `CDS`, `EDS`.
pub fn short(type_url: &str) -> &'static str {
    match type_url {
        LISTENER => "LDS",
        ROUTE => "RDS",
        CLUSTER => "CDS",
        ENDPOINT => "EDS",
        SECRET => "SDS",
        _ => "unknown",
    }
}

/// Everything one node has been told, keyed by resource name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    pub listeners: BTreeMap<String, Listener>,
    pub routes: BTreeMap<String, RouteConfiguration>,
    pub clusters: BTreeMap<String, Cluster>,
    /// Keyed by `cluster_name` (the EDS service name).
    pub endpoints: BTreeMap<String, ClusterLoadAssignment>,
    /// SDS secrets the node holds (the xDS client only; the server makes them per node).
    pub secrets: BTreeMap<String, Secret>,
}

/// One decoded resource of any supported type. (Short-lived, one per decoded Any: the size
/// difference between variants costs nothing worth boxing for.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Resource {
    Listener(Listener),
    Route(RouteConfiguration),
    Cluster(Cluster),
    Endpoint(ClusterLoadAssignment),
    Secret(Secret),
}

impl Resource {
    pub fn name(&self) -> &str {
        match self {
            Resource::Listener(r) => &r.name,
            Resource::Route(r) => &r.name,
            Resource::Cluster(r) => &r.name,
            Resource::Endpoint(r) => &r.cluster_name,
            Resource::Secret(r) => &r.name,
        }
    }

    /// Decode an Any of one of the four types; `expected` is the type the response announced.
    pub fn decode(any: &Any, expected: &str) -> Result<Resource> {
        if any.type_url != expected {
            return Err(XdsError::resource(
                format!("{} response", short(expected)),
                format!(
                    "carries a resource of type `{}`; every resource must be `{expected}`",
                    any.type_url
                ),
            ));
        }
        let bad = |e: prost::DecodeError| {
            XdsError::resource(
                format!("{} resource", short(expected)),
                format!("is not a valid protobuf message: {e}"),
            )
        };
        let value = any.value.as_slice();
        Ok(match expected {
            LISTENER => Resource::Listener(Listener::decode(value).map_err(bad)?),
            ROUTE => Resource::Route(RouteConfiguration::decode(value).map_err(bad)?),
            CLUSTER => Resource::Cluster(Cluster::decode(value).map_err(bad)?),
            ENDPOINT => Resource::Endpoint(ClusterLoadAssignment::decode(value).map_err(bad)?),
            SECRET => Resource::Secret(Secret::decode(value).map_err(bad)?),
            other => {
                return Err(XdsError::resource(
                    "response",
                    format!(
                        "type `{other}` is not one flatmesh subscribes to (LDS, RDS, CDS, EDS, SDS)"
                    ),
                ))
            }
        })
    }

    pub fn type_url(&self) -> &'static str {
        match self {
            Resource::Listener(_) => LISTENER,
            Resource::Route(_) => ROUTE,
            Resource::Cluster(_) => CLUSTER,
            Resource::Endpoint(_) => ENDPOINT,
            Resource::Secret(_) => SECRET,
        }
    }

    pub fn to_any(&self) -> Any {
        match self {
            Resource::Listener(r) => pack(r),
            Resource::Route(r) => pack(r),
            Resource::Cluster(r) => pack(r),
            Resource::Endpoint(r) => pack(r),
            Resource::Secret(r) => pack(r),
        }
    }
}

pub fn pack<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

impl Resources {
    /// The resources of one type as (name, Resource), sorted by name.
    pub fn of_type(&self, type_url: &str) -> Vec<Resource> {
        match type_url {
            LISTENER => self
                .listeners
                .values()
                .cloned()
                .map(Resource::Listener)
                .collect(),
            ROUTE => self.routes.values().cloned().map(Resource::Route).collect(),
            CLUSTER => self
                .clusters
                .values()
                .cloned()
                .map(Resource::Cluster)
                .collect(),
            ENDPOINT => self
                .endpoints
                .values()
                .cloned()
                .map(Resource::Endpoint)
                .collect(),
            SECRET => self
                .secrets
                .values()
                .cloned()
                .map(Resource::Secret)
                .collect(),
            _ => Vec::new(),
        }
    }

    pub fn insert(&mut self, resource: Resource) {
        match resource {
            Resource::Listener(r) => {
                self.listeners.insert(r.name.clone(), r);
            }
            Resource::Route(r) => {
                self.routes.insert(r.name.clone(), r);
            }
            Resource::Cluster(r) => {
                self.clusters.insert(r.name.clone(), r);
            }
            Resource::Endpoint(r) => {
                self.endpoints.insert(r.cluster_name.clone(), r);
            }
            Resource::Secret(r) => {
                self.secrets.insert(r.name.clone(), r);
            }
        }
    }

    /// Insert `resource`, returning the one of the same type and name it replaces.
    pub fn put(&mut self, resource: Resource) -> Option<Resource> {
        match resource {
            Resource::Listener(r) => self
                .listeners
                .insert(r.name.clone(), r)
                .map(Resource::Listener),
            Resource::Route(r) => self.routes.insert(r.name.clone(), r).map(Resource::Route),
            Resource::Cluster(r) => self
                .clusters
                .insert(r.name.clone(), r)
                .map(Resource::Cluster),
            Resource::Endpoint(r) => self
                .endpoints
                .insert(r.cluster_name.clone(), r)
                .map(Resource::Endpoint),
            Resource::Secret(r) => self.secrets.insert(r.name.clone(), r).map(Resource::Secret),
        }
    }

    /// Remove and return the resource of `type_url` named `name`.
    pub fn take(&mut self, type_url: &str, name: &str) -> Option<Resource> {
        match type_url {
            LISTENER => self.listeners.remove(name).map(Resource::Listener),
            ROUTE => self.routes.remove(name).map(Resource::Route),
            CLUSTER => self.clusters.remove(name).map(Resource::Cluster),
            ENDPOINT => self.endpoints.remove(name).map(Resource::Endpoint),
            SECRET => self.secrets.remove(name).map(Resource::Secret),
            _ => None,
        }
    }

    pub fn remove(&mut self, type_url: &str, name: &str) {
        match type_url {
            LISTENER => drop(self.listeners.remove(name)),
            ROUTE => drop(self.routes.remove(name)),
            CLUSTER => drop(self.clusters.remove(name)),
            ENDPOINT => drop(self.endpoints.remove(name)),
            SECRET => drop(self.secrets.remove(name)),
            _ => {}
        }
    }

    /// Drop every resource of `type_url` (a state-of-the-world LDS/CDS response replaces them all).
    pub fn clear(&mut self, type_url: &str) {
        match type_url {
            LISTENER => self.listeners.clear(),
            ROUTE => self.routes.clear(),
            CLUSTER => self.clusters.clear(),
            ENDPOINT => self.endpoints.clear(),
            SECRET => self.secrets.clear(),
            _ => {}
        }
    }

    /// Names of the route configurations the listeners ask for over RDS.
    pub fn wanted_routes(&self) -> std::collections::BTreeSet<String> {
        self.listeners
            .values()
            .flat_map(|l| l.filter_chains.iter())
            .flat_map(|c| c.filters.iter())
            .filter_map(crate::to_model::rds_name)
            .collect()
    }

    /// Names of the ClusterLoadAssignments the EDS clusters ask for.
    pub fn wanted_endpoints(&self) -> std::collections::BTreeSet<String> {
        self.clusters
            .values()
            .filter_map(crate::to_model::eds_name)
            .collect()
    }

    /// Names of the SDS secrets the listeners' and clusters' TLS contexts refer to.
    pub fn wanted_secrets(&self) -> std::collections::BTreeSet<String> {
        let listeners = self
            .listeners
            .values()
            .flat_map(|l| l.filter_chains.iter())
            .filter_map(|c| c.transport_socket.as_ref());
        let clusters = self
            .clusters
            .values()
            .filter_map(|c| c.transport_socket.as_ref());
        listeners
            .chain(clusters)
            .flat_map(crate::tls::secret_names)
            .collect()
    }

    /// Names of the resources of `type_url` held now.
    pub fn names(&self, type_url: &str) -> Vec<String> {
        match type_url {
            LISTENER => self.listeners.keys().cloned().collect(),
            ROUTE => self.routes.keys().cloned().collect(),
            CLUSTER => self.clusters.keys().cloned().collect(),
            ENDPOINT => self.endpoints.keys().cloned().collect(),
            SECRET => self.secrets.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }
}
