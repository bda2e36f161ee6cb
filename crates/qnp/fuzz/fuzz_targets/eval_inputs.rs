//! The `flatmesh qnp rules eval` input parser never panics, and every input it accepts runs
//! through the Matcher model of a compiled image to the same decision as the plain semantics.
#![no_main]
use flatmesh_qnp::image::{parse_eval_inputs, Image};
use flatmesh_qnp::rules::RuleSet;
use libfuzzer_sys::fuzz_target;

const RULES: &str = "rule 1 0 0 \"...AAA.BB\" -> 3\nrule 1 0 0 \"user:\" -> 1\nrule 1 0 0 \"us.r\" -> 2\ndefault 1 0 -> 0\nrule 2 0 0 \"\\x00\" -> 4\n";

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(inputs) = parse_eval_inputs("fuzz.inputs", src) else {
        return;
    };
    let set = RuleSet::parse("fuzz.rules", RULES).expect("the fixed rules parse");
    let img = Image::compile(&set).expect("the fixed rules fit");
    for i in inputs {
        let want = set.eval(i.app_id, i.req_type, |_| Some(&i.value[..]));
        assert_eq!(
            img.run(i.app_id, i.req_type, |_| Some(&i.value[..])).0,
            want
        );
    }
});
