//! `flatmesh check` and `flatmesh node` on bad configs: exact `FILE:LINE:COL: message` and a
//! `hint:` line. Positions are computed from the YAML text itself (the marked token), so the
//! expected location is exact and cannot drift from the test config.

mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(20);

/// 1-based (line, column) of the `nth` (0-based) occurrence of `needle` in `text`.
fn position_of(text: &str, needle: &str, nth: usize) -> (usize, usize) {
    let offset = text
        .match_indices(needle)
        .nth(nth)
        .unwrap_or_else(|| panic!("test bug: `{needle}` #{nth} not in the config"))
        .0;
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// A good base config; each case edits one spot.
fn base() -> String {
    r#"admin: 127.0.0.1:15999
workers: 1
listeners:
  - name: web
    address: 127.0.0.1:18080
    protocol: http
    routes:
      - name: api
        match:
          path:
            prefix: /api
        cluster: api
        timeout: 2s
      - name: items
        match:
          path:
            regex: ^/v[0-9]+/items
          method: GET
        split:
          - cluster: api
            weight: 90
          - cluster: canary
            weight: 10
      - name: health
        match:
          path:
            exact: /healthz
        direct_response:
          status: 200
          body: ok
  - name: db
    address: 127.0.0.1:18081
    protocol: tcp
    cluster: db
clusters:
  - name: api
    lb: round_robin
    endpoints: [ 127.0.0.1:19001, 127.0.0.1:19002 ]
  - name: canary
    protocol: http2
    endpoints: [ 127.0.0.1:19003 ]
  - name: db
    endpoints: [ 127.0.0.1:19432 ]
"#
    .to_owned()
}

/// Replace the single occurrence of `from` in the base config.
fn edit(from: &str, to: &str) -> String {
    let base = base();
    assert_eq!(
        base.matches(from).count(),
        1,
        "test bug: `{from}` must occur once in the base config"
    );
    base.replace(from, to)
}

/// Run `flatmesh check` on `yaml`; expect failure at the position of `marker` (its `nth`
/// occurrence), a message containing every one of `words`, and a hint containing `hint`.
async fn expect_error(
    case: &str,
    yaml: &str,
    marker: &str,
    nth: usize,
    words: &[&str],
    hint: &str,
) {
    let dir = TempDir::new();
    let path = dir.write("bad.yaml", yaml);
    let path_str = path.to_str().expect("utf-8 temp path");
    let out = run_flatmesh(&["check", "--config", path_str], LIMIT).await;
    let all = out.all_output();
    assert_ne!(
        out.code,
        Some(0),
        "{case}: `flatmesh check` accepted a bad config; output:\n{all}"
    );
    let (line, col) = position_of(yaml, marker, nth);
    let location = format!("{path_str}:{line}:{col}: ");
    let Some(error_line) = all.lines().find(|l| l.contains(&location)) else {
        panic!("{case}: expected an error at `{location}` (the `{marker}` token); output:\n{all}");
    };
    for word in words {
        assert!(
            error_line.to_lowercase().contains(&word.to_lowercase()),
            "{case}: the message should mention `{word}`: {error_line}"
        );
    }
    let Some(hint_line) = all.lines().find(|l| l.trim_start().starts_with("hint:")) else {
        panic!("{case}: no `hint:` line; output:\n{all}");
    };
    assert!(
        hint_line.contains(hint),
        "{case}: hint should contain {hint:?}: {hint_line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn good_config_passes_check() {
    let dir = TempDir::new();
    let path = dir.write("good.yaml", &base());
    let out = run_flatmesh(&["check", "--config", path.to_str().expect("utf-8")], LIMIT).await;
    assert_eq!(
        out.code,
        Some(0),
        "good config rejected:\n{}",
        out.all_output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_prints_every_rule_and_its_tier() {
    let dir = TempDir::new();
    let path = dir.write("good.yaml", &base());
    let out = run_flatmesh(
        &[
            "check",
            "--config",
            path.to_str().expect("utf-8"),
            "--explain",
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "--explain failed:\n{}", out.all_output());
    let text = out.stdout.clone();
    for name in ["api", "items", "health", "canary", "db", "web"] {
        assert!(
            text.contains(name),
            "--explain does not mention `{name}`:\n{text}"
        );
    }
    assert!(
        text.to_lowercase().contains("tier"),
        "--explain does not name tiers:\n{text}"
    );
    // A regex route can only run in the user L7 tier.
    assert!(
        text.contains("U7"),
        "--explain shows no U7 rule, but the regex route needs it:\n{text}"
    );
    assert!(
        text.contains("workloads: none declared"),
        "--explain does not say there are no workloads:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_lists_the_declared_workloads() {
    let dir = TempDir::new();
    let yaml = format!(
        "{}\nworkloads:\n  - name: cart\n    identity: spiffe://shop.test/ns/shop/sa/cart\n    match: {{ port: 18099 }}\n",
        base()
    );
    let path = dir.write("workloads.yaml", &yaml);
    let out = run_flatmesh(
        &[
            "check",
            "--config",
            path.to_str().expect("utf-8"),
            "--explain",
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "--explain failed:\n{}", out.all_output());
    assert!(
        out.stdout.contains("workloads (1):")
            && out.stdout.contains(
                "cart: spiffe://shop.test/ns/shop/sa/cart (listens on port 18099; destination of HBONE streams)"
            ),
        "--explain does not list the workload:\n{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_route_key_suggests_cluster() {
    let yaml = edit(
        "        cluster: api\n        timeout",
        "        clustr: api\n        timeout",
    );
    expect_error(
        "unknown route key",
        &yaml,
        "clustr",
        0,
        &["clustr"],
        "did you mean `cluster`?",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_top_level_key_suggests_listeners() {
    let yaml = base().replacen("listeners:", "listners:", 1);
    expect_error(
        "unknown top-level key",
        &yaml,
        "listners",
        0,
        &["listners"],
        "did you mean `listeners`?",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_cluster_reference_points_at_the_value() {
    let yaml = edit("          - cluster: canary", "          - cluster: canery");
    expect_error("unknown cluster", &yaml, "canery", 0, &["canery"], "canary").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_regex_points_at_the_value() {
    let yaml = edit("regex: ^/v[0-9]+/items", "regex: ^/v([0-9]+/items");
    expect_error(
        "invalid regex",
        &yaml,
        "^/v([0-9]+/items",
        0,
        &["regex"],
        "",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_duration_points_at_the_value() {
    let yaml = edit("timeout: 2s", "timeout: 2x");
    expect_error("bad duration", &yaml, "2x", 0, &["2x"], "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_lb_policy_suggests_the_closest() {
    let yaml = edit("lb: round_robin", "lb: round_robbin");
    expect_error(
        "unknown lb",
        &yaml,
        "round_robbin",
        0,
        &["round_robbin"],
        "did you mean `round_robin`?",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_listener_protocol_lists_the_choices() {
    let yaml = edit("    protocol: tcp", "    protocol: udp");
    expect_error("unknown protocol", &yaml, "udp", 0, &["udp"], "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_type_points_at_the_value() {
    let yaml = edit("workers: 1", "workers: many");
    expect_error("wrong type", &yaml, "many", 0, &["workers"], "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_socket_address_points_at_the_value() {
    let yaml = edit("address: 127.0.0.1:18081", "address: 127.0.0.1:99999");
    expect_error("bad address", &yaml, "127.0.0.1:99999", 0, &["address"], "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_listener_name_points_at_the_second() {
    let yaml = edit("  - name: db\n    address", "  - name: web\n    address");
    // `web` occurs as a listener name twice; the error points at the second value.
    expect_error("duplicate listener", &yaml, "web", 1, &["web"], "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_with_two_actions_is_refused() {
    let yaml = edit(
        "        direct_response:\n          status: 200",
        "        cluster: api\n        direct_response:\n          status: 200",
    );
    // Either action may be named as the offender; the line must be one of the two keys.
    let dir = TempDir::new();
    let path = dir.write("bad.yaml", &yaml);
    let path_str = path.to_str().expect("utf-8");
    let out = run_flatmesh(&["check", "--config", path_str], LIMIT).await;
    let all = out.all_output();
    assert_ne!(
        out.code,
        Some(0),
        "a route with cluster and direct_response was accepted:\n{all}"
    );
    let (l1, c1) = position_of(&yaml, "cluster: api\n        direct_response", 0);
    let (l2, c2) = position_of(&yaml, "direct_response:\n          status: 200", 0);
    let a = format!("{path_str}:{l1}:{c1}: ");
    let b = format!("{path_str}:{l2}:{c2}: ");
    assert!(
        all.contains(&a) || all.contains(&b),
        "expected an error at {a} or {b}:\n{all}"
    );
    assert!(all.contains("hint:"), "no hint:\n{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reads_the_tls_files_as_the_node_would() {
    // The config is well-formed; the certificate it names is not there.
    let dir = TempDir::new();
    let missing = dir.path.join("nowhere/node.pem");
    let yaml = edit(
        "    protocol: tcp",
        &format!(
            "    protocol: tcp\n    tls: {{ cert: {}, key: {} }}",
            missing.display(),
            dir.path.join("node.key").display()
        ),
    );
    let path = dir.write("tls.yaml", &yaml);
    let out = run_flatmesh(&["check", "--config", path.to_str().expect("utf-8")], LIMIT).await;
    let all = out.all_output();
    assert_ne!(
        out.code,
        Some(0),
        "a missing certificate passed check:\n{all}"
    );
    assert!(
        all.contains("listener `db` tls") && all.contains(&missing.display().to_string()),
        "the error names the listener and the file:\n{all}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowercase_method_is_refused_with_a_fix() {
    let yaml = edit("method: GET", "method: get");
    expect_error("lowercase method", &yaml, "get\n", 0, &["get"], "GET").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_syntax_error_gives_its_line() {
    let yaml = edit("    protocol: http\n", "    protocol: http: broken\n");
    let dir = TempDir::new();
    let path = dir.write("bad.yaml", &yaml);
    let path_str = path.to_str().expect("utf-8");
    let out = run_flatmesh(&["check", "--config", path_str], LIMIT).await;
    let all = out.all_output();
    assert_ne!(out.code, Some(0), "broken YAML accepted:\n{all}");
    let (line, _) = position_of(&yaml, "protocol: http: broken", 0);
    assert!(
        all.contains(&format!("{path_str}:{line}:")),
        "expected the error on line {line}:\n{all}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_file_names_the_path() {
    let dir = TempDir::new();
    let missing = dir.path.join("does-not-exist.yaml");
    let missing = missing.to_str().expect("utf-8");
    let out = run_flatmesh(&["check", "--config", missing], LIMIT).await;
    assert_ne!(out.code, Some(0));
    assert!(
        out.all_output().contains(missing),
        "error should name the file:\n{}",
        out.all_output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_refuses_to_start_on_a_bad_config() {
    let yaml = edit(
        "        cluster: api\n        timeout",
        "        clustr: api\n        timeout",
    );
    let dir = TempDir::new();
    let path = dir.write("bad.yaml", &yaml);
    let path_str = path.to_str().expect("utf-8");
    let out = run_flatmesh(&["node", "--config", path_str], LIMIT).await;
    let all = out.all_output();
    assert_ne!(
        out.code,
        Some(0),
        "`flatmesh node` ran with a bad config:\n{all}"
    );
    let (line, col) = position_of(&yaml, "clustr", 0);
    assert!(
        all.contains(&format!("{path_str}:{line}:{col}:")),
        "node's error should locate the problem:\n{all}"
    );
}
