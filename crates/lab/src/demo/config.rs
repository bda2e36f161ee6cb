//! The built-in demo node config, and the traffic the demo sends through it.
//!
//! The config and the expectations live side by side on purpose: the report
//! checks each route's backend shares against the weights written here.

use std::net::SocketAddr;

use flatmesh_config::Config;
use http::{Method, StatusCode};

use crate::demo::load::{HttpTarget, NO_BACKEND};
use crate::demo::report::{Balance, Expectation, Expectations, ShareGroup};
use crate::LabError;

/// Name of the HTTP listener in the demo config.
pub const WEB_LISTENER: &str = "web";
/// Name of the TCP listener in the demo config.
pub const ECHO_LISTENER: &str = "echo";

/// Where the demo backends listen.
#[derive(Debug, Clone, Copy)]
pub struct Backends {
    pub api_1: SocketAddr,
    pub api_2: SocketAddr,
    pub canary: SocketAddr,
    pub echo: SocketAddr,
}

/// The built-in node config as YAML, the same shape a user writes. Every
/// address the node binds is 127.0.0.1:0 (the node binds an ephemeral port and
/// reports it), so the demo never collides with anything.
///
/// - `web` (http): `/api` prefix → `api` (round robin over api-1, api-2);
///   `^/v[0-9]+/items` GET → 90/10 split between `api` and `canary` (h2c upstream);
///   `/healthz` → direct 200 "ok"; anything else → the proxy's 404.
/// - `echo` (tcp): → the echo service.
///
/// `extra_listeners` (YAML list items, e.g. the mTLS part's `secure` listener) go after those.
pub fn node_config_yaml(backends: &Backends, extra_listeners: &str) -> String {
    let Backends {
        api_1,
        api_2,
        canary,
        echo,
    } = backends;
    format!(
        r#"# flatmesh demo: the built-in node config.
admin: 127.0.0.1:0
# Two shared-nothing workers: round-robin shares must hold across workers too.
workers: 2
listeners:
  - name: {WEB_LISTENER}
    address: 127.0.0.1:0
    protocol: http
    routes:
      - name: api
        match: {{ path: {{ prefix: /api }} }}
        cluster: api
      - name: items-split
        match: {{ path: {{ regex: "^/v[0-9]+/items" }}, method: GET }}
        split: [ {{ cluster: api, weight: 90 }}, {{ cluster: canary, weight: 10 }} ]
      - name: healthz
        match: {{ path: {{ exact: /healthz }} }}
        direct_response: {{ status: 200, body: "ok" }}
  - name: {ECHO_LISTENER}
    address: 127.0.0.1:0
    protocol: tcp
    cluster: echo
{extra_listeners}clusters:
  - name: api
    lb: round_robin
    endpoints: [ {api_1}, {api_2} ]
  - name: canary
    endpoints: [ {canary} ]
    protocol: http2
  - name: echo
    endpoints: [ {echo} ]
"#
    )
}

/// The built-in node config, parsed and validated like any config file.
pub fn node_config(backends: &Backends, extra_listeners: &str) -> Result<Config, LabError> {
    flatmesh_config::parse(
        &node_config_yaml(backends, extra_listeners),
        "built-in demo config",
    )
    .map_err(|e| LabError::BuiltinConfig(e.to_string()))
}

/// The HTTP requests the demo sends, one target per route (round robin across them).
pub fn targets() -> Vec<HttpTarget> {
    let get = |name: &str, path: &str, status: StatusCode| HttpTarget {
        name: name.into(),
        method: Method::GET,
        path: path.into(),
        expect_status: status,
    };
    vec![
        get("api", "/api/users", StatusCode::OK),
        get("items-split", "/v1/items", StatusCode::OK),
        get("healthz", "/healthz", StatusCode::OK),
        get("no-route", "/nowhere", StatusCode::NOT_FOUND),
    ]
}

/// What share of each route's answers each backend should give, from the weights
/// above, and which clusters must balance evenly over the whole run.
pub fn expectations() -> Expectations {
    let group = |label: &str, backends: &[&str], weight: Option<f64>| ShareGroup {
        label: label.into(),
        backends: backends.iter().map(|b| b.to_string()).collect(),
        weight,
    };
    Expectations {
        routes: vec![
            // Shown per backend but not checked per route: the `api` cluster's
            // round-robin cursor is shared with the split route, so only the whole
            // run balances (the `balances` check below). Any other backend is a misroute.
            Expectation {
                route: "api".into(),
                groups: vec![
                    group("api-1", &["api-1"], None),
                    group("api-2", &["api-2"], None),
                ],
            },
            Expectation {
                route: "items-split".into(),
                groups: vec![
                    group("api", &["api-1", "api-2"], Some(90.0)),
                    group("canary", &["canary"], Some(10.0)),
                ],
            },
            Expectation {
                route: "healthz".into(),
                groups: vec![group("direct", &[NO_BACKEND], Some(1.0))],
            },
            Expectation {
                route: "no-route".into(),
                groups: vec![group("proxy 404", &[NO_BACKEND], Some(1.0))],
            },
        ],
        balances: vec![Balance {
            cluster: "api".into(),
            backends: vec!["api-1".into(), "api-2".into()],
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn backends() -> Backends {
        let a = |p| SocketAddr::from((Ipv4Addr::LOCALHOST, p));
        Backends {
            api_1: a(9001),
            api_2: a(9002),
            canary: a(9003),
            echo: a(9004),
        }
    }

    #[test]
    fn builtin_config_is_valid_and_has_what_the_demo_needs() -> Result<(), LabError> {
        let config = node_config(&backends(), "")?;
        assert_eq!(config.admin.address.tcp().map(|a| a.port()), Some(0));
        let names: Vec<_> = config.listeners.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, [WEB_LISTENER, ECHO_LISTENER]);
        assert!(config.listeners.iter().all(|l| l.address.port() == 0));
        let api = config.cluster("api").map(|c| c.endpoints.to_vec());
        assert_eq!(api, Some(vec![backends().api_1, backends().api_2]));
        Ok(())
    }

    #[test]
    fn every_target_has_an_expectation_and_a_route_name() -> Result<(), LabError> {
        let config = node_config(&backends(), "")?;
        let expectations = expectations().routes;
        let route_names: Vec<_> = config.listeners[0]
            .routes
            .iter()
            .filter_map(|r| r.name.clone())
            .collect();
        for target in targets() {
            assert!(expectations.iter().any(|e| e.route == target.name));
            // The unmatched target is the only one without a route in the config.
            assert_eq!(
                route_names.contains(&target.name),
                target.expect_status == StatusCode::OK,
                "{}",
                target.name
            );
        }
        Ok(())
    }
}
