//! Envoy's `ORIGINAL_DST` cluster type as flatmesh's `type: original_dst`.
//!
//! Envoy's cluster has no allow-list: it forwards to whatever address a connection was
//! going to. A cluster imported without flatmesh's metadata gets that behaviour written out,
//! `allow: [0.0.0.0/0, ::/0]` (the node still refuses a destination that is the node
//! itself). flatmesh's own xDS server sends its allow-list and `max_destinations` along in
//! the cluster's metadata, `filter_metadata["flatmesh.original_dst"]`, so they survive the
//! trip.

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use flatmesh_config::Cidr;

use crate::error::{Result, XdsError};
use crate::hbone::{string, take_field};

/// The metadata key of an original_dst cluster's flatmesh settings.
pub const METADATA_KEY: &str = "flatmesh.original_dst";

/// The allow-list and `max_destinations` of an original_dst cluster, as its metadata.
pub fn metadata(allow: &[Cidr], max_destinations: Option<u32>) -> Metadata {
    let mut fields = std::collections::BTreeMap::new();
    let list = allow
        .iter()
        .map(|c| Value {
            kind: Some(Kind::StringValue(c.to_string())),
        })
        .collect();
    fields.insert(
        "allow".to_string(),
        Value {
            kind: Some(Kind::ListValue(ListValue { values: list })),
        },
    );
    if let Some(n) = max_destinations {
        fields.insert(
            "max_destinations".to_string(),
            Value {
                kind: Some(Kind::NumberValue(f64::from(n))),
            },
        );
    }
    let mut m = Metadata::default();
    m.filter_metadata.insert(
        METADATA_KEY.to_string(),
        Struct {
            fields: fields.into_iter().collect(),
        },
    );
    m
}

/// Takes an original_dst cluster's settings out of its metadata: its allow-list (Envoy's
/// behaviour, every address, without one) and `max_destinations`.
pub fn take(m: &mut Option<Metadata>, at: &str) -> Result<(Vec<Cidr>, Option<u32>)> {
    let here = |field: &str| format!("{at}.metadata.filter_metadata[\"{METADATA_KEY}\"].{field}");
    let allow = match take_field(m, METADATA_KEY, "allow") {
        None => vec![Cidr::ANY_V4, Cidr::ANY_V6],
        Some(Value {
            kind: Some(Kind::ListValue(list)),
        }) => list
            .values
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                let at = format!("{}[{i}]", here("allow"));
                string(v, &at)?
                    .parse::<Cidr>()
                    .map_err(|why| XdsError::resource(at, why))
            })
            .collect::<Result<_>>()?,
        Some(_) => {
            return Err(XdsError::resource(
                here("allow"),
                "is not a list of address prefixes such as 10.0.0.0/8",
            ))
        }
    };
    let max_destinations = match take_field(m, METADATA_KEY, "max_destinations") {
        None => None,
        Some(Value {
            kind: Some(Kind::NumberValue(n)),
        }) if n.fract() == 0.0 && (1.0..=f64::from(u32::MAX)).contains(&n) => Some(n as u32),
        Some(_) => {
            return Err(XdsError::resource(
                here("max_destinations"),
                "is not a whole number of destinations (1 or more)",
            ))
        }
    };
    Ok((allow, max_destinations))
}
