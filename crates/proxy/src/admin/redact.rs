//! Secrets out of `/config`: header values a route adds (`request_headers_to_add`,
//! `response_headers_to_add`) or matches on (`match.headers`), and any value whose key is
//! named like a credential (token, secret, password, key, ...) or that holds a PEM private
//! key. The config's shape stays, so the output still shows what is configured where.
//!
//! The rules go by key names rather than by the config's types, so a section added later
//! (TLS keys, say) is covered as long as its keys say what they hold.

use serde_json::Value;

/// What a hidden value reads as.
pub const REDACTED: &str = "[redacted]";

/// Route keys whose values are header values the node sends.
const HEADER_EDITS: &[&str] = &["request_headers_to_add", "response_headers_to_add"];
/// The value fields of a header match.
const MATCH_VALUES: &[&str] = &["exact", "prefix", "regex"];

/// Hide the secrets in a config's JSON form, in place.
pub fn redact(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, child) in map.iter_mut() {
                if HEADER_EDITS.contains(&key.as_str()) {
                    hide_all(child);
                } else if key == "headers" {
                    // A list of header matches: the names stay, what they match is hidden.
                    if let Value::Array(matches) = child {
                        for m in matches.iter_mut().filter_map(Value::as_object_mut) {
                            for field in MATCH_VALUES {
                                if let Some(v) = m.get_mut(*field) {
                                    hide_all(v);
                                }
                            }
                        }
                    }
                } else if names_a_credential(key) {
                    hide_all(child);
                } else {
                    redact(child);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        Value::String(text) if text.contains("PRIVATE KEY-----") => {
            *text = REDACTED.to_string();
        }
        _ => {}
    }
}

/// Replace every scalar under `value` (a string, a map of strings, ...) with [`REDACTED`].
fn hide_all(value: &mut Value) {
    match value {
        Value::Object(map) => map.values_mut().for_each(hide_all),
        Value::Array(items) => items.iter_mut().for_each(hide_all),
        Value::Null => {}
        other => *other = Value::String(REDACTED.to_string()),
    }
}

/// A key that holds a secret: `token`, `api_key`, `client_secret`, `password`, `key`, ...
/// A key that holds where a secret lives (`token_file`, `key_path`) is not one.
fn names_a_credential(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    if ["_file", "_path", "_dir"].iter().any(|s| key.ends_with(s)) {
        return false;
    }
    const WORDS: &[&str] = &[
        "token",
        "secret",
        "password",
        "passwd",
        "credential",
        "private",
        "apikey",
        "api_key",
        "authorization",
        "cookie",
        "signature",
    ];
    key == "key" || key.ends_with("_key") || WORDS.iter().any(|w| key.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_hidden_and_the_rest_is_kept() {
        let mut v = serde_json::json!({
            "admin": { "address": "127.0.0.1:15000", "token": "s3cret-token-value", "token_file": "/etc/t" },
            "listeners": [{
                "name": "web",
                "routes": [{
                    "match": { "path": { "prefix": "/api" }, "headers": [
                        { "name": "authorization", "exact": "Bearer abc" },
                        { "name": "x-canary", "present": true }
                    ]},
                    "request_headers_to_add": { "authorization": "Bearer upstream-secret", "x-env": "prod" },
                    "response_headers_to_add": { "set-cookie": "session=1" }
                }]
            }],
            "tls": { "private_key": "-----BEGIN PRIVATE KEY-----\nMII...", "cert_path": "/c.pem",
                     "inline": "-----BEGIN EC PRIVATE KEY-----\n..." },
            "client_secret": 42
        });
        redact(&mut v);
        let text = v.to_string();
        for secret in [
            "s3cret",
            "Bearer abc",
            "upstream-secret",
            "prod",
            "session=1",
            "MII",
            "EC PRIVATE",
            "42",
        ] {
            assert!(!text.contains(secret), "{secret} leaked: {text}");
        }
        for kept in [
            "127.0.0.1:15000",
            "/etc/t",
            "/api",
            "authorization",
            "x-canary",
            "x-env",
            "/c.pem",
        ] {
            assert!(text.contains(kept), "{kept} lost: {text}");
        }
        assert_eq!(
            v["listeners"][0]["routes"][0]["match"]["headers"][1]["present"],
            true
        );
    }
}
