//! The three readings of a rule file agree: the plain semantics (`RuleSet::eval`), the software
//! dispatcher's `FastMatcher`, and the bit-exact Matcher model running the compiled RAM/CAM image,
//! also after the image went through its file format.

use flatmesh_qnp::image::Image;
use flatmesh_qnp::rules::{FastMatcher, PatByte, RuleSet};
use proptest::prelude::*;

/// A pattern over a tiny alphabet so that random values often match; sometimes with a long skip
/// (> 255, split across RAM entries) or a long literal (> 8 bytes, split across CAM entries).
fn pattern() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        6 => Just("a".to_owned()),
        4 => Just("b".to_owned()),
        5 => Just(".".to_owned()),
        1 => Just("\\.".to_owned()),
        1 => Just("\\x00".to_owned()),
        1 => Just(".".repeat(260)),
        1 => Just("abababababa".to_owned()),
    ];
    proptest::collection::vec(piece, 0..6).prop_map(|p| p.concat())
}

fn rule_file() -> impl Strategy<Value = String> {
    let rule = (1u8..3, 0u8..2, 0u8..2, pattern(), 0u8..6)
        .prop_map(|(a, t, f, p, q)| format!("rule {a} {t} {f} \"{p}\" -> {q}\n"));
    (
        proptest::collection::vec(rule, 0..16),
        proptest::collection::btree_map((1u8..3, 0u8..2), 0u8..6, 0..3),
    )
        .prop_map(|(rules, defaults)| {
            let defaults: String = defaults
                .into_iter()
                .map(|((a, t), q)| format!("default {a} {t} -> {q}\n"))
                .collect();
            rules.concat() + &defaults
        })
}

/// Families of rules that share a leading pattern and differ after it, so the image compiler's
/// groups with a shared prefix (and the group boundaries of first-match order) are exercised.
fn family_rule_file() -> impl Strategy<Value = String> {
    let tail = prop_oneof![
        Just("a".to_owned()),
        Just("b".to_owned()),
        Just("c".to_owned()),
        Just("ab".to_owned()),
        Just("cd".to_owned()),
        Just(".a".to_owned()),
        Just(".b".to_owned()),
        Just(".c".to_owned()),
        Just(".d".to_owned()),
        Just("".to_owned()),
    ];
    let field = prop_oneof![4 => Just(0u8), 1 => Just(1u8)];
    let rule = (field, proptest::collection::vec(tail, 0..3), 0u8..6);
    let base = prop_oneof![
        3 => Just("a".to_owned()),
        2 => Just("a.b".to_owned()),
        1 => Just("..".to_owned()),
        1 => Just(String::new()),
        2 => pattern(),
    ];
    (
        base,
        proptest::collection::vec(rule, 1..12),
        proptest::option::of(0u8..6),
    )
        .prop_map(|(base, rules, default)| {
            let mut s: String = rules
                .into_iter()
                .map(|(f, t, q)| format!("rule 1 0 {f} \"{base}{}\" -> {q}\n", t.concat()))
                .collect();
            if let Some(q) = default {
                s += &format!("default 1 0 -> {q}\n");
            }
            s
        })
}

fn value() -> impl Strategy<Value = Option<Vec<u8>>> {
    let byte = prop_oneof![Just(b'a'), Just(b'b'), Just(b'.'), Just(0u8), any::<u8>()];
    proptest::option::weighted(
        0.9,
        prop_oneof![
            4 => proptest::collection::vec(byte.clone(), 0..16),
            1 => proptest::collection::vec(byte, 250..300),
        ],
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn image_fast_and_plain_agree(
        src in rule_file(),
        inputs in proptest::collection::vec((1u8..4, 0u8..3, value(), value()), 1..16),
    ) {
        let set = RuleSet::parse("prop.rules", &src).unwrap();
        let fast = FastMatcher::new(&set);
        let img = Image::compile(&set).unwrap();
        let img = Image::from_bytes(&img.to_bytes()).unwrap();
        for (app, ty, f0, f1) in &inputs {
            let field = |i: u8| match i {
                0 => f0.as_deref(),
                1 => f1.as_deref(),
                _ => None,
            };
            let want = set.eval(*app, *ty, field);
            prop_assert_eq!(fast.eval(*app, *ty, field), want, "fast matcher, rules:\n{}", src);
            prop_assert_eq!(img.run(*app, *ty, field).0, want, "image, rules:\n{}", src);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn image_agrees_on_rule_families_with_shared_prefixes(
        src in family_rule_file(),
        inputs in proptest::collection::vec((value(), value()), 1..24),
    ) {
        let set = RuleSet::parse("family.rules", &src).unwrap();
        let fast = FastMatcher::new(&set);
        let img = Image::compile(&set).unwrap();
        // Besides random values, a value that each rule matches (skips filled with `z`), so
        // every group is walked to its end and its members are told apart.
        let exact = set.rules.iter().map(|r| {
            let v: Vec<u8> = r.pattern.iter().map(|p| match p {
                PatByte::Skip => b'z',
                PatByte::Byte(b) => *b,
            }).collect();
            (Some(v.clone()), Some(v))
        });
        let inputs: Vec<_> = inputs.into_iter().chain(exact).collect();
        for (f0, f1) in &inputs {
            let field = |i: u8| match i {
                0 => f0.as_deref(),
                1 => f1.as_deref(),
                _ => None,
            };
            let want = set.eval(1, 0, field);
            prop_assert_eq!(fast.eval(1, 0, field), want, "fast matcher, rules:\n{}", src);
            prop_assert_eq!(img.run(1, 0, field).0, want, "image, rules:\n{}", src);
        }
    }
}

#[test]
fn the_issue_example_over_the_image() {
    let set = RuleSet::parse(
        "r",
        "rule 1 0 0 \"...AAA.BB\" -> 3\nrule 1 0 0 \"user:\" -> 1\ndefault 1 0 -> 0\n",
    )
    .unwrap();
    let img = Image::compile(&set).unwrap();
    let (d, lookups) = img.run(1, 0, |_| Some(&b"FEFAAACBB"[..]));
    assert_eq!(d.to_string(), "3");
    assert_eq!(lookups, 3, "start, AAA, BB");
    // Falling through the first rule into the second costs a miss lookup per step tried.
    let (d, lookups) = img.run(1, 0, |_| Some(&b"user:name"[..]));
    assert_eq!(d.to_string(), "1");
    assert_eq!(lookups, 4, "start, AAA miss, fall-through, user:");
}
