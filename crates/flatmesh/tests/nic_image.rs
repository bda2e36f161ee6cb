//! Tier N on the command line: `flatmesh check --nic-image OUT` writes the QingNiao Matcher
//! image of a config's http listeners, and `flatmesh qnp rules eval` runs it with the bit-exact
//! model. Every decision the image makes is the user tier's (checked here against the same
//! config compiled in the test), and `--explain` says why the other routes stay on the host.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

const CONFIG: &str = r#"
listeners:
  - name: web
    address: 127.0.0.1:18080
    protocol: http
    routes:
      - match: { path: { prefix: /api/v2 }, headers: [ { name: x-canary, exact: "1" } ] }
        cluster: canary
      - match: { path: { exact: /healthz }, method: GET }
        direct_response: { status: 200, body: "ok" }
      - match: { path: { prefix: /api } }
        split: [ { cluster: api, weight: 90 }, { cluster: canary, weight: 10 } ]
      - match: { path: { regex: "^/r[0-9]+$" } }
        cluster: api
      - match: { method: DELETE }
        cluster: api
  - name: db
    address: 127.0.0.1:18081
    protocol: tcp
    cluster: api
  - name: admin-api
    address: 127.0.0.1:18082
    protocol: http
    routes:
      - match: { path: { prefix: / } }
        cluster: api
clusters:
  - { name: api, endpoints: [ 127.0.0.1:9001 ] }
  - { name: canary, endpoints: [ 127.0.0.1:9002 ] }
"#;

/// (app, request line): app 1 is listener 0 `web`, app 3 is listener 2 `admin-api`.
const REQUESTS: [(u8, &str); 12] = [
    (1, "GET /healthz HTTP/1.1"),
    (1, "GET /healthz?probe=1 HTTP/1.1"),
    (1, "POST /healthz HTTP/1.1"),
    (1, "GET /api/items HTTP/1.1"),
    (1, "PUT /api HTTP/1.1"),
    (1, "GET /api/v2/items HTTP/1.1"),
    (1, "GET /r42 HTTP/1.1"),
    (1, "DELETE /anything HTTP/1.1"),
    (1, "GET /nothing HTTP/1.1"),
    (1, "GET http://h/api HTTP/1.1"),
    (3, "GET /x HTTP/1.1"),
    (3, "OPTIONS * HTTP/1.1"),
];

/// What the user tier answers for a request line on listener `app - 1`, as the queue the image
/// must give when it decides (route + 1).
fn user_queue(program: &flatmesh_rules::RuleProgram, app: u8, line: &str) -> u8 {
    let mut words = line.split(' ');
    let (method, target) = (words.next().unwrap(), words.next().unwrap());
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let method = http::Method::from_bytes(method.as_bytes()).unwrap();
    let headers = http::HeaderMap::new();
    let req = flatmesh_rules::Request {
        method: &method,
        host: None,
        path,
        query,
        headers: (&headers).into(),
        message: None,
    };
    program
        .route(usize::from(app) - 1, &req)
        .map_or(0, |r| r.id as u8 + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_writes_the_image_and_rules_eval_runs_it_as_the_user_tier_decides() {
    let dir = TempDir::new();
    let config = dir.write("node.yaml", CONFIG);
    let image = dir.path.join("web.img");
    let out = run_flatmesh(
        &[
            "check",
            "--config",
            config.to_str().unwrap(),
            "--nic-image",
            image.to_str().unwrap(),
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all_output());
    assert!(out.stdout.contains("wrote "), "{}", out.stdout);
    let web = out
        .stdout
        .lines()
        .find(|l| l.contains("listener `web`"))
        .unwrap_or_else(|| panic!("no line for `web`:\n{}", out.stdout));
    assert!(
        web.contains("app 1 type 0") && web.contains("3 of 5 routes decided"),
        "{web}"
    );
    assert!(
        out.stdout.contains("listener `admin-api`: app 3 type 0"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.contains("listener `db`"),
        "tcp listeners have no app"
    );
    let bytes = std::fs::read(&image).unwrap();
    assert_eq!(&bytes[..8], b"QNPIMG01");
    let entries = usize::from(u16::from_be_bytes([bytes[8], bytes[9]]));
    assert!(entries > 0 && entries <= 512, "{entries}");
    assert_eq!(bytes.len(), 10 + entries * 16);

    // Every request line through the bit-exact model: where the image decides (queue > 0),
    // its queue is the user tier's route + 1.
    let inputs: String = REQUESTS
        .iter()
        .map(|(app, line)| format!("{app} 0 \"{line}\"\n"))
        .collect();
    let inputs = dir.write("requests.inputs", &inputs);
    let out = run_flatmesh(
        &[
            "qnp",
            "rules",
            "eval",
            "--image",
            image.to_str().unwrap(),
            "--inputs",
            inputs.to_str().unwrap(),
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all_output());
    let got: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(got.len(), REQUESTS.len(), "{}", out.stdout);
    let program = flatmesh_rules::compile(&flatmesh_config::load(&config).unwrap()).unwrap();
    let mut decided = 0;
    for ((app, line), got) in REQUESTS.iter().zip(&got) {
        let queue: u8 = got
            .parse()
            .unwrap_or_else(|_| panic!("{line}: `{got}` is not a queue"));
        if queue > 0 {
            decided += 1;
            assert_eq!(queue, user_queue(&program, *app, line), "{line}");
        }
    }
    assert_eq!(
        got,
        ["2", "2", "0", "3", "3", "0", "0", "5", "0", "0", "1", "0"],
        "healthz and the split are decided (the query is not part of the path), the header \
         route's superset and the regex go to the host, DELETE is decided, absolute-form and \
         `OPTIONS *` go to the host"
    );
    assert_eq!(decided, 6);

    // --explain: the entries of each app, and per request the lookups and entries hit.
    let out = run_flatmesh(
        &[
            "qnp",
            "rules",
            "eval",
            "--image",
            image.to_str().unwrap(),
            "--inputs",
            inputs.to_str().unwrap(),
            "--explain",
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all_output());
    assert!(out.stdout.contains("# app 1 type 0: "), "{}", out.stdout);
    assert!(out.stdout.contains("# app 3 type 0: "), "{}", out.stdout);
    let first = out.stdout.lines().find(|l| !l.starts_with('#')).unwrap();
    assert!(
        first.starts_with("2  # ") && first.contains("lookups, entries hit: 0 "),
        "{first}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_explain_says_which_routes_the_image_decides_and_why_the_others_stay_on_the_host() {
    let dir = TempDir::new();
    let config = dir.write("node.yaml", CONFIG);
    let out = run_flatmesh(
        &["check", "--config", config.to_str().unwrap(), "--explain"],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all_output());
    let text = &out.stdout;
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}:\n{text}"))
    };
    assert!(
        line("tier N: app 1 type 0, image entries 0..").contains("routes it decides: #1, #2, #4;")
    );
    assert!(line("route 0 stays on the host").contains("header match needs the full request head"));
    assert!(line("route 3 stays on the host").contains("regex runs only in the user tier"));
    assert!(line("tier N: app 3 type 0").contains("routes it decides: #0;"));
    assert!(line("respond 200 (2 bytes)").contains(" q2 "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_image_paths_and_files_say_what_to_do() {
    let dir = TempDir::new();
    let config = dir.write("node.yaml", CONFIG);
    let missing_dir = dir.path.join("no/such/dir/web.img");
    let out = run_flatmesh(
        &[
            "check",
            "--config",
            config.to_str().unwrap(),
            "--nic-image",
            missing_dir.to_str().unwrap(),
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.all_output());
    assert!(
        out.stderr.contains("writing") && out.stderr.contains("check the directory"),
        "{}",
        out.stderr
    );
    let junk = dir.write("junk.img", "not an image");
    let inputs = dir.write("in", "1 0 \"GET / HTTP/1.1\"\n");
    let out = run_flatmesh(
        &[
            "qnp",
            "rules",
            "eval",
            "--image",
            junk.to_str().unwrap(),
            "--inputs",
            inputs.to_str().unwrap(),
        ],
        LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.all_output());
    assert!(
        out.stderr.contains("bad table image") && out.stderr.contains("--nic-image"),
        "{}",
        out.stderr
    );
}
