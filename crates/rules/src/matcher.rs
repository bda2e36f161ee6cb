//! Match conditions of one rule (the "match" half of match-action) and how the user tier evaluates them.
//!
//! Semantics follow Envoy's route matching so that configs port over without surprises:
//! - every regex must match the WHOLE value (Envoy `safe_regex`): `/v[0-9]+` does not match `/v1/x`;
//!   write `/v[0-9]+(/.*)?` or `/v[0-9]+.*` to accept a tail;
//! - header names are case-insensitive; several values of one header are joined with `,`
//!   and matched as one value (Envoy does the same);
//! - query parameters are matched on their decoded value (`%xx` and `+` as space, the
//!   `application/x-www-form-urlencoded` rules); the first occurrence of a name counts;
//! - host matching ignores the port and ASCII case.

use std::borrow::Cow;

use http::{HeaderName, Method};
use regex_automata::meta;
use regex_syntax::hir::{Hir, Look};

use crate::protobuf;
use crate::request::{strip_port, Headers, Request};

/// A regex that must match a whole value. Keeps its source text for explain and JSON.
#[derive(Debug, Clone)]
pub struct Pattern {
    pub source: String,
    regex: meta::Regex,
}

/// Bounds that keep a hostile or careless pattern from eating memory at compile time.
const NFA_SIZE_LIMIT: usize = 8 << 20;

/// Parse `source` and anchor it at both ends. Anchoring the parsed tree (not the text, as in
/// `^(?:...)$`) means no pattern can escape the anchors, e.g. through a `(?x)` comment.
pub(crate) fn anchored_hir(source: &str) -> Result<Hir, String> {
    let hir = regex_automata::util::syntax::parse(source).map_err(|e| e.to_string())?;
    Ok(Hir::concat(vec![
        Hir::look(Look::Start),
        hir,
        Hir::look(Look::End),
    ]))
}

pub(crate) fn meta_config() -> meta::Config {
    meta::Config::new().nfa_size_limit(Some(NFA_SIZE_LIMIT))
}

impl Pattern {
    pub fn new(source: &str) -> Result<Pattern, String> {
        let hir = anchored_hir(source)?;
        let regex = meta::Builder::new()
            .configure(meta_config())
            .build_from_hir(&hir)
            .map_err(|e| e.to_string())?;
        Ok(Pattern {
            source: source.to_string(),
            regex,
        })
    }

    pub fn full_match(&self, value: &[u8]) -> bool {
        self.regex.is_match(value)
    }

    /// The literal prefix every match starts with (`/api/v[0-9]+` → `/api/v`); empty if there
    /// is none. The executor's index and the lowerings' supersets both rely on it.
    pub fn guard(&self) -> Vec<u8> {
        // The source parsed when the pattern was built, so this cannot fail; an empty guard
        // is always safe (every value starts with it).
        anchored_hir(&self.source)
            .map(|hir| crate::index::literal_guard(&hir))
            .unwrap_or_default()
    }
}

/// Host condition. Patterns are stored lower-case, without a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    /// `*`: any host, and requests without one.
    Any,
    Exact(String),
    /// `*.example.com` keeps `.example.com`: at least one character must precede it (Envoy).
    Suffix(String),
}

impl HostMatch {
    /// `None` if the pattern has a `*` anywhere but in front, or is empty.
    pub fn parse(pattern: &str) -> Option<HostMatch> {
        let pattern = strip_port(pattern.trim()).to_ascii_lowercase();
        if pattern == "*" {
            return Some(HostMatch::Any);
        }
        let (wild, rest) = match pattern.strip_prefix('*') {
            Some(rest) => (true, rest),
            None => (false, pattern.as_str()),
        };
        if rest.is_empty() || rest.contains('*') {
            return None;
        }
        Some(if wild {
            HostMatch::Suffix(rest.to_string())
        } else {
            HostMatch::Exact(rest.to_string())
        })
    }

    pub fn matches(&self, host: Option<&str>) -> bool {
        let host = match (self, host) {
            (HostMatch::Any, _) => return true,
            (_, None) => return false,
            (_, Some(h)) => strip_port(h).as_bytes(),
        };
        match self {
            HostMatch::Any => true,
            HostMatch::Exact(want) => host.eq_ignore_ascii_case(want.as_bytes()),
            HostMatch::Suffix(suffix) => {
                host.len() > suffix.len()
                    && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            HostMatch::Any => "host *".into(),
            HostMatch::Exact(h) => format!("host {h}"),
            HostMatch::Suffix(s) => format!("host *{s}"),
        }
    }
}

/// Path condition. Exact and prefix compare bytes as received (case-sensitive, not decoded).
#[derive(Debug, Clone)]
pub enum PathCond {
    Exact(String),
    Prefix(String),
    Regex(Pattern),
}

impl PathCond {
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathCond::Exact(p) => path == p,
            PathCond::Prefix(p) => path.starts_with(p.as_str()),
            PathCond::Regex(r) => r.full_match(path.as_bytes()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            PathCond::Exact(p) => format!("path = {p}"),
            PathCond::Prefix(p) => format!("path ^= {p}"),
            PathCond::Regex(r) => format!("path ~ {}", r.source),
        }
    }
}

/// How a header or query value is matched.
#[derive(Debug, Clone)]
pub enum ValueMatch {
    Exact(String),
    Prefix(String),
    /// `true`: the name must be present (any value); `false`: it must be absent.
    Present(bool),
    Regex(Pattern),
}

impl ValueMatch {
    fn describe(&self, name: &str) -> String {
        match self {
            ValueMatch::Exact(v) => format!("{name} = {v:?}"),
            ValueMatch::Prefix(v) => format!("{name} ^= {v:?}"),
            ValueMatch::Present(true) => format!("{name} present"),
            ValueMatch::Present(false) => format!("{name} absent"),
            ValueMatch::Regex(r) => format!("{name} ~ {:?}", r.source),
        }
    }

    /// Match a possibly absent single value.
    fn matches_value(&self, value: Option<&[u8]>) -> bool {
        match (self, value) {
            (ValueMatch::Present(want), v) => v.is_some() == *want,
            (_, None) => false,
            (ValueMatch::Exact(want), Some(v)) => v == want.as_bytes(),
            (ValueMatch::Prefix(want), Some(v)) => v.starts_with(want.as_bytes()),
            (ValueMatch::Regex(r), Some(v)) => r.full_match(v),
        }
    }
}

#[derive(Debug, Clone)]
pub struct HeaderCond {
    pub name: HeaderName,
    pub value: ValueMatch,
}

impl HeaderCond {
    pub fn matches(&self, headers: Headers<'_>) -> bool {
        let all = || headers.values(&self.name);
        let mut iter = all();
        let first = iter.next();
        let second = iter.next();
        match (first, second) {
            (None, _) => self.value.matches_value(None),
            (Some(one), None) => self.value.matches_value(Some(one)),
            // Several values: compare against their `,`-join without building it when we can.
            (Some(_), Some(_)) => match &self.value {
                ValueMatch::Present(want) => *want,
                ValueMatch::Exact(want) => joined_cmp(all(), want.as_bytes(), false),
                ValueMatch::Prefix(want) => joined_cmp(all(), want.as_bytes(), true),
                ValueMatch::Regex(r) => {
                    let mut joined = Vec::new();
                    for (i, v) in all().enumerate() {
                        if i > 0 {
                            joined.push(b',');
                        }
                        joined.extend_from_slice(v);
                    }
                    r.full_match(&joined)
                }
            },
        }
    }

    pub fn describe(&self) -> String {
        format!("header {}", self.value.describe(self.name.as_str()))
    }
}

/// Is `want` equal to (or, with `prefix`, a prefix of) the `,`-join of `values`? No allocation.
fn joined_cmp<'v>(values: impl Iterator<Item = &'v [u8]>, want: &[u8], prefix: bool) -> bool {
    let mut rest = want;
    for (i, v) in values.enumerate() {
        let sep: &[u8] = if i > 0 { b"," } else { b"" };
        for part in [sep, v] {
            if prefix && rest.len() <= part.len() {
                return part.starts_with(rest);
            }
            match rest.strip_prefix(part) {
                Some(r) => rest = r,
                None => return false,
            }
        }
    }
    rest.is_empty()
}

#[derive(Debug, Clone)]
pub struct QueryCond {
    /// Decoded parameter name, compared case-sensitively.
    pub name: String,
    pub value: ValueMatch,
}

impl QueryCond {
    pub fn matches(&self, query: Option<&str>) -> bool {
        let value = query.and_then(|q| first_param(q, &self.name));
        self.value
            .matches_value(value.as_deref().map(str::as_bytes))
    }

    pub fn describe(&self) -> String {
        format!("query {}", self.value.describe(&self.name))
    }
}

/// Decoded value of the first parameter named `name`. Borrows unless decoding changed something.
/// A parameter without `=` has the empty value.
pub fn first_param<'q>(query: &'q str, name: &str) -> Option<Cow<'q, str>> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

/// A condition on one field of the request's first gRPC message (`grpc_field`): its first
/// occurrence in the message's first [`crate::protobuf::MESSAGE_PREFIX_MAX`] bytes, a
/// string/bytes field compared as bytes, a varint field as its unsigned decimal text. A request
/// without a readable first message (not gRPC, compressed, no body) does not match.
#[derive(Debug, Clone)]
pub struct GrpcFieldCond {
    pub number: u32,
    /// `Exact` or `Prefix` only.
    pub value: ValueMatch,
}

impl GrpcFieldCond {
    pub fn matches(&self, message: Option<&[u8]>) -> bool {
        let Some(field) = message.and_then(|m| protobuf::find_field(m, self.number)) else {
            return false;
        };
        let mut digits = [0u8; 20];
        let value = match field {
            protobuf::FieldValue::Bytes(bytes) => bytes,
            protobuf::FieldValue::Varint(v) => decimal(v, &mut digits),
            // Only its start was read: a prefix within it can match, an exact value cannot
            // (it would have to be longer than the bytes read).
            protobuf::FieldValue::Partial { start, .. } => {
                return matches!(&self.value, ValueMatch::Prefix(p) if start.starts_with(p.as_bytes()));
            }
        };
        self.value.matches_value(Some(value))
    }

    pub fn describe(&self) -> String {
        self.value.describe(&format!("grpc field {}", self.number))
    }
}

/// `v` in decimal, written at the end of `buf` (u64 has at most 20 digits).
fn decimal(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[at..];
        }
    }
}

/// All conditions of one rule; an empty match matches every request.
#[derive(Debug, Clone, Default)]
pub struct RuleMatch {
    pub host: Option<HostMatch>,
    pub path: Option<PathCond>,
    pub method: Option<Method>,
    pub headers: Vec<HeaderCond>,
    pub query: Vec<QueryCond>,
    pub grpc_field: Option<GrpcFieldCond>,
}

impl RuleMatch {
    /// Every condition, path included (the linear reference and lowerings use this).
    pub fn matches(&self, req: &Request<'_>) -> bool {
        self.path.as_ref().is_none_or(|p| p.matches(req.path)) && self.matches_except_path(req)
    }

    /// Every condition but the path, which the executor's index has already decided.
    /// Cheapest checks first.
    pub fn matches_except_path(&self, req: &Request<'_>) -> bool {
        self.method.as_ref().is_none_or(|m| m == req.method)
            && self.host.as_ref().is_none_or(|h| h.matches(req.host))
            && self.headers.iter().all(|h| h.matches(req.headers))
            && self.query.iter().all(|q| q.matches(req.query))
            && self
                .grpc_field
                .as_ref()
                .is_none_or(|f| f.matches(req.message))
    }

    /// `path ^= /api, method GET, header x-canary = "1"`, or `*` for the empty match.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(h) = &self.host {
            parts.push(h.describe());
        }
        if let Some(p) = &self.path {
            parts.push(p.describe());
        }
        if let Some(m) = &self.method {
            parts.push(format!("method {m}"));
        }
        parts.extend(self.headers.iter().map(HeaderCond::describe));
        parts.extend(self.query.iter().map(QueryCond::describe));
        parts.extend(self.grpc_field.iter().map(GrpcFieldCond::describe));
        if parts.is_empty() {
            "*".to_string()
        } else {
            parts.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    fn cond(name: &str, value: ValueMatch) -> HeaderCond {
        HeaderCond {
            name: HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value,
        }
    }

    #[test]
    fn regex_must_match_whole_value() {
        let p = Pattern::new("/v[0-9]+").unwrap();
        assert!(p.full_match(b"/v12"));
        assert!(!p.full_match(b"/v12/x"));
        assert!(!p.full_match(b"x/v12"));
        // Alternation binds inside the anchors.
        let p = Pattern::new("a|ab").unwrap();
        assert!(p.full_match(b"ab"));
        assert!(p.full_match(b"a"));
        // A (?x) comment cannot swallow the end anchor.
        let p = Pattern::new("(?x) /a # trailing comment").unwrap();
        assert!(p.full_match(b"/a"));
        assert!(!p.full_match(b"/ab"));
        assert!(Pattern::new("a)|(b").is_err());
        assert!(Pattern::new("(").is_err());
    }

    #[test]
    fn host_exact_and_wildcard() {
        let exact = HostMatch::parse("API.local:8080").unwrap();
        assert_eq!(exact, HostMatch::Exact("api.local".into()));
        assert!(exact.matches(Some("api.LOCAL")));
        assert!(exact.matches(Some("api.local:9999")));
        assert!(!exact.matches(Some("api.local.evil")));
        assert!(!exact.matches(None));

        let wild = HostMatch::parse("*.example.com").unwrap();
        assert!(wild.matches(Some("a.example.com")));
        assert!(wild.matches(Some("a.b.EXAMPLE.com:443")));
        assert!(!wild.matches(Some("example.com")));
        assert!(!wild.matches(Some(".example.com")));
        assert!(!wild.matches(Some("aexample.com")));

        let dash = HostMatch::parse("*-bar.io").unwrap();
        assert!(dash.matches(Some("foo-bar.io")));

        assert_eq!(HostMatch::parse("*"), Some(HostMatch::Any));
        assert!(HostMatch::Any.matches(None));
        assert_eq!(HostMatch::parse(""), None);
        assert_eq!(HostMatch::parse("a.*.com"), None);
        assert_eq!(HostMatch::parse("**.com"), None);
    }

    #[test]
    fn host_suffix_with_multibyte_host_does_not_panic() {
        let wild = HostMatch::parse("*.é.com").unwrap();
        assert!(wild.matches(Some("x.é.com")));
        assert!(!wild.matches(Some("éé")));
        assert!(!wild.matches(Some("ééééééé")));
    }

    #[test]
    fn header_kinds() {
        let map = headers(&[
            ("x-canary", "1"),
            ("X-Tag", "abc"),
            ("x-multi", "a"),
            ("x-multi", "b"),
        ]);
        assert!(cond("x-canary", ValueMatch::Exact("1".into())).matches(Headers::Map(&map)));
        assert!(!cond("x-canary", ValueMatch::Exact("2".into())).matches(Headers::Map(&map)));
        assert!(cond("X-TAG", ValueMatch::Prefix("ab".into())).matches(Headers::Map(&map)));
        assert!(!cond("x-tag", ValueMatch::Prefix("b".into())).matches(Headers::Map(&map)));
        assert!(cond("x-tag", ValueMatch::Present(true)).matches(Headers::Map(&map)));
        assert!(!cond("x-tag", ValueMatch::Present(false)).matches(Headers::Map(&map)));
        assert!(cond("x-none", ValueMatch::Present(false)).matches(Headers::Map(&map)));
        assert!(!cond("x-none", ValueMatch::Present(true)).matches(Headers::Map(&map)));
        assert!(!cond("x-none", ValueMatch::Exact(String::new())).matches(Headers::Map(&map)));
        assert!(!cond("x-none", ValueMatch::Prefix(String::new())).matches(Headers::Map(&map)));
        assert!(
            cond("x-tag", ValueMatch::Regex(Pattern::new("a.c").unwrap()))
                .matches(Headers::Map(&map))
        );
        assert!(
            !cond("x-tag", ValueMatch::Regex(Pattern::new("a").unwrap()))
                .matches(Headers::Map(&map))
        );
    }

    #[test]
    fn multiple_header_values_are_joined_with_comma() {
        let map = headers(&[("x-m", "ab"), ("x-m", "cd"), ("x-m", "")]);
        let exact = |v: &str| cond("x-m", ValueMatch::Exact(v.into())).matches(Headers::Map(&map));
        let prefix =
            |v: &str| cond("x-m", ValueMatch::Prefix(v.into())).matches(Headers::Map(&map));
        assert!(exact("ab,cd,"));
        assert!(!exact("ab,cd"));
        assert!(!exact("ab"));
        assert!(!exact("ab,cd,,"));
        for p in ["", "a", "ab", "ab,", "ab,c", "ab,cd", "ab,cd,"] {
            assert!(prefix(p), "{p}");
        }
        for p in ["b", "ab,d", "ab,cd,x", "abc"] {
            assert!(!prefix(p), "{p}");
        }
        assert!(
            cond("x-m", ValueMatch::Regex(Pattern::new("ab,cd,").unwrap()))
                .matches(Headers::Map(&map))
        );
        assert!(cond("x-m", ValueMatch::Present(true)).matches(Headers::Map(&map)));
    }

    #[test]
    fn raw_header_lines_match_like_the_map() {
        let pairs = [
            ("X-M", "ab"),
            ("x-other", "1"),
            ("x-m", "cd"),
            ("X-Tag", "abc"),
        ];
        let map = headers(&pairs);
        let raw: Vec<httparse::Header<'_>> = pairs
            .iter()
            .map(|(name, value)| httparse::Header {
                name,
                value: value.as_bytes(),
            })
            .collect();
        let conds = [
            cond("x-m", ValueMatch::Exact("ab,cd".into())),
            cond("x-m", ValueMatch::Prefix("ab,c".into())),
            cond("x-tag", ValueMatch::Exact("abc".into())),
            cond("x-tag", ValueMatch::Regex(Pattern::new("a.c").unwrap())),
            cond("x-none", ValueMatch::Present(false)),
            cond("x-other", ValueMatch::Present(true)),
            cond("x-other", ValueMatch::Exact("2".into())),
        ];
        for c in &conds {
            assert_eq!(
                c.matches(Headers::Raw(&raw)),
                c.matches(Headers::Map(&map)),
                "{}",
                c.describe()
            );
        }
    }

    #[test]
    fn query_values_are_decoded_first_occurrence_wins() {
        let q = Some("a=1&b=hello%20world&c=x+y&a=2&flag&e=%ZZ&n%61me=v");
        let qc = |name: &str, value| {
            QueryCond {
                name: name.into(),
                value,
            }
            .matches(q)
        };
        assert!(qc("a", ValueMatch::Exact("1".into())));
        assert!(!qc("a", ValueMatch::Exact("2".into())));
        assert!(qc("b", ValueMatch::Exact("hello world".into())));
        assert!(qc("c", ValueMatch::Exact("x y".into())));
        assert!(qc("b", ValueMatch::Prefix("hello ".into())));
        assert!(qc("flag", ValueMatch::Present(true)));
        assert!(qc("flag", ValueMatch::Exact(String::new())));
        assert!(qc("zz", ValueMatch::Present(false)));
        assert!(!qc("zz", ValueMatch::Present(true)));
        // An invalid escape is kept as is.
        assert!(qc("e", ValueMatch::Exact("%ZZ".into())));
        // Names are decoded too.
        assert!(qc("name", ValueMatch::Exact("v".into())));
        assert!(qc(
            "b",
            ValueMatch::Regex(Pattern::new("hello w.*").unwrap())
        ));
        assert!(!QueryCond {
            name: "a".into(),
            value: ValueMatch::Present(true)
        }
        .matches(None));
        assert!(QueryCond {
            name: "a".into(),
            value: ValueMatch::Present(false)
        }
        .matches(None));
    }

    #[test]
    fn grpc_field_compares_strings_as_bytes_and_varints_as_decimal() {
        // field 1 (string) "vip-7", field 2 (varint) 300.
        let message = [0x0a, 5, b'v', b'i', b'p', b'-', b'7', 0x10, 0xac, 0x02];
        let cond = |number, value| GrpcFieldCond { number, value };
        assert!(cond(1, ValueMatch::Exact("vip-7".into())).matches(Some(&message)));
        assert!(cond(1, ValueMatch::Prefix("vip-".into())).matches(Some(&message)));
        assert!(!cond(1, ValueMatch::Exact("vip".into())).matches(Some(&message)));
        assert!(cond(2, ValueMatch::Exact("300".into())).matches(Some(&message)));
        assert!(cond(2, ValueMatch::Prefix("30".into())).matches(Some(&message)));
        assert!(!cond(2, ValueMatch::Exact("3".into())).matches(Some(&message)));
        assert!(!cond(3, ValueMatch::Prefix(String::new())).matches(Some(&message)));
        // No message (not gRPC, compressed, HTTP/1): nothing matches.
        assert!(!cond(1, ValueMatch::Prefix(String::new())).matches(None));
        assert_eq!(decimal(0, &mut [0; 20]), b"0");
        assert_eq!(
            decimal(u64::MAX, &mut [0; 20]),
            u64::MAX.to_string().as_bytes()
        );
        assert_eq!(
            cond(4, ValueMatch::Prefix("a".into())).describe(),
            "grpc field 4 ^= \"a\""
        );
    }

    #[test]
    fn describe_is_readable() {
        let m = RuleMatch {
            host: HostMatch::parse("*.example.com"),
            path: Some(PathCond::Prefix("/api".into())),
            method: Some(Method::GET),
            headers: vec![cond("x-canary", ValueMatch::Exact("1".into()))],
            query: vec![QueryCond {
                name: "v".into(),
                value: ValueMatch::Present(false),
            }],
            grpc_field: None,
        };
        assert_eq!(
            m.describe(),
            r#"host *.example.com, path ^= /api, method GET, header x-canary = "1", query v absent"#
        );
        assert_eq!(RuleMatch::default().describe(), "*");
    }
}
