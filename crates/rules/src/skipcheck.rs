//! Skip-and-check rules (QingNiao §3.3): what the Matcher's image ([`crate::image`]) is compiled
//! from. A rule reads one field of a request and alternates skipping bytes with checking bytes:
//! `...AAA.BB` matches any value of at least 9 bytes with `AAA` at bytes 4–6 and `BB` at 8–9.
//!
//! Two producers write these rules: QNP's rule file (`flatmesh_qnp::rules`, where the file
//! syntax is defined) and the tier-N lowering of http routes ([`crate::lower::nic`]).

use std::fmt::Write as _;

/// One pattern position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PatByte {
    /// `.`: any byte.
    Skip,
    /// This exact byte.
    Byte(u8),
}

impl PatByte {
    /// Every byte of `bytes` as a literal.
    pub fn literal(bytes: &[u8]) -> impl Iterator<Item = PatByte> + '_ {
        bytes.iter().map(|b| PatByte::Byte(*b))
    }
}

/// One rule: on requests of `app_id` / `req_type`, field `field` matching `pattern` goes to `queue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub app_id: u8,
    pub req_type: u8,
    pub field: u8,
    pub pattern: Vec<PatByte>,
    pub queue: u8,
    /// Where the rule came from (a rule file's 1-based line; a route's id for lowered routes),
    /// named in errors.
    pub line: usize,
}

impl Rule {
    /// The plain semantics of one rule: the value is at least as long as the pattern and every
    /// non-skip byte is equal.
    pub fn matches(&self, value: &[u8]) -> bool {
        value.len() >= self.pattern.len()
            && self.pattern.iter().zip(value).all(|(p, v)| match p {
                PatByte::Skip => true,
                PatByte::Byte(b) => b == v,
            })
    }

    /// The pattern in rule file syntax: `.` skips a byte, `\.` is a dot, `\\` a backslash,
    /// `\xHH` any other byte that is not printable.
    pub fn pattern_text(&self) -> String {
        let mut s = String::new();
        for p in &self.pattern {
            match p {
                PatByte::Skip => s.push('.'),
                PatByte::Byte(b'.') => s.push_str("\\."),
                PatByte::Byte(b'\\') => s.push_str("\\\\"),
                PatByte::Byte(b) if b.is_ascii_graphic() && *b != b'"' || *b == b' ' => {
                    s.push(char::from(*b))
                }
                PatByte::Byte(b) => {
                    let _ = write!(s, "\\x{b:02x}");
                }
            }
        }
        s
    }
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Decision {
    Queue(u8),
    Drop,
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decision::Queue(q) => write!(f, "{q}"),
            Decision::Drop => f.write_str("drop"),
        }
    }
}

/// What the image compiler reads: rules in first-match order, and each app/type's default.
/// Within one app and type the first matching rule wins; with no match the default applies; with
/// no default the request is dropped.
pub trait RuleTable {
    /// Every rule, in first-match order.
    fn rules(&self) -> &[Rule];
    /// The queue of `app_id`/`req_type` when none of its rules matches; `None`: drop.
    fn default_queue(&self, app_id: u8, req_type: u8) -> Option<u8>;
    /// Every `(app_id, req_type)` with a default, in any order.
    fn defaults(&self) -> Vec<(u8, u8)>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_semantics_and_text() {
        let r = Rule {
            app_id: 1,
            req_type: 0,
            field: 0,
            pattern: [PatByte::Skip, PatByte::Byte(b'.'), PatByte::Byte(0x01)]
                .into_iter()
                .chain(PatByte::literal(b"a \"\\"))
                .collect(),
            queue: 3,
            line: 1,
        };
        assert_eq!(r.pattern_text(), r#".\.\x01a \x22\\"#);
        assert!(r.matches(b"x.\x01a \"\\tail"));
        assert!(!r.matches(b"x.\x01a \"")); // too short
        assert!(!r.matches(b"x,\x01a \"\\"));
        assert_eq!(Decision::Queue(4).to_string(), "4");
        assert_eq!(Decision::Drop.to_string(), "drop");
    }
}
