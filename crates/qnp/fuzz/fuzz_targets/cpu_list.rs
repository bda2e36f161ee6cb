//! The CPU list parser of `flatmesh qnp bench --server-cpus/--load-cpus` never panics, and what
//! it accepts is a sorted set of CPUs a cpu_set_t can hold.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cpus) = flatmesh_qnp::cpu::parse_cpu_list(s) {
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
        assert!(cpus.iter().all(|c| *c < 1024));
    }
});
