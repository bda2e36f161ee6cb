//! Authorization policies from arbitrary YAML-shaped input, run on arbitrary requests and
//! callers: the config check and the policy compiler never panic, and every decision agrees
//! with the policy it names (a deny is a deny policy's or the default's, an allow an allow
//! policy's or the open default's).
#![no_main]

use flatmesh_config::{Authorization, AuthzAction};
use flatmesh_rules::{compile, Peer, Request};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Call {
    method: String,
    host: Option<String>,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    principal: Option<String>,
}

#[derive(Arbitrary, Debug)]
struct Case {
    /// The listener's `authorization:` as YAML (flow style fits on one line).
    authorization: String,
    tcp: bool,
    calls: Vec<Call>,
}

fuzz_target!(|case: Case| {
    if case.authorization.len() > 4096 {
        return;
    }
    let listener = if case.tcp {
        "protocol: tcp, cluster: a"
    } else {
        "protocol: http, routes: [ { match: { path: { prefix: / } }, cluster: a } ]"
    };
    let yaml = format!(
        "listeners:\n  - {{ name: l, address: 127.0.0.1:1, {listener}, authorization: {} }}\nclusters: [ {{ name: a, endpoints: [127.0.0.1:2] }} ]\n",
        case.authorization.replace('\n', " ")
    );
    // The same path a node takes: parse and validate, then compile.
    let Ok(config) = flatmesh_config::parse(&yaml, "fuzz") else {
        return;
    };
    let Ok(program) = compile(&config) else {
        return;
    };
    let Some(authz) = program.authz(0) else {
        return;
    };
    let written: &Authorization = config.listeners[0]
        .authorization
        .as_ref()
        .expect("compiled policies come from the config");
    for call in case.calls.iter().take(8) {
        let peer = Peer {
            principal: call.principal.as_deref(),
        };
        let decision = if case.tcp {
            authz.check_connection(peer)
        } else {
            let method =
                http::Method::from_bytes(call.method.as_bytes()).unwrap_or(http::Method::GET);
            let mut headers = http::HeaderMap::new();
            for (k, v) in &call.headers {
                if let (Ok(k), Ok(v)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    http::HeaderValue::from_bytes(v),
                ) {
                    headers.append(k, v);
                }
            }
            let req = Request {
                method: &method,
                host: call.host.as_deref(),
                path: &call.path,
                query: None,
                headers: (&headers).into(),
                message: None,
            };
            authz.check_request(&req, peer)
        };
        match decision.policy {
            Some(i) => {
                let action = written.policies[i].action;
                assert_eq!(
                    decision.allowed,
                    action == AuthzAction::Allow,
                    "policy {i} ({action:?}) gave the opposite decision"
                );
            }
            None => {
                let has_allow = written
                    .policies
                    .iter()
                    .any(|p| p.action == AuthzAction::Allow);
                let open = !has_allow && written.default == flatmesh_config::AuthzDefault::Allow;
                assert_eq!(
                    decision.allowed, open,
                    "the unmatched decision is not the default's"
                );
            }
        }
    }
});
