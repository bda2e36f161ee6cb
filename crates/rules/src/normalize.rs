//! Request path normalisation, Envoy's `normalize_path`, `merge_slashes` and
//! `path_with_escaped_slashes_action`: run once on a request's path before any tier matches it,
//! and the result is what the upstream gets, so the rules and the upstream never read two
//! different paths (`/admin` denied, `//admin`, `/./admin`, `/%61dmin` or `/x/../admin` let
//! through to an upstream that reads them all as `/admin`).
//!
//! The steps, in Envoy's order (`ConnectionManagerUtility::maybeNormalizePath`):
//! 1. escaped slashes: `%2F`, `%2f`, `%5C`, `%5c` are kept, refused (400), or unescaped into
//!    `/` and `\` (then the request is redirected there, or goes on);
//! 2. `normalize_path`: percent-escapes of unreserved characters (RFC 3986 §2.3: letters,
//!    digits, `-._~`) are decoded and the hex digits of every other escape upper-cased
//!    (§6.2.2.1, §6.2.2.2); a `%` without two hex digits is refused (400); then dot segments
//!    are removed (§5.2.4), so `/a/./b/../c` is `/a/c`;
//! 3. `merge_slashes`: runs of `/` become one.
//!
//! Paths are case-sensitive (RFC 3986 §6.2.2.1, as in Envoy): `/Admin` is not `/admin`. The
//! query is never touched. A target that does not start with `/` (`OPTIONS *`) is left as is.

use std::borrow::Cow;

use flatmesh_config::{EscapedSlashesAction, PathOptions};

/// One listener's path normalisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PathNormalization {
    options: PathOptions,
}

/// A path the listener matches and forwards, or the redirect it answers instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Normalized<'a> {
    /// Match this path and forward it (borrowed when normalisation changed nothing).
    Path(Cow<'a, str>),
    /// Answer 307 with this path in `Location` (`unescape_and_redirect`): the client asks
    /// again with plain slashes, and that request is matched as usual.
    Redirect(String),
}

/// Why a path is refused (400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathRejection {
    /// `%2F` or `%5C` under `path_with_escaped_slashes_action: reject_request`.
    EscapedSlash,
    /// A `%` not followed by two hex digits, under `normalize_path`.
    BadEscape,
}

impl PathRejection {
    /// What the 400's text says.
    pub fn describe(self) -> &'static str {
        match self {
            PathRejection::EscapedSlash => {
                "the path holds an escaped slash (%2F) or backslash (%5C), which this listener refuses; send them unescaped"
            }
            PathRejection::BadEscape => {
                "the path holds a `%` that is not followed by two hex digits (RFC 3986 §2.1)"
            }
        }
    }
}

/// Whether every normalisation leaves `path` as it is: no `%`, no `//`, no `.` or `..`
/// segment. What tier K checks before it decides a request (`dispatch.bpf.c`), because the
/// kernel cannot normalise: a path that is not plain goes to the user tier.
pub fn is_plain(path: &str) -> bool {
    let bytes = path.as_bytes();
    if bytes.contains(&b'%') {
        return false;
    }
    // Per segment: how many bytes since the last `/`, and whether they were all dots.
    let mut since_slash: Option<usize> = None;
    let mut dots_only = true;
    for &b in bytes {
        if b == b'/' {
            if let Some(n) = since_slash {
                if n == 0 || dots_only && n <= 2 {
                    return false; // `//`, `/./` or `/../`
                }
            }
            since_slash = Some(0);
            dots_only = true;
        } else if let Some(n) = since_slash.as_mut() {
            *n += 1;
            dots_only &= b == b'.';
        }
    }
    // A last segment of `.` or `..`.
    !matches!(since_slash, Some(1 | 2) if dots_only)
}

impl PathNormalization {
    pub fn new(options: PathOptions) -> PathNormalization {
        PathNormalization { options }
    }

    pub fn options(&self) -> PathOptions {
        self.options
    }

    /// `paths as received`, or which steps run: for `--explain`.
    pub fn describe(&self) -> String {
        if self.is_raw() {
            return "paths as received".into();
        }
        let o = self.options;
        let mut steps = Vec::new();
        if o.normalize_path {
            steps.push("normalize_path".to_string());
        }
        if o.merge_slashes {
            steps.push("merge_slashes".to_string());
        }
        if o.escaped_slashes != EscapedSlashesAction::KeepUnchanged {
            steps.push(format!(
                "escaped slashes: {}",
                escaped_name(o.escaped_slashes)
            ));
        }
        format!("paths: {}", steps.join(", "))
    }

    /// The options as `/rules` shows them (the config's keys).
    pub fn to_json(&self) -> serde_json::Value {
        let o = self.options;
        serde_json::json!({
            "normalize_path": o.normalize_path,
            "merge_slashes": o.merge_slashes,
            "path_with_escaped_slashes_action": escaped_name(o.escaped_slashes),
        })
    }

    /// Whether paths are matched and forwarded as received.
    pub fn is_raw(&self) -> bool {
        self.options == PathOptions::RAW
    }

    /// Whether `path` is one this listener matches as it is: normalising changes nothing and
    /// refuses nothing. (A normalised path always is: normalisation is idempotent.)
    pub fn is_normal(&self, path: &str) -> bool {
        matches!(self.apply(path), Ok(Normalized::Path(p)) if p == path)
    }

    /// The path to match and forward, the redirect to answer, or why the path is refused.
    pub fn apply<'a>(&self, path: &'a str) -> Result<Normalized<'a>, PathRejection> {
        let o = self.options;
        if self.is_raw() || !path.starts_with('/') || is_plain(path) {
            return Ok(Normalized::Path(Cow::Borrowed(path)));
        }
        let mut out: Cow<'a, [u8]> = Cow::Borrowed(path.as_bytes());
        let mut redirect = false;
        if o.escaped_slashes != EscapedSlashesAction::KeepUnchanged && has_escaped_slash(&out) {
            match o.escaped_slashes {
                EscapedSlashesAction::RejectRequest => return Err(PathRejection::EscapedSlash),
                EscapedSlashesAction::UnescapeAndRedirect => redirect = true,
                EscapedSlashesAction::UnescapeAndForward | EscapedSlashesAction::KeepUnchanged => {}
            }
            out = Cow::Owned(unescape_slashes(&out));
        }
        if o.normalize_path {
            let decoded = decode_unreserved(&out)?;
            out = Cow::Owned(remove_dot_segments(&decoded));
        }
        if o.merge_slashes && out.windows(2).any(|w| w == b"//") {
            out = Cow::Owned(merge_slashes(&out));
        }
        // Only ASCII sequences were replaced by ASCII bytes, so the text stays UTF-8.
        let text: Cow<'a, str> = match out {
            Cow::Borrowed(_) => Cow::Borrowed(path),
            Cow::Owned(bytes) if bytes == path.as_bytes() => Cow::Borrowed(path),
            Cow::Owned(bytes) => Cow::Owned(
                String::from_utf8(bytes)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
            ),
        };
        Ok(if redirect {
            Normalized::Redirect(text.into_owned())
        } else {
            Normalized::Path(text)
        })
    }
}

/// The config's word for an escaped-slash action.
fn escaped_name(action: EscapedSlashesAction) -> &'static str {
    match action {
        EscapedSlashesAction::KeepUnchanged => "keep_unchanged",
        EscapedSlashesAction::RejectRequest => "reject_request",
        EscapedSlashesAction::UnescapeAndRedirect => "unescape_and_redirect",
        EscapedSlashesAction::UnescapeAndForward => "unescape_and_forward",
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// `%2F`, `%2f`, `%5C` or `%5c` at `at`: the byte it stands for.
fn escaped_slash_at(path: &[u8], at: usize) -> Option<u8> {
    match path.get(at..at + 3)? {
        [b'%', b'2', b'f' | b'F'] => Some(b'/'),
        [b'%', b'5', b'c' | b'C'] => Some(b'\\'),
        _ => None,
    }
}

fn has_escaped_slash(path: &[u8]) -> bool {
    (0..path.len()).any(|i| escaped_slash_at(path, i).is_some())
}

fn unescape_slashes(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        match escaped_slash_at(path, i) {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(path[i]);
                i += 1;
            }
        }
    }
    out
}

/// RFC 3986 §2.3.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Decodes escapes of unreserved characters and upper-cases the hex of the others.
fn decode_unreserved(path: &[u8]) -> Result<Vec<u8>, PathRejection> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        if path[i] != b'%' {
            out.push(path[i]);
            i += 1;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            path.get(i + 1).copied().and_then(hex),
            path.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(PathRejection::BadEscape);
        };
        let value = hi << 4 | lo;
        if is_unreserved(value) {
            out.push(value);
        } else {
            out.push(b'%');
            out.push(path[i + 1].to_ascii_uppercase());
            out.push(path[i + 2].to_ascii_uppercase());
        }
        i += 3;
    }
    Ok(out)
}

/// RFC 3986 §5.2.4 on an absolute path (it starts with `/`): `.` segments go, a `..` segment
/// takes the one before it along (never past the root), and a path that ended in a dot
/// segment keeps its trailing `/`.
fn remove_dot_segments(path: &[u8]) -> Vec<u8> {
    let rest = path.strip_prefix(b"/").unwrap_or(path);
    let segments: Vec<&[u8]> = rest.split(|b| *b == b'/').collect();
    let last = segments.len() - 1;
    let mut kept: Vec<&[u8]> = Vec::with_capacity(segments.len());
    for (i, segment) in segments.into_iter().enumerate() {
        match segment {
            b"." => {}
            b".." => {
                kept.pop();
            }
            s => {
                kept.push(s);
                continue;
            }
        }
        if i == last {
            kept.push(b"");
        }
    }
    let mut out = Vec::with_capacity(path.len());
    for segment in kept {
        out.push(b'/');
        out.extend_from_slice(segment);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    out
}

fn merge_slashes(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    for &b in path {
        if !(b == b'/' && out.last() == Some(&b'/')) {
            out.push(b);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: [EscapedSlashesAction; 4] = [
        EscapedSlashesAction::KeepUnchanged,
        EscapedSlashesAction::RejectRequest,
        EscapedSlashesAction::UnescapeAndRedirect,
        EscapedSlashesAction::UnescapeAndForward,
    ];

    fn every_option() -> impl Iterator<Item = PathNormalization> {
        [false, true].into_iter().flat_map(|normalize_path| {
            [false, true].into_iter().flat_map(move |merge_slashes| {
                ALL.into_iter().map(move |escaped_slashes| {
                    PathNormalization::new(PathOptions {
                        normalize_path,
                        merge_slashes,
                        escaped_slashes,
                    })
                })
            })
        })
    }

    fn strict() -> PathNormalization {
        PathNormalization::new(PathOptions::STRICT)
    }

    fn path(n: PathNormalization, p: &str) -> String {
        match n.apply(p) {
            Ok(Normalized::Path(p)) => p.into_owned(),
            other => panic!("{p}: {other:?}"),
        }
    }

    #[test]
    fn the_walk_arounds_of_the_attack_run_all_become_the_denied_path() {
        // Issue 23 item 5: each of these reached the backend past a deny route on `/x`.
        for walk in [
            "//x",
            "/./x",
            "/%78",
            "/a/../x",
            "/%2e/x",
            "/a/%2E%2E/x",
            "///x",
            "/a/b/../../x",
        ] {
            assert_eq!(path(strict(), walk), "/x", "{walk}");
        }
        // Case is not folded: paths are case-sensitive, as in RFC 3986 and Envoy.
        assert_eq!(path(strict(), "/X"), "/X");
    }

    #[test]
    fn rfc_3986_dot_segments() {
        let n = PathNormalization::new(PathOptions {
            normalize_path: true,
            merge_slashes: false,
            escaped_slashes: EscapedSlashesAction::KeepUnchanged,
        });
        for (raw, want) in [
            ("/", "/"),
            ("/a/b/c/./../../g", "/a/g"),
            ("/mid/content=5/../6", "/mid/6"),
            ("/a/b/.", "/a/b/"),
            ("/a/b/..", "/a/"),
            ("/..", "/"),
            ("/../a", "/a"),
            ("/a/..b/.c", "/a/..b/.c"),
            ("/a//b", "/a//b"),
            ("/a//..", "/a/"),
            ("/a/./", "/a/"),
            ("/%7euser/%41%2d%5F", "/~user/A-_"),
            ("/a%2fb%3f", "/a%2Fb%3F"),
            ("/%252e%252e/", "/%252e%252e/"),
        ] {
            assert_eq!(path(n, raw), want, "{raw}");
        }
        assert_eq!(n.apply("/a%zz"), Err(PathRejection::BadEscape));
        assert_eq!(n.apply("/a%4"), Err(PathRejection::BadEscape));
        assert_eq!(n.apply("/a%"), Err(PathRejection::BadEscape));
        // `OPTIONS *` and other non-paths are left alone.
        assert_eq!(path(n, "*"), "*");
    }

    #[test]
    fn escaped_slashes_follow_the_action() {
        let with = |escaped_slashes| {
            PathNormalization::new(PathOptions {
                normalize_path: true,
                merge_slashes: true,
                escaped_slashes,
            })
        };
        let raw = "/a%2F..%2f..%5Cb";
        assert_eq!(
            with(EscapedSlashesAction::RejectRequest).apply(raw),
            Err(PathRejection::EscapedSlash)
        );
        assert_eq!(
            path(with(EscapedSlashesAction::KeepUnchanged), raw),
            "/a%2F..%2F..%5Cb"
        );
        // Unescaped first, then normalised: the dot segments the escapes hid are removed.
        assert_eq!(
            path(with(EscapedSlashesAction::UnescapeAndForward), raw),
            "/..\\b"
        );
        assert_eq!(
            path(with(EscapedSlashesAction::UnescapeAndForward), "/a%2F%2Fb"),
            "/a/b"
        );
        assert_eq!(
            with(EscapedSlashesAction::UnescapeAndRedirect).apply("/a%2Fb"),
            Ok(Normalized::Redirect("/a/b".into()))
        );
        // Without an escaped slash there is nothing to redirect.
        assert_eq!(
            with(EscapedSlashesAction::UnescapeAndRedirect).apply("/a//b"),
            Ok(Normalized::Path("/a/b".into()))
        );
    }

    #[test]
    fn raw_listeners_change_nothing_and_plain_paths_are_borrowed() {
        let raw = PathNormalization::new(PathOptions::RAW);
        assert!(raw.is_raw());
        for p in ["//x", "/./x", "/%2F", "/a%zz"] {
            assert!(matches!(raw.apply(p), Ok(Normalized::Path(Cow::Borrowed(q))) if q == p));
        }
        assert!(matches!(
            strict().apply("/api/v1/items"),
            Ok(Normalized::Path(Cow::Borrowed(_)))
        ));
        for (p, plain) in [
            ("/", true),
            ("/a/b/", true),
            ("/a.b/..c/...", true),
            ("/a//b", false),
            ("//", false),
            ("/./a", false),
            ("/a/../b", false),
            ("/a/.", false),
            ("/..", false),
            ("/a%41", false),
            ("*", true),
        ] {
            assert_eq!(is_plain(p), plain, "{p}");
        }
    }

    /// Paths built from the pieces that matter: slashes, dots, escapes (valid, of unreserved
    /// characters, of slashes, invalid) and letters.
    fn path_strategy() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("/"),
            Just("."),
            Just(".."),
            Just("a"),
            Just("B"),
            Just("%2e"),
            Just("%2F"),
            Just("%5c"),
            Just("%41"),
            Just("%3f"),
            Just("%25"),
            Just("%"),
            Just("%g1"),
            Just("~"),
            Just("\\"),
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|p| format!("/{}", p.concat()))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

        /// A normalised path is normal (normalising it again changes and refuses nothing),
        /// starts with `/`, and has no dot segments and, with merge_slashes, no `//`.
        #[test]
        fn normalisation_is_idempotent(p in path_strategy()) {
            for n in every_option() {
                let out = match n.apply(&p) {
                    Ok(Normalized::Path(out)) => out.into_owned(),
                    Ok(Normalized::Redirect(out)) => out,
                    Err(_) => continue,
                };
                prop_assert!(out.starts_with('/'), "{p} -> {out} with {n:?}");
                // A redirect's target too: the client's second request goes through.
                prop_assert!(n.is_normal(&out), "{p} -> {out} is not normal with {n:?}");
                if n.options().normalize_path {
                    let segments: Vec<&str> = out.split('/').collect();
                    prop_assert!(!segments.contains(&".") && !segments.contains(&".."), "{p} -> {out}");
                }
                if n.options().merge_slashes {
                    prop_assert!(!out.contains("//"), "{p} -> {out}");
                }
            }
        }

        /// A plain path is normal under every option: what lets tier K decide it as received.
        #[test]
        fn plain_paths_are_normal_everywhere(p in path_strategy()) {
            if is_plain(&p) {
                for n in every_option() {
                    prop_assert!(n.is_normal(&p), "{p} with {n:?}");
                }
            }
        }
    }
}
