//! Declares the `fuzzing` cfg (set by cargo-fuzz for crates/shm/fuzz) so that the compiler
//! knows it.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(fuzzing)");
}
