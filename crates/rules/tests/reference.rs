//! The executor against a naive reference matcher on 1,000 random routes.
//!
//! The reference below is written straight from the documented semantics, on the config model,
//! with the `regex` crate and a hand-written query decoder: it shares no code with the crate.
//! A seeded generator draws routes and requests from a small vocabulary so that many routes
//! overlap and ordering decides most answers.

// Test helpers may unwrap: the workspace allows it in tests (clippy.toml), helpers included.
#![allow(clippy::unwrap_used)]

use flatmesh_config::{Config, NamedMatch, PathMatch, Route, RouteMatch};
use flatmesh_rules::{compile, Request};
use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// xorshift64*: small, seeded, good enough to draw test cases.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

const SEGMENTS: &[&str] = &["a", "b", "api", "v1", "items", "42", "x y", "%2F"];
const REGEXES: &[&str] = &[
    "/a/[0-9]+",
    "/(a|b)/s1.*",
    "/api(/.*)?",
    "/v1/items/[0-9]+",
    "/[a-z]+",
    "/s[0-9]/.*42",
    ".*/items/[0-9]+",
    "/b",
];
const HOSTS: &[&str] = &["a.local", "*.local", "*", "B.Local", "x.a.local:80"];
const VALUES: &[&str] = &["1", "12", "abc", "", "a b", "x"];
const HEADERS: &[&str] = &["x-a", "X-B"];
const PARAMS: &[&str] = &["q", "id", "a b"];

fn path(rng: &mut Rng) -> String {
    let depth = if rng.chance(5) { 0 } else { 1 + rng.below(3) };
    path_of_depth(rng, depth)
}

fn path_of_depth(rng: &mut Rng, depth: usize) -> String {
    let mut p = String::new();
    for _ in 0..depth {
        p.push('/');
        // A few fixed segments that regexes care about, and enough others to keep paths apart.
        if rng.chance(50) {
            p.push_str(rng.pick(SEGMENTS));
        } else {
            p.push_str(&format!("s{}", rng.below(16)));
        }
    }
    if p.is_empty() || rng.chance(10) {
        p.push('/');
    }
    p
}

fn named(rng: &mut Rng, names: &[&str]) -> NamedMatch {
    let mut m = NamedMatch {
        name: rng.pick(names).to_string(),
        exact: None,
        prefix: None,
        present: None,
        regex: None,
    };
    let v = rng.pick(VALUES).to_string();
    match rng.below(5) {
        0 => m.exact = Some(v),
        1 => m.prefix = Some(v),
        2 => m.present = Some(true),
        3 => m.present = Some(false),
        _ => {
            m.regex = Some(
                rng.pick(&["[0-9]+", "a.*", "", ".*,.*", "a b|x"])
                    .to_string(),
            )
        }
    }
    m
}

/// Which regexes a table draws from, and what share of its routes are regex routes.
struct Mix {
    regexes: &'static [&'static str],
    regex_percent: usize,
}

/// Many regexes, some without a literal guard: lookups take the multi-pattern pass.
const REGEX_HEAVY: Mix = Mix {
    regexes: REGEXES,
    regex_percent: 20,
};
/// A few regexes, each behind a specific literal guard: lookups check them one by one.
const REGEX_LIGHT: Mix = Mix {
    regexes: &[
        "/a/[0-9]+",
        "/api(/.*)?",
        "/v1/items/[0-9]+",
        "/s[0-9]/.*42",
        "/b",
    ],
    regex_percent: 2,
};

fn route(rng: &mut Rng, mix: &Mix) -> Route {
    let roll = rng.below(100);
    let path = match roll {
        // Mostly deep paths: a shallow prefix near the top would shadow everything after it.
        0..=29 => Some(PathMatch::Exact(path(rng))),
        30..=69 => {
            let depth = 1 + rng.below(3);
            Some(PathMatch::Prefix(path_of_depth(rng, depth)))
        }
        _ if roll < 70 + mix.regex_percent => {
            Some(PathMatch::Regex(rng.pick(mix.regexes).to_string()))
        }
        _ => None,
    };
    let mut m = RouteMatch {
        path,
        ..Default::default()
    };
    if rng.chance(20) {
        m.host = Some(rng.pick(HOSTS).to_string());
    }
    if rng.chance(20) {
        m.method = Some(rng.pick(&["GET", "POST"]).to_string());
    }
    // A route without a path condition always gets a rare exact header, for the same reason.
    if m.path.is_none() {
        let token = format!("t{}", rng.below(32));
        m.headers.push(NamedMatch {
            name: "x-t".into(),
            exact: Some(token),
            prefix: None,
            present: None,
            regex: None,
        });
    }
    while rng.chance(20) {
        m.headers.push(named(rng, HEADERS));
    }
    while rng.chance(20) {
        m.query.push(named(rng, PARAMS));
    }
    // Built from YAML so fields the config model gains later take their defaults.
    let mut route: Route = serde_norway::from_str("cluster: c").unwrap();
    route.matches = m;
    route
}

struct OwnedRequest {
    method: Method,
    host: Option<String>,
    path: String,
    query: Option<String>,
    headers: HeaderMap,
}

/// Half the requests aim at a random route's path, so late routes get reached too.
fn request(rng: &mut Rng, routes: &[Route]) -> OwnedRequest {
    let mut headers = HeaderMap::new();
    if rng.chance(30) {
        headers.insert(
            "x-t",
            HeaderValue::from_str(&format!("t{}", rng.below(32))).unwrap(),
        );
    }
    while rng.chance(40) {
        let name = HeaderName::from_bytes(rng.pick(HEADERS).as_bytes()).unwrap();
        headers.append(name, HeaderValue::from_str(rng.pick(VALUES)).unwrap());
    }
    let query = rng.chance(60).then(|| {
        let mut parts = Vec::new();
        while parts.is_empty() || rng.chance(40) {
            let name = rng.pick(&["q", "id", "a+b", "a%20b", "i%64", "zz"]);
            let value = rng.pick(&["1", "12", "abc", "a+b", "a%20b", "%31", "%zz", ""]);
            parts.push(if rng.chance(10) {
                name.to_string()
            } else {
                format!("{name}={value}")
            });
        }
        parts.join("&")
    });
    OwnedRequest {
        method: if rng.chance(70) {
            Method::GET
        } else {
            Method::POST
        },
        host: rng.chance(70).then(|| {
            rng.pick(&[
                "a.local",
                "A.LOCAL:8080",
                "x.a.local",
                "b.local",
                "local",
                "[::1]:80",
            ])
            .to_string()
        }),
        path: match &routes[rng.below(routes.len())].matches.path {
            Some(PathMatch::Exact(p)) if rng.chance(50) => p.clone(),
            Some(PathMatch::Prefix(p)) if rng.chance(50) => format!("{p}{}", path(rng)),
            Some(PathMatch::Regex(_)) if rng.chance(50) => rng
                .pick(&[
                    "/a/123",
                    "/b/s1/y",
                    "/api",
                    "/api/v1",
                    "/v1/items/7",
                    "/abc",
                    "/s3/x42",
                    "/b",
                ])
                .to_string(),
            _ => path(rng),
        },
        query,
        headers,
    }
}

// ---- the naive reference -------------------------------------------------------------

fn full_match(pattern: &str, value: &[u8]) -> bool {
    thread_local! {
        static CACHE: std::cell::RefCell<std::collections::HashMap<String, regex::bytes::Regex>> = Default::default();
    }
    CACHE.with(|c| {
        c.borrow_mut()
            .entry(pattern.to_string())
            .or_insert_with(|| regex::bytes::Regex::new(&format!("^(?:{pattern})$")).unwrap())
            .is_match(value)
    })
}

fn no_port(h: &str) -> &str {
    if h.starts_with('[') {
        return &h[..h.find(']').map_or(h.len(), |i| i + 1)];
    }
    match h.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !host.contains(':') => {
            host
        }
        _ => h,
    }
}

fn host_ok(pattern: &str, host: Option<&str>) -> bool {
    let pattern = no_port(pattern).to_ascii_lowercase();
    if pattern == "*" {
        return true;
    }
    let Some(host) = host else { return false };
    let host = no_port(host).to_ascii_lowercase();
    match pattern.strip_prefix('*') {
        Some(suffix) => host.len() > suffix.len() && host.ends_with(suffix),
        None => host == pattern,
    }
}

fn value_ok(m: &NamedMatch, value: Option<&[u8]>) -> bool {
    if let Some(p) = m.present {
        return value.is_some() == p;
    }
    let Some(v) = value else { return false };
    if let Some(e) = &m.exact {
        return v == e.as_bytes();
    }
    if let Some(p) = &m.prefix {
        return v.starts_with(p.as_bytes());
    }
    full_match(m.regex.as_deref().unwrap(), v)
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_value(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter(|p| !p.is_empty())
        .find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k) == name).then(|| decode(v))
        })
}

fn reference(routes: &[Route], r: &OwnedRequest) -> Option<usize> {
    routes.iter().position(|route| {
        let m = &route.matches;
        let path_ok = match &m.path {
            None => true,
            Some(PathMatch::Exact(p)) => r.path == *p,
            Some(PathMatch::Prefix(p)) => r.path.starts_with(p.as_str()),
            Some(PathMatch::Regex(p)) => full_match(p, r.path.as_bytes()),
        };
        let headers_ok = m.headers.iter().all(|h| {
            let values: Vec<&[u8]> = r
                .headers
                .get_all(h.name.to_ascii_lowercase().as_str())
                .iter()
                .map(|v| v.as_bytes())
                .collect();
            let joined = values.join(&b","[..]);
            value_ok(h, (!values.is_empty()).then_some(&joined[..]))
        });
        let query_ok = m.query.iter().all(|q| {
            let v = query_value(r.query.as_deref(), &q.name);
            value_ok(q, v.as_deref().map(str::as_bytes))
        });
        path_ok
            && m.host
                .as_deref()
                .is_none_or(|h| host_ok(h, r.host.as_deref()))
            && m.method
                .as_deref()
                .is_none_or(|want| r.method.as_str() == want)
            && headers_ok
            && query_ok
    })
}

#[test]
fn reference_decoder_agrees_with_known_cases() {
    assert_eq!(decode("a%20b+c%zz%4"), "a b c%zz%4");
    assert_eq!(
        query_value(Some("x=1&i%64=2&id=3"), "id").as_deref(),
        Some("2")
    );
    assert_eq!(query_value(Some("flag&x"), "flag").as_deref(), Some(""));
}

#[test]
fn thousand_routes_agree_with_the_naive_reference() {
    let mut total_hits = 0;
    for (seed, mix) in [
        (1u64, &REGEX_HEAVY),
        (0x5eed, &REGEX_HEAVY),
        (0xdead_beef, &REGEX_LIGHT),
    ] {
        let mut rng = Rng(seed);
        let routes: Vec<Route> = (0..1000).map(|_| route(&mut rng, mix)).collect();
        let mut cfg: Config = serde_norway::from_str(
            "listeners: [ { name: web, address: 127.0.0.1:1, protocol: http } ]\n\
             clusters: [ { name: c, endpoints: [127.0.0.1:2] } ]",
        )
        .unwrap();
        cfg.listeners[0].routes = routes.clone();
        let program = compile(&cfg).unwrap();
        let mut hits = std::collections::HashSet::new();
        for _ in 0..3000 {
            let r = request(&mut rng, &routes);
            let view = Request {
                method: &r.method,
                host: r.host.as_deref(),
                path: &r.path,
                query: r.query.as_deref(),
                headers: (&r.headers).into(),
                message: None,
            };
            let want = reference(&routes, &r);
            let got = program.route(0, &view).map(|c| c.id);
            assert_eq!(
                got, want,
                "seed {seed:#x}: {} {:?} path {:?} query {:?} headers {:?}\nexecutor chose {:?}, reference {:?}",
                r.method, r.host, r.path, r.query, r.headers,
                got.map(|i| &routes[i].matches), want.map(|i| &routes[i].matches)
            );
            assert_eq!(program.route_linear(0, &view).map(|c| c.id), want);
            if let Some(id) = want {
                hits.insert(id);
            }
        }
        // The generator must exercise many distinct routes, not one catch-all.
        assert!(
            hits.len() > 100,
            "seed {seed:#x}: only {} distinct routes hit",
            hits.len()
        );
        total_hits += hits.len();
    }
    println!("distinct winning routes over 3 seeds: {total_hits}");
}
