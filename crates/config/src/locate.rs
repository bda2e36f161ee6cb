//! Where each config path sits in the YAML text.
//!
//! serde_norway gives a position only for errors it finds itself. A config that
//! deserializes fine but fails validation has lost all positions by then, so we
//! walk the same text once more with a marker-aware event parser and record,
//! for every path like `listeners[0].routes[1].cluster`, where its key and its
//! value start.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// A 1-based line and column (columns count characters, as editors do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

impl Position {
    pub const START: Position = Position { line: 1, column: 1 };

    fn from_marker(marker: &Marker) -> Position {
        // yaml-rust2 counts lines from 1 and columns from 0.
        Position {
            line: marker.line().max(1),
            column: marker.col() + 1,
        }
    }
}

/// Which end of a `key: value` pair a diagnostic points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Key,
    Value,
}

#[derive(Debug, Clone)]
struct Entry {
    key: Position,
    value: Option<Position>,
    /// The value's text when it is a scalar.
    scalar: Option<String>,
}

/// Map from config path to the position of its key and value.
#[derive(Debug, Default)]
pub struct LocationIndex {
    entries: HashMap<String, Entry>,
    /// Second occurrence of a key written twice in one mapping.
    duplicates: HashMap<String, Position>,
    /// The text parsed cleanly and holds nothing: no node, a null, or `{}`.
    blank: bool,
}

impl LocationIndex {
    /// Index `text`. A YAML syntax error stops the walk; what was seen before it
    /// stays indexed (serde_norway reports the syntax error with its own position).
    pub fn build(text: &str) -> LocationIndex {
        let mut walker = Walker::default();
        let mut parser = Parser::new_from_str(text);
        // Only the first document is the config; errors are reported by serde_norway.
        let parsed = parser.load(&mut walker, false).is_ok();
        LocationIndex {
            blank: parsed && !walker.content && walker.entries.is_empty(),
            entries: walker.entries,
            duplicates: walker.duplicates,
        }
    }

    /// Position of `path`, or of its closest indexed ancestor if the path itself is
    /// not in the text (e.g. a defaulted field). Falls back to the top of the file.
    pub fn find(&self, path: &str, target: Target) -> Position {
        let mut path = path;
        loop {
            if let Some(entry) = self.entries.get(path) {
                return match target {
                    Target::Value => entry.value.unwrap_or(entry.key),
                    Target::Key => entry.key,
                };
            }
            match parent(path) {
                Some(up) => path = up,
                None => return Position::START,
            }
        }
    }

    /// Where `path` is written a second time, if it is.
    pub fn duplicate(&self, path: &str) -> Option<Position> {
        self.duplicates.get(path).copied()
    }

    /// True when the text is valid YAML that says nothing: empty, only comments,
    /// a null, or `{}`.
    pub fn is_blank(&self) -> bool {
        self.blank
    }

    /// The first value directly under `parent` whose scalar text is `text`.
    /// Used for errors that name the bad value but not its key.
    pub fn child_with_scalar(&self, parent: &str, text: &str) -> Option<Position> {
        self.entries
            .iter()
            .filter(|(path, e)| {
                e.scalar.as_deref() == Some(text) && self::parent(path) == Some(parent)
            })
            .filter_map(|(_, e)| e.value)
            .min()
    }

    /// Exact lookup without falling back to an ancestor.
    pub fn get(&self, path: &str, target: Target) -> Option<Position> {
        self.entries.get(path).map(|e| match target {
            Target::Value => e.value.unwrap_or(e.key),
            Target::Key => e.key,
        })
    }
}

/// `a.b[2].c` → `a.b[2]` → `a.b` → `a` → None.
fn parent(path: &str) -> Option<&str> {
    if path.is_empty() {
        return None;
    }
    let cut = path.rfind(['.', '[']).unwrap_or(0);
    Some(&path[..cut])
}

fn child_key(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

enum Frame {
    /// A mapping at `path`. `pending` is `None` while a key is expected, then the
    /// path of the entry whose value comes next (`""` when the key had no name).
    Map {
        path: String,
        pending: Option<String>,
        /// No key seen yet. A block mapping's start marker sits after its first
        /// key, so the first key's position is the mapping's true start.
        fresh: bool,
    },
    Seq {
        path: String,
        next: usize,
    },
    /// A container we cannot name (a mapping used as a key, or a node in a later
    /// document): its children are not indexed.
    Opaque,
}

#[derive(Default)]
struct Walker {
    /// Open containers, each with whether it is a mapping key.
    stack: Vec<(Frame, bool)>,
    entries: HashMap<String, Entry>,
    duplicates: HashMap<String, Position>,
    /// Set once the first document's root node is complete.
    done: bool,
    /// Seen anything besides an empty top-level mapping or a top-level null.
    content: bool,
}

impl Walker {
    /// A node starts at `at`. Returns its path (if it has one) and whether it is a mapping key.
    fn begin(&mut self, at: Position, scalar: Option<&str>) -> (Option<String>, bool) {
        let Some((frame, _)) = self.stack.last_mut() else {
            return ((!self.done).then(String::new), false);
        };
        match frame {
            Frame::Opaque => (None, false),
            Frame::Seq { path, next } => {
                let item = format!("{path}[{next}]");
                self.entries.entry(item.clone()).or_insert(Entry {
                    key: at,
                    value: Some(at),
                    scalar: scalar.map(str::to_string),
                });
                (Some(item), false)
            }
            Frame::Map {
                path,
                pending,
                fresh,
            } => match pending {
                None => {
                    if std::mem::take(fresh) {
                        if let Some(entry) = self.entries.get_mut(path.as_str()) {
                            entry.key = entry.key.min(at);
                            entry.value = entry.value.map(|v| v.min(at));
                        }
                    }
                    // This node is a key; only a scalar key names a path.
                    if let Some(name) = scalar {
                        let full = child_key(path, name);
                        if self.entries.contains_key(&full) {
                            self.duplicates.entry(full.clone()).or_insert(at);
                        } else {
                            let entry = Entry {
                                key: at,
                                value: None,
                                scalar: None,
                            };
                            self.entries.insert(full.clone(), entry);
                        }
                        *pending = Some(full);
                    }
                    (None, true)
                }
                Some(full) if full.is_empty() => (None, false),
                Some(full) => {
                    let full = full.clone();
                    if let Some(entry) = self.entries.get_mut(&full) {
                        entry.value.get_or_insert(at);
                        if entry.scalar.is_none() {
                            entry.scalar = scalar.map(str::to_string);
                        }
                    }
                    (Some(full), false)
                }
            },
        }
    }

    /// A node that `begin` saw is complete.
    fn finish(&mut self, is_key: bool) {
        let Some((frame, _)) = self.stack.last_mut() else {
            self.done = true;
            return;
        };
        match frame {
            Frame::Opaque => {}
            Frame::Seq { next, .. } => *next += 1,
            Frame::Map { pending, .. } => {
                if !is_key {
                    *pending = None;
                } else if pending.is_none() {
                    // An unnamed key (alias or container): its value is not indexed.
                    *pending = Some(String::new());
                }
            }
        }
    }
}

impl MarkedEventReceiver for Walker {
    fn on_event(&mut self, event: Event, marker: Marker) {
        let at = Position::from_marker(&marker);
        match event {
            Event::Scalar(ref text, style, ..) => {
                let null = style == TScalarStyle::Plain
                    && matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL");
                if !(self.stack.is_empty() && null) {
                    self.content = true;
                }
                let (_, is_key) = self.begin(at, Some(text));
                self.finish(is_key);
            }
            Event::Alias(_) => {
                self.content = true;
                let (_, is_key) = self.begin(at, None);
                self.finish(is_key);
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                if !self.stack.is_empty() || matches!(event, Event::SequenceStart(..)) {
                    self.content = true;
                }
                let (path, is_key) = self.begin(at, None);
                let frame = match (path, is_key) {
                    (Some(path), false) if matches!(event, Event::MappingStart(..)) => Frame::Map {
                        path,
                        pending: None,
                        fresh: true,
                    },
                    (Some(path), false) => Frame::Seq { path, next: 0 },
                    _ => Frame::Opaque,
                };
                self.stack.push((frame, is_key));
            }
            Event::MappingEnd | Event::SequenceEnd => {
                if let Some((_, is_key)) = self.stack.pop() {
                    self.finish(is_key);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(line: usize, column: usize) -> Option<Position> {
        Some(Position { line, column })
    }

    const TEXT: &str = "\
admin: 127.0.0.1:1
listeners:
  - name: web
    routes:
      - match: { path: { prefix: /a }, headers: [ { name: x } ] }
        cluster: api
  -   name: db
clusters: []
";

    #[test]
    fn block_and_flow_positions() {
        let index = LocationIndex::build(TEXT);
        assert_eq!(index.get("admin", Target::Key), pos(1, 1));
        assert_eq!(index.get("admin", Target::Value), pos(1, 8));
        // A block mapping in a sequence starts at its first key, not at its marker.
        assert_eq!(index.get("listeners[0]", Target::Value), pos(3, 5));
        assert_eq!(index.get("listeners[0].name", Target::Value), pos(3, 11));
        assert_eq!(index.get("listeners[0].routes[0]", Target::Key), pos(5, 9));
        assert_eq!(
            index.get("listeners[0].routes[0].match", Target::Value),
            pos(5, 16)
        );
        assert_eq!(
            index.get("listeners[0].routes[0].match.path.prefix", Target::Value),
            pos(5, 34)
        );
        assert_eq!(
            index.get("listeners[0].routes[0].match.headers[0]", Target::Value),
            pos(5, 51)
        );
        assert_eq!(
            index.get(
                "listeners[0].routes[0].match.headers[0].name",
                Target::Value
            ),
            pos(5, 59)
        );
        assert_eq!(
            index.get("listeners[0].routes[0].cluster", Target::Key),
            pos(6, 9)
        );
        assert_eq!(
            index.get("listeners[0].routes[0].cluster", Target::Value),
            pos(6, 18)
        );
        assert_eq!(index.get("listeners[1].name", Target::Key), pos(7, 7));
        assert_eq!(index.get("clusters", Target::Value), pos(8, 11));
        assert!(!index.is_blank());
    }

    #[test]
    fn find_falls_back_to_the_closest_ancestor() {
        let index = LocationIndex::build(TEXT);
        // `timeout` is not written: point at the route it would belong to.
        assert_eq!(
            index.find("listeners[0].routes[0].timeout", Target::Key),
            Position { line: 5, column: 9 }
        );
        assert_eq!(index.find("workers", Target::Value), Position::START);
        assert_eq!(index.get("workers", Target::Value), None);
    }

    #[test]
    fn scalars_and_duplicates() {
        let index = LocationIndex::build("a:\n  b: 1\n  c: 2s\n  b: 3\n");
        assert_eq!(index.child_with_scalar("a", "2s"), pos(3, 6));
        assert_eq!(index.child_with_scalar("a", "9"), None);
        assert_eq!(index.duplicate("a.b"), pos(4, 3));
        assert_eq!(index.get("a.b", Target::Value), pos(2, 6));
    }

    #[test]
    fn unicode_columns_count_characters() {
        let index = LocationIndex::build("é: { ü: x }\n");
        assert_eq!(index.get("é.ü", Target::Value), pos(1, 9));
    }

    #[test]
    fn blank_documents() {
        for text in ["", "# c\n", "~", "null\n", "{}", "---\n"] {
            assert!(LocationIndex::build(text).is_blank(), "{text:?}");
        }
        for text in ["a: 1", "[]", "x", "]", "{ a"] {
            assert!(!LocationIndex::build(text).is_blank(), "{text:?}");
        }
    }

    #[test]
    fn odd_keys_do_not_confuse_the_walk() {
        // A complex key and an alias key are skipped; later keys still index.
        let text = "? [a, b]\n: 1\nx: &v 2\n*v : 3\nz: 4\n";
        let index = LocationIndex::build(text);
        // An anchored value starts at the value, after its anchor.
        assert_eq!(index.get("x", Target::Value), pos(3, 7));
        assert_eq!(index.get("z", Target::Value), pos(5, 4));
    }
}
