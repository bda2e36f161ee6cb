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
//! Regexes are the one costly step, so they run only when they could change the answer.
//! Every regex route gets a *guard*, the literal prefix every match of it must start with
//! (`/api/v[0-9]+` → `/api/v`), stored in the same trie. The walk collects the regex routes
//! whose guard holds. If there are at most [`FEW_REGEXES`] of them and no regex without a
//! guard, each is tried on its own when the merge reaches it. Otherwise the multi-pattern pass
//! runs once, and only if the merge reaches the first such route without a hit.
//!
//! Buckets hold `u32` ids (a listener with more than 2^32 routes is refused at compile time).

use std::cell::RefCell;
use std::collections::HashMap;

use regex_automata::util::primitives::PatternID;
use regex_automata::{meta, Anchored, Input, MatchKind, PatternSet};
use regex_syntax::hir::literal::{ExtractKind, Extractor};
use regex_syntax::hir::Hir;
use smallvec::SmallVec;

use crate::matcher::{anchored_hir, meta_config, PathCond, RuleMatch};

/// Up to this many guard-passing regex routes are tried one by one; more take the
/// multi-pattern pass, whose cost does not grow with the number of candidates.
pub(crate) const FEW_REGEXES: usize = 8;

/// The literal prefix every match of `hir` starts with; empty if there is none
/// (e.g. `.*x`, or alternatives that share nothing).
pub(crate) fn literal_guard(hir: &Hir) -> Vec<u8> {
    let mut extractor = Extractor::new();
    extractor.kind(ExtractKind::Prefix);
    extractor
        .extract(hir)
        .longest_common_prefix()
        .map(<[u8]>::to_vec)
        .unwrap_or_default()
}

/// A trie node: children sorted by byte, the prefix routes and the guarded regex routes
/// whose key ends here (both ascending).
#[derive(Debug, Default, Clone)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    routes: Vec<u32>,
    regex_routes: Vec<u32>,
}

#[derive(Debug, Clone)]
pub(crate) struct PathIndex {
    /// foldhash, not SipHash: the keys come from the config, so request paths cannot grow
    /// collision chains, and a lookup hashes every request's path (SipHash was ~20 ns of ~60).
    exact: HashMap<Box<str>, Vec<u32>, foldhash::fast::RandomState>,
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
    /// Pattern i on its own, for the few-candidates case.
    single: Vec<meta::Regex>,
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
            exact: HashMap::default(),
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
                        index.trie[node].regex_routes.push(id);
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
            let single = hirs
                .iter()
                .map(|h| {
                    meta::Builder::new()
                        .configure(meta_config())
                        .build_from_hir(h)
                        .map_err(|e| e.to_string())
                })
                .collect::<Result<Vec<_>, _>>()?;
            index.regex = Some(RegexBucket {
                routes: regex_routes,
                set,
                single,
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
        // Sorted id lists that admit this path (most requests touch 1-4), each flagged with
        // whether its routes still need their own path regex checked.
        let mut sources: SmallVec<[(&[u32], bool); 8]> = SmallVec::new();
        if let Some(ids) = self.exact.get(path) {
            sources.push((ids, false));
        }
        if !self.any.is_empty() {
            sources.push((&self.any, false));
        }
        let mut guarded: SmallVec<[&[u32]; 4]> = SmallVec::new();
        let mut guarded_count = 0usize;
        let mut node = &self.trie[0];
        let mut bytes = path.bytes();
        loop {
            if !node.routes.is_empty() {
                sources.push((&node.routes, false));
            }
            if !node.regex_routes.is_empty() {
                guarded_count += node.regex_routes.len();
                guarded.push(&node.regex_routes);
            }
            let Some(b) = bytes.next() else { break };
            match node.children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => node = &self.trie[node.children[i].1 as usize],
                Err(_) => break,
            }
        }

        // Few guarded candidates and no unguarded regex: try each on its own, in order.
        // Otherwise one multi-pattern pass, once the merge reaches the first candidate.
        let mut regex_pending = None;
        if self.unguarded_regex_min == u32::MAX && guarded_count <= FEW_REGEXES {
            sources.extend(guarded.iter().map(|g| (*g, true)));
        } else {
            let first_guarded = guarded.iter().map(|g| g[0]).min().unwrap_or(u32::MAX);
            regex_pending = Some(self.unguarded_regex_min.min(first_guarded));
        }
        let mut regex_hits: SmallVec<[u32; 8]> = SmallVec::new();
        let mut regex_pos = 0usize;

        loop {
            let mut next = u32::MAX;
            let mut next_is_regex = false;
            for (s, is_regex) in &sources {
                if s[0] < next {
                    next = s[0];
                    next_is_regex = *is_regex;
                }
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
            sources.retain(|(s, _)| {
                if s[0] == next {
                    *s = &s[1..];
                }
                !s.is_empty()
            });
            if (!next_is_regex || self.regex_single_match(next, path)) && accept(next) {
                return Some(next);
            }
        }
    }

    /// Does regex route `route`'s own pattern match the whole path?
    fn regex_single_match(&self, route: u32, path: &str) -> bool {
        let Some(bucket) = &self.regex else {
            return false;
        };
        #[cfg(test)]
        tests::REGEX_SINGLES.with(|n| n.set(n.get() + 1));
        match bucket.routes.binary_search(&route) {
            Ok(i) => bucket.single[i].is_match(Input::new(path).anchored(Anchored::Yes)),
            Err(_) => false,
        }
    }

    /// Every regex route whose pattern matches the whole path, ascending, in one pass.
    fn regex_matches(&self, path: &str, out: &mut SmallVec<[u32; 8]>) {
        let Some(bucket) = &self.regex else {
            return;
        };
        #[cfg(test)]
        tests::REGEX_PASSES.with(|n| n.set(n.get() + 1));
        PATTERN_SET.with(|cell| {
            // A re-entrant call (impossible today) would find the set borrowed: use a fresh one.
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
        pub(super) static REGEX_SINGLES: Cell<usize> = const { Cell::new(0) };
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
    fn first(index: &PathIndex, path: &str, accept: &[u32]) -> (Option<u32>, usize, usize) {
        REGEX_PASSES.with(|n| n.set(0));
        REGEX_SINGLES.with(|n| n.set(0));
        let hit = index.first(path, |id| accept.contains(&id));
        (
            hit,
            REGEX_PASSES.with(Cell::get),
            REGEX_SINGLES.with(Cell::get),
        )
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
    fn few_guarded_regexes_are_checked_one_by_one() {
        let matches = paths(vec![
            Some(PathCond::Prefix("/svc".into())),
            regex("/r1/[0-9]+"),
            Some(PathCond::Prefix("/svc9".into())),
            regex("/r2/.*"),
        ]);
        let index = PathIndex::build(&matches).unwrap();
        let all = [0, 1, 2, 3];
        assert_eq!(first(&index, "/svc9/x", &all), (Some(0), 0, 0));
        // Route 0 refused: route 2 wins, and no regex route's guard holds for /svc9.
        assert_eq!(first(&index, "/svc9/x", &[2, 3]), (Some(2), 0, 0));
        // One candidate behind a holding guard: checked on its own, no multi-pattern pass.
        assert_eq!(first(&index, "/r1/42", &all), (Some(1), 0, 1));
        assert_eq!(first(&index, "/r1/x", &all), (None, 0, 1));
        assert_eq!(first(&index, "/r1/42", &[]), (None, 0, 1));
        assert_eq!(first(&index, "/r2/x", &all), (Some(3), 0, 1));
        assert_eq!(first(&index, "/nothing", &all), (None, 0, 0));
    }

    #[test]
    fn many_guarded_candidates_take_one_multi_pattern_pass() {
        // FEW_REGEXES + 2 regex routes behind the one guard `/x/`, then a prefix route.
        let mut conds: Vec<_> = (0..FEW_REGEXES + 2)
            .map(|i| regex(&format!("/x/[a-z]*{i}")))
            .collect();
        conds.push(Some(PathCond::Prefix("/x/".into())));
        let index = PathIndex::build(&paths(conds)).unwrap();
        let n = (FEW_REGEXES + 2) as u32;
        let all: Vec<u32> = (0..=n).collect();
        assert_eq!(first(&index, "/x/abc3", &all), (Some(3), 1, 0));
        assert_eq!(first(&index, "/x/abc3", &[n]), (Some(n), 1, 0));
        assert_eq!(first(&index, "/x/", &all), (Some(n), 1, 0));
        // The guard fails: no regex work at all.
        assert_eq!(first(&index, "/y/3", &all), (None, 0, 0));
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
        assert_eq!(first(&index, "/a", &[0, 1, 2, 3]), (Some(0), 0, 0));
        assert_eq!(first(&index, "/a", &[1, 2, 3]), (Some(1), 1, 0));
        assert_eq!(first(&index, "/b", &[1, 2, 3]), (Some(2), 1, 0));
        assert_eq!(first(&index, "/b", &[3]), (Some(3), 1, 0));
        assert_eq!(first(&index, "", &[]), (None, 1, 0));
        let stats = index.stats();
        assert_eq!(
            (stats.exact, stats.prefix, stats.regex, stats.any),
            (1, 1, 1, 1)
        );
    }
}
