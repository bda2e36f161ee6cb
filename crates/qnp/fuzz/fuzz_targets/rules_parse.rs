//! The rule parser never panics; whatever parses and compiles agrees across the plain semantics,
//! the fast matcher and the image model, for values taken from the same input.
#![no_main]
use flatmesh_qnp::image::Image;
use flatmesh_qnp::rules::{FastMatcher, RuleSet};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Input: rule file text, then a NUL, then probe values separated by newlines.
    let (text, probes) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(src) = std::str::from_utf8(text) else {
        return;
    };
    let Ok(set) = RuleSet::parse("fuzz.rules", src) else {
        return;
    };
    let fast = FastMatcher::new(&set);
    let Ok(img) = Image::compile(&set) else {
        return;
    };
    let back = Image::from_bytes(&img.to_bytes()).expect("an image reads back");
    assert_eq!(back, img);
    let _ = img.explain();
    for value in probes.split(|b| *b == b'\n') {
        for (app, ty) in set.groups().into_iter().chain([(0, 0)]) {
            let want = set.eval(app, ty, |_| Some(value));
            assert_eq!(fast.eval(app, ty, |_| Some(value)), want);
            assert_eq!(img.run(app, ty, |_| Some(value)).0, want);
        }
    }
});
