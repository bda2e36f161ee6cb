//! Finding the fields of a protobuf message that are set although flatmesh does not support them.
//!
//! prost generates no reflection and envoy-types ships no descriptor API, so the names come from
//! the derived `Debug` output: each translator moves the fields it understands out of a clone of
//! the message, and whatever top-level field still differs from the default is unsupported. This
//! names the exact field in a NACK without hand-listing the hundreds of fields Envoy's messages have.

use std::fmt::Debug;

/// The names of the top-level fields of `rest` that are not at their default value.
///
/// The common case, nothing left over, is one derived `==` against the default; the `Debug`
/// text (slow: it formats the whole message) is only made to name what is left.
pub fn set_fields<T: Debug + Default + PartialEq>(rest: &T) -> Vec<String> {
    if *rest == T::default() {
        return Vec::new();
    }
    let now = top_level_fields(&format!("{rest:#?}"));
    let default = top_level_fields(&format!("{:#?}", T::default()));
    now.into_iter()
        .filter(|(name, value)| {
            default
                .iter()
                .find(|(n, _)| n == name)
                .is_none_or(|(_, v)| v != value)
        })
        .map(|(name, _)| name)
        .collect()
}

/// Splits pretty `Debug` output (`Name {\n    field: value,\n ...}`) into (field, value text).
fn top_level_fields(text: &str) -> Vec<(String, String)> {
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in text.lines().skip(1) {
        let is_field = line.starts_with("    ") && !line.starts_with("     ");
        match line.strip_prefix("    ").and_then(|l| l.split_once(": ")) {
            Some((name, value)) if is_field && !name.contains(' ') => {
                fields.push((name.to_string(), value.to_string()))
            }
            _ => {
                if let Some(last) = fields.last_mut() {
                    last.1.push('\n');
                    last.1.push_str(line);
                }
            }
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use envoy_types::pb::envoy::config::cluster::v3::{CircuitBreakers, Cluster};

    #[test]
    fn names_only_the_fields_that_are_set() {
        let mut c = Cluster::default();
        assert!(set_fields(&c).is_empty());
        c.circuit_breakers = Some(CircuitBreakers::default());
        c.respect_dns_ttl = true;
        let mut set = set_fields(&c);
        set.sort();
        assert_eq!(set, ["circuit_breakers", "respect_dns_ttl"]);
    }
}
