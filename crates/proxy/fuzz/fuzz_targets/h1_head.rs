//! Any request head a client sends goes through httparse, flatmesh's framing analysis and the
//! upstream head writer. None of them may panic, and what the writer emits must itself be a
//! well-formed request head that frames the body the same way.
#![no_main]

use std::sync::OnceLock;

use flatmesh_proxy::fuzz::{analyze_request, write_request_head, MAX_HEADERS};
use flatmesh_rules::{CompiledRoute, RuleProgram, TableKind};
use libfuzzer_sys::fuzz_target;

fn route() -> &'static CompiledRoute {
    static PROGRAM: OnceLock<RuleProgram> = OnceLock::new();
    let program = PROGRAM.get_or_init(|| {
        let config = flatmesh_config::parse(
            r#"
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: { path: { prefix: / } }
        cluster: c
        request_headers_to_add: { x-via: flatmesh }
        request_headers_to_remove: [ x-drop, cookie ]
clusters:
  - name: c
    endpoints: [ 127.0.0.1:2 ]
"#,
            "fuzz.yaml",
        )
        .expect("config");
        flatmesh_rules::compile(&config).expect("compiles")
    });
    match &program.listeners()[0].kind {
        TableKind::Http(table) => &table.routes[0],
        TableKind::Tcp(_) | TableKind::Hbone(_) | TableKind::Qnp(_) => {
            unreachable!("an http listener")
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut lines);
    let Ok(httparse::Status::Complete(_)) = req.parse(data) else {
        return;
    };
    let Ok(mut info) = analyze_request(&req) else {
        return;
    };
    // A host that gets through is `host[:port]` (issue 23: garbage Host values went on).
    if let Some(host) = info.host {
        assert!(flatmesh_rules::is_valid_authority(host), "host {host:?} went on");
    }
    // The path as a listener with a deny route normalises it: what is written upstream.
    let strict = flatmesh_rules::PathNormalization::new(flatmesh_config::PathOptions::STRICT);
    let normalized = match strict.apply(&info.path) {
        Ok(flatmesh_rules::Normalized::Path(p)) => Some(p.into_owned()),
        _ => None,
    };
    if let Some(p) = &normalized {
        assert!(strict.is_normal(p), "{p:?} is not normal");
        info.path = p.clone().into();
    }
    let mut out = Vec::new();
    write_request_head(&mut out, &req, &info, route(), b"127.0.0.1", "127.0.0.1:2", &[]);
    let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS + 8];
    let mut again = httparse::Request::new(&mut lines);
    match again.parse(&out) {
        Ok(httparse::Status::Complete(n)) => assert_eq!(n, out.len(), "one head, nothing after it"),
        other => panic!(
            "the upstream head does not parse: {other:?}\n{}",
            String::from_utf8_lossy(&out)
        ),
    }
    let reparsed = analyze_request(&again).expect("the upstream head is acceptable");
    assert_eq!(reparsed.framing, info.framing, "framing changed on the way");
    assert_eq!(reparsed.path, info.path, "the path written is the path matched");
    assert_eq!(reparsed.upgrade, info.upgrade, "an upgrade appeared or vanished");
});
