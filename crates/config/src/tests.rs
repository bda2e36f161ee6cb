//! Parse + validate tests: every rule, each asserting the exact line:column.

use super::*;

/// Clusters every test can refer to. Kept last so they never shift line numbers above.
const CLUSTERS: &str = "\
clusters:
  - name: api
    endpoints: [127.0.0.1:9001]
  - name: api-canary
    endpoints: [127.0.0.1:9003]
  - name: db
    endpoints: [127.0.0.1:5432]
";

/// One http listener; `routes` starts on line 6, each route line indented by 6.
fn http(routes: &str) -> String {
    format!(
        "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes:\n{routes}{CLUSTERS}"
    )
}

fn errors(yaml: &str) -> Vec<Diagnostic> {
    match parse(yaml, "t.yaml") {
        Ok(_) => panic!("expected errors, config was accepted:\n{yaml}"),
        Err(e) => e.diagnostics().to_vec(),
    }
}

/// Exactly one diagnostic, at `line:column`, whose message contains `message`.
#[track_caller]
fn only(yaml: &str, line: usize, column: usize, message: &str) -> Diagnostic {
    let all = errors(yaml);
    assert_eq!(all.len(), 1, "expected one diagnostic, got {all:#?}");
    let d = all.into_iter().next().unwrap_or_else(|| unreachable!());
    assert_eq!((d.line, d.column), (line, column), "wrong position for {d}");
    assert!(
        d.message.contains(message),
        "message `{}` lacks `{message}`",
        d.message
    );
    assert!(!d.hint.is_empty());
    d
}

#[test]
fn example_from_issue_parses() {
    let text = include_str!("../tests/data/example.yaml");
    let config = parse(text, "example.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.workers, Some(2));
    assert_eq!(config.listeners.len(), 2);
    let web = &config.listeners[0];
    assert_eq!(web.routes.len(), 4);
    assert_eq!(
        web.routes[0].matches.path,
        Some(PathMatch::Prefix("/api".into()))
    );
    assert_eq!(web.routes[0].matches.headers[0].exact.as_deref(), Some("1"));
    assert_eq!(
        web.routes[1].timeout,
        Some(std::time::Duration::from_secs(2))
    );
    assert_eq!(web.routes[1].split.as_ref().map(|s| s[0].weight), Some(90));
    assert_eq!(
        web.routes[2].direct_response.as_ref().map(|d| d.status),
        Some(200)
    );
    assert_eq!(web.routes[3].matches.host.as_deref(), Some("*.example.com"));
    assert_eq!(config.listeners[1].protocol, ListenerProtocol::Tcp);
    assert_eq!(
        config.cluster("api-canary").map(|c| c.protocol),
        Some(UpstreamProtocol::Http2)
    );
    assert_eq!(
        config.cluster("api").map(|c| c.lb),
        Some(LbPolicy::RoundRobin)
    );
}

#[test]
fn json_round_trips() {
    let text = include_str!("../tests/data/example.yaml");
    let config = parse(text, "example.yaml").unwrap_or_else(|e| panic!("{e}"));
    let json = config.to_json();
    assert!(json.contains(r#""prefix": "/api""#), "{json}");
    assert!(json.contains(r#""timeout": "2s""#), "{json}");
    assert!(json.contains(r#""lb": "round_robin""#), "{json}");
    let back: Config = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}\n{json}"));
    assert_eq!(back, config);
}

#[test]
fn display_format() {
    let d = only(
        &http("      - cluster: apii\n"),
        6,
        18,
        "route references unknown cluster `apii`",
    );
    assert_eq!(
        d.to_string(),
        "t.yaml:6:18: route references unknown cluster `apii`\n  hint: did you mean `api`? defined clusters: api, api-canary, db"
    );
}

// ---- deserialization errors -------------------------------------------------

#[test]
fn unknown_key_suggests_the_closest() {
    let d = only(&http("      - clustr: api\n"), 6, 9, "unknown key `clustr`");
    assert!(
        d.hint
            .starts_with("did you mean `cluster`? allowed keys here: name, match, cluster"),
        "{}",
        d.hint
    );
    let d = only("listenrs: []\n", 1, 1, "unknown key `listenrs`");
    assert!(
        d.hint.starts_with("did you mean `listeners`?"),
        "{}",
        d.hint
    );
    // Deep in a flow mapping.
    let d = only(
        &http("      - match: { path: { prefx: /a } }\n        cluster: api\n"),
        6,
        26,
        "unknown key `prefx`",
    );
    assert!(d.hint.starts_with("did you mean `prefix`?"), "{}", d.hint);
    // A word that resembles nothing gets the list only.
    let d = only(
        &http("      - banana: 1\n        cluster: api\n"),
        6,
        9,
        "unknown key `banana`",
    );
    assert!(d.hint.starts_with("allowed keys here:"), "{}", d.hint);
}

#[test]
fn unknown_enum_value_suggests_the_closest() {
    let yaml = format!("{}    lb: round_robbin\n", http("      - cluster: api\n"));
    // CLUSTERS starts on line 7 and ends on line 13; lb is appended on line 14.
    let d = only(&yaml, 14, 9, "unknown value `round_robbin`");
    assert!(
        d.hint
            .starts_with("did you mean `round_robin`? allowed values: round_robin, least_request"),
        "{}",
        d.hint
    );
}

#[test]
fn bad_socket_address() {
    let yaml = "listeners:\n  - name: web\n    address: localhost:80\n";
    let d = only(yaml, 3, 14, "invalid socket address");
    assert!(d.hint.contains("IP:PORT"));
}

#[test]
fn bad_duration_points_at_the_value() {
    let d = only(
        &http("      - cluster: api\n        timeout: 2\n"),
        7,
        18,
        "duration `2` has no unit",
    );
    assert!(d.hint.contains("250ms"));
    only("limits:\n  idle_timeout: 5x\n", 2, 17, "unknown unit `x`");
}

#[test]
fn wrong_type() {
    let d = only("workers: two\n", 1, 10, "invalid type");
    assert!(d.hint.contains("whole number"));
    only("listeners:\n  - name: [a]\n", 2, 11, "expected a string");
}

#[test]
fn missing_required_key() {
    let d = only(
        "listeners:\n  - name: web\n    protocol: tcp\n",
        2,
        5,
        "missing required key `address`",
    );
    assert!(d.hint.contains("add `address: ...`"));
}

#[test]
fn duplicate_key() {
    only(
        "workers: 2\nworkers: 3\n",
        2,
        1,
        "key `workers` is written twice",
    );
}

#[test]
fn path_match_needs_exactly_one_kind() {
    only(
        &http("      - match: { path: { prefix: /a, exact: /b } }\n        cluster: api\n"),
        6,
        24,
        "more than one",
    );
    only(
        &http("      - match: { path: {} }\n        cluster: api\n"),
        6,
        24,
        "path match is empty",
    );
}

#[test]
fn yaml_syntax_error() {
    let d = only("listeners: [\n", 2, 1, "YAML syntax error");
    assert!(d.hint.contains("indentation"));
}

#[test]
fn empty_document() {
    for text in [
        "",
        "\n\n",
        "# only a comment\n",
        "{}\n",
        "~\n",
        "---\n...\n",
    ] {
        only(
            text,
            1,
            1,
            "config is empty: it needs at least one listener",
        );
    }
}

#[test]
fn unreadable_file_names_path_and_reason() {
    let err = load(Path::new("/nonexistent/flatmesh.yaml"))
        .err()
        .map(|e| e.to_string());
    let err = err.unwrap_or_default();
    assert!(err.contains("/nonexistent/flatmesh.yaml"), "{err}");
    assert!(err.contains("No such file or directory"), "{err}");
}

#[test]
fn load_names_the_file_in_diagnostics() {
    let dir = std::env::temp_dir().join(format!("flatmesh-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let file = dir.join("web.yaml");
    std::fs::write(&file, "workers: two\n").unwrap_or_else(|e| panic!("{e}"));
    let err = load(&file).err().map(|e| e.to_string()).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        err.starts_with(&format!("{}:1:10: invalid type", file.display())),
        "{err}"
    );
}

// ---- validation rules ---------------------------------------------------------

fn two_tcp(first: &str, second: &str) -> String {
    format!(
        "listeners:\n  - name: {first}\n    address: 127.0.0.1:8080\n    protocol: tcp\n    cluster: db\n  - name: {second}\n    address: 127.0.0.1:8081\n    protocol: tcp\n    cluster: db\n{CLUSTERS}"
    )
}

#[test]
fn listener_names_unique() {
    let d = only(
        &two_tcp("web", "web"),
        6,
        11,
        "listener name `web` is used twice",
    );
    assert!(
        d.hint.ends_with("(the first is at line 2, column 11)"),
        "{}",
        d.hint
    );
}

#[test]
fn listener_name_not_empty() {
    only(&two_tcp("\"\"", "b"), 2, 11, "listener name is empty");
}

#[test]
fn cluster_names_unique() {
    let yaml = format!(
        "{}  - name: api\n    endpoints: [127.0.0.1:1]\n",
        two_tcp("a", "b")
    );
    // CLUSTERS starts on line 10; its `api` is on line 11, the copy on line 17.
    let d = only(&yaml, 17, 11, "cluster name `api` is used twice");
    assert!(d.hint.contains("line 11, column 11"), "{}", d.hint);
}

#[test]
fn listener_addresses_unique() {
    let yaml = two_tcp("a", "b").replace("127.0.0.1:8081", "127.0.0.1:8080");
    only(&yaml, 7, 14, "clashes with listener `a`");
    // A wildcard address takes the port on every address.
    let yaml = two_tcp("a", "b").replace("127.0.0.1:8081", "0.0.0.0:8080");
    only(&yaml, 7, 14, "clashes with listener `a`");
    // Port 0 lets the OS pick, so two of them do not clash on the port...
    let yaml = two_tcp("a", "b")
        .replace("127.0.0.1:8080", "127.0.0.1:0")
        .replace("127.0.0.1:8081", "127.0.0.2:0");
    assert!(parse(&yaml, "t.yaml").is_ok());
    // ...but the node tells listeners apart by address and protocol: two tcp listeners on
    // 127.0.0.1:0 would be one.
    let yaml = two_tcp("a", "b")
        .replace(":8080", ":0")
        .replace(":8081", ":0");
    only(
        &yaml,
        7,
        14,
        "is the same as listener `a`'s, with the same protocol",
    );
}

#[test]
fn admin_address_not_a_listener_address() {
    let yaml = format!("admin: 127.0.0.1:8081\n{}", two_tcp("a", "b"));
    only(
        &yaml,
        8,
        14,
        "clashes with the admin address 127.0.0.1:8081",
    );
}

#[test]
fn http_listener_needs_routes_and_no_cluster() {
    let yaml = format!(
        "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n{CLUSTERS}"
    );
    only(&yaml, 2, 5, "http listener `web` has no routes");
    let yaml = format!("listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    cluster: db\n    routes: [ {{ cluster: api }} ]\n{CLUSTERS}");
    only(&yaml, 5, 5, "sets `cluster`, which only tcp listeners use");
}

#[test]
fn tcp_listener_needs_cluster_and_no_routes() {
    let yaml = format!(
        "listeners:\n  - name: db\n    address: 127.0.0.1:8080\n    protocol: tcp\n{CLUSTERS}"
    );
    only(&yaml, 2, 5, "tcp listener `db` has no `cluster`");
    let yaml = format!("listeners:\n  - name: db\n    address: 127.0.0.1:8080\n    protocol: tcp\n    cluster: db\n    routes: [ {{ cluster: api }} ]\n{CLUSTERS}");
    only(&yaml, 6, 5, "has routes, which only http listeners use");
    let yaml = two_tcp("a", "b").replacen("cluster: db", "cluster: dbb", 1);
    let d = only(&yaml, 5, 14, "listener references unknown cluster `dbb`");
    assert!(d.hint.starts_with("did you mean `db`?"), "{}", d.hint);
}

#[test]
fn route_needs_exactly_one_action() {
    only(
        &http("      - match: { method: GET }\n"),
        6,
        9,
        "route has no action",
    );
    let d = only(
        &http("      - cluster: api\n        direct_response: { status: 200 }\n"),
        7,
        9,
        "route sets both `cluster` and `direct_response`",
    );
    assert!(d.hint.contains("exactly one"));
}

#[test]
fn referenced_clusters_exist() {
    let d = only(
        &http("      - cluster: nope\n"),
        6,
        18,
        "unknown cluster `nope`",
    );
    assert_eq!(d.hint, "defined clusters: api, api-canary, db");
    // With no clusters at all, the hint says so.
    let yaml = "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes:\n      - cluster: api\n";
    let d = only(yaml, 6, 18, "unknown cluster `api`");
    assert!(d.hint.contains("no clusters are defined"));
}

#[test]
fn split_rules() {
    only(&http("      - split: []\n"), 6, 16, "split is empty");
    only(
        &http("      - split: [ { cluster: api, weight: 0 }, { cluster: db, weight: 1 } ]\n"),
        6,
        42,
        "split weight for `api` is 0",
    );
    only(
        &http("      - split: [ { cluster: api, weight: 999999 }, { cluster: db, weight: 2 } ]\n"),
        6,
        9,
        "split weights add up to 1000001",
    );
    let d = only(
        &http(
            "      - split: [ { cluster: api, weight: 9 }, { cluster: api-canery, weight: 1 } ]\n",
        ),
        6,
        58,
        "unknown cluster `api-canery`",
    );
    assert!(
        d.hint.starts_with("did you mean `api-canary`?"),
        "{}",
        d.hint
    );
}

#[test]
fn direct_response_status_range() {
    only(
        &http("      - direct_response: { status: 600 }\n"),
        6,
        36,
        "600 is not an HTTP status",
    );
    only(
        &http("      - direct_response: { status: 99 }\n"),
        6,
        36,
        "99 is not an HTTP status",
    );
    assert!(parse(&http("      - direct_response: { status: 599 }\n"), "t").is_ok());
}

#[test]
fn named_match_exactly_one_condition() {
    only(
        &http("      - match: { headers: [ { name: x-a } ] }\n        cluster: api\n"),
        6,
        29,
        "match on `x-a` has no condition",
    );
    only(
        &http("      - match: { query: [ { name: v, exact: \"1\", regex: \"^1\" } ] }\n        cluster: api\n"),
        6,
        50,
        "sets both `exact` and `regex`",
    );
}

#[test]
fn grpc_field_needs_a_field_number_and_one_condition() {
    only(
        &http("      - match: { grpc_field: { number: 0, exact: a } }\n        cluster: api\n"),
        6,
        40,
        "field number 0 is not a protobuf field number",
    );
    only(
        &http("      - match: { grpc_field: { number: 1 } }\n        cluster: api\n"),
        6,
        18,
        "grpc_field 1 has no condition",
    );
    only(
        &http("      - match: { grpc_field: { number: 2, exact: a, prefix: b } }\n        cluster: api\n"),
        6,
        53,
        "sets both `exact` and `prefix`",
    );
    assert!(parse(
        &http("      - match: { grpc_field: { number: 536870911, prefix: \"\" } }\n        cluster: api\n"),
        "t"
    )
    .is_ok());
}

#[test]
fn named_match_names() {
    only(
        &http("      - match: { headers: [ { name: \"x a\", present: true } ] }\n        cluster: api\n"),
        6,
        37,
        "`x a` is not a valid HTTP header name",
    );
    only(
        &http(
            "      - match: { query: [ { name: \"\", present: true } ] }\n        cluster: api\n",
        ),
        6,
        35,
        "query parameter name is empty",
    );
    only(
        &http(
            "      - match: { headers: [ { name: \"\", present: true } ] }\n        cluster: api\n",
        ),
        6,
        37,
        "is not a valid HTTP header name",
    );
    // Mixed case is a valid header name (matched case-insensitively later).
    assert!(parse(&http("      - match: { headers: [ { name: X-Canary, present: true } ] }\n        cluster: api\n"), "t").is_ok());
}

#[test]
fn regexes_compile() {
    let d = only(
        &http(
            "      - match: { headers: [ { name: x-a, regex: \"(a\" } ] }\n        cluster: api\n",
        ),
        6,
        49,
        "regex `(a` does not compile: unclosed group",
    );
    assert!(d.hint.contains("regex"));
    only(
        &http("      - match: { path: { regex: \"[z-a]\" } }\n        cluster: api\n"),
        6,
        33,
        "regex `[z-a]` does not compile",
    );
}

#[test]
fn paths_start_with_slash() {
    let d = only(
        &http("      - match: { path: { prefix: api } }\n        cluster: api\n"),
        6,
        34,
        "path prefix `api` does not start with `/`",
    );
    assert!(d.hint.contains("`/api`"));
    only(
        &http("      - match: { path: { exact: healthz } }\n        cluster: api\n"),
        6,
        33,
        "path exact `healthz`",
    );
}

#[test]
fn host_exact_or_wildcard_suffix() {
    for good in ["api.local", "*.example.com", "localhost"] {
        let yaml = http(&format!(
            "      - match: {{ host: \"{good}\" }}\n        cluster: api\n"
        ));
        assert!(parse(&yaml, "t").is_ok(), "{good} rejected");
    }
    for (bad, hint) in [
        ("a*.example.com", "leading `*.`"),
        ("*", "leading `*.`"),
        ("api.local:8080", "port"),
        ("*.", "write a host"),
        ("a..b", "labels"),
    ] {
        let yaml = http(&format!(
            "      - match: {{ host: \"{bad}\" }}\n        cluster: api\n"
        ));
        let d = only(&yaml, 6, 24, "is not a host name");
        assert!(d.hint.contains(hint), "{bad}: {}", d.hint);
    }
}

#[test]
fn method_is_a_token() {
    only(
        &http("      - match: { method: \"GE T\" }\n        cluster: api\n"),
        6,
        26,
        "`GE T` is not a valid HTTP method",
    );
    let d = only(
        &http("      - match: { method: get }\n        cluster: api\n"),
        6,
        26,
        "lowercase",
    );
    assert!(d.hint.contains("`GET`"));
    assert!(parse(
        &http("      - match: { method: PURGE }\n        cluster: api\n"),
        "t"
    )
    .is_ok());
}

#[test]
fn clusters_need_endpoints() {
    let yaml = format!("{}  - name: empty\n    endpoints: []\n", two_tcp("a", "b"));
    only(&yaml, 18, 16, "cluster `empty` has no endpoints");
    let yaml = format!(
        "{}  - name: zero\n    endpoints: [ 127.0.0.1:0 ]\n",
        two_tcp("a", "b")
    );
    only(&yaml, 18, 18, "cannot be connected to");
}

#[test]
fn hash_on_needs_a_hashing_policy() {
    let yaml = format!(
        "{}  - name: h\n    endpoints: [127.0.0.1:1]\n    hash_on: {{ header: x-user }}\n",
        two_tcp("a", "b")
    );
    let d = only(
        &yaml,
        19,
        5,
        "sets `hash_on` but its lb policy does not hash",
    );
    assert!(d.hint.contains("ring_hash"));
    for lb in ["ring_hash", "maglev"] {
        let yaml = format!("{}  - name: h\n    lb: {lb}\n    endpoints: [127.0.0.1:1]\n    hash_on: {{ header: x-user }}\n", two_tcp("a", "b"));
        assert!(parse(&yaml, "t").is_ok());
    }
    let yaml = format!("{}  - name: h\n    lb: maglev\n    endpoints: [127.0.0.1:1]\n    hash_on: {{ header: \"x user\" }}\n", two_tcp("a", "b"));
    only(&yaml, 20, 24, "`x user` is not a valid HTTP header name");
}

#[test]
fn workers_range() {
    let base = two_tcp("a", "b");
    only(&format!("workers: 0\n{base}"), 1, 10, "workers is 0");
    only(&format!("workers: 1025\n{base}"), 1, 10, "workers is 1025");
    assert!(parse(&format!("workers: 1024\n{base}"), "t").is_ok());
}

#[test]
fn limits_sane() {
    let base = two_tcp("a", "b");
    only(
        &format!("limits: {{ max_header_bytes: 1000 }}\n{base}"),
        1,
        29,
        "max_header_bytes is 1000",
    );
    only(
        &format!("limits: {{ max_header_bytes: 1048577 }}\n{base}"),
        1,
        29,
        "max_header_bytes is 1048577",
    );
    assert!(parse(
        &format!("limits: {{ max_header_bytes: 1024 }}\n{base}"),
        "t"
    )
    .is_ok());
    only(
        &format!("limits:\n  idle_timeout: 0s\n{base}"),
        2,
        17,
        "limits.idle_timeout is zero",
    );
    only(
        &http("      - cluster: api\n        timeout: 0ms\n"),
        7,
        18,
        "timeout is zero",
    );
}

#[test]
fn header_edits_are_valid() {
    only(
        &http("      - cluster: api\n        request_headers_to_add: { \"x bad\": v }\n"),
        7,
        35,
        "`x bad` is not a valid HTTP header name",
    );
    only(
        &http("      - cluster: api\n        response_headers_to_add: { x-ok: \"a\\nb\" }\n"),
        7,
        42,
        "value of header `x-ok` is not a valid HTTP header value",
    );
    only(
        &http(
            "      - cluster: api\n        request_headers_to_remove: [ x-ok, Content-Length ]\n",
        ),
        7,
        44,
        "`Content-Length` cannot be added or removed",
    );
}

#[test]
fn retries_bounded() {
    only(
        &http("      - cluster: api\n        retries: { attempts: 11 }\n"),
        7,
        30,
        "retries.attempts is 11",
    );
    only(
        &http("      - cluster: api\n        retries: { on: [] }\n"),
        7,
        24,
        "retries.on is empty",
    );
    assert!(parse(
        &http("      - cluster: api\n        retries: { attempts: 10, on: [5xx, reset] }\n"),
        "t"
    )
    .is_ok());
}

#[test]
fn retries_grown_up_bounded() {
    only(
        &http("      - cluster: api\n        retries: { per_try_timeout: 0s }\n"),
        7,
        37,
        "retries.per_try_timeout is zero",
    );
    only(
        &http("      - cluster: api\n        retries: { backoff: { base: 1s, max: 10ms } }\n"),
        7,
        46,
        "backoff.max (10ms) is shorter than backoff.base (1s)",
    );
    only(
        &http("      - cluster: api\n        retries: { budget: { ratio: 1.5 } }\n"),
        7,
        37,
        "retries.budget.ratio is 1.5",
    );
    only(
        &http("      - cluster: api\n        retries: { budget: { min_per_s: 100001 } }\n"),
        7,
        41,
        "retries.budget.min_per_s is 100001",
    );
    only(
        &http("      - cluster: api\n        retries: { max_replay_body: 2000000 }\n"),
        7,
        37,
        "retries.max_replay_body is 2000000",
    );
    only(
        &http("      - cluster: api\n        retries: { on: [unavailable, retriable] }\n"),
        7,
        38,
        "unknown value `retriable`",
    );
    let config = parse(
        &http("      - cluster: api\n        retries: { attempts: 2, on: [5xx, unavailable, resource-exhausted, cancelled, deadline-exceeded], per_try_timeout: 250ms, backoff: { base: 10ms }, budget: { ratio: 0.5 }, max_replay_body: 1024 }\n"),
        "t",
    )
    .unwrap();
    let retries = config.listeners[0].routes[0].retries.clone().unwrap();
    assert_eq!(retries.on.len(), 5);
    assert_eq!(retries.on[1].grpc_status(), Some(14));
    assert_eq!(
        retries.per_try_timeout,
        Some(std::time::Duration::from_millis(250))
    );
    assert_eq!(
        retries.backoff().max(),
        std::time::Duration::from_millis(100),
        "10 × base"
    );
    assert_eq!(
        (retries.budget().ratio, retries.budget().min_per_s),
        (0.5, 10)
    );
    assert_eq!(retries.max_replay_body(), 1024);
    // The defaults: Envoy's backoff, Linkerd's budget, 64 KiB of body.
    let config = parse(&http("      - cluster: api\n        retries: {}\n"), "t").unwrap();
    let retries = config.listeners[0].routes[0].retries.clone().unwrap();
    assert_eq!(
        (retries.backoff().base, retries.backoff().max()),
        (
            std::time::Duration::from_millis(25),
            std::time::Duration::from_millis(250)
        )
    );
    assert_eq!(
        (retries.budget().ratio, retries.budget().min_per_s),
        (0.2, 10)
    );
    assert_eq!(retries.max_replay_body(), 64 * 1024);
    assert_eq!(retries.per_try_timeout, None);
}

#[test]
fn no_listeners() {
    only(CLUSTERS, 1, 1, "config has no listeners");
    only(
        &format!("listeners: []\n{CLUSTERS}"),
        1,
        1,
        "config has no listeners",
    );
}

#[test]
fn every_problem_reported_in_file_order() {
    let yaml =
        http("      - cluster: apii\n      - split: []\n      - direct_response: { status: 1 }\n");
    let found: Vec<(usize, usize)> = errors(&yaml).iter().map(|d| (d.line, d.column)).collect();
    assert_eq!(found, vec![(6, 18), (7, 16), (8, 36)]);
}

#[test]
fn connection_and_memory_budgets_sane() {
    let base = two_tcp("a", "b");
    only(
        &format!("limits:\n  max_connections: 0\n{base}"),
        2,
        20,
        "limits.max_connections is 0: it must be between 1 and",
    );
    only(
        &format!("limits:\n  reserved_fds: 2\n{base}"),
        2,
        17,
        "limits.reserved_fds is 2",
    );
    only(
        &format!("limits:\n  http2_stream_window: 100\n{base}"),
        2,
        24,
        "limits.http2_stream_window is 100",
    );
    only(
        &format!("limits:\n  http2_connection_window: 2147483648\n{base}"),
        2,
        28,
        "limits.http2_connection_window is 2147483648",
    );
    only(
        &format!("limits:\n  per_connection_buffer_bytes: 4194304\n  memory_budget_bytes: 1048576\n{base}"),
        3,
        24,
        "limits.memory_budget_bytes is 1048576: it must be at least 4194304",
    );
    only(
        &format!("limits:\n  tcp_idle_timeout: 0s\n{base}"),
        2,
        21,
        "limits.tcp_idle_timeout is zero",
    );
    only(
        &format!("limits:\n  stream_stall_timeout: 0s\n{base}"),
        2,
        25,
        "limits.stream_stall_timeout is zero",
    );
    // A misspelt key gets a suggestion.
    let d = only(
        &format!("limits:\n  max_conections: 5\n{base}"),
        2,
        3,
        "max_conections",
    );
    assert!(d.hint.contains("max_connections"), "{}", d.hint);
    // A listener's own limits: a cap positive and within the node's, the same ranges.
    let own = |limits: &str| {
        format!("limits: {{ max_connections: 100 }}\nlisteners:\n  - name: a\n    address: 127.0.0.1:8080\n    protocol: tcp\n    cluster: db\n    limits: {{ {limits} }}\n{CLUSTERS}")
    };
    only(&own("max_connections: 0"), 7, 32, "max_connections is 0");
    only(
        &own("max_connections: 101"),
        7,
        32,
        "above the node's limits.max_connections (100)",
    );
    only(
        &own("http2_stream_window: 10"),
        7,
        36,
        "listeners[0].limits.http2_stream_window is 10",
    );
    only(
        &own("tcp_idle_timeout: 0s"),
        7,
        33,
        "listeners[0].limits.tcp_idle_timeout is zero",
    );
    only(&own("max_conn: 1"), 7, 15, "max_conn");
    let config = parse(&own("max_connections: 100, tcp_idle_timeout: 5m"), "t")
        .unwrap_or_else(|e| panic!("{e}"));
    let listener = &config.listeners[0];
    assert_eq!(listener.limits.max_connections, Some(100));
    let effective = config.limits.for_listener(listener);
    assert_eq!(
        (effective.tcp_idle_timeout, effective.http2_stream_window),
        (std::time::Duration::from_secs(300), 65536)
    );
    let config = parse(
        &format!("limits: {{ max_connections: 5, http2_max_concurrent_streams: 10, tcp_idle_timeout: 10m }}\n{base}"),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (
            config.limits.max_connections,
            config.limits.http2_max_concurrent_streams,
            config.limits.tcp_idle_timeout
        ),
        (5, 10, std::time::Duration::from_secs(600))
    );
}

#[test]
fn full_example_from_docs_parses_and_round_trips() {
    // The same text as the example in docs/config.md; keep the two in sync.
    let text = include_str!("../tests/data/full.yaml");
    let config = parse(text, "full.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.limits.request_timeout,
        std::time::Duration::from_secs(15)
    );
    let retries = config.listeners[0].routes[1].retries.clone();
    assert_eq!(
        retries.map(|r| (r.attempts, r.on)),
        Some((2, vec![RetryOn::ConnectFailure, RetryOn::GatewayError]))
    );
    let sessions = config
        .cluster("sessions")
        .map(|c| (c.lb, c.hash_on.clone()));
    assert_eq!(
        sessions,
        Some((
            LbPolicy::RingHash,
            Some(HashOn {
                header: "x-user".into()
            })
        ))
    );
    let back: Config = serde_json::from_str(&config.to_json()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, config);
}

#[test]
fn defaults_apply() {
    let config = parse(&two_tcp("a", "b"), "t").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.admin, default_admin());
    assert_eq!(config.workers, None);
    assert_eq!(config.limits, Limits::default());
    assert_eq!(config.clusters[0].lb, LbPolicy::RoundRobin);
    assert_eq!(config.clusters[0].protocol, UpstreamProtocol::Http1);
    let config = parse(&http("      - cluster: api\n        retries: {}\n"), "t")
        .unwrap_or_else(|e| panic!("{e}"));
    let retries = config.listeners[0].routes[0].retries.clone();
    assert_eq!(
        retries.map(|r| (r.attempts, r.on)),
        Some((1, vec![RetryOn::ConnectFailure]))
    );
}

#[test]
fn ipv6_addresses_and_flow_style_config() {
    let text = "{ admin: \"[::1]:15000\", listeners: [ { name: t, address: \"[::1]:8080\", protocol: tcp, cluster: c } ], clusters: [ { name: c, endpoints: [\"[::1]:9000\"] } ] }";
    let config = parse(text, "t").unwrap_or_else(|e| panic!("{e}"));
    assert!(config.listeners[0].address.is_ipv6());
    // Errors inside flow style are located too.
    let bad = text.replace("cluster: c }", "cluster: d }");
    let d = only(&bad, 1, 96, "unknown cluster `d`");
    assert_eq!(d.hint, "defined clusters: c");
}

/// A tcp listener `db` and a kernel section (from line 5 on).
fn with_kernel(kernel: &str) -> String {
    format!("listeners:\n  - name: db\n    address: 127.0.0.1:7000\n    protocol: tcp\n    cluster: db\n{kernel}{CLUSTERS}")
}

#[test]
fn kernel_section_parses_with_its_defaults() {
    let text = with_kernel("kernel: { capture: { cgroup: /sys/fs/cgroup/unified/w, services: [ { address: \"10.96.0.10:80\", listener: db } ] } }\n");
    let config = parse(&text, "t").unwrap_or_else(|e| panic!("{e}"));
    let k = config.kernel.unwrap_or_else(|| panic!("kernel section"));
    assert!(k.redirect && k.tcp_splice && !k.l7_dispatch && !k.l7_stream_parser);
    assert_eq!(k.pin_dir, None);
    assert_eq!(k.capture.map(|c| c.services.len()), Some(1));
}

#[test]
fn kernel_paths_are_absolute() {
    only(
        &with_kernel("kernel: { pin_dir: fm }\n"),
        6,
        20,
        "kernel.pin_dir `fm` is not an absolute path",
    );
    only(
        &with_kernel("kernel: { capture: { cgroup: w, services: [ { address: \"10.0.0.1:80\", listener: db } ] } }\n"),
        6,
        30,
        "is not an absolute path",
    );
}

#[test]
fn kernel_capture_rules() {
    let dup = with_kernel(
        "kernel:\n  capture:\n    cgroup: /sys/fs/cgroup/unified/w\n    services:\n      - { address: \"10.0.0.1:80\", listener: db }\n      - { address: \"10.0.0.1:80\", listener: db }\n",
    );
    only(
        &dup,
        11,
        20,
        "service address 10.0.0.1:80 is captured twice",
    );
    let family = with_kernel(
        "kernel:\n  capture:\n    cgroup: /sys/fs/cgroup/unified/w\n    services:\n      - { address: \"[fd00::1]:80\", listener: db }\n",
    );
    only(&family, 10, 20, "different address families");
    let unknown = with_kernel(
        "kernel:\n  capture:\n    cgroup: /sys/fs/cgroup/unified/w\n    services:\n      - { address: \"10.0.0.1:80\", listener: dbb }\n",
    );
    let d = only(&unknown, 10, 45, "unknown listener `dbb`");
    assert!(d.hint.contains("did you mean `db`"), "{}", d.hint);
    only(
        &with_kernel("kernel: { capture: { cgroup: /sys/fs/cgroup/unified/w, services: [] } }\n"),
        6,
        66,
        "nothing would be captured",
    );
}

#[test]
fn kernel_l7_dispatch_needs_one_http_listener() {
    only(
        &with_kernel("kernel: { l7_dispatch: true }\n"),
        6,
        24,
        "no `http` listener to dispatch",
    );
    only(
        &with_kernel("kernel: { l7_listener: db }\n"),
        6,
        24,
        "listener `db` is not an http listener",
    );
    let d = only(
        &with_kernel("kernel: { sockmap: true }\n"),
        6,
        11,
        "unknown",
    );
    assert!(!d.hint.is_empty());
}

/// `admin:` (from line 1) above two tcp listeners.
fn with_admin(admin: &str) -> String {
    format!("{admin}{}", two_tcp("a", "b"))
}

#[test]
fn admin_is_an_address_or_a_mapping() {
    let short =
        parse(&with_admin("admin: 127.0.0.1:9901\n"), "t").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(short.admin.address.to_string(), "127.0.0.1:9901");
    assert_eq!(short.admin.max_connections, 16);
    let unix = parse(&with_admin("admin: unix:/run/fm/admin.sock\n"), "t")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        unix.admin.address,
        AdminAddress::Unix("/run/fm/admin.sock".into())
    );
    assert_eq!(unix.admin.unix_mode(), 0o600);
    let full = parse(
        &with_admin(
            "admin:\n  address: unix:/run/fm/admin.sock\n  mode: 0o660\n  token: 0123456789abcdef0123\n  open_paths: [/metrics]\n  hosts: [node-1.mesh.internal]\n  max_connections: 4\n  header_read_timeout: 2s\n  request_timeout: 10s\n",
        ),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(full.admin.unix_mode(), 0o660);
    assert_eq!(full.admin.token.as_deref(), Some("0123456789abcdef0123"));
    assert_eq!(full.admin.max_connections, 4);
    assert_eq!(
        full.admin.request_timeout,
        std::time::Duration::from_secs(10)
    );
    // A bare 0600 is text in YAML; it means the same octal bits.
    let text_mode = parse(
        &with_admin("admin: { address: /tmp/a.sock, mode: 0600 }\n"),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(text_mode.admin.mode, Some(0o600));
    // Both forms write back as the mapping and read back equal.
    let back: Config = serde_json::from_str(&full.to_json()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, full);
    let back: Config = serde_json::from_str(&short.to_json()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, short);
}

#[test]
fn admin_reachable_from_other_hosts_is_refused_unless_allowed() {
    let d = only(
        &with_admin("admin: 0.0.0.0:15000\n"),
        1,
        8,
        "admin address 0.0.0.0:15000 can be reached from other hosts",
    );
    assert!(d.hint.contains("allow_remote: true"), "{}", d.hint);
    only(
        &with_admin("admin: { address: \"[::]:15000\" }\n"),
        1,
        19,
        "can be reached from other hosts",
    );
    let allowed = with_admin("admin: { address: 0.0.0.0:15000, allow_remote: true }\n");
    assert!(parse(&allowed, "t").is_ok());
}

#[test]
fn admin_settings_are_checked() {
    let d = only(
        &with_admin("admin: { adress: 127.0.0.1:1 }\n"),
        1,
        10,
        "unknown key `adress`",
    );
    assert!(d.hint.contains("did you mean `address`"), "{}", d.hint);
    only(
        &with_admin("admin: { token: short }\n"),
        1,
        17,
        "it needs at least 16",
    );
    only(
        &with_admin("admin: { token: 0123456789abcdef0123, token_file: /t }\n"),
        1,
        51,
        "both `token` and `token_file`",
    );
    only(
        &with_admin("admin: { open_paths: [/reload] }\n"),
        1,
        23,
        "`/reload` changes the node",
    );
    let d = only(
        &with_admin("admin: { open_paths: [/metric] }\n"),
        1,
        23,
        "unknown admin endpoint `/metric`",
    );
    assert!(d.hint.contains("did you mean `/metrics`"), "{}", d.hint);
    only(
        &with_admin("admin: { address: unix:/a.sock, mode: 0o666 }\n"),
        1,
        39,
        "lets every local user",
    );
    only(
        &with_admin("admin: { mode: 0o600 }\n"),
        1,
        16,
        "the admin endpoint listens on TCP",
    );
    only(
        &with_admin("admin: { address: unix:run/a.sock }\n"),
        1,
        19,
        "is not absolute",
    );
    only(
        &with_admin("admin: { max_connections: 0 }\n"),
        1,
        27,
        "admin.max_connections is 0",
    );
    only(
        &with_admin("admin: { hosts: [\"a:1\"] }\n"),
        1,
        18,
        "is not a host name",
    );
    only(
        &with_admin("admin: localhost:15000\n"),
        1,
        8,
        "invalid admin address `localhost:15000`",
    );
}

#[test]
fn access_log_queue_and_field_sizes_are_bounded() {
    let ok =
        parse(&with_admin("access_log: { path: stderr }\n"), "t").unwrap_or_else(|e| panic!("{e}"));
    let log = ok.access_log.unwrap_or_else(|| panic!("access_log"));
    assert_eq!(log.queue_bytes, DEFAULT_ACCESS_LOG_QUEUE_BYTES);
    assert_eq!(log.max_field_bytes, DEFAULT_ACCESS_LOG_MAX_FIELD_BYTES);
    only(
        &with_admin("access_log: { path: stderr, queue_bytes: 10 }\n"),
        1,
        42,
        "access_log.queue_bytes is 10",
    );
    only(
        &with_admin("access_log: { path: stderr, max_field_bytes: 1000000 }\n"),
        1,
        46,
        "access_log.max_field_bytes is 1000000",
    );
}

#[test]
fn tracing_has_defaults_and_checked_values() {
    let ok = parse(&with_admin("tracing: { otlp: \"jaeger:4317\" }\n"), "t")
        .unwrap_or_else(|e| panic!("{e}"));
    let t = ok.tracing.unwrap_or_else(|| panic!("tracing"));
    assert_eq!(t.otlp, "jaeger:4317");
    assert_eq!(t.sample, DEFAULT_TRACING_SAMPLE);
    assert_eq!(t.service_name, DEFAULT_TRACING_SERVICE_NAME);
    assert_eq!(t.queue, DEFAULT_TRACING_QUEUE);
    only(
        &with_admin("tracing: { otlp: jaeger }\n"),
        1,
        18,
        "tracing.otlp is `jaeger`: it must be the collector's HOST:PORT",
    );
    only(
        &with_admin("tracing: { otlp: \"j:4317\", sample: 1.5 }\n"),
        1,
        36,
        "tracing.sample is 1.5",
    );
    only(
        &with_admin("tracing: { otlp: \"j:4317\", queue: 1 }\n"),
        1,
        35,
        "tracing.queue is 1",
    );
    let unknown = errors(&with_admin("tracing: { otlp: \"j:4317\", sampel: 0.5 }\n"));
    assert!(
        unknown
            .iter()
            .any(|d| d.to_string().contains("did you mean `sample`")),
        "{unknown:#?}"
    );
}

// ---- hardening: durations, paths, upgrades (issue 23) ---------------------------

#[test]
fn durations_past_365_days_are_refused_with_the_limit_named() {
    let d = only(
        &http("      - cluster: api\n        timeout: 9223372036854775807s\n"),
        7,
        18,
        "longest is 365 days",
    );
    assert!(d.hint.contains("250ms"), "{}", d.hint);
    only("limits:\n  request_timeout: 8761h\n", 2, 20, "out of range");
    assert!(parse(&http("      - cluster: api\n        timeout: 8760h\n"), "t").is_ok());
    // A config built in code (or translated from xDS) is checked by validation.
    let mut config = parse(&http("      - cluster: api\n"), "t").unwrap_or_else(|e| panic!("{e}"));
    config.listeners[0].routes[0].timeout = Some(std::time::Duration::from_secs(i64::MAX as u64));
    let problems = crate::validate::validate(&config);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].message.contains("longer than 365 days"),
        "{}",
        problems[0]
    );
}

#[test]
fn path_normalisation_defaults_on_only_where_a_route_denies() {
    let open = parse(&http("      - cluster: api\n"), "t").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(open.listeners[0].path_options(), PathOptions::RAW);
    let deny = parse(
        &http("      - match: { path: { prefix: /admin } }\n        direct_response: { status: 403 }\n      - cluster: api\n"),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(deny.listeners[0].path_options(), PathOptions::STRICT);
    // A route answered 200 (a health check) denies nothing.
    let health = parse(
        &http("      - match: { path: { exact: /healthz } }\n        direct_response: { status: 200 }\n      - cluster: api\n"),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(health.listeners[0].path_options(), PathOptions::RAW);
    // Each key set wins over the default; the others keep theirs.
    let text = "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    merge_slashes: false\n    path_with_escaped_slashes_action: unescape_and_redirect\n    routes:\n      - direct_response: { status: 403 }\n";
    let set = parse(text, "t").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        set.listeners[0].path_options(),
        PathOptions {
            normalize_path: true,
            merge_slashes: false,
            escaped_slashes: EscapedSlashesAction::UnescapeAndRedirect,
        }
    );
    let back: Config = serde_json::from_str(&set.to_json()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, set);
    // A wrong value names the allowed ones.
    let d = only(
        &text.replace("unescape_and_redirect", "redirect"),
        6,
        39,
        "unknown value `redirect`",
    );
    assert!(d.hint.contains("unescape_and_redirect"), "{}", d.hint);
    // tcp listeners read no path.
    only(
        &two_tcp("a", "b").replace(
            "    cluster: db\n  - name: b",
            "    cluster: db\n    normalize_path: true\n  - name: b",
        ),
        6,
        5,
        "tcp listener `a` sets `normalize_path`",
    );
}

#[test]
fn upgrades_are_protocol_names_on_forwarding_routes() {
    let ok = parse(
        &http("      - cluster: api\n        upgrades: [ websocket, \"foo/2\" ]\n"),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.listeners[0].routes[0].upgrades, ["websocket", "foo/2"]);
    only(
        &http("      - cluster: api\n        upgrades: [ \"web socket\" ]\n"),
        7,
        21,
        "`web socket` is not an upgrade protocol name",
    );
    let d = only(
        &http("      - cluster: api\n        upgrades: [ h2c ]\n"),
        7,
        21,
        "`h2c` cannot be listed",
    );
    assert!(d.hint.contains("prior knowledge"), "{}", d.hint);
    only(
        &http("      - direct_response: { status: 200 }\n        upgrades: [ websocket ]\n"),
        7,
        9,
        "lists `upgrades`",
    );
}

#[test]
fn fault_and_mirror_on_a_route() {
    let ok = parse(
        &http("      - cluster: api\n        fault: { abort: { status: 503, percent: 12.5 }, delay: { duration: 2s } }\n        mirror: { cluster: api, percent: 50 }\n"),
        "t",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let route = &ok.listeners[0].routes[0];
    let fault = route.fault.as_ref().unwrap();
    let abort = fault.abort.as_ref().unwrap();
    assert_eq!(
        (abort.status, abort.grpc_status, abort.percent),
        (Some(503), None, 12.5)
    );
    let delay = fault.delay.as_ref().unwrap();
    assert_eq!(
        (delay.duration, delay.percent),
        (std::time::Duration::from_secs(2), 100.0)
    );
    let mirror = route.mirror.as_ref().unwrap();
    assert_eq!((mirror.cluster.as_str(), mirror.percent), ("api", 50.0));

    only(
        &http("      - cluster: api\n        fault: { abort: { status: 503, grpc_status: 14 } }\n"),
        7,
        40,
        "sets both `status` and `grpc_status`",
    );
    only(
        &http("      - cluster: api\n        fault: { abort: { percent: 5 } }\n"),
        7,
        18,
        "has no `status` or `grpc_status`",
    );
    only(
        &http("      - cluster: api\n        fault: { abort: { grpc_status: 17 } }\n"),
        7,
        40,
        "grpc_status 17 is not a gRPC error status",
    );
    only(
        &http("      - cluster: api\n        fault: { abort: { status: 503, percent: 150 } }\n"),
        7,
        49,
        "percent is 150",
    );
    only(
        &http("      - cluster: api\n        fault: { delay: { duration: 0s } }\n"),
        7,
        37,
        "duration is zero",
    );
    only(
        &http("      - cluster: api\n        fault: {}\n"),
        7,
        9,
        "neither `abort` nor `delay`",
    );
    let d = only(
        &http("      - cluster: api\n        mirror: { cluster: apu }\n"),
        7,
        28,
        "unknown cluster `apu`",
    );
    assert!(d.hint.contains("did you mean `api`"), "{}", d.hint);
    only(
        &http("      - direct_response: { status: 200 }\n        mirror: { cluster: api }\n"),
        7,
        9,
        "sets `mirror`",
    );
    let e = parse(
        &http("      - cluster: api\n        mirror: { cluster: api, percnt: 5 }\n"),
        "t",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("percnt"), "{e}");
}

/// One tcp listener to cluster `c`, whose settings start on line 8.
fn guarded(settings: &str) -> String {
    format!(
        "listeners:\n  - name: t\n    address: 127.0.0.1:7000\n    protocol: tcp\n    cluster: c\nclusters:\n  - name: c\n{settings}    endpoints: [127.0.0.1:9001]\n"
    )
}

#[test]
fn circuit_breaker_and_outlier_detection_parse_with_envoy_s_defaults() {
    let config = parse(
        &guarded("    circuit_breaker: { max_requests: 5 }\n    outlier_detection: { consecutive_5xx: 2, base_ejection_time: 1s }\n"),
        "t.yaml",
    )
    .unwrap();
    let c = &config.clusters[0];
    assert_eq!(
        c.breaker(),
        CircuitBreaker {
            max_connections: 1024,
            max_pending: 1024,
            max_requests: 5,
            max_retries: 3,
        }
    );
    assert_eq!(
        c.outlier_detection,
        Some(OutlierDetection {
            consecutive_5xx: 2,
            consecutive_gateway_errors: 0,
            consecutive_connect_failures: 5,
            interval: std::time::Duration::from_secs(10),
            base_ejection_time: std::time::Duration::from_secs(1),
            max_ejection_percent: 10,
            success_rate: SuccessRate {
                enforcing: true,
                minimum_hosts: 5,
                request_volume: 100,
                stdev_factor: 1900,
            },
            failure_percentage: FailurePercentage {
                enforcing: false,
                threshold: 85,
                minimum_hosts: 5,
                request_volume: 50,
            },
        })
    );
    // The interval kinds, each key on its own.
    let config = parse(
        &guarded("    outlier_detection:\n      success_rate: { enforcing: false }\n      failure_percentage: { enforcing: true, threshold: 60, request_volume: 20 }\n"),
        "t.yaml",
    )
    .unwrap();
    let od = config.clusters[0].outlier_detection.clone().unwrap();
    assert!(!od.success_rate.enforcing);
    assert_eq!(od.success_rate.request_volume, 100, "the rest default");
    assert_eq!(
        od.failure_percentage,
        FailurePercentage {
            enforcing: true,
            threshold: 60,
            minimum_hosts: 5,
            request_volume: 20,
        }
    );
    // Without the keys: the breaker's defaults, no outlier detection.
    let plain = parse(&guarded(""), "t.yaml").unwrap();
    assert_eq!(plain.clusters[0].breaker(), CircuitBreaker::default());
    assert_eq!(plain.clusters[0].outlier_detection, None);
}

#[test]
fn circuit_breaker_and_outlier_detection_are_validated_by_line() {
    let d = only(
        &guarded("    circuit_breaker: { max_requests: 0 }\n"),
        8,
        38,
        "max_requests is 0",
    );
    assert!(d.hint.contains("default is 1024"), "{}", d.hint);
    let d = only(
        &guarded("    circuit_breaker: { max_request: 10 }\n"),
        8,
        24,
        "max_request",
    );
    assert!(
        d.hint.starts_with("did you mean `max_requests`?"),
        "{}",
        d.hint
    );
    let d = only(
        &guarded("    outlier_detection:\n      max_ejection_percent: 150\n"),
        9,
        29,
        "cannot pass 100",
    );
    assert!(d.hint.contains("0 to 100"), "{}", d.hint);
    only(
        &guarded("    outlier_detection: { base_ejection_time: 0s }\n"),
        8,
        46,
        "is zero",
    );
    let d = only(
        &guarded(
            "    outlier_detection: { consecutive_5xx: 0, consecutive_connect_failures: 0, success_rate: { enforcing: false } }\n",
        ),
        8,
        5,
        "every kind is off",
    );
    assert!(d.hint.contains("consecutive_5xx"), "{}", d.hint);
    let d = only(
        &guarded("    outlier_detection:\n      failure_percentage: { threshold: 101 }\n"),
        9,
        40,
        "cannot pass 100",
    );
    assert!(d.hint.contains("default is 85"), "{}", d.hint);
    only(
        &guarded("    outlier_detection:\n      success_rate: { minimum_hosts: 0 }\n"),
        9,
        38,
        "at least one is needed",
    );
    let d = only(
        &guarded("    outlier_detection: { consecutive_5xxx: 3 }\n"),
        8,
        26,
        "consecutive_5xxx",
    );
    assert!(
        d.hint.starts_with("did you mean `consecutive_5xx`?"),
        "{}",
        d.hint
    );
}

/// An hbone listener with mutual TLS, then `rest` (indented by 4); `rest` starts on line 6.
fn hbone(rest: &str) -> String {
    format!(
        "listeners:\n  - name: in\n    address: 127.0.0.1:15008\n    protocol: hbone\n    tls: {{ cert: n.pem, key: n.key, client_ca: ca.pem, allow: [ spiffe://td/* ] }}\n{rest}{CLUSTERS}"
    )
}

#[test]
fn hbone_listeners_and_tunnel_clusters() {
    let ok = parse(
        &hbone("    hbone: { destinations: [ 10.0.0.0/8, 127.0.0.1, \"[::1]:80\" ] }\n"),
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.listeners[0].protocol, ListenerProtocol::Hbone);
    // A destination that does not parse, at its own line and column.
    let d = only(
        &hbone("    hbone:\n      destinations: [ 10.0.0.0/8, example.org:80 ]\n"),
        7,
        35,
        "neither an address block",
    );
    assert!(d.hint.contains("IP:PORT"));
    only(
        &hbone("    hbone: { destinations: [ 10.1.0.0/8 ] }\n"),
        6,
        30,
        "bits set past its prefix",
    );
    // Without mutual TLS anyone could tunnel: refused.
    only(
        "listeners:\n  - name: in\n    address: 127.0.0.1:15008\n    protocol: hbone\n",
        2,
        5,
        "has no `tls`",
    );
    only(
        "listeners:\n  - name: in\n    address: 127.0.0.1:15008\n    protocol: hbone\n    tls: { cert: n.pem, key: n.key }\n",
        5,
        5,
        "does not ask for client certificates",
    );
    // What an hbone listener does not use, and `hbone:` where it means nothing.
    only(&hbone("    cluster: db\n"), 6, 5, "which it does not use");
    only(
        &format!("listeners:\n  - name: db\n    address: 127.0.0.1:5432\n    protocol: tcp\n    cluster: db\n    hbone: {{ destinations: [] }}\n{CLUSTERS}"),
        6,
        5,
        "only hbone listeners use",
    );
    // Request-level policies on a listener that sees tunnels, not requests.
    only(
        &hbone("    authorization:\n      policies:\n        - { name: p, action: deny, to: { paths: [ /x ] } }\n"),
        8,
        11,
        "is a hbone listener",
    );
}

#[test]
fn a_tunnel_cluster_needs_tls_and_serves_tcp_and_http_listeners() {
    let tcp = |cluster: &str| {
        format!(
            "listeners:\n  - name: app\n    address: 127.0.0.1:9000\n    protocol: tcp\n    cluster: remote\nclusters:\n{cluster}"
        )
    };
    let tls =
        "tls: { ca: ca.pem, cert: n.pem, key: n.key, server_ids: [ spiffe://td/ns/mesh/sa/node ] }";
    let ok = parse(
        &tcp(&format!(
            "  - {{ name: remote, endpoints: [ 10.0.0.7:80 ], tunnel: hbone, tunnel_port: 15009, {tls} }}\n"
        )),
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.clusters[0].tunnel, Some(Tunnel::Hbone));
    only(
        &tcp("  - name: remote\n    endpoints: [ 10.0.0.7:80 ]\n    tunnel: hbone\n"),
        9,
        5,
        "without `tls`",
    );
    only(
        &tcp(&format!(
            "  - name: remote\n    endpoints: [ 10.0.0.7:80 ]\n    {tls}\n    tunnel_port: 15008\n"
        )),
        10,
        5,
        "does not tunnel",
    );
    only(
        &tcp(&format!(
            "  - name: remote\n    endpoints: [ 10.0.0.7:80 ]\n    {tls}\n    tunnel: hbone\n    tunnel_port: 0\n"
        )),
        11,
        18,
        "tunnel_port 0",
    );
    // Not applied to a tcp listener's tunnels yet, so refused rather than ignored.
    only(
        &tcp(&format!(
            "  - name: remote\n    endpoints: [ 10.0.0.7:80 ]\n    {tls}\n    tunnel: hbone\n    outlier_detection: {{ consecutive_5xx: 3 }}\n"
        )),
        10,
        5,
        "tunnels for tcp listener `app`, whose tunnelled relay runs no circuit breaker or outlier detection yet",
    );
    only(
        &tcp(&format!(
            "  - name: remote\n    endpoints: [ 10.0.0.7:80 ]\n    {tls}\n    tunnel: hbone\n    health_check: {{ tcp: {{}} }}\n"
        )),
        10,
        5,
        "runs no health check yet",
    );
    // An http route to a tunnel cluster, HTTP/1.1 or HTTP/2: its requests ride the tunnel.
    for protocol in ["http1", "http2"] {
        let ok = parse(
            &format!(
                "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes:\n      - cluster: remote\nclusters:\n  - {{ name: remote, endpoints: [ 10.0.0.7:80 ], protocol: {protocol}, tunnel: hbone, {tls} }}\n"
            ),
            "t.yaml",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.clusters[0].tunnel, Some(Tunnel::Hbone));
    }
    // The http path runs a circuit breaker and outlier detection on tunnelled connections;
    // health probes would go past the tunnel, so they stay refused.
    let http = |guards: &str| {
        format!(
            "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes:\n      - cluster: remote\nclusters:\n  - name: remote\n    endpoints: [ 10.0.0.7:80 ]\n    {tls}\n    tunnel: hbone\n{guards}"
        )
    };
    parse(
        &http("    circuit_breaker: { max_connections: 8 }\n    outlier_detection: { consecutive_connect_failures: 2 }\n"),
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    only(
        &http("    health_check: { tcp: {} }\n"),
        11,
        5,
        "runs no health check yet",
    );
}

#[test]
fn health_checks_parse_with_defaults_and_every_expect_form() {
    let config = parse(
        &guarded("    health_check: { http: { path: /healthz }, interval: 200ms }\n"),
        "t.yaml",
    )
    .unwrap();
    let check = config.clusters[0].health_check.clone().unwrap();
    assert_eq!(
        check,
        HealthCheck {
            interval: std::time::Duration::from_millis(200),
            ..HealthCheck::new(HealthCheckKind::Http(HttpHealthCheck {
                path: "/healthz".into(),
                expect: ExpectStatus(vec![(200, 200)]),
            }))
        }
    );
    assert_eq!(check.timeout, std::time::Duration::from_secs(1));
    assert_eq!((check.unhealthy_threshold, check.healthy_threshold), (3, 2));
    for (yaml, ranges) in [
        ("204", vec![(204, 204)]),
        ("\"200-299\"", vec![(200, 299)]),
        ("[200, \"300-302\"]", vec![(200, 200), (300, 302)]),
    ] {
        let config = parse(
            &guarded(&format!(
                "    health_check: {{ http: {{ path: /, expect: {yaml} }} }}\n"
            )),
            "t.yaml",
        )
        .unwrap();
        let check = config.clusters[0].health_check.clone().unwrap();
        let HealthCheckKind::Http(http) = check.kind() else {
            panic!("not http: {check:?}");
        };
        assert_eq!(http.expect.0, ranges, "{yaml}");
        // What is written back reads the same.
        let again: Config =
            serde_norway::from_str(&serde_norway::to_string(&config).unwrap()).unwrap();
        assert_eq!(again.clusters[0].health_check, Some(check));
    }
    let tcp = parse(&guarded("    health_check: { tcp: {} }\n"), "t.yaml").unwrap();
    assert_eq!(
        tcp.clusters[0].health_check.as_ref().map(HealthCheck::kind),
        Some(HealthCheckKind::Tcp)
    );
    let grpc = parse(
        &guarded("    health_check: { grpc: { service: echo } }\n"),
        "t.yaml",
    )
    .unwrap();
    assert_eq!(
        grpc.clusters[0]
            .health_check
            .as_ref()
            .map(HealthCheck::kind),
        Some(HealthCheckKind::Grpc(GrpcHealthCheck {
            service: "echo".into()
        }))
    );
}

#[test]
fn health_checks_are_validated_by_line() {
    let d = only(
        &guarded("    health_check: { interval: 1s }\n"),
        8,
        5,
        "no `http`, `tcp` or `grpc`",
    );
    assert!(d.hint.contains("exactly one"), "{}", d.hint);
    only(
        &guarded("    health_check: { tcp: {}, http: { path: / } }\n"),
        8,
        5,
        "http and tcp",
    );
    only(
        &guarded("    health_check: { tcp: {}, unhealthy_threshold: 0 }\n"),
        8,
        51,
        "unhealthy_threshold is 0",
    );
    only(
        &guarded("    health_check: { tcp: {}, timeout: 0s }\n"),
        8,
        39,
        "is zero",
    );
    only(
        &guarded("    health_check: { http: { path: healthz } }\n"),
        8,
        35,
        "not a request path",
    );
    only(
        &guarded("    health_check: { http: { path: /, expect: \"300-200\" } }\n"),
        8,
        46,
        "not a status from 100 to 599",
    );
    let d = only(
        &guarded("    health_check: { tcp: {}, healthy_treshold: 2 }\n"),
        8,
        30,
        "healthy_treshold",
    );
    assert!(
        d.hint.starts_with("did you mean `healthy_threshold`?"),
        "{}",
        d.hint
    );
}

#[test]
fn drain_timeout_defaults_to_five_seconds_and_reads_a_duration() {
    let routes = "      - match: { path: { prefix: / } }\n        cluster: api\n";
    let config = parse(&http(routes), "t.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.drain_timeout, std::time::Duration::from_secs(5));
    let config = parse(&format!("drain_timeout: 45s\n{}", http(routes)), "t.yaml")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.drain_timeout, std::time::Duration::from_secs(45));
    only(
        &format!("drain_timeout: soon\n{}", http(routes)),
        1,
        16,
        "duration",
    );
}

#[test]
fn rate_limits_parse_with_their_defaults() {
    let yaml = "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    rate_limit: { requests_per_s: 5, key: client_address }\n    routes:\n      - cluster: api\n        rate_limit: { requests_per_s: 10, burst: 20, key: { header: x-user } }\n  - name: t\n    address: 127.0.0.1:8081\n    protocol: tcp\n    cluster: db\n    connection_rate_limit: { connections_per_s: 100 }\n";
    let config = parse(&format!("{yaml}{CLUSTERS}"), "t.yaml").unwrap();
    let web = &config.listeners[0];
    let listener_limit = web.rate_limit.as_ref().unwrap();
    assert_eq!(listener_limit.burst(), 5, "one second's worth by default");
    assert_eq!(
        listener_limit.key,
        Some(RateLimitKey::Named(RateLimitKeyName::ClientAddress))
    );
    assert_eq!(
        web.routes[0].rate_limit,
        Some(RateLimit {
            requests_per_s: 10,
            burst: Some(20),
            key: Some(RateLimitKey::Header {
                header: "x-user".into()
            }),
        })
    );
    let conns = config.listeners[1].connection_rate_limit.as_ref().unwrap();
    assert_eq!(conns.as_rate_limit().burst(), 100);
}

#[test]
fn rate_limits_are_validated_by_line() {
    let d = only(
        &http("      - cluster: api\n        rate_limit: { requests_per_s: 0 }\n"),
        7,
        39,
        "requests_per_s is 0",
    );
    assert!(d.hint.contains("positive rate"), "{}", d.hint);
    only(
        &http("      - cluster: api\n        rate_limit: { requests_per_s: 5, burst: 0 }\n"),
        7,
        49,
        "burst is 0",
    );
    only(
        &http("      - cluster: api\n        rate_limit: { requests_per_s: 5, key: { header: \"x user\" } }\n"),
        7,
        57,
        "not a valid HTTP header name",
    );
    let d = only(
        &http("      - cluster: api\n        rate_limit: { request_per_s: 5 }\n"),
        7,
        23,
        "request_per_s",
    );
    assert!(d.hint.contains("requests_per_s"), "{}", d.hint);
    only(
        &format!("listeners:\n  - name: t\n    address: 127.0.0.1:8081\n    protocol: tcp\n    cluster: db\n    rate_limit: {{ requests_per_s: 5 }}\n{CLUSTERS}"),
        6,
        5,
        "only http listeners use",
    );
    only(
        &http("      - cluster: api\n").replace(
            "    routes:",
            "    connection_rate_limit: { connections_per_s: 5 }\n    routes:",
        ),
        5,
        5,
        "only tcp listeners use",
    );
}

/// A tcp listener on cluster `c` whose lines from line 7 on are `cluster` (its `endpoints:`
/// and anything else), then `tail` at the top level.
fn weighted(cluster: &str, tail: &str) -> String {
    format!(
        "listeners:\n  - name: t\n    address: 127.0.0.1:7000\n    protocol: tcp\n    cluster: c\nclusters:\n  - name: c\n{cluster}{tail}"
    )
}

#[test]
fn endpoint_weights_priorities_and_localities_parse_beside_plain_addresses() {
    let config = parse(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001, { address: 127.0.0.1:9002, weight: 3, priority: 1, locality: us-east1/b } ]\n    overprovisioning_factor: 120\n    slow_start: { window: 30s }\n",
            "node: { locality: us-east1/b/r7 }\n",
        ),
        "t.yaml",
    )
    .unwrap();
    let c = config.cluster("c").unwrap();
    // The addresses, as every reader that needs only those sees them.
    let addresses: Vec<std::net::SocketAddr> = c.endpoints.to_vec();
    assert_eq!(
        addresses,
        vec![
            "127.0.0.1:9001".parse().unwrap(),
            "127.0.0.1:9002".parse().unwrap()
        ]
    );
    assert_eq!(c.endpoints.entries()[0], crate::Endpoint::new(addresses[0]));
    assert_eq!(
        c.endpoints.entries()[1],
        crate::Endpoint {
            address: addresses[1],
            weight: 3,
            priority: 1,
            locality: Some("us-east1/b".into()),
        }
    );
    assert_eq!(c.overprovisioning(), 120);
    assert_eq!(
        c.slow_start,
        Some(crate::SlowStart {
            window: std::time::Duration::from_secs(30),
            aggression: 1.0,
            min_weight_percent: 10,
        })
    );
    assert_eq!(
        config.node.as_ref().and_then(|n| n.locality.as_deref()),
        Some("us-east1/b/r7")
    );
    // Plain entries are written back as addresses, the others as mappings; it reads back equal.
    let json = config.to_json();
    assert!(json.contains("\"127.0.0.1:9001\""), "{json}");
    let back: Config = serde_json::from_str(&json).unwrap();
    assert_eq!(back, config);
    // Without any of it: weight 1, priority 0, the default factor.
    let plain = parse(&weighted("    endpoints: [127.0.0.1:9001]\n", ""), "t.yaml").unwrap();
    let c = plain.cluster("c").unwrap();
    assert!(!c.endpoints.has_attributes());
    assert_eq!(c.overprovisioning(), 140);
}

#[test]
fn endpoint_weights_are_validated_by_line() {
    only(
        &weighted(
            "    endpoints: [ { address: 127.0.0.1:9001, weight: 0 } ]\n",
            "",
        ),
        8,
        53,
        "endpoint weight 0 is out of range",
    );
    only(
        &weighted(
            "    endpoints: [ { address: 127.0.0.1:9001, weight: 129 } ]\n",
            "",
        ),
        8,
        53,
        "out of range",
    );
    only(
        &weighted(
            "    endpoints: [ { address: 127.0.0.1:9001, priority: 128 } ]\n",
            "",
        ),
        8,
        55,
        "endpoint priority 128 is out of range",
    );
    only(
        &weighted(
            "    endpoints: [ { address: 127.0.0.1:9001, locality: a//b } ]\n",
            "",
        ),
        8,
        55,
        "is not region/zone/subzone",
    );
    only(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001 ]\n",
            "node: { locality: a/b/c/d }\n",
        ),
        9,
        19,
        "is not region/zone/subzone",
    );
    only(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001 ]\n    overprovisioning_factor: 0\n",
            "",
        ),
        9,
        30,
        "overprovisioning_factor 0",
    );
    only(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001 ]\n    slow_start: { window: 10s, aggression: 0 }\n",
            "",
        ),
        9,
        44,
        "aggression 0 is out of range",
    );
    only(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001 ]\n    slow_start: { window: 10s, min_weight_percent: 101 }\n",
            "",
        ),
        9,
        52,
        "over 100",
    );
    only(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001 ]\n    lb: maglev\n    slow_start: { window: 10s }\n",
            "",
        ),
        10,
        5,
        "its lb policy hashes",
    );
    only(
        &weighted(
            "    endpoints: [ 127.0.0.1:9001 ]\n    slow_start: {}\n",
            "",
        ),
        9,
        17,
        "window",
    );
    // An unknown key in an endpoint mapping: named, with a suggestion.
    let d = only(
        &weighted(
            "    endpoints: [ { address: 127.0.0.1:9001, wieght: 2 } ]\n",
            "",
        ),
        8,
        45,
        "wieght",
    );
    assert!(d.hint.starts_with("did you mean `weight`?"), "{}", d.hint);
    // A bad plain address still reads as one.
    let d = only(
        &weighted("    endpoints: [ 127.0.0.1:9001, localhost:80 ]\n", ""),
        8,
        34,
        "invalid socket address",
    );
    assert!(d.hint.contains("IP:PORT"), "{}", d.hint);
}

/// A tcp listener `app` to cluster `remote` ({cluster} its extra keys), captured from a VIP
/// ({service} the service's extra keys), then `workloads` from line 13 on.
fn captured(cluster: &str, service: &str, workloads: &str) -> String {
    format!(
        "listeners:\n  - {{ name: app, address: 127.0.0.1:9000, protocol: tcp, cluster: remote }}\n\
         kernel:\n  capture:\n    cgroup: /sys/fs/cgroup/unified/w\n    services:\n      - {{ address: \"10.96.0.1:80\", listener: app{service} }}\n\
         clusters:\n  - {{ name: remote, endpoints: [ 10.0.0.7:80 ]{cluster} }}\n\
         # comment\n# comment\n{workloads}"
    )
}

const TUNNEL: &str =
    ", tunnel: hbone, tls: { ca: ca.pem, server_ids: [ spiffe://td/ns/mesh/sa/node ] }";

#[test]
fn captured_traffic_into_the_mesh_must_tunnel() {
    let d = only(
        &captured("", "", ""),
        7,
        46,
        "would leave the node in the clear",
    );
    assert!(d.message.contains("cluster `remote`") && d.message.contains("10.0.0.7:80"));
    assert!(d.hint.contains("tunnel: hbone") && d.hint.contains("plaintext_ok"));
    for ok in [
        captured(TUNNEL, "", ""),
        captured("", ", plaintext_ok: true", ""),
    ] {
        parse(&ok, "t.yaml").unwrap_or_else(|e| panic!("{e}"));
    }
    // Loopback endpoints are services on this host: nothing leaves the node.
    let local = captured("", "", "").replace("10.0.0.7:80", "127.0.0.1:80");
    parse(&local, "t.yaml").unwrap_or_else(|e| panic!("{e}"));
    // An original_dst cluster leaves for wherever its allow-list lets it.
    let original = |allow: &str| {
        captured("", "", "").replace(
            "endpoints: [ 10.0.0.7:80 ]",
            &format!("type: original_dst, allow: [ {allow} ]"),
        )
    };
    let d = only(
        &original("127.0.0.0/8, 10.0.0.0/8"),
        7,
        46,
        "whose allow-list prefix 10.0.0.0/8 is not on this host's loopback",
    );
    assert!(d.hint.contains("plaintext_ok"));
    parse(&original("127.0.0.0/8"), "t.yaml").unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn workloads_parse_and_say_how_they_are_matched() {
    let text = captured(
        TUNNEL,
        "",
        "workloads:\n  - { name: cart, identity: spiffe://td/ns/shop/sa/cart, cert: c.pem, key: c.key, match: { uid: 1001 } }\n  - { name: web, identity: spiffe://td/ns/shop/sa/web, cert: w.pem, key: w.key, match: { cgroup: /sys/fs/cgroup/unified/w/web } }\n  - { name: db, identity: spiffe://td/ns/shop/sa/db, match: { port: 5432 } }\n",
    );
    let config = parse(&text, "t.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.workloads.len(), 3);
    assert_eq!(config.workloads[0].matches.uid, Some(1001));
    assert!(config.workloads[1].is_client() && !config.workloads[2].is_client());
}

#[test]
fn workload_rules() {
    let w = |line: &str| captured(TUNNEL, "", &format!("workloads:\n  - {line}\n"));
    only(
        &w("{ name: a, identity: spiffe://td/ns/x/sa/a, cert: a.pem, key: a.key, match: { uid: 1, port: 80 } }"),
        13,
        81,
        "exactly one of `cgroup`, `uid` and `port`",
    );
    only(
        &w("{ name: a, identity: spiffe://td/ns/x/sa/a, cert: a.pem, match: { uid: 1 } }"),
        13,
        5,
        "needs both `cert` and `key`",
    );
    only(
        &w("{ name: a, identity: td/ns/x/sa/a, cert: a.pem, key: a.key, match: { uid: 1 } }"),
        13,
        26,
        "is not a SPIFFE ID",
    );
    only(
        &w("{ name: a, identity: spiffe://td/ns/x/*, cert: a.pem, key: a.key, match: { uid: 1 } }"),
        13,
        26,
        "not a pattern",
    );
    only(
        &w("{ name: a, identity: spiffe://td/ns/x/sa/a, match: { port: 0 } }"),
        13,
        64,
        "port 0",
    );
    let two = captured(
        TUNNEL,
        "",
        "workloads:\n  - { name: a, identity: spiffe://td/ns/x/sa/a, cert: a.pem, key: a.key, match: { uid: 7 } }\n  - { name: a, identity: spiffe://td/ns/x/sa/b, cert: b.pem, key: b.key, match: { uid: 7 } }\n",
    );
    let all = errors(&two);
    assert_eq!(all.len(), 2, "{all:#?}");
    assert!(all[0].message.contains("workload name `a` is used twice"));
    assert!(all[1].message.contains("uid 7 already names workload `a`"));
    assert!(all.iter().all(|d| d.line == 14));
    // Matching by cgroup needs the kernel's record of each connection's cgroup.
    let no_kernel = "listeners:\n  - { name: app, address: 127.0.0.1:9000, protocol: tcp, cluster: remote }\nclusters:\n  - { name: remote, endpoints: [ 127.0.0.1:80 ] }\nworkloads:\n  - { name: a, identity: spiffe://td/ns/x/sa/a, cert: a.pem, key: a.key, match: { cgroup: /sys/fs/cgroup/unified/a } }\n";
    let d = only(no_kernel, 6, 91, "only tier K can see");
    assert!(d.hint.contains("uid"));
}

#[test]
fn a_crl_needs_client_certificates_on_a_listener() {
    let listener = |tls: &str| {
        format!(
            "listeners:\n  - name: in\n    address: 127.0.0.1:8443\n    protocol: tcp\n    cluster: api\n    tls: {tls}\n{CLUSTERS}"
        )
    };
    let ok = parse(
        &listener("{ cert: n.pem, key: n.key, client_ca: ca.pem, allow: [ spiffe://td/* ], crl: crl.pem }"),
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let tls = ok.listeners[0]
        .tls
        .as_ref()
        .unwrap_or_else(|| unreachable!());
    assert_eq!(tls.crl.as_deref(), Some(std::path::Path::new("crl.pem")));
    let all = errors(&listener("{ cert: n.pem, key: n.key, crl: crl.pem }"));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(all[0].message.contains("without `client_ca`"), "{}", all[0]);
    assert!(all[0].hint.contains("client_ca"));
    let all = errors(&listener(
        "{ cert: n.pem, key: n.key, client_ca: ca.pem, allow: [ spiffe://td/* ], crl: \"\" }",
    ));
    assert!(
        all.iter().any(|d| d.message.contains("file path is empty")),
        "{all:#?}"
    );
    let cluster = parse(
        "listeners:\n  - name: in\n    address: 127.0.0.1:8443\n    protocol: tcp\n    cluster: api\nclusters:\n  - name: api\n    endpoints: [127.0.0.1:9001]\n    tls: { ca: ca.pem, server_ids: [ spiffe://td/* ], crl: crl.pem }\n",
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let tls = cluster.clusters[0]
        .tls
        .as_ref()
        .unwrap_or_else(|| unreachable!());
    assert_eq!(tls.crl.as_deref(), Some(std::path::Path::new("crl.pem")));
}

/// A tcp listener on cluster `out`, whose settings are `cluster` (indented by 4, from line 7).
fn original_dst(cluster: &str) -> String {
    format!(
        "listeners:\n  - {{ name: capture, address: 127.0.0.1:15001, protocol: tcp, cluster: out }}\nclusters:\n  - name: out\n    type: original_dst\n\n{cluster}"
    )
}

#[test]
fn an_original_dst_cluster_has_an_allow_list_and_no_endpoints() {
    let config = parse(
        &original_dst(
            "    allow: [ 10.0.0.0/8, 192.168.1.7, \"fd00::/8\" ]\n    max_destinations: 64\n",
        ),
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let out = config.cluster("out").unwrap_or_else(|| unreachable!());
    assert_eq!(out.kind, ClusterType::OriginalDst);
    let allow: Vec<String> = out.allow.iter().map(|c| c.to_string()).collect();
    assert_eq!(allow, ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8"]);
    assert_eq!(out.destinations_bound(), 64);
    assert!(out.endpoints.is_empty());

    only(&original_dst(""), 5, 11, "has no `allow` list");
    only(
        &original_dst("    allow: [ 10.0.0.0/8 ]\n    endpoints: [ 127.0.0.1:9001 ]\n"),
        8,
        5,
        "so it has no endpoints",
    );
    only(
        &original_dst("    allow: [ 10.0.0.0/8 ]\n    max_destinations: 0\n"),
        8,
        23,
        "max_destinations is 0",
    );
    only(
        &original_dst("    allow: [ 10.0.0.0/8 ]\n    protocol: http2\n"),
        8,
        15,
        "speaks HTTP/1.1",
    );
    only(
        &original_dst("    allow: [ 10.0.0.0/8 ]\n    health_check: { tcp: {} }\n"),
        8,
        5,
        "`health_check` applies to a list of endpoints",
    );
    // A bad prefix is named where it is written.
    let all = errors(&original_dst("    allow: [ 10.0.0.0/33 ]\n"));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert_eq!(all[0].line, 7, "{}", all[0]);
    assert!(all[0].message.contains("0 to 32"), "{}", all[0]);
    // A misspelt key gets its suggestion.
    let all = errors(&original_dst("    alow: [ 10.0.0.0/8 ]\n"));
    assert!(
        all[0].line == 7 && all[0].to_string().contains("allow"),
        "{all:#?}"
    );
}

#[test]
fn allow_and_max_destinations_belong_to_original_dst_clusters() {
    let yaml = "listeners:\n  - { name: t, address: 127.0.0.1:15001, protocol: tcp, cluster: out }\nclusters:\n  - name: out\n    endpoints: [ 127.0.0.1:9001 ]\n    allow: [ 10.0.0.0/8 ]\n";
    only(yaml, 6, 5, "which only an `original_dst` cluster has");
    let yaml = "listeners:\n  - { name: t, address: 127.0.0.1:15001, protocol: tcp, cluster: out }\nclusters:\n  - name: out\n";
    only(yaml, 4, 5, "has no endpoints");
}

/// A qnp listener; `qnp` (indented by 4) starts on line 5.
fn qnp(section: &str) -> String {
    format!(
        "listeners:\n  - name: kv\n    address: 127.0.0.1:7000\n    protocol: qnp\n{section}{CLUSTERS}"
    )
}

#[test]
fn qnp_listeners() {
    let ok = parse(
        &qnp("    qnp:\n      workers: [ 127.0.0.1:7001, 127.0.0.1:7002 ]\n      rules: |\n        rule 1 0 0 \"a\" -> 0\n        default 1 0 -> 1\n"),
        "t.yaml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.listeners[0].protocol, ListenerProtocol::Qnp);
    let q = ok.listeners[0]
        .qnp
        .as_ref()
        .unwrap_or_else(|| unreachable!());
    assert_eq!(q.workers.len(), 2);
    assert_eq!(q.idle_timeout, std::time::Duration::from_secs(60));
    assert_eq!(q.max_sessions, 4096);
    assert!(q
        .rules
        .as_deref()
        .is_some_and(|r| r.contains("default 1 0 -> 1")));
    // The JSON form (`/config`) parses back.
    let back = parse(&ok.to_json(), "t.json").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, ok);

    only(&qnp(""), 2, 5, "has no `qnp` section");
    only(
        &qnp("    qnp: { workers: [], rules_file: kv.rules }\n"),
        5,
        21,
        "has no workers",
    );
    only(
        &qnp("    qnp: { workers: [ 0.0.0.0:7001 ], rules_file: kv.rules }\n"),
        5,
        23,
        "cannot be sent to",
    );
    only(
        &qnp("    qnp: { workers: [ 127.0.0.1:7001, 127.0.0.1:7001 ], rules_file: kv.rules }\n"),
        5,
        39,
        "listed twice",
    );
    only(
        &qnp("    qnp: { workers: [ 127.0.0.1:7000 ], rules_file: kv.rules }\n"),
        5,
        23,
        "requests would loop",
    );
    only(
        &qnp("    qnp: { workers: [ 127.0.0.1:7001 ] }\n"),
        5,
        5,
        "has no rules",
    );
    only(
        &qnp("    qnp: { workers: [ 127.0.0.1:7001 ], rules: \"\", rules_file: kv.rules }\n"),
        5,
        52,
        "sets both",
    );
    only(
        &qnp("    qnp: { workers: [ 127.0.0.1:7001 ], rules_file: kv.rules, max_sessions: 0 }\n"),
        5,
        77,
        "max_sessions is 0",
    );
    only(
        &qnp("    qnp: { workers: [ 127.0.0.1:7001 ], rules_file: kv.rules, idle_timeout: 0s }\n"),
        5,
        77,
        "is zero",
    );
    let many: Vec<String> = (0..=QNP_MAX_WORKERS)
        .map(|k| format!("127.0.0.1:{}", 10_000 + k))
        .collect();
    only(
        &qnp(&format!(
            "    qnp: {{ workers: [ {} ], rules_file: kv.rules }}\n",
            many.join(", ")
        )),
        5,
        21,
        "more than the 64",
    );
    let long = format!(
        "    qnp:\n      workers: [ 127.0.0.1:7001 ]\n      rules: \"{}\"\n",
        "#".repeat(QNP_MAX_RULES_BYTES + 1)
    );
    only(&qnp(&long), 7, 14, "bytes, more than");
    // What a qnp listener does not use, and `qnp:` where it means nothing.
    only(
        &qnp("    cluster: db\n    qnp: { workers: [ 127.0.0.1:7001 ], rules_file: kv.rules }\n"),
        5,
        5,
        "which it does not use",
    );
    only(
        &format!("listeners:\n  - name: db\n    address: 127.0.0.1:5432\n    protocol: tcp\n    cluster: db\n    qnp: {{ workers: [ 127.0.0.1:7001 ], rules_file: kv.rules }}\n{CLUSTERS}"),
        6,
        5,
        "only qnp listeners use",
    );
    // Its address clashes with another listener's like any listener's.
    only(
        &format!("listeners:\n  - name: db\n    address: 127.0.0.1:7000\n    protocol: tcp\n    cluster: db\n  - name: kv\n    address: 127.0.0.1:7000\n    protocol: qnp\n    qnp: {{ workers: [ 127.0.0.1:7001 ], rules_file: kv.rules }}\n{CLUSTERS}"),
        7,
        14,
        "clashes with listener `db`",
    );
}
