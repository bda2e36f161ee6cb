//! The Matcher's tables (§4.2.1–4.2.2) and its bit-exact reference model: the layout, the
//! compiler and the model live in `flatmesh_rules::image` (tier N of the rule program lowers
//! http routes to the same image) and are re-exported here; a QNP rule file compiles with
//! [`Image::compile`] (see docs/qnp.md, "The Matcher's image"). This module adds the input
//! files of `flatmesh qnp rules eval`.

pub use flatmesh_rules::image::{
    compile_app, skip_and_checks, AppEntries, CamEntry, Image, RamEntry, CHECK_BYTES, MAX_STATES,
    MISS_BIT, TABLE_ENTRIES,
};

use crate::QnpError;

impl From<flatmesh_rules::RulesError> for QnpError {
    /// The image code's errors: a table that is full, or an image file that is not one.
    fn from(e: flatmesh_rules::RulesError) -> QnpError {
        match e {
            flatmesh_rules::RulesError::TableFull(msg) => QnpError::TableFull(msg),
            flatmesh_rules::RulesError::BadImage(msg) => QnpError::Image(msg),
            // The image code returns no other variant.
            other => QnpError::Config(other.to_string()),
        }
    }
}

/// One line of a `flatmesh qnp rules eval` input file: `app_id req_type value`, the value as
/// hex (`757365723a`) or as a quoted string (`"GET /api HTTP/1.1"`, with `\\`, `\"` and
/// `\xHH` escapes), or left out for an empty value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalInput {
    pub app_id: u8,
    pub req_type: u8,
    /// The field value. The Matcher reads it for whichever field index the rules name.
    pub value: Vec<u8>,
}

/// The first whitespace-separated word of `s` and the text after it.
fn next_word(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    let end = s.find(char::is_whitespace).unwrap_or(s.len());
    s.split_at(end)
}

/// The bytes of a quoted value (`s` starts at its opening quote); nothing may follow it.
fn quoted(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '"' if s[i + 1..].trim().is_empty() => return Ok(out),
            '"' => {
                return Err(format!(
                    "unexpected `{}` after the quoted value",
                    s[i + 1..].trim()
                ))
            }
            '\\' => match chars.next() {
                Some((_, '\\')) => out.push(b'\\'),
                Some((_, '"')) => out.push(b'"'),
                Some((_, 'x')) => {
                    let hex: String = chars.by_ref().take(2).map(|(_, c)| c).collect();
                    let b = (hex.len() == 2)
                        .then(|| u8::from_str_radix(&hex, 16).ok())
                        .flatten()
                        .ok_or_else(|| {
                            format!("`\\x{hex}` is not a byte; write two hex digits, like `\\x0d`")
                        })?;
                    out.push(b);
                }
                other => {
                    return Err(format!(
                        "unknown escape `\\{}`; use `\\\\`, `\\\"` or `\\xHH`",
                        other.map_or(String::new(), |(_, c)| c.to_string())
                    ))
                }
            },
            c => {
                let mut buf = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    Err("the quoted value has no closing `\"`".into())
}

/// Parses an eval input file; blank lines and `#` comments are skipped.
pub fn parse_eval_inputs(file: &str, src: &str) -> Result<Vec<EvalInput>, QnpError> {
    let mut out = Vec::new();
    for (i, raw) in src.lines().enumerate() {
        let text = raw.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let err = |msg: String| QnpError::Rules {
            file: file.to_owned(),
            line: i + 1,
            msg,
        };
        let (app, rest) = next_word(text);
        let (ty, rest) = next_word(rest);
        let rest = rest.trim();
        if ty.is_empty() {
            return Err(err(
                "expected `app_id req_type value` (the value in hex or in double quotes), found 1 word".into(),
            ));
        }
        let num = |s: &str, what: &str| {
            s.parse::<u8>()
                .map_err(|_| err(format!("{what} `{s}` is not a number in 0..=255")))
        };
        let value = if rest.starts_with('"') {
            quoted(rest).map_err(&err)?
        } else {
            if rest.split_whitespace().count() > 1 {
                return Err(err(format!(
                    "expected `app_id req_type value`, found {} words; write a value with spaces in double quotes",
                    2 + rest.split_whitespace().count()
                )));
            }
            let hex = rest;
            if hex.len() % 2 != 0 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err(format!(
                    "`{hex}` is not hex; write the value as pairs of hex digits, like 757365723a, or in double quotes"
                )));
            }
            (0..hex.len())
                .step_by(2)
                .map(|j| u8::from_str_radix(&hex[j..j + 2], 16).map_err(|e| err(e.to_string())))
                .collect::<Result<Vec<u8>, _>>()?
        };
        out.push(EvalInput {
            app_id: num(app, "app_id")?,
            req_type: num(ty, "req_type")?,
            value,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Decision, RuleSet};

    const EXAMPLE: &str =
        "rule 1 0 0 \"...AAA.BB\" -> 3\nrule 1 0 0 \"user:\" -> 1\ndefault 1 0 -> 0\n";

    #[test]
    fn compiles_the_issue_example() {
        let set = RuleSet::parse("r", EXAMPLE).unwrap();
        let img = Image::compile(&set).unwrap();
        // start + rule 1 (2 steps × hit+miss) + rule 2 (1 step × hit+miss)
        assert_eq!(img.cam.len(), 7);
        assert_eq!(
            img.ram[0],
            RamEntry {
                field: 0,
                skip: 3,
                check: 3,
                state: 1
            }
        );
        assert_eq!(&img.cam[1].string[..3], b"AAA");
        for (v, want) in [
            (&b"FEFAAACBB"[..], Decision::Queue(3)),
            (b"FEFBAACBB", Decision::Queue(0)),
            (b"user:x", Decision::Queue(1)),
            (b"FEFAAACB", Decision::Queue(0)),
        ] {
            assert_eq!(img.run(1, 0, |_| Some(v)).0, want, "{v:?}");
        }
        assert_eq!(img.run(2, 0, |_| Some(b"x")).0, Decision::Drop);
        let back = Image::from_bytes(&img.to_bytes()).unwrap();
        assert_eq!(back, img);
        let text = img.explain();
        assert!(text.contains("exit -> queue 3"), "{text}");
        assert!(text.contains("state 1 matched \"AAA\" -> RAM 1"), "{text}");
    }

    #[test]
    fn reports_how_far_over_the_table_a_rule_set_is() {
        let src: String = (0..300)
            .map(|i| format!("rule 1 0 {} \"k{i}\" -> 1\n", i % 3))
            .collect();
        let set = RuleSet::parse("r", &src).unwrap();
        let e = Image::compile(&set).unwrap_err().to_string();
        assert!(
            e.contains("need 600 RAM and 600 CAM entries") && e.contains("88 entries over"),
            "{e}"
        );
        // Distinct first checks share one state; each rule's three later checks need their own.
        let src: String = (0..50)
            .map(|i| format!("rule 1 0 0 \"{i:03}.a.b.c\" -> 1\n"))
            .collect();
        let e = Image::compile(&RuleSet::parse("r", &src).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs 130 check states by rule line 43"), "{e}");
    }

    #[test]
    fn rules_with_one_shape_share_a_state_and_one_lookup() {
        // 500 single-check rules: one shared state, 500 hit entries, one start entry.
        let src: String = (0..500)
            .map(|i| {
                format!(
                    "rule 1 0 0 \"..\\x{:02x}\\x{:02x}\" -> {}\n",
                    i / 256,
                    i % 256,
                    i % 7
                )
            })
            .collect();
        let set = RuleSet::parse("r", &src).unwrap();
        let img = Image::compile(&set).unwrap();
        assert_eq!(img.cam.len(), 501);
        for i in [0usize, 250, 499] {
            let v = [b'x', b'y', (i / 256) as u8, (i % 256) as u8];
            let (d, lookups) = img.run(1, 0, |_| Some(&v[..]));
            assert_eq!(d, Decision::Queue((i % 7) as u8));
            assert_eq!(
                lookups, 2,
                "start + one CAM lookup, whatever the rule's position"
            );
        }
        assert_eq!(
            img.run(1, 0, |_| Some(&b"xy\x02\x00"[..])).0,
            Decision::Drop
        );
    }

    #[test]
    fn rules_that_differ_late_share_their_leading_checks() {
        // 32 rules of 48 skip-and-checks that differ only in the last: 47 shared states and one
        // distinguishing state, instead of 32 × 48 states.
        let src: String = (0..32)
            .map(|r| {
                let mut p: String = (0..47)
                    .map(|k| format!(".\\x{:02x}bcd\\x00", k + 1))
                    .collect();
                p.push_str(&format!(".\\x{r:02x}bcd\\x01"));
                format!("rule 1 0 0 \"{p}\" -> {}\n", r % 4)
            })
            .collect();
        let set = RuleSet::parse("r", &src).unwrap();
        assert_eq!(set.rules.iter().map(skip_and_checks).max(), Some(48));
        let img = Image::compile(&set).unwrap();
        // start + 47 shared hits + 32 distinguishing hits; no fall-through (no default).
        assert_eq!(img.cam.len(), 1 + 47 + 32);
        assert!(img.cam.iter().all(|c| c.state <= 48));
        let value = |r: u8| -> Vec<u8> {
            let mut v: Vec<u8> = (0..47u8)
                .flat_map(|k| [b'-', k + 1, b'b', b'c', b'd', 0])
                .collect();
            v.extend_from_slice(&[b'-', r, b'b', b'c', b'd', 1]);
            v
        };
        for r in [0u8, 17, 31] {
            let v = value(r);
            let (d, lookups) = img.run(1, 0, |_| Some(&v[..]));
            assert_eq!(d, Decision::Queue(r % 4));
            assert_eq!(lookups, 49, "start + one lookup per skip-and-check");
        }
        let mut miss = value(3);
        miss[6 * 20 + 2] = b'X';
        assert_eq!(img.run(1, 0, |_| Some(&miss[..])).0, Decision::Drop);
        // With a default, a miss in the shared prefix or at the last check falls through to it.
        let with_default = RuleSet::parse("r", &format!("{src}default 1 0 -> 9\n")).unwrap();
        let img = Image::compile(&with_default).unwrap();
        assert_eq!(img.run(1, 0, |_| Some(&miss[..])).0, Decision::Queue(9));
        let mut last = value(3);
        last[6 * 47 + 1] = 200;
        assert_eq!(img.run(1, 0, |_| Some(&last[..])).0, Decision::Queue(9));
    }

    #[test]
    fn a_group_ends_where_first_match_order_needs_it() {
        // "ab.x" and "ab.y" share "ab" and differ at the last check; "ab" alone cannot join
        // (it is the prefix itself), nor can "ab.x" again (same bytes as a member).
        let set = RuleSet::parse(
            "r",
            "rule 1 0 0 \"ab.x\" -> 1\nrule 1 0 0 \"ab.y\" -> 2\nrule 1 0 0 \"ab.x\" -> 3\nrule 1 0 0 \"ab\" -> 4\ndefault 1 0 -> 5\n",
        )
        .unwrap();
        let img = Image::compile(&set).unwrap();
        for (v, want) in [
            (&b"ab-x"[..], 1),
            (b"ab-y", 2),
            (b"ab-z", 4),
            (b"a", 5),
            (b"abyx", 1),
        ] {
            assert_eq!(img.run(1, 0, |_| Some(v)).0, Decision::Queue(want), "{v:?}");
            assert_eq!(set.eval(1, 0, |_| Some(v)), Decision::Queue(want), "{v:?}");
        }
        // "ac.d" checks the same shape at its second step as "a.a" and "a.b" but its first
        // step differs: it must not join their group.
        let set = RuleSet::parse(
            "r",
            "rule 1 0 0 \"a.a\" -> 1\nrule 1 0 0 \"a.b\" -> 2\nrule 1 0 0 \"ac.d\" -> 3\n",
        )
        .unwrap();
        let img = Image::compile(&set).unwrap();
        for (v, want) in [(&b"aczd"[..], 3), (b"azb", 2), (b"aca", 1)] {
            assert_eq!(img.run(1, 0, |_| Some(v)).0, Decision::Queue(want), "{v:?}");
            assert_eq!(set.eval(1, 0, |_| Some(v)), Decision::Queue(want), "{v:?}");
        }
    }

    #[test]
    fn parses_eval_inputs() {
        let v = parse_eval_inputs("in", "# c\n1 0 757365723a\n\n2 3\n").unwrap();
        assert_eq!(
            v[0],
            EvalInput {
                app_id: 1,
                req_type: 0,
                value: b"user:".to_vec()
            }
        );
        assert!(v[1].value.is_empty());
        let e = parse_eval_inputs("in", "1 0 7g").unwrap_err().to_string();
        assert!(e.starts_with("in:1: `7g` is not hex"), "{e}");
        assert!(parse_eval_inputs("in", "1 0 abc").is_err());
        assert!(parse_eval_inputs("in", "1").is_err());
        assert!(parse_eval_inputs("in", "1 0 00 00").is_err());
        assert!(parse_eval_inputs("in", "1 x 00")
            .unwrap_err()
            .to_string()
            .contains("req_type `x`"));
        // A quoted value, as an http image's request line is easier written.
        let v = parse_eval_inputs(
            "in",
            "1 0 \"GET /a?b=1 HTTP/1.1\"\n1 0 \"a\\\"b\\\\c\\x0d\"  \n",
        )
        .unwrap();
        assert_eq!(v[0].value, b"GET /a?b=1 HTTP/1.1");
        assert_eq!(v[1].value, b"a\"b\\c\r");
        for (bad, says) in [
            ("1 0 \"open", "no closing"),
            ("1 0 \"a\" b", "unexpected `b`"),
            ("1 0 \"\\q\"", "unknown escape"),
            ("1 0 \"\\x4\"", "two hex digits"),
        ] {
            let e = parse_eval_inputs("in", bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
