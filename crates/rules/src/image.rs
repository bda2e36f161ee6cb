//! The Matcher's tables (§4.2.1–4.2.2) and a bit-exact reference model of the Matcher.
//!
//! Layout, as in the paper: a RAM and a CAM of at most 512 entries each. A RAM entry is 32 bits:
//! `field index (8) | skip count (8) | check count (8) | state (8)`. A CAM entry is 96 bits:
//! `app_id (8) | req_type (8) | field index (8) | state (8) | string (64)`, the first string byte
//! in the most significant position. Entry *i* of the CAM and entry *i* of the RAM form a pair,
//! as in the TCAM+RAM packet parsers the paper builds on: a CAM hit at *i* executes RAM[*i*].
//!
//! The Matcher (documented in docs/qnp.md, "Matcher model"):
//! 1. Look up the start key `(app, type, field 0, state 0, 0)`.
//! 2. On a hit at *i*, read RAM[*i*]. `skip = check = 0` is an exit: `state` is the queue.
//!    Otherwise it is a skip-and-check: if the hit key's state was 0 or had the miss bit (0x80)
//!    set, rewind to the start of field `field`. Skip `skip` bytes, inspect `check` bytes
//!    (zero-padded to 8), and look up `(app, type, field, state, window)`. A value too short for
//!    the skip and check is a mismatch.
//! 3. On a miss (or mismatch) of a check state *s*, look up `(app, type, field, s | 0x80, 0)`:
//!    the fall-through to the next rule, or to the default. A miss there drops.
//!
//! The compiler walks each app/type's rules in first-match order and groups consecutive rules on one
//! field that share their leading skip-and-checks and then, at one step, skip and check the same
//! number of bytes but want different bytes. A group shares the states of its common prefix and
//! one state for the step where its members differ, whose CAM entries compare the window with
//! every member at once (the CAM's reason to exist, §5.2.1); at most one member can match, so a
//! miss anywhere in a group falls through to the next group and first-match order holds. Each
//! member then has its own states for its remaining steps. States are numbered 1..=127 per app,
//! type and field. A state costs a hit entry per value it tests and one fall-through entry (none
//! when nothing follows: no later rule and no default), plus one start entry per app/type.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::skipcheck::{Decision, PatByte, Rule, RuleTable};
use crate::RulesError;

/// Entries in each table (the paper's prototype).
pub const TABLE_ENTRIES: usize = 512;
/// Bytes one CAM entry compares.
pub const CHECK_BYTES: usize = 8;
/// State bit that marks the fall-through (miss) key of a state.
pub const MISS_BIT: u8 = 0x80;
/// Check states available per app, type and field.
pub const MAX_STATES: usize = 127;
const MAGIC: &[u8; 8] = b"QNPIMG01";

/// A 32-bit RAM entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RamEntry {
    pub field: u8,
    pub skip: u8,
    pub check: u8,
    /// The next state, or the queue of an exit entry.
    pub state: u8,
}

impl RamEntry {
    fn exit(queue: u8) -> RamEntry {
        RamEntry {
            field: 0,
            skip: 0,
            check: 0,
            state: queue,
        }
    }
    pub fn is_exit(&self) -> bool {
        self.skip == 0 && self.check == 0
    }
    pub fn to_word(self) -> u32 {
        u32::from_be_bytes([self.field, self.skip, self.check, self.state])
    }
    pub fn from_word(w: u32) -> RamEntry {
        let [field, skip, check, state] = w.to_be_bytes();
        RamEntry {
            field,
            skip,
            check,
            state,
        }
    }
}

/// A 96-bit CAM entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CamEntry {
    pub app_id: u8,
    pub req_type: u8,
    pub field: u8,
    pub state: u8,
    pub string: [u8; CHECK_BYTES],
}

impl CamEntry {
    /// The 96 bits, right-aligned in a u128.
    pub fn to_bits(self) -> u128 {
        u128::from(self.app_id) << 88
            | u128::from(self.req_type) << 80
            | u128::from(self.field) << 72
            | u128::from(self.state) << 64
            | u128::from(u64::from_be_bytes(self.string))
    }
    pub fn to_bytes(self) -> [u8; 12] {
        let b = self.to_bits().to_be_bytes();
        let mut out = [0; 12];
        out.copy_from_slice(&b[4..]);
        out
    }
    pub fn from_bytes(b: &[u8; 12]) -> CamEntry {
        let mut string = [0; CHECK_BYTES];
        string.copy_from_slice(&b[4..]);
        CamEntry {
            app_id: b[0],
            req_type: b[1],
            field: b[2],
            state: b[3],
            string,
        }
    }
}

/// The compiled tables: `ram[i]` is executed when `cam[i]` hits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Image {
    pub ram: Vec<RamEntry>,
    pub cam: Vec<CamEntry>,
}

/// One skip-and-check of a rule: skip `skip` bytes, then compare `lit` (≤ 8 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Step {
    skip: u8,
    lit: Vec<u8>,
}

fn steps_of(pattern: &[PatByte]) -> Vec<Step> {
    fn push(steps: &mut Vec<Step>, mut skip: usize, lit: Vec<u8>) {
        while skip > usize::from(u8::MAX) {
            steps.push(Step {
                skip: u8::MAX,
                lit: Vec::new(),
            });
            skip -= usize::from(u8::MAX);
        }
        // The loop above leaves skip ≤ 255.
        steps.push(Step {
            skip: skip as u8,
            lit,
        });
    }
    let mut steps = Vec::new();
    let (mut skip, mut lit) = (0usize, Vec::new());
    for p in pattern {
        match p {
            PatByte::Skip => {
                if !lit.is_empty() {
                    push(&mut steps, skip, std::mem::take(&mut lit));
                    skip = 0;
                }
                skip += 1;
            }
            PatByte::Byte(b) => {
                if lit.len() == CHECK_BYTES {
                    push(&mut steps, skip, std::mem::take(&mut lit));
                    skip = 0;
                }
                lit.push(*b);
            }
        }
    }
    if !lit.is_empty() || skip > 0 {
        push(&mut steps, skip, lit);
    }
    steps
}

/// How many skip-and-checks a rule compiles to.
pub fn skip_and_checks(rule: &Rule) -> usize {
    steps_of(&rule.pattern).len()
}

/// Consecutive rules (file order) of one app/type that the image tests together: they read the
/// same field, their first `prefix` skip-and-checks are identical, and at step `prefix` they
/// skip and check the same number of bytes but want pairwise different bytes. So at most one
/// member can match any value, and first-match order holds when a miss anywhere in the group
/// falls through to the next group. A single rule is a group of one (`prefix` 0).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Group {
    members: Vec<usize>,
    prefix: usize,
}

fn group_rules(rules: &[&Rule], steps: &[Vec<Step>]) -> Vec<Group> {
    let same_shape = |a: &Step, b: &Step| a.skip == b.skip && a.lit.len() == b.lit.len();
    let mut groups: Vec<Group> = Vec::new();
    for i in 0..rules.len() {
        let joined = groups.last_mut().is_some_and(|g| {
            let first = g.members[0];
            if rules[first].field != rules[i].field {
                return false;
            }
            let (a, b) = (&steps[first], &steps[i]);
            let prefix = if g.members.len() == 1 {
                // The second member fixes the prefix: the steps the two rules share.
                a.iter().zip(b).take_while(|(x, y)| x == y).count()
            } else {
                g.prefix
            };
            let fits = prefix < a.len()
                && prefix < b.len()
                && a[..prefix] == b[..prefix]
                && same_shape(&a[prefix], &b[prefix])
                && g.members
                    .iter()
                    .all(|&k| steps[k][prefix].lit != b[prefix].lit);
            if fits {
                g.prefix = prefix;
                g.members.push(i);
            }
            fits
        });
        if !joined {
            groups.push(Group {
                members: vec![i],
                prefix: 0,
            });
        }
    }
    groups
}

/// The entries of one app/type, in table order: `cam[i]` hits execute `ram[i]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppEntries {
    pub cam: Vec<CamEntry>,
    pub ram: Vec<RamEntry>,
}

impl AppEntries {
    pub fn len(&self) -> usize {
        self.cam.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cam.is_empty()
    }
}

/// Compiles the rules of one app/type (all of `rules` have this `app_id` and `req_type`, in
/// first-match order) and its default queue into table entries. Apps never share entries, so
/// an image is the concatenation of its apps' entries, in any order.
pub fn compile_app(
    app: u8,
    ty: u8,
    rules: &[&Rule],
    default: Option<u8>,
) -> Result<AppEntries, RulesError> {
    let mut out = AppEntries::default();
    let steps: Vec<Vec<Step>> = rules.iter().map(|r| steps_of(&r.pattern)).collect();
    let groups = group_rules(rules, &steps);
    // State numbers, per field: each group's shared prefix states and its distinguishing
    // state, then each member's own states for its remaining steps.
    let mut next_state: HashMap<u8, usize> = HashMap::new();
    let mut states: Vec<Vec<u8>> = vec![Vec::new(); rules.len()];
    for g in &groups {
        let first = g.members[0];
        let field = rules[first].field;
        let next = next_state.entry(field).or_insert(1);
        // Shared: the prefix steps and the distinguishing step (none for an empty rule).
        let shared_len = if steps[first].is_empty() {
            0
        } else {
            g.prefix + 1
        };
        let shared: Vec<usize> = (*next..*next + shared_len).collect();
        *next += shared_len;
        for &i in &g.members {
            let own = *next..*next + steps[i].len().saturating_sub(shared_len);
            *next = own.end;
            if *next - 1 > MAX_STATES {
                return Err(RulesError::TableFull(format!(
                        "app {app} type {ty} field {field} needs {} check states by rule line {} but the 8-bit state (high bit reserved) allows {MAX_STATES}; use fewer or shorter rules on this field, or let rules share their leading skip-and-checks (rules that differ only from one skip-and-check on share the ones before it)",
                        *next - 1,
                        rules[i].line
                    )));
            }
            // Bounded by MAX_STATES just above.
            states[i] = shared.iter().copied().chain(own).map(|s| s as u8).collect();
        }
    }
    // The RAM entry that executes step `j` of rule `i`, or its exit after the last step.
    let step_entry = |i: usize, j: usize| -> RamEntry {
        match steps[i].get(j) {
            None => RamEntry::exit(rules[i].queue),
            Some(s) => RamEntry {
                field: rules[i].field,
                skip: s.skip,
                // A step holds at most CHECK_BYTES bytes.
                check: s.lit.len() as u8,
                state: states[i][j],
            },
        }
    };
    // The RAM entry that starts group `g` (or the default after the last group).
    let entry_of = |g: usize| -> Option<RamEntry> {
        match groups.get(g) {
            Some(group) => Some(step_entry(group.members[0], 0)),
            None => default.map(RamEntry::exit),
        }
    };
    let mut push = |cam: CamEntry, ram: RamEntry| {
        out.cam.push(cam);
        out.ram.push(ram);
    };
    let key = |field: u8, state: u8, lit: &[u8]| {
        let mut string = [0; CHECK_BYTES];
        string[..lit.len()].copy_from_slice(lit);
        CamEntry {
            app_id: app,
            req_type: ty,
            field,
            state,
            string,
        }
    };
    if let Some(start) = entry_of(0) {
        push(key(0, 0, &[]), start);
    }
    for (g, group) in groups.iter().enumerate() {
        // A miss anywhere in a group falls past the whole group: its members need the
        // same bytes in the prefix and other bytes at the distinguishing step.
        let fall_through = entry_of(g + 1);
        let first = group.members[0];
        let field = rules[first].field;
        if steps[first].is_empty() {
            // An empty pattern matches everything: its group starts with its exit.
            continue;
        }
        let p = group.prefix;
        // The shared prefix: one hit and one fall-through entry per step.
        for j in 0..p {
            push(
                key(field, states[first][j], &steps[first][j].lit),
                step_entry(first, j + 1),
            );
            if let Some(ft) = fall_through {
                push(key(field, states[first][j] | MISS_BIT, &[]), ft);
            }
        }
        // The distinguishing step: one hit per member, all in one state, so the CAM
        // compares the window with every member at once; then each member's own steps.
        for &i in &group.members {
            push(
                key(field, states[i][p], &steps[i][p].lit),
                step_entry(i, p + 1),
            );
        }
        if let Some(ft) = fall_through {
            push(key(field, states[first][p] | MISS_BIT, &[]), ft);
        }
        for &i in &group.members {
            for j in p + 1..steps[i].len() {
                push(
                    key(field, states[i][j], &steps[i][j].lit),
                    step_entry(i, j + 1),
                );
                if let Some(ft) = fall_through {
                    push(key(field, states[i][j] | MISS_BIT, &[]), ft);
                }
            }
        }
    }
    Ok(out)
}

impl Image {
    /// Compiles a rule table into tables of [`TABLE_ENTRIES`] entries.
    pub fn compile(set: &impl RuleTable) -> Result<Image, RulesError> {
        Self::compile_with_capacity(set, TABLE_ENTRIES)
    }

    /// Compiles into tables of `capacity` entries.
    pub fn compile_with_capacity(
        set: &impl RuleTable,
        capacity: usize,
    ) -> Result<Image, RulesError> {
        let mut apps: Vec<(u8, u8)> = set
            .rules()
            .iter()
            .map(|r| (r.app_id, r.req_type))
            .chain(set.defaults())
            .collect();
        apps.sort_unstable();
        apps.dedup();
        let mut img = Image::default();
        for (app, ty) in apps {
            let rules: Vec<&Rule> = set
                .rules()
                .iter()
                .filter(|r| r.app_id == app && r.req_type == ty)
                .collect();
            img.push(compile_app(app, ty, &rules, set.default_queue(app, ty))?);
        }
        if img.cam.len() > capacity {
            return Err(RulesError::TableFull(format!(
                "the rules need {} RAM and {} CAM entries but each table holds {capacity}: {} entries over; remove rules or shorten patterns (a skip-and-check a rule does not share with its neighbours costs a hit and a fall-through entry; rules that differ only from one skip-and-check on share the ones before it)",
                img.ram.len(),
                img.cam.len(),
                img.cam.len() - capacity
            )));
        }
        Ok(img)
    }

    /// Appends one app/type's entries (from [`compile_app`]) to the tables.
    pub fn push(&mut self, entries: AppEntries) {
        self.cam.extend(entries.cam);
        self.ram.extend(entries.ram);
    }

    /// Runs the Matcher on a request; see the module docs. Returns the decision and the number of
    /// CAM lookups it took (the Matcher's work, which grows with skip-and-checks as in Table 1).
    pub fn run<'a>(
        &self,
        app_id: u8,
        req_type: u8,
        field: impl Fn(u8) -> Option<&'a [u8]>,
    ) -> (Decision, usize) {
        self.run_traced(app_id, req_type, field, |_| {})
    }

    /// As [`run`](Self::run), calling `hit` with the index of every entry the Matcher hits,
    /// in order (`flatmesh qnp rules eval --explain`).
    pub fn run_traced<'a>(
        &self,
        app_id: u8,
        req_type: u8,
        field: impl Fn(u8) -> Option<&'a [u8]>,
        mut hit: impl FnMut(usize),
    ) -> (Decision, usize) {
        let mut key = CamEntry {
            app_id,
            req_type,
            field: 0,
            state: 0,
            string: [0; CHECK_BYTES],
        };
        let (mut cur, mut pos): (Option<(u8, &[u8])>, usize) = (None, 0);
        // Every non-exit step either advances through the value or falls through to a later rule,
        // so a well-formed image needs fewer lookups than entries; the bound stops corrupt images.
        for lookups in 1..=2 * self.cam.len() + 2 {
            let Some(i) = self.cam.iter().position(|e| *e == key) else {
                if key.state != 0 && key.state & MISS_BIT == 0 {
                    key.state |= MISS_BIT;
                    key.string = [0; CHECK_BYTES];
                    continue;
                }
                return (Decision::Drop, lookups);
            };
            hit(i);
            let ram = self.ram[i];
            if ram.is_exit() {
                return (Decision::Queue(ram.state), lookups);
            }
            if key.state == 0 || key.state & MISS_BIT != 0 || cur.map(|(f, _)| f) != Some(ram.field)
            {
                // A missing field reads as empty, as in the plain semantics.
                cur = Some((ram.field, field(ram.field).unwrap_or_default()));
                pos = 0;
            }
            let (skip, check) = (
                usize::from(ram.skip),
                usize::from(ram.check).min(CHECK_BYTES),
            );
            key.field = ram.field;
            key.string = [0; CHECK_BYTES];
            match cur {
                Some((_, v)) if pos + skip + check <= v.len() => {
                    key.state = ram.state;
                    key.string[..check].copy_from_slice(&v[pos + skip..pos + skip + check]);
                    pos += skip + check;
                }
                _ => key.state = ram.state | MISS_BIT,
            }
        }
        (Decision::Drop, 2 * self.cam.len() + 2)
    }

    /// Every `(app_id, req_type)` in the image with how many entries it has and the first and
    /// last of them, in table order.
    pub fn apps(&self) -> Vec<((u8, u8), usize, usize, usize)> {
        let mut out: Vec<((u8, u8), usize, usize, usize)> = Vec::new();
        for (i, c) in self.cam.iter().enumerate() {
            let key = (c.app_id, c.req_type);
            match out.iter_mut().find(|(k, ..)| *k == key) {
                Some((_, n, _, last)) => {
                    *n += 1;
                    *last = i;
                }
                None => out.push((key, 1, i, i)),
            }
        }
        out
    }

    /// The image file: `QNPIMG01`, entry count (u16 BE), RAM words (4 bytes BE each), then CAM
    /// entries (12 bytes BE each).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        // compile() caps the entries at the table size, far below u16::MAX.
        out.extend_from_slice(&(self.ram.len() as u16).to_be_bytes());
        for r in &self.ram {
            out.extend_from_slice(&r.to_word().to_be_bytes());
        }
        for c in &self.cam {
            out.extend_from_slice(&c.to_bytes());
        }
        out
    }

    /// Reads an image file.
    pub fn from_bytes(b: &[u8]) -> Result<Image, RulesError> {
        let rest = b
            .strip_prefix(&MAGIC[..])
            .ok_or_else(|| RulesError::BadImage("it does not start with QNPIMG01".into()))?;
        let Some((n, rest)) = rest.split_first_chunk::<2>() else {
            return Err(RulesError::BadImage(
                "it ends before the entry count".into(),
            ));
        };
        let n = usize::from(u16::from_be_bytes(*n));
        if n > TABLE_ENTRIES {
            return Err(RulesError::BadImage(format!(
                "it has {n} entries, the tables hold {TABLE_ENTRIES}"
            )));
        }
        if rest.len() != n * 16 {
            return Err(RulesError::BadImage(format!(
                "{n} entries need {} bytes after the header, found {}",
                n * 16,
                rest.len()
            )));
        }
        let (ram, cam) = rest.split_at(n * 4);
        Ok(Image {
            ram: ram
                .chunks_exact(4)
                .map(|w| RamEntry::from_word(u32::from_be_bytes([w[0], w[1], w[2], w[3]])))
                .collect(),
            cam: cam
                .chunks_exact(12)
                .map(|c| {
                    let mut e = [0; 12];
                    e.copy_from_slice(c);
                    CamEntry::from_bytes(&e)
                })
                .collect(),
        })
    }

    /// Both tables, readably.
    pub fn explain(&self) -> String {
        let mut o = String::new();
        let n = self.ram.len();
        let _ = writeln!(
            o,
            "RAM: {n} of {TABLE_ENTRIES} entries (32 bits: field | skip | check | state)"
        );
        let _ = writeln!(o, "  idx  word        field skip check state  meaning");
        for (i, r) in self.ram.iter().enumerate() {
            let meaning = if r.is_exit() {
                format!("exit -> queue {}", r.state)
            } else {
                format!(
                    "field {}: skip {}, check {}, look up state {}",
                    r.field, r.skip, r.check, r.state
                )
            };
            let _ = writeln!(
                o,
                "  {i:>3}  0x{:08x}  {:>5} {:>4} {:>5} {:>5}  {meaning}",
                r.to_word(),
                r.field,
                r.skip,
                r.check,
                r.state
            );
        }
        let _ = writeln!(
            o,
            "CAM: {} of {TABLE_ENTRIES} entries (96 bits: app | type | field | state | string)",
            self.cam.len()
        );
        let _ = writeln!(
            o,
            "  idx  bits                        app type field state  string            meaning"
        );
        for (i, c) in self.cam.iter().enumerate() {
            let meaning = if c.state == 0 {
                format!("start of app {} type {}", c.app_id, c.req_type)
            } else if c.state & MISS_BIT != 0 {
                format!("state {} missed: fall through", c.state & !MISS_BIT)
            } else {
                // Trailing zeros are the padding of checks shorter than 8 bytes.
                let len = c.string.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
                format!(
                    "state {} matched \"{}\"",
                    c.state,
                    c.string[..len].escape_ascii()
                )
            };
            let hex: String = c.string.iter().map(|b| format!("{b:02x}")).collect();
            let _ = writeln!(
                o,
                "  {i:>3}  0x{:024x}  {:>3} {:>4} {:>5} {:>5}  {hex}  {meaning} -> RAM {i}",
                c.to_bits(),
                c.app_id,
                c.req_type,
                c.field,
                c.state
            );
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rule table written in code: `(pattern, queue)` rules of app 1 type 0 field 0.
    struct Table(Vec<Rule>, Option<u8>);

    impl RuleTable for Table {
        fn rules(&self) -> &[Rule] {
            &self.0
        }
        fn default_queue(&self, app_id: u8, req_type: u8) -> Option<u8> {
            self.1.filter(|_| (app_id, req_type) == (1, 0))
        }
        fn defaults(&self) -> Vec<(u8, u8)> {
            self.1.map(|_| (1, 0)).into_iter().collect()
        }
    }

    fn table(rules: &[(&str, u8)], default: Option<u8>) -> Table {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(line, (pattern, queue))| Rule {
                app_id: 1,
                req_type: 0,
                field: 0,
                pattern: pattern
                    .bytes()
                    .map(|b| match b {
                        b'.' => PatByte::Skip,
                        b => PatByte::Byte(b),
                    })
                    .collect(),
                queue: *queue,
                line: line + 1,
            })
            .collect();
        Table(rules, default)
    }

    #[test]
    fn compiles_the_papers_example() {
        let img = Image::compile(&table(&[("...AAA.BB", 3), ("user:", 1)], Some(0))).unwrap();
        // start + rule 1 (2 steps × hit+miss) + rule 2 (1 step × hit+miss)
        assert_eq!(img.cam.len(), 7);
        for (v, want) in [
            (&b"FEFAAACBB"[..], Decision::Queue(3)),
            (b"FEFBAACBB", Decision::Queue(0)),
            (b"user:x", Decision::Queue(1)),
            (b"FEFAAACB", Decision::Queue(0)),
        ] {
            assert_eq!(img.run(1, 0, |_| Some(v)).0, want, "{v:?}");
        }
        assert_eq!(img.run(2, 0, |_| Some(b"x")).0, Decision::Drop);
        assert_eq!(Image::from_bytes(&img.to_bytes()).unwrap(), img);
        // One app compiled alone gives the same entries.
        let t = table(&[("...AAA.BB", 3), ("user:", 1)], Some(0));
        let rules: Vec<&Rule> = t.0.iter().collect();
        let app = compile_app(1, 0, &rules, Some(0)).unwrap();
        assert_eq!((app.cam, app.ram), (img.cam, img.ram));
    }

    #[test]
    fn bit_layout_is_the_papers() {
        let r = RamEntry {
            field: 1,
            skip: 2,
            check: 3,
            state: 4,
        };
        assert_eq!(r.to_word(), 0x0102_0304);
        assert_eq!(RamEntry::from_word(0x0102_0304), r);
        let c = CamEntry {
            app_id: 0xaa,
            req_type: 0xbb,
            field: 0xcc,
            state: 0xdd,
            string: *b"12345678",
        };
        assert_eq!(c.to_bits() >> 96, 0, "96 bits");
        assert_eq!(
            c.to_bits() >> 72,
            0xaabbcc,
            "24-bit app/type/field key on top"
        );
        assert_eq!(c.to_bytes()[..4], [0xaa, 0xbb, 0xcc, 0xdd]);
        assert_eq!(CamEntry::from_bytes(&c.to_bytes()), c);
    }

    #[test]
    fn long_checks_and_skips_are_split() {
        let pat: Vec<PatByte> = std::iter::repeat_n(PatByte::Skip, 300)
            .chain(PatByte::literal(b"0123456789"))
            .chain([PatByte::Skip, PatByte::Skip])
            .collect();
        let steps = steps_of(&pat);
        let shape: Vec<(u8, usize)> = steps.iter().map(|s| (s.skip, s.lit.len())).collect();
        assert_eq!(shape, [(255, 0), (45, 8), (0, 2), (2, 0)]);
        assert!(steps_of(&[]).is_empty());
    }

    #[test]
    fn too_many_entries_or_states_are_refused_with_the_numbers() {
        let many: Vec<(String, u8)> = (0..600).map(|i| (format!("k{i:03}"), 1)).collect();
        let refs: Vec<(&str, u8)> = many.iter().map(|(p, q)| (p.as_str(), *q)).collect();
        let e = Image::compile(&table(&refs, None)).unwrap_err().to_string();
        assert!(
            e.contains("need 601 RAM and 601 CAM entries") && e.contains("89 entries over"),
            "{e}"
        );
        // Start, hit and fall-through: 3 entries.
        assert!(Image::compile_with_capacity(&table(&[("a", 1)], Some(0)), 3).is_ok());
        assert!(matches!(
            Image::compile_with_capacity(&table(&[("a", 1)], Some(0)), 2),
            Err(RulesError::TableFull(_))
        ));
    }

    #[test]
    fn rejects_bad_image_files() {
        assert!(matches!(
            Image::from_bytes(b"nope"),
            Err(RulesError::BadImage(_))
        ));
        let mut b = Image::default().to_bytes();
        assert_eq!(Image::from_bytes(&b).unwrap(), Image::default());
        b[9] = 1;
        assert!(Image::from_bytes(&b).is_err());
        let e = Image::from_bytes(b"QNPIMG01").unwrap_err().to_string();
        assert!(e.contains("entry count"), "{e}");
    }
}
