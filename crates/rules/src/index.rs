//! The user-tier executor's path index: which routes could match a path, in route order,
//! without trying every route.
//!
//! Each http route lands in exactly one bucket by its path condition:
//! - exact paths: a hash map from path to route ids;
//! - prefixes: a byte trie; walking the request path visits every stored prefix of it;
//! - regexes: one multi-pattern automaton (`regex_automata::meta` with all patterns) that
//!   reports every regex route matching the whole path in one pass;
//! - no path condition: a plain list.
//!
//! Each bucket yields route ids in ascending order, so the executor merges them lazily and
//! checks the remaining conditions of each candidate in route order: the first hit is the
//! answer, exactly as if every route had been tried in order.
//!
//! The regex pass is the one costly step, so it runs only when it could change the answer:
//! every regex route also gets a *guard*, the literal prefix every match of it must start
//! with (`/api/v[0-9]+` → `/api/v`), stored in the same trie. The walk learns the lowest regex
//! route whose guard holds; the pass runs only if the merge reaches that route without a hit.
//!
//! Buckets hold `u32` ids (a listener with more than 2^32 routes is refused at compile time).

use std::cell::RefCell;
use std::collections::HashMap;

use regex_automata::util::primitives::PatternID;
use regex_automata::{meta, Anchored, Input, MatchKind, PatternSet};
use smallvec::SmallVec;

use crate::matcher::{anchored_hir, meta_config, PathCond, RuleMatch};
use regex_syntax::hir::literal::{ExtractKind, Extractor};
use regex_syntax::hir::Hir;

/// The literal prefix every match of `hir` starts with; empty if there is none
/// (e.g. `.*x`, or alternatives that share nothing).
fn literal_guard(hir: &Hir) -> Vec<u8> {
    let mut extractor = Extractor::new();
    extractor.kind(ExtractKind::Prefix);
    extractor
        .extract(hir)
        .longest_common_prefix()
        .map(<[u8]>::to_vec)
        .unwrap_or_default()
}

/// A trie node: children sorted by byte, and the routes whose prefix ends here.
#[derive(Debug, Clone)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    routes: Vec<u32>,
    /// Lowest regex route whose literal guard ends here (`u32::MAX`: none).
    regex_min: u32,
}

impl Default for TrieNode {
    fn default() -> Self {
        TrieNode {
            children: Vec::new(),
            routes: Vec::new(),
            regex_min: u32::MAX,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct PathIndex {
    exact: HashMap<Box<str>, Vec<u32>>,
    trie: Vec<TrieNode>,
    regex: Option<RegexBucket>,
    /// Lowest regex route without a literal guard (`u32::MAX`: none): it could match any path.
    unguarded_regex_min: u32,
    any: Vec<u32>,
}

#[derive(Debug, Clone)]
struct RegexBucket {
    /// Pattern i belongs to route `routes[i]`; ascending, so pattern order is route order.
    routes: Vec<u32>,
    set: meta::Regex,
}

thread_local! {
    /// Reused across requests so the regex pass does not allocate (grown to the largest set seen).
    static PATTERN_SET: RefCell<PatternSet> = RefCell::new(PatternSet::new(0));
}

/// Counts per bucket, for explain and JSON.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IndexStats {
    pub exact: usize,
    pub prefix: usize,
    pub regex: usize,
    pub any: usize,
    pub trie_nodes: usize,
}

impl PathIndex {
    /// Build the index. Fails only if the regex set as a whole is too big to compile.
    pub(crate) fn build<'a>(
        matches: impl IntoIterator<Item = &'a RuleMatch>,
    ) -> Result<PathIndex, String> {
        let mut index = PathIndex {
            exact: HashMap::new(),
            trie: vec![TrieNode::default()],
            regex: None,
            unguarded_regex_min: u32::MAX,
            any: vec![],
        };
        let mut regex_routes = Vec::new();
        let mut hirs = Vec::new();
        for (id, m) in matches.into_iter().enumerate() {
            let id = id as u32;
            match &m.path {
                None => index.any.push(id),
                Some(PathCond::Exact(p)) => {
                    index.exact.entry(p.as_str().into()).or_default().push(id)
                }
                Some(PathCond::Prefix(p)) => {
                    let node = index.trie_insert(p.as_bytes());
                    index.trie[node].routes.push(id);
                }
                Some(PathCond::Regex(r)) => {
                    let hir = anchored_hir(&r.source)?;
                    let guard = literal_guard(&hir);
                    if guard.is_empty() {
                        index.unguarded_regex_min = index.unguarded_regex_min.min(id);
                    } else {
                        let node = index.trie_insert(&guard);
                        index.trie[node].regex_min = index.trie[node].regex_min.min(id);
                    }
                    regex_routes.push(id);
                    hirs.push(hir);
                }
            }
        }
        if !hirs.is_empty() {
            // MatchKind::All: overlapping search must report every pattern that matches.
            let set = meta::Builder::new()
                .configure(meta_config().match_kind(MatchKind::All))
                .build_many_from_hir(&hirs)
                .map_err(|e| e.to_string())?;
            index.regex = Some(RegexBucket {
                routes: regex_routes,
                set,
            });
        }
        Ok(index)
    }

    fn trie_insert(&mut self, key: &[u8]) -> usize {
        let mut node = 0usize;
        for &b in key {
            node = match self.trie[node].children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => self.trie[node].children[i].1 as usize,
                Err(i) => {
                    let next = self.trie.len();
                    self.trie.push(TrieNode::default());
                    self.trie[node].children.insert(i, (b, next as u32));
                    next
                }
            };
        }
        node
    }

    pub(crate) fn stats(&self) -> IndexStats {
        IndexStats {
            exact: self.exact.values().map(Vec::len).sum(),
            prefix: self.trie.iter().map(|n| n.routes.len()).sum(),
            regex: self.regex.as_ref().map_or(0, |r| r.routes.len()),
            any: self.any.len(),
            trie_nodes: self.trie.len(),
        }
    }

    /// The first route id, in ascending order, whose path bucket admits `path` and for which
    /// `accept` holds. `accept` checks the non-path conditions.
    pub(crate) fn first(&self, path: &str, mut accept: impl FnMut(u32) -> bool) -> Option<u32> {
        // Sorted id lists that admit this path; most requests touch 1-4 of them.
        let mut sources: SmallVec<[&[u32]; 8]> = SmallVec::new();
        if let Some(ids) = self.exact.get(path) {
            sources.push(ids);
        }
        if !self.any.is_empty() {
            sources.push(&self.any);
        }
        let mut node = &self.trie[0];
        let mut regex_first = self.unguarded_regex_min.min(node.regex_min);
        if !node.routes.is_empty() {
            sources.push(&node.routes);
        }
        for &b in path.as_bytes() {
            match node.children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => node = &self.trie[node.children[i].1 as usize],
                Err(_) => break,
            }
            if !node.routes.is_empty() {
                sources.push(&node.routes);
            }
            regex_first = regex_first.min(node.regex_min);
        }

        // The regex pass runs only once the merge reaches the first regex route that could match.
        let mut regex_pending = (regex_first != u32::MAX).then_some(regex_first);
        let mut regex_hits: SmallVec<[u32; 8]> = SmallVec::new();
        let mut regex_pos = 0usize;

        loop {
            let mut next = u32::MAX;
            for s in &sources {
                next = next.min(s[0]);
            }
            if let Some(first_regex) = regex_pending {
                if first_regex <= next {
                    regex_pending = None;
                    self.regex_matches(path, &mut regex_hits);
                    continue;
                }
            }
            if let Some(&r) = regex_hits.get(regex_pos) {
                if r < next {
                    regex_pos += 1;
                    if accept(r) {
                        return Some(r);
                    }
                    continue;
                }
            }
            if next == u32::MAX {
                return None;
            }
            // Advance the source that holds `next` (each id lives in exactly one source).
            sources.retain(|s| {
                if s[0] == next {
                    *s = &s[1..];
                }
                !s.is_empty()
            });
            if accept(next) {
                return Some(next);
            }
        }
    }

    fn regex_matches(&self, path: &str, out: &mut SmallVec<[u32; 8]>) {
        let Some(bucket) = &self.regex else { return };
        #[cfg(test)]
        tests::REGEX_PASSES.with(|n| n.set(n.get() + 1));
        PATTERN_SET.with(|cell| {
            // A re-entrant call (impossible today) would find the set borrowed: fall back to a fresh one.
            let mut fresh;
            let mut guard = cell.try_borrow_mut();
            let set = match guard.as_deref_mut() {
                Ok(set) => set,
                Err(_) => {
                    fresh = PatternSet::new(bucket.set.pattern_len());
                    &mut fresh
                }
            };
            if set.capacity() < bucket.set.pattern_len() {
                *set = PatternSet::new(bucket.set.pattern_len());
            }
            set.clear();
            let input = Input::new(path).anchored(Anchored::Yes);
            bucket.set.which_overlapping_matches(&input, set);
            out.extend(set.iter().map(|p: PatternID| bucket.routes[p.as_usize()]));
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::Pattern;
    use std::cell::Cell;

    thread_local! {
        pub(super) static REGEX_PASSES: Cell<usize> = const { Cell::new(0) };
    }

    fn guard(p: &str) -> String {
        String::from_utf8(literal_guard(&anchored_hir(p).unwrap())).unwrap()
    }

    fn paths(conds: Vec<Option<PathCond>>) -> Vec<RuleMatch> {
        conds
            .into_iter()
            .map(|path| RuleMatch {
                path,
                ..Default::default()
            })
            .collect()
    }

    fn regex(p: &str) -> Option<PathCond> {
        Some(PathCond::Regex(Pattern::new(p).unwrap()))
    }

    /// (first hit, regex passes) with every candidate accepted.
    fn first(index: &PathIndex, path: &str, accept: &[u32]) -> (Option<u32>, usize) {
        REGEX_PASSES.with(|n| n.set(0));
        let hit = index.first(path, |id| accept.contains(&id));
        (hit, REGEX_PASSES.with(Cell::get))
    }

    #[test]
    fn guards_are_required_literal_prefixes() {
        assert_eq!(guard("/api/v[0-9]+"), "/api/v");
        assert_eq!(guard("^/v[0-9]+/items"), "/v");
        assert_eq!(guard("/a|/b"), "/");
        assert_eq!(guard("/items/(x|y)"), "/items/");
        assert_eq!(guard(".*x"), "");
        assert_eq!(guard("[a-z]+/"), "");
        assert_eq!(guard("(?i)/API"), "/");
        assert_eq!(guard(""), "");
    }

    #[test]
    fn regex_pass_runs_only_when_a_guard_holds() {
        let matches = paths(vec![
            Some(PathCond::Prefix("/svc".into())),
            regex("/r1/[0-9]+"),
            Some(PathCond::Prefix("/svc9".into())),
            regex("/r2/.*"),
        ]);
        let index = PathIndex::build(&matches).unwrap();
        let all = [0, 1, 2, 3];
        assert_eq!(first(&index, "/svc9/x", &all), (Some(0), 0));
        // Route 0 refused: route 2 wins, and no regex route's guard holds for /svc9.
        assert_eq!(first(&index, "/svc9/x", &[2, 3]), (Some(2), 0));
        assert_eq!(first(&index, "/r1/42", &all), (Some(1), 1));
        assert_eq!(first(&index, "/r1/x", &all), (None, 1));
        assert_eq!(first(&index, "/r2/x", &all), (Some(3), 1));
        assert_eq!(first(&index, "/nothing", &all), (None, 0));
    }

    #[test]
    fn unguarded_regex_is_always_considered_in_order() {
        let matches = paths(vec![
            Some(PathCond::Exact("/a".into())),
            regex(".*a"),
            None,
            Some(PathCond::Prefix("".into())),
        ]);
        let index = PathIndex::build(&matches).unwrap();
        // Route 0 wins before the regex route is reached: no pass.
        assert_eq!(first(&index, "/a", &[0, 1, 2, 3]), (Some(0), 0));
        assert_eq!(first(&index, "/a", &[1, 2, 3]), (Some(1), 1));
        assert_eq!(first(&index, "/b", &[1, 2, 3]), (Some(2), 1));
        assert_eq!(first(&index, "/b", &[3]), (Some(3), 1));
        assert_eq!(first(&index, "", &[]), (None, 1));
        let stats = index.stats();
        assert_eq!(
            (stats.exact, stats.prefix, stats.regex, stats.any),
            (1, 1, 1, 1)
        );
    }
}
