//! Encoding the tier-K route table (`fm_routes`) into its map ABI.
//!
//! What the table holds is decided by the tier-K lowering in `flatmesh-rules`
//! (`flatmesh_rules::lower::kernel`): routes become [`KernelEntry`]s there, with the reference
//! executor the tests compare the verdict program against. This module only lays each entry out
//! as the C side's `struct fm_route`.

use flatmesh_rules::lower::kernel::{KernelAction, KernelEntry, PathKey, Protocols};

use crate::abi::{FmRoute, ACT_BACKEND, ACT_PUNT, MATCH_EXACT, MATCH_PREFIX, METHOD_MAX, PATH_MAX};

/// FM_PROTO_H1 and FM_PROTO_H2 (bpf/dispatch.bpf.c): `fm_route.protos` holds `1 << proto`.
const FM_PROTO_H1: u32 = 1;
const FM_PROTO_H2: u32 = 2;

/// `fm_route.protos` for a set of connection protocols.
fn proto_bits(p: Protocols) -> u32 {
    let mut bits = 0;
    if p.contains(Protocols::HTTP1) {
        bits |= 1 << FM_PROTO_H1;
    }
    if p.contains(Protocols::HTTP2) {
        bits |= 1 << FM_PROTO_H2;
    }
    bits
}

/// Longest prefix of `s` of at most `max` bytes that ends on a char boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// One entry as `struct fm_route`. The lowering keeps methods and paths within the ABI's
/// sizes; an entry built by hand that does not is made a punt that matches more (any method,
/// its path cut short), never one that decides what the user tier would not.
pub(crate) fn to_abi(e: &KernelEntry) -> FmRoute {
    let mut r = FmRoute::default();
    let method_fits = e.method.as_ref().is_none_or(|m| m.len() <= METHOD_MAX);
    if let Some(m) = e.method.as_ref().filter(|_| method_fits) {
        r.method[..m.len()].copy_from_slice(m.as_bytes());
    }
    let path = e.path.as_str();
    let path_fits = path.len() <= PATH_MAX;
    let p = truncate(path, PATH_MAX).as_bytes();
    r.path[..p.len()].copy_from_slice(p);
    r.path_len = p.len() as u32;
    r.kind = match &e.path {
        PathKey::Exact(_) if path_fits => MATCH_EXACT,
        PathKey::Exact(_) | PathKey::Prefix(_) => MATCH_PREFIX,
    };
    match &e.action {
        KernelAction::Forward { cluster, protocols } if method_fits && path_fits => {
            match u32::try_from(*cluster) {
                Ok(backend) => {
                    r.action = ACT_BACKEND;
                    r.backend = backend;
                    r.protos = proto_bits(*protocols);
                }
                Err(_) => r.action = ACT_PUNT,
            }
        }
        _ => r.action = ACT_PUNT,
    }
    // Route ids are u32 in the ABI; compile() refuses more routes than that.
    r.route_id = u32::try_from(e.route).unwrap_or(u32::MAX);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(method: Option<&str>, path: PathKey, action: KernelAction) -> KernelEntry {
        KernelEntry {
            route: 7,
            method: method.map(str::to_owned),
            path,
            action,
        }
    }

    #[test]
    fn entries_encode_field_by_field() {
        let fwd = KernelAction::Forward {
            cluster: 3,
            protocols: Protocols::HTTP1 | Protocols::HTTP2,
        };
        let r = to_abi(&entry(Some("GET"), PathKey::Exact("/a".into()), fwd));
        assert_eq!(&r.method[..4], b"GET\0");
        assert_eq!(
            (&r.path[..2], r.path_len, r.kind),
            (&b"/a"[..], 2, MATCH_EXACT)
        );
        assert_eq!((r.action, r.backend, r.route_id), (ACT_BACKEND, 3, 7));
        assert_eq!(r.protos, 0b110);
        let r = to_abi(&entry(
            None,
            PathKey::Prefix("/api/".into()),
            KernelAction::Punt(flatmesh_rules::Reason::HeaderMatch),
        ));
        assert_eq!((r.kind, r.action, r.protos), (MATCH_PREFIX, ACT_PUNT, 0));
        assert_eq!(r.method, [0; METHOD_MAX]);
        let h2 = KernelAction::Forward {
            cluster: 0,
            protocols: Protocols::HTTP2,
        };
        assert_eq!(
            to_abi(&entry(None, PathKey::Prefix(String::new()), h2)).protos,
            0b100
        );
    }

    #[test]
    fn an_oversized_hand_made_entry_becomes_a_wider_punt() {
        let long = format!("/{}", "é".repeat(40));
        let fwd = KernelAction::Forward {
            cluster: 1,
            protocols: Protocols::HTTP1,
        };
        let r = to_abi(&entry(None, PathKey::Exact(long.clone()), fwd.clone()));
        assert_eq!((r.kind, r.action), (MATCH_PREFIX, ACT_PUNT));
        assert!(r.path_len as usize <= PATH_MAX);
        assert!(long.as_bytes().starts_with(&r.path[..r.path_len as usize]));
        let r = to_abi(&entry(
            Some("VERYLONGMETHOD"),
            PathKey::Exact("/m".into()),
            fwd,
        ));
        assert_eq!((r.method, r.action), ([0; METHOD_MAX], ACT_PUNT));
    }
}
