//! A cluster's `endpoints:` list. Each entry is an address (`127.0.0.1:9001`) or a mapping
//! `{ address, weight, priority, locality }`. Most of the code base only needs the addresses,
//! so [`Endpoints`] reads as a slice of them (`Deref`); the load balancer also reads each
//! entry's [`Endpoint`] attributes.

use std::net::SocketAddr;
use std::ops::Deref;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Envoy's bound on an endpoint's `load_balancing_weight`.
pub const MAX_ENDPOINT_WEIGHT: u32 = 128;

/// One endpoint and how the load balancer treats it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    pub address: SocketAddr,
    /// Its share of its priority level's traffic, relative to the others (1..=128, default 1).
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// 0 (the default) is the highest; a lower level takes traffic only as far as the
    /// higher ones are unhealthy.
    #[serde(default)]
    pub priority: u32,
    /// `region/zone/subzone` (leading parts alone are fine: `us-east1`, `us-east1/b`);
    /// endpoints in the node's own locality are preferred within a priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<String>,
}

fn default_weight() -> u32 {
    1
}

impl Endpoint {
    /// An endpoint with every attribute at its default.
    pub fn new(address: SocketAddr) -> Endpoint {
        Endpoint {
            address,
            weight: default_weight(),
            priority: 0,
            locality: None,
        }
    }

    /// Whether the entry is a plain address (every attribute at its default).
    pub fn is_plain(&self) -> bool {
        *self == Endpoint::new(self.address)
    }
}

/// A cluster's endpoints in config order: a slice of addresses to most readers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoints {
    entries: Vec<Endpoint>,
    addresses: Vec<SocketAddr>,
}

impl Endpoints {
    /// The entries with their attributes.
    pub fn entries(&self) -> &[Endpoint] {
        &self.entries
    }

    /// Whether some entry sets a weight, priority or locality.
    pub fn has_attributes(&self) -> bool {
        self.entries.iter().any(|e| !e.is_plain())
    }
}

impl Deref for Endpoints {
    type Target = [SocketAddr];

    fn deref(&self) -> &[SocketAddr] {
        &self.addresses
    }
}

impl From<Vec<Endpoint>> for Endpoints {
    fn from(entries: Vec<Endpoint>) -> Endpoints {
        let addresses = entries.iter().map(|e| e.address).collect();
        Endpoints { entries, addresses }
    }
}

impl From<Vec<SocketAddr>> for Endpoints {
    fn from(addresses: Vec<SocketAddr>) -> Endpoints {
        addresses.into_iter().collect()
    }
}

impl FromIterator<SocketAddr> for Endpoints {
    fn from_iter<I: IntoIterator<Item = SocketAddr>>(iter: I) -> Endpoints {
        iter.into_iter().map(Endpoint::new).collect()
    }
}

impl FromIterator<Endpoint> for Endpoints {
    fn from_iter<I: IntoIterator<Item = Endpoint>>(iter: I) -> Endpoints {
        Endpoints::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl PartialEq<Vec<SocketAddr>> for Endpoints {
    fn eq(&self, other: &Vec<SocketAddr>) -> bool {
        self.addresses == *other
    }
}

impl PartialEq<Endpoints> for Vec<SocketAddr> {
    fn eq(&self, other: &Endpoints) -> bool {
        *self == other.addresses
    }
}

impl Serialize for Endpoints {
    /// A plain entry as its address, the others as mappings: what the YAML would say.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(untagged)]
        enum Entry<'a> {
            Plain(&'a SocketAddr),
            Full(&'a Endpoint),
        }
        s.collect_seq(self.entries.iter().map(|e| {
            if e.is_plain() {
                Entry::Plain(&e.address)
            } else {
                Entry::Full(e)
            }
        }))
    }
}

impl<'de> Deserialize<'de> for Endpoints {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Endpoints, D::Error> {
        struct List;
        impl<'de> Visitor<'de> for List {
            type Value = Endpoints;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of endpoints")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Endpoints, A::Error> {
                let mut entries = Vec::new();
                while let Some(Entry(e)) = seq.next_element()? {
                    entries.push(e);
                }
                Ok(Endpoints::from(entries))
            }
        }
        d.deserialize_seq(List)
    }
}

/// One list entry: an address or a mapping.
struct Entry(Endpoint);

impl<'de> Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Entry, D::Error> {
        struct One;
        impl<'de> Visitor<'de> for One {
            type Value = Entry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an address (IP:PORT) or { address, weight, priority, locality }")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Entry, E> {
                // The same message a plain SocketAddr field gives (decode.rs explains it).
                text.parse()
                    .map(|a| Entry(Endpoint::new(a)))
                    .map_err(|_| E::custom(format!("invalid socket address `{text}`")))
            }
            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<Entry, M::Error> {
                Endpoint::deserialize(de::value::MapAccessDeserializer::new(map)).map(Entry)
            }
        }
        d.deserialize_any(One)
    }
}
