//! Skip-and-check dispatch rules (§3.3). The rule file syntax is a contract:
//!
//! ```text
//! # app_id req_type field_index "pattern" -> queue
//! rule 1 0 0 "...AAA.BB" -> 3
//! rule 1 0 0 "user:" -> 1
//! default 1 0 -> 0
//! ```
//!
//! In a pattern `.` skips one byte; `\.` is a literal dot, `\\` a backslash, `\xHH` one byte, and
//! any other character stands for itself (its UTF-8 bytes). A rule matches when the field value is
//! at least as long as the pattern and every non-skip byte is equal. The first matching rule in
//! file order wins; with no match the app/type's `default` applies; with no default the request is
//! dropped.
//!
//! [`RuleSet::eval`] is the plain semantics; [`FastMatcher`] is the software dispatcher's matcher.
//! The rule types ([`Rule`], [`PatByte`], [`Decision`]) are shared with tier N of the rule
//! program (`flatmesh_rules::skipcheck`), which lowers http routes to the same Matcher image.

use crate::QnpError;
use flatmesh_rules::skipcheck::RuleTable;
use std::collections::BTreeMap;

pub use flatmesh_rules::skipcheck::{Decision, PatByte, Rule};

/// A parsed rule file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleSet {
    /// Rules in file order.
    pub rules: Vec<Rule>,
    /// `(app_id, req_type) -> (queue, line)`.
    pub defaults: BTreeMap<(u8, u8), (u8, usize)>,
}

impl RuleSet {
    /// Parses a rule file. `file` names it in errors.
    pub fn parse(file: &str, src: &str) -> Result<RuleSet, QnpError> {
        let mut set = RuleSet::default();
        for (i, raw) in src.lines().enumerate() {
            let line = i + 1;
            let err = |msg: String| QnpError::Rules {
                file: file.to_owned(),
                line,
                msg,
            };
            let text = raw.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let (kw, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
            match kw {
                "rule" => {
                    let (head, tail) = rest.split_once('"').ok_or_else(|| {
                        err("expected `rule APP TYPE FIELD \"PATTERN\" -> QUEUE`: the pattern must be in double quotes".into())
                    })?;
                    let nums: Vec<&str> = head.split_whitespace().collect();
                    let [app, ty, field] = nums[..] else {
                        return Err(err(format!(
                            "expected three numbers (app_id req_type field_index) before the pattern, found {}",
                            nums.len()
                        )));
                    };
                    let app_id = byte(app, "app_id").map_err(&err)?;
                    let req_type = byte(ty, "req_type").map_err(&err)?;
                    let field = byte(field, "field_index").map_err(&err)?;
                    let (pattern, after) = parse_pattern(tail).map_err(&err)?;
                    let queue = arrow_queue(after).map_err(&err)?;
                    set.rules.push(Rule {
                        app_id,
                        req_type,
                        field,
                        pattern,
                        queue,
                        line,
                    });
                }
                "default" => {
                    let (head, after) = rest.split_once("->").ok_or_else(|| {
                        err("expected `default APP TYPE -> QUEUE`: missing `->`".into())
                    })?;
                    let nums: Vec<&str> = head.split_whitespace().collect();
                    let [app, ty] = nums[..] else {
                        return Err(err(format!(
                            "expected two numbers (app_id req_type) before `->`, found {}",
                            nums.len()
                        )));
                    };
                    let app_id = byte(app, "app_id").map_err(&err)?;
                    let req_type = byte(ty, "req_type").map_err(&err)?;
                    let queue = arrow_queue(&format!("->{after}")).map_err(&err)?;
                    if let Some((_, first)) = set.defaults.get(&(app_id, req_type)) {
                        return Err(err(format!(
                            "app {app_id} type {req_type} already has a default on line {first}; keep one"
                        )));
                    }
                    set.defaults.insert((app_id, req_type), (queue, line));
                }
                other => {
                    return Err(err(format!(
                        "unknown statement `{other}`; lines are `rule ...`, `default ...` or `# comment`"
                    )))
                }
            }
        }
        Ok(set)
    }

    /// The plain semantics: the first rule of `app_id`/`req_type` whose field value matches, else
    /// the default, else drop. `field` gives a field's value, or `None` if the first packet lacks
    /// it; a missing field reads as empty, so only an empty pattern matches it.
    pub fn eval<'a>(
        &self,
        app_id: u8,
        req_type: u8,
        field: impl Fn(u8) -> Option<&'a [u8]>,
    ) -> Decision {
        self.rules
            .iter()
            .filter(|r| r.app_id == app_id && r.req_type == req_type)
            .find(|r| r.matches(field(r.field).unwrap_or_default()))
            .map(|r| Decision::Queue(r.queue))
            .or_else(|| {
                self.defaults
                    .get(&(app_id, req_type))
                    .map(|(q, _)| Decision::Queue(*q))
            })
            .unwrap_or(Decision::Drop)
    }

    /// The distinct `(app_id, req_type)` pairs with rules or a default, in order.
    pub fn groups(&self) -> Vec<(u8, u8)> {
        let mut g: Vec<(u8, u8)> = self
            .rules
            .iter()
            .map(|r| (r.app_id, r.req_type))
            .chain(self.defaults.keys().copied())
            .collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    /// A copy without the rules and default of one app: how one app is reconfigured (§5.2.2).
    pub fn without_app(&self, app_id: u8) -> RuleSet {
        RuleSet {
            rules: self
                .rules
                .iter()
                .filter(|r| r.app_id != app_id)
                .cloned()
                .collect(),
            defaults: self
                .defaults
                .iter()
                .filter(|((a, _), _)| *a != app_id)
                .map(|(k, v)| (*k, *v))
                .collect(),
        }
    }
}

/// What the image compiler reads ([`crate::image::Image::compile`]).
impl RuleTable for RuleSet {
    fn rules(&self) -> &[Rule] {
        &self.rules
    }

    fn default_queue(&self, app_id: u8, req_type: u8) -> Option<u8> {
        self.defaults.get(&(app_id, req_type)).map(|(q, _)| *q)
    }

    fn defaults(&self) -> Vec<(u8, u8)> {
        self.defaults.keys().copied().collect()
    }
}

fn byte(s: &str, what: &str) -> Result<u8, String> {
    s.parse::<u8>()
        .map_err(|_| format!("{what} `{s}` is not a number in 0..=255"))
}

fn arrow_queue(s: &str) -> Result<u8, String> {
    let s = s.trim();
    let q = s
        .strip_prefix("->")
        .ok_or_else(|| format!("expected `-> QUEUE` after the pattern, found `{s}`"))?
        .trim();
    if q.is_empty() {
        return Err("missing queue number after `->`".into());
    }
    byte(q, "queue")
}

/// Parses a pattern body up to its closing quote; returns it and the text after the quote.
fn parse_pattern(s: &str) -> Result<(Vec<PatByte>, &str), String> {
    let mut out = Vec::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((out, &s[i + 1..])),
            '.' => out.push(PatByte::Skip),
            '\\' => match chars.next() {
                Some((_, '.')) => out.push(PatByte::Byte(b'.')),
                Some((_, '\\')) => out.push(PatByte::Byte(b'\\')),
                Some((_, 'x')) => {
                    let hex: String = chars.by_ref().take(2).map(|(_, c)| c).collect();
                    let b = (hex.len() == 2)
                        .then(|| u8::from_str_radix(&hex, 16).ok())
                        .flatten()
                        .ok_or_else(|| {
                            format!("`\\x{hex}` is not a byte; write two hex digits, like `\\x41`")
                        })?;
                    out.push(PatByte::Byte(b));
                }
                Some((_, other)) => {
                    return Err(format!(
                        "unknown escape `\\{other}`; use `\\.` for a dot, `\\\\` for a backslash or `\\xHH` for any byte"
                    ))
                }
                None => return Err("the pattern ends in a lone `\\`; write `\\\\` for a backslash".into()),
            },
            other => {
                let mut buf = [0; 4];
                out.extend(other.encode_utf8(&mut buf).bytes().map(PatByte::Byte));
            }
        }
    }
    Err("the pattern has no closing `\"`; write `\\x22` for a quote inside a pattern".into())
}

/// The software dispatcher's matcher: rules pre-split into literal runs and indexed by
/// app/type, so a request is compared only with its own group and only at non-skip bytes.
#[derive(Debug, Clone)]
pub struct FastMatcher {
    /// `(app_id << 8 | req_type) -> index into groups + 1` (0: no group).
    index: Vec<u32>,
    groups: Vec<FastGroup>,
}

#[derive(Debug, Clone)]
struct FastGroup {
    rules: Vec<FastRule>,
    default: Decision,
}

#[derive(Debug, Clone)]
struct FastRule {
    field: u8,
    min_len: usize,
    /// `(offset, literal bytes)` runs.
    runs: Vec<(usize, Box<[u8]>)>,
    queue: u8,
}

impl FastMatcher {
    pub fn new(set: &RuleSet) -> FastMatcher {
        let mut index = vec![0u32; 1 << 16];
        let mut groups = Vec::new();
        for (app, ty) in set.groups() {
            let rules = set
                .rules
                .iter()
                .filter(|r| r.app_id == app && r.req_type == ty)
                .map(|r| {
                    let mut runs: Vec<(usize, Vec<u8>)> = Vec::new();
                    for (i, p) in r.pattern.iter().enumerate() {
                        if let PatByte::Byte(b) = p {
                            match runs.last_mut() {
                                Some((off, lit)) if *off + lit.len() == i => lit.push(*b),
                                _ => runs.push((i, vec![*b])),
                            }
                        }
                    }
                    FastRule {
                        field: r.field,
                        min_len: r.pattern.len(),
                        runs: runs
                            .into_iter()
                            .map(|(o, l)| (o, l.into_boxed_slice()))
                            .collect(),
                        queue: r.queue,
                    }
                })
                .collect();
            let default = set
                .defaults
                .get(&(app, ty))
                .map_or(Decision::Drop, |(q, _)| Decision::Queue(*q));
            groups.push(FastGroup { rules, default });
            // At most 65,536 groups exist, so the count always fits in u32.
            index[usize::from(app) << 8 | usize::from(ty)] = groups.len() as u32;
        }
        FastMatcher { index, groups }
    }

    /// Same contract as [`RuleSet::eval`].
    pub fn eval<'a>(
        &self,
        app_id: u8,
        req_type: u8,
        field: impl Fn(u8) -> Option<&'a [u8]>,
    ) -> Decision {
        let g = self.index[usize::from(app_id) << 8 | usize::from(req_type)];
        let Some(group) = (g as usize).checked_sub(1).and_then(|g| self.groups.get(g)) else {
            return Decision::Drop;
        };
        for r in &group.rules {
            let v = field(r.field).unwrap_or_default();
            if v.len() >= r.min_len && r.runs.iter().all(|(o, lit)| v[*o..*o + lit.len()] == **lit)
            {
                return Decision::Queue(r.queue);
            }
        }
        group.default
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "# app_id req_type field_index \"pattern\" -> queue\nrule 1 0 0 \"...AAA.BB\" -> 3\nrule 1 0 0 \"user:\" -> 1\ndefault 1 0 -> 0\n";

    #[test]
    fn parses_the_issue_example_and_applies_first_match() {
        let set = RuleSet::parse("r.rules", EXAMPLE).unwrap();
        assert_eq!(set.rules.len(), 2);
        assert_eq!(set.rules[0].line, 2);
        let eval = |v: &[u8]| set.eval(1, 0, |_| Some(v));
        assert_eq!(eval(b"FEFAAACBB"), Decision::Queue(3));
        assert_eq!(
            eval(b"FEFBAACBB"),
            Decision::Queue(0),
            "the paper's non-matching example"
        );
        assert_eq!(eval(b"FEFAAACB"), Decision::Queue(0), "too short");
        assert_eq!(eval(b"user:42"), Decision::Queue(1));
        assert_eq!(
            set.eval(1, 1, |_| Some(b"user:")),
            Decision::Drop,
            "no default"
        );
        assert_eq!(
            set.eval(1, 0, |_| None),
            Decision::Queue(0),
            "missing field"
        );
        let any = RuleSet::parse("r", "rule 1 0 0 \"\" -> 5").unwrap();
        assert_eq!(
            any.eval(1, 0, |_| None),
            Decision::Queue(5),
            "a missing field reads as empty"
        );
    }

    #[test]
    fn escapes() {
        let set = RuleSet::parse("r", "rule 1 0 0 \"\\.\\\\\\x41.é\" -> 2").unwrap();
        assert_eq!(
            set.rules[0].pattern,
            vec![
                PatByte::Byte(b'.'),
                PatByte::Byte(b'\\'),
                PatByte::Byte(b'A'),
                PatByte::Skip,
                PatByte::Byte(0xc3),
                PatByte::Byte(0xa9)
            ]
        );
        let back = format!("rule 1 0 0 \"{}\" -> 2", set.rules[0].pattern_text());
        assert_eq!(
            RuleSet::parse("r", &back).unwrap().rules[0].pattern,
            set.rules[0].pattern
        );
    }

    fn err(src: &str) -> String {
        RuleSet::parse("bad.rules", src).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_file_and_line() {
        assert!(err("\nrule 1 0 \"x\" -> 1").starts_with("bad.rules:2: expected three numbers"));
        assert!(err("rule 1 0 0 x -> 1").contains("double quotes"));
        assert!(err("rule 1 0 0 \"x -> 1").contains("no closing"));
        assert!(err("rule 1 0 0 \"\\q\" -> 1").contains("unknown escape `\\q`"));
        assert!(err("rule 1 0 0 \"\\x4\" -> 1").contains("two hex digits"));
        assert!(err("rule 1 0 0 \"x\" -> 256").contains("queue `256`"));
        assert!(err("rule 1 0 0 \"x\" 1").contains("`-> QUEUE`"));
        assert!(err("rule 1 0 0 \"x\" ->").contains("missing queue"));
        assert!(err("default 1 0 -> 1\n\ndefault 1 0 -> 2")
            .starts_with("bad.rules:3: app 1 type 0 already has a default on line 1"));
        assert!(err("default 1 -> 1").contains("two numbers"));
        assert!(err("default 1 0 1").contains("missing `->`"));
        assert!(err("route 1").contains("unknown statement `route`"));
    }

    #[test]
    fn fast_matcher_agrees_on_the_example() {
        let set = RuleSet::parse("r", EXAMPLE).unwrap();
        let fast = FastMatcher::new(&set);
        for v in [&b"FEFAAACBB"[..], b"FEFBAACBB", b"user:", b"use", b""] {
            assert_eq!(fast.eval(1, 0, |_| Some(v)), set.eval(1, 0, |_| Some(v)));
        }
        assert_eq!(fast.eval(9, 9, |_| Some(b"x")), Decision::Drop);
    }

    #[test]
    fn without_app_removes_only_that_app() {
        let set = RuleSet::parse(
            "r",
            "rule 1 0 0 \"a\" -> 1\nrule 2 0 0 \"a\" -> 2\ndefault 1 0 -> 0",
        )
        .unwrap();
        let rest = set.without_app(1);
        assert_eq!(rest.rules.len(), 1);
        assert!(rest.defaults.is_empty());
        assert_eq!(rest.eval(2, 0, |_| Some(b"a")), Decision::Queue(2));
    }
}
