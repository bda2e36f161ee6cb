//! SPIFFE IDs (`spiffe://TRUST_DOMAIN/PATH`) and the patterns that allow them.
//!
//! The rules are the SPIFFE ID specification's: a trust domain of lower-case letters, digits,
//! `.`, `-` and `_`; a path of non-empty segments of letters, digits, `.`, `-` and `_`, none of
//! them `.` or `..`; no query, fragment, port, user info or trailing slash; at most 2,048
//! bytes in all. Workloads in flatmesh are named `spiffe://TD/ns/NAMESPACE/sa/SERVICE_ACCOUNT`
//! (the Istio and Linkerd convention), but any valid path is accepted.

use crate::error::IdentityError;
use std::fmt;

/// The longest SPIFFE ID the specification allows.
pub const MAX_ID_BYTES: usize = 2048;
/// The longest trust domain the specification allows.
pub const MAX_TRUST_DOMAIN_BYTES: usize = 255;

const SCHEME: &str = "spiffe://";

/// A valid SPIFFE ID.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    /// The whole ID, `spiffe://td/path`.
    text: String,
    /// Length of `spiffe://td`.
    domain_end: usize,
}

fn bad(text: &str, why: impl Into<String>) -> IdentityError {
    IdentityError::BadSpiffeId {
        id: text.chars().take(200).collect(),
        why: why.into(),
    }
}

/// Checks a trust domain name.
pub fn check_trust_domain(domain: &str) -> Result<(), String> {
    if domain.is_empty() {
        return Err("the trust domain is empty".into());
    }
    if domain.len() > MAX_TRUST_DOMAIN_BYTES {
        return Err(format!(
            "the trust domain is {} bytes long; at most {MAX_TRUST_DOMAIN_BYTES} are allowed",
            domain.len()
        ));
    }
    if let Some(c) = domain
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-' | '_')))
    {
        return Err(format!(
            "the trust domain has `{}`: only lower-case letters, digits, `.`, `-` and `_` are allowed (a port, user info or upper case is not)",
            c.escape_default()
        ));
    }
    Ok(())
}

fn check_segment(segment: &str) -> Result<(), String> {
    if segment.is_empty() {
        return Err("the path has an empty segment (`//` or a trailing `/`)".into());
    }
    if segment == "." || segment == ".." {
        return Err(format!("the path has a `{segment}` segment"));
    }
    if let Some(c) = segment
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        return Err(format!(
            "the path has `{}`: segments hold only letters, digits, `.`, `-` and `_` (no query, fragment or percent-encoding)",
            c.escape_default()
        ));
    }
    Ok(())
}

/// The namespace of flatmesh's own identities (the nodes').
pub const SYSTEM_NAMESPACE: &str = "flatmesh-system";

impl SpiffeId {
    /// Parses and checks `text`.
    pub fn parse(text: &str) -> Result<SpiffeId, IdentityError> {
        if text.len() > MAX_ID_BYTES {
            return Err(bad(
                text,
                format!(
                    "it is {} bytes long; at most {MAX_ID_BYTES} are allowed",
                    text.len()
                ),
            ));
        }
        let rest = text.strip_prefix(SCHEME).ok_or_else(|| {
            bad(
                text,
                "it must start with `spiffe://` (lower case), like spiffe://example.org/ns/default/sa/web",
            )
        })?;
        let (domain, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, ""),
        };
        check_trust_domain(domain).map_err(|why| bad(text, why))?;
        if !path.is_empty() {
            for segment in path[1..].split('/') {
                check_segment(segment).map_err(|why| bad(text, why))?;
            }
        }
        Ok(SpiffeId {
            text: text.to_string(),
            domain_end: SCHEME.len() + domain.len(),
        })
    }

    /// The ID of a workload: `spiffe://TD/ns/NAMESPACE/sa/SERVICE_ACCOUNT`.
    pub fn workload(
        trust_domain: &str,
        namespace: &str,
        service_account: &str,
    ) -> Result<SpiffeId, IdentityError> {
        SpiffeId::parse(&format!(
            "{SCHEME}{trust_domain}/ns/{namespace}/sa/{service_account}"
        ))
    }

    /// The node's own identity, which its control center issues to it alone:
    /// `spiffe://TD/ns/flatmesh-system/sa/node/NODE_ID` (a node id of several segments, like
    /// `r0-s0/host`, keeps its `/`s). `spiffe://TD/ns/flatmesh-system/*` admits every node.
    pub fn node(trust_domain: &str, node_id: &str) -> Result<SpiffeId, IdentityError> {
        SpiffeId::parse(&format!(
            "{SCHEME}{trust_domain}/ns/{SYSTEM_NAMESPACE}/sa/node/{node_id}"
        ))
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn trust_domain(&self) -> &str {
        &self.text[SCHEME.len()..self.domain_end]
    }

    /// The path, with its leading `/` (empty for a trust domain's own ID).
    pub fn path(&self) -> &str {
        &self.text[self.domain_end..]
    }

    /// `NAMESPACE` of a `/ns/NAMESPACE/sa/SA` path.
    pub fn namespace(&self) -> Option<&str> {
        self.workload_parts().map(|(ns, _)| ns)
    }

    /// `SA` of a `/ns/NAMESPACE/sa/SA` path.
    pub fn service_account(&self) -> Option<&str> {
        self.workload_parts().map(|(_, sa)| sa)
    }

    fn workload_parts(&self) -> Option<(&str, &str)> {
        let mut segments = self.path().strip_prefix('/')?.split('/');
        match (
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
        ) {
            (Some("ns"), Some(ns), Some("sa"), Some(sa), None) => Some((ns, sa)),
            _ => None,
        }
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for SpiffeId {
    type Err = IdentityError;

    fn from_str(text: &str) -> Result<SpiffeId, IdentityError> {
        SpiffeId::parse(text)
    }
}

/// Which IDs an allow-list entry admits: one ID, or every ID under a path
/// (`spiffe://TD/ns/NS/*`: every workload of a namespace; `spiffe://TD/*`: the whole trust
/// domain).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IdPattern {
    Exact(SpiffeId),
    /// IDs whose text starts with this, which ends in `/` (a whole segment boundary).
    Under(String),
}

impl IdPattern {
    pub fn parse(text: &str) -> Result<IdPattern, IdentityError> {
        match text.strip_suffix("/*") {
            Some(base) => {
                // The base must itself be a valid ID (a trust domain, or one with a path).
                let base = SpiffeId::parse(base).map_err(|e| match e {
                    IdentityError::BadSpiffeId { why, .. } => IdentityError::BadSpiffeId {
                        id: text.chars().take(200).collect(),
                        why: format!("{why} (in a pattern, only a last `/*` segment is special)"),
                    },
                    other => other,
                })?;
                Ok(IdPattern::Under(format!("{base}/")))
            }
            None => {
                if text.contains('*') {
                    return Err(bad(
                        text,
                        "a `*` may only be the whole last segment, like spiffe://example.org/ns/default/*",
                    ));
                }
                SpiffeId::parse(text).map(IdPattern::Exact)
            }
        }
    }

    pub fn matches(&self, id: &SpiffeId) -> bool {
        match self {
            IdPattern::Exact(exact) => exact == id,
            IdPattern::Under(prefix) => id.as_str().starts_with(prefix.as_str()),
        }
    }

    /// The trust domain every ID this pattern admits belongs to.
    pub fn trust_domain(&self) -> &str {
        match self {
            IdPattern::Exact(id) => id.trust_domain(),
            IdPattern::Under(prefix) => {
                let rest = &prefix[SCHEME.len()..];
                &rest[..rest.find('/').unwrap_or(rest.len())]
            }
        }
    }
}

impl fmt::Display for IdPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdPattern::Exact(id) => id.fmt(f),
            IdPattern::Under(prefix) => write!(f, "{prefix}*"),
        }
    }
}

/// Whether any pattern admits `id` (an empty list admits nobody).
pub fn allowed(patterns: &[IdPattern], id: &SpiffeId) -> bool {
    patterns.iter().any(|p| p.matches(id))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn workload_ids_parse_into_their_parts() {
        let id = SpiffeId::parse("spiffe://cluster.local/ns/shop/sa/cart").unwrap();
        assert_eq!(id.trust_domain(), "cluster.local");
        assert_eq!(id.path(), "/ns/shop/sa/cart");
        assert_eq!(id.namespace(), Some("shop"));
        assert_eq!(id.service_account(), Some("cart"));
        assert_eq!(
            SpiffeId::workload("cluster.local", "shop", "cart").unwrap(),
            id
        );
        let domain_only = SpiffeId::parse("spiffe://example.org").unwrap();
        assert_eq!(domain_only.path(), "");
        assert_eq!(domain_only.namespace(), None);
        let other = SpiffeId::parse("spiffe://example.org/node/n1").unwrap();
        assert_eq!(other.namespace(), None);
    }

    #[test]
    fn invalid_ids_are_refused_with_the_rule_they_break() {
        for (text, why) in [
            ("http://example.org/x", "spiffe://"),
            ("SPIFFE://example.org/x", "spiffe://"),
            ("spiffe://", "empty"),
            ("spiffe:///ns/a", "empty"),
            ("spiffe://Example.org/x", "lower-case"),
            ("spiffe://example.org:8080/x", "port"),
            ("spiffe://user@example.org/x", "`@`"),
            ("spiffe://example.org/", "empty segment"),
            ("spiffe://example.org//x", "empty segment"),
            ("spiffe://example.org/a/./b", "`.` segment"),
            ("spiffe://example.org/a/../b", "`..` segment"),
            ("spiffe://example.org/a?b", "`?`"),
            ("spiffe://example.org/a#b", "`#`"),
            ("spiffe://example.org/a%20b", "`%`"),
            ("spiffe://example.org/ns/a b", "` `"),
        ] {
            let err = SpiffeId::parse(text).unwrap_err().to_string();
            assert!(
                err.contains(why),
                "{text}: {err} (expected to mention {why})"
            );
        }
        let long = format!("spiffe://example.org/{}", "a".repeat(MAX_ID_BYTES));
        assert!(SpiffeId::parse(&long)
            .unwrap_err()
            .to_string()
            .contains("bytes long"));
        let long_domain = format!("spiffe://{}/x", "a".repeat(300));
        assert!(SpiffeId::parse(&long_domain)
            .unwrap_err()
            .to_string()
            .contains("at most 255"));
    }

    #[test]
    fn patterns_admit_exact_ids_and_whole_subtrees_only() {
        let id = |t: &str| SpiffeId::parse(t).unwrap();
        let namespace = IdPattern::parse("spiffe://td/ns/shop/*").unwrap();
        assert!(namespace.matches(&id("spiffe://td/ns/shop/sa/cart")));
        assert!(!namespace.matches(&id("spiffe://td/ns/shopping/sa/cart")));
        assert!(!namespace.matches(&id("spiffe://td/ns/shop")));
        assert!(!namespace.matches(&id("spiffe://other/ns/shop/sa/cart")));
        assert_eq!(namespace.trust_domain(), "td");
        assert_eq!(namespace.to_string(), "spiffe://td/ns/shop/*");
        let domain = IdPattern::parse("spiffe://td/*").unwrap();
        assert!(domain.matches(&id("spiffe://td/ns/a/sa/b")));
        assert!(!domain.matches(&id("spiffe://tdx/ns/a/sa/b")));
        assert_eq!(domain.trust_domain(), "td");
        let exact = IdPattern::parse("spiffe://td/ns/a/sa/b").unwrap();
        assert!(exact.matches(&id("spiffe://td/ns/a/sa/b")));
        assert!(!exact.matches(&id("spiffe://td/ns/a/sa/bc")));
        assert!(allowed(
            &[exact, namespace],
            &id("spiffe://td/ns/shop/sa/x")
        ));
        assert!(!allowed(&[], &id("spiffe://td/ns/shop/sa/x")));
        for text in [
            "spiffe://td/ns/*/sa/x",
            "spiffe://td/ns/sh*",
            "spiffe://*",
            "spiffe://td//*",
        ] {
            assert!(IdPattern::parse(text).is_err(), "{text} accepted");
        }
    }
}
