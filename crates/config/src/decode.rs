//! YAML text → [`Config`] with serde_norway, and its errors → [`Diagnostic`]s
//! with a precise position and a hint.

use crate::error::Diagnostic;
use crate::locate::{LocationIndex, Position, Target};
use crate::model::{Config, PATH_MATCH_MANY, PATH_MATCH_NONE};
use crate::suggest;

pub fn decode(text: &str, origin: &str, index: &LocationIndex) -> Result<Config, Diagnostic> {
    serde_norway::from_str(text).map_err(|error| diagnose(&error, origin, index))
}

fn diagnose(error: &serde_norway::Error, origin: &str, index: &LocationIndex) -> Diagnostic {
    let reported = error.location().map(|l| Position {
        line: l.line().max(1),
        column: l.column().max(1),
    });
    let mut text = error.to_string();
    if let Some(at) = reported {
        // The position is reported separately; drop it from the message.
        text = text.replacen(&format!(" at line {} column {}", at.line, at.column), "", 1);
    }
    let (path, message) = split_path(&text);
    let fallback = reported.unwrap_or(Position::START);
    let (position, message, hint) = explain(path, message, fallback, index);
    Diagnostic {
        origin: origin.to_string(),
        line: position.line,
        column: position.column,
        message,
        hint,
    }
}

/// serde_norway prefixes messages with the path of the failing node:
/// `listeners[0].routes[0]: unknown field ...`. A path has no spaces or backticks,
/// which tells it apart from a message that merely contains `: `.
fn split_path(text: &str) -> (&str, &str) {
    match text.split_once(": ") {
        Some((path, rest)) if !path.is_empty() && !path.contains([' ', '`', '"']) => (path, rest),
        _ => ("", text),
    }
}

fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// The words in backticks, in order: "unknown field `a`, expected `b`" → [a, b].
fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Where a wrong *value* is. For errors raised while reading a struct
/// (custom errors like a bad duration), serde_norway reports the struct's start,
/// so look for the child of `path` holding the quoted text; otherwise the
/// value at `path` itself.
fn value_position(
    path: &str,
    text: Option<&str>,
    reported: Position,
    index: &LocationIndex,
) -> Position {
    text.and_then(|t| index.child_with_scalar(path, t))
        .or_else(|| index.get(path, Target::Value))
        .unwrap_or(reported)
}

fn explain(
    path: &str,
    message: &str,
    reported: Position,
    index: &LocationIndex,
) -> (Position, String, String) {
    let words = backticked(message);

    if let Some(rest) = message.strip_prefix("unknown field ") {
        let field = words.first().copied().unwrap_or_default();
        let allowed: Vec<&str> = backticked(rest).into_iter().skip(1).collect();
        let at = index
            .get(&child(path, field), Target::Key)
            .unwrap_or(reported);
        let hint = if allowed.is_empty() {
            "remove this key: nothing is allowed here".to_string()
        } else {
            format!(
                "{}allowed keys here: {}",
                suggest::did_you_mean(field, allowed.iter().copied()),
                allowed.join(", ")
            )
        };
        return (at, format!("unknown key `{field}`"), hint);
    }

    if message.starts_with("unknown variant ") {
        let value = words.first().copied().unwrap_or_default();
        let allowed: Vec<&str> = words.iter().skip(1).copied().collect();
        let hint = format!(
            "{}allowed values: {}",
            suggest::did_you_mean(value, allowed.iter().copied()),
            allowed.join(", ")
        );
        let at = value_position(path, words.first().copied(), reported, index);
        return (
            at,
            format!("unknown value `{value}`{}", for_key(path)),
            hint,
        );
    }

    if message.starts_with("missing field ") {
        let field = words.first().copied().unwrap_or_default();
        let at = index.get(path, Target::Value).unwrap_or(reported);
        return (
            at,
            format!("missing required key `{field}`{}", in_node(path)),
            format!("add `{field}: ...` to this entry (see docs/config.md)"),
        );
    }

    if message.starts_with("duplicate field ") {
        let field = words.first().copied().unwrap_or_default();
        let at = index.duplicate(&child(path, field)).unwrap_or(reported);
        return (
            at,
            format!("key `{field}` is written twice"),
            "remove one of them: each key may appear once per entry".into(),
        );
    }

    if message == PATH_MATCH_NONE || message == PATH_MATCH_MANY {
        let at = index
            .get(&child(path, "path"), Target::Value)
            .unwrap_or(reported);
        return (
            at,
            message.to_string(),
            "write one of `path: { exact: /x }`, `path: { prefix: /x }`, `path: { regex: \"^/x\" }`".into(),
        );
    }

    if message.starts_with("invalid socket address") {
        let at = value_position(path, words.first().copied(), reported, index);
        return (
            at,
            format!("invalid socket address{}", for_key(path)),
            "write IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080 (host names are not resolved)".into(),
        );
    }

    if message.starts_with("duration ") {
        let at = value_position(path, words.first().copied(), reported, index);
        return (
            at,
            message.to_string(),
            "a duration is a number and a unit: `250ms`, `2s`, `1m`, `1h`".into(),
        );
    }

    if message.starts_with("invalid type: ") || message.starts_with("invalid value: ") {
        let expected = message
            .rsplit_once(", expected ")
            .map(|(_, e)| e)
            .unwrap_or("");
        let at = value_position(path, words.first().copied(), reported, index);
        return (
            at,
            format!("{message}{}", for_key(path)),
            type_hint(expected).into(),
        );
    }

    if message.contains("recursion limit exceeded") {
        return (
            reported,
            "the document is nested too deeply".into(),
            "a flatmesh config is only a few levels deep: check the indentation".into(),
        );
    }

    if message.contains("more than one document") {
        return (
            reported,
            "the file holds more than one YAML document".into(),
            "keep a single document: remove the `---` separators".into(),
        );
    }

    if path.is_empty() {
        // Everything else without a path comes from the YAML scanner/parser itself.
        return (
            reported,
            format!("YAML syntax error: {message}"),
            "check indentation, matching brackets and quotes; quote values that contain `: ` or ` #`".into(),
        );
    }

    let at = value_position(path, words.first().copied(), reported, index);
    (
        at,
        format!("{message}{}", for_key(path)),
        "see docs/config.md for what this key accepts".into(),
    )
}

fn for_key(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!(" for `{path}`")
    }
}

fn in_node(path: &str) -> String {
    if path.is_empty() {
        " at the top level".into()
    } else {
        format!(" in `{path}`")
    }
}

fn type_hint(expected: &str) -> &'static str {
    if expected.starts_with('u') || expected.starts_with('i') || expected.contains("integer") {
        "write a whole number (not negative, no quotes)"
    } else if expected.contains("string") {
        "write text; quote it if YAML could read it as something else, e.g. \"1\""
    } else if expected.contains("sequence") {
        "write a list: `[a, b]` or one `- item` per line"
    } else if expected.contains("bool") {
        "write true or false"
    } else if expected.starts_with("struct") || expected.contains("map") {
        "write a mapping: `key: value` lines or `{ key: value }`"
    } else {
        "see docs/config.md for what this key accepts"
    }
}
