//! Who may use the admin endpoint: the `Host` check (a DNS-rebinding defence: a web page
//! the operator opens must not reach the admin port through a name it controls) and the
//! bearer token.

use std::net::IpAddr;

use flatmesh_config::Admin;
use http::{header, HeaderMap, Method};

/// Why a request was refused before any endpoint saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its `Host` names neither this machine's loopback nor a configured admin host.
    Host,
    /// The token is required and missing or wrong.
    Token,
}

/// Whether `host` (the `Host` header's value, with or without a port) names this admin
/// endpoint: a loopback address, `localhost` (or a name under `.localhost`), the address the
/// connection came in on, or one of `admin.hosts`. No `Host` at all is fine (HTTP/1.0
/// tools); a browser always sends one.
pub fn host_allowed(host: Option<&str>, admin: &Admin, local: Option<IpAddr>) -> bool {
    let Some(host) = host else {
        return true;
    };
    let name = strip_port(host.trim());
    if let Ok(ip) = name
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        let ip = ip.to_canonical();
        return ip.is_loopback() || Some(ip) == local.map(|l| l.to_canonical());
    }
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || admin.hosts.iter().any(|h| h.eq_ignore_ascii_case(&name))
}

/// `name:port` → `name`, `[v6]:port` → `[v6]`; a bare IPv6 address stays whole.
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    }
}

/// Whether this request must carry the token: all do, when one is set, except `GET /ready`
/// and the read-only endpoints listed in `admin.open_paths`. A request that changes the node
/// (`POST /reload`, `POST /drain`) always does.
pub fn needs_token(method: &Method, path: &str, admin: &Admin, token: Option<&str>) -> bool {
    if token.is_none() {
        return false;
    }
    let open =
        method == Method::GET && (path == "/ready" || admin.open_paths.iter().any(|p| p == path));
    !open
}

/// Whether `headers` carry `Authorization: Bearer TOKEN` with the right token.
pub fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        })
    else {
        return false;
    };
    constant_time_eq(given.as_bytes(), token.as_bytes())
}

/// Compare without an early exit, so the time taken does not tell how much of a guess was
/// right. (Hand-written: the proxy crate needs nothing else from a crypto crate.)
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admin(hosts: &[&str]) -> Admin {
        Admin {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..Admin::default()
        }
    }

    #[test]
    fn hosts_that_name_this_machine_pass_and_others_do_not() {
        let a = admin(&["node-1.mesh.internal"]);
        let local = Some("10.0.0.5".parse().unwrap());
        for ok in [
            None,
            Some("127.0.0.1:15000"),
            Some("127.0.0.1"),
            Some("[::1]:15000"),
            Some("localhost:15000"),
            Some("LOCALHOST."),
            Some("admin.localhost"),
            Some("10.0.0.5:15000"),
            Some("Node-1.mesh.internal:15000"),
        ] {
            assert!(host_allowed(ok, &a, local), "{ok:?} should pass");
        }
        for bad in [
            Some("attacker.example:15000"),
            Some("attacker.example"),
            Some("10.0.0.6:15000"),
            Some("localhost.attacker.example"),
            Some(""),
        ] {
            assert!(!host_allowed(bad, &a, local), "{bad:?} should be refused");
        }
    }

    #[test]
    fn token_rules() {
        let mut a = admin(&[]);
        a.open_paths = vec!["/metrics".into()];
        let t = Some("0123456789abcdef");
        assert!(!needs_token(&Method::GET, "/config", &a, None));
        assert!(needs_token(&Method::GET, "/config", &a, t));
        assert!(!needs_token(&Method::GET, "/ready", &a, t));
        assert!(!needs_token(&Method::GET, "/metrics", &a, t));
        assert!(needs_token(&Method::POST, "/reload", &a, t));
        assert!(needs_token(&Method::POST, "/drain", &a, t));
        assert!(needs_token(&Method::POST, "/metrics", &a, t));

        let mut h = HeaderMap::new();
        assert!(!bearer_matches(&h, "0123456789abcdef"));
        h.insert(
            header::AUTHORIZATION,
            "Bearer 0123456789abcdef".parse().unwrap(),
        );
        assert!(bearer_matches(&h, "0123456789abcdef"));
        assert!(!bearer_matches(&h, "0123456789abcdeX"));
        assert!(!bearer_matches(&h, "0123456789abcdef0"));
        h.insert(
            header::AUTHORIZATION,
            "Basic 0123456789abcdef".parse().unwrap(),
        );
        assert!(!bearer_matches(&h, "0123456789abcdef"));
    }
}
