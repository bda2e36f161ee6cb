//! Builds the kernel receive-side dispatcher `bpf/qnp_rsd.bpf.c` with clang (the same toolchain
//! as crates/kernel: C + clang, loaded with aya 0.14). FLATMESH_CLANG overrides the clang path.

use std::env;
use std::path::PathBuf;
use std::process::{exit, Command};

fn main() {
    println!("cargo:rerun-if-changed=bpf/qnp_rsd.bpf.c");
    println!("cargo:rerun-if-env-changed=FLATMESH_CLANG");
    let Some(out) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        eprintln!("error: flatmesh-qnp build: OUT_DIR is not set; run the build through cargo");
        exit(1);
    };
    let clang = env::var("FLATMESH_CLANG").unwrap_or_else(|_| "clang".to_string());
    let arch_include = format!("/usr/include/{}-linux-gnu", env::consts::ARCH);
    let result = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .arg(format!("-I{arch_include}"))
        .args(["-c", "bpf/qnp_rsd.bpf.c", "-o"])
        .arg(out.join("qnp_rsd.bpf.o"))
        .output();
    match result {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "error: flatmesh-qnp build: clang failed on bpf/qnp_rsd.bpf.c:\n{}\nInstall clang and libbpf-dev (`apt-get install -y clang libbpf-dev`).",
                String::from_utf8_lossy(&o.stderr)
            );
            exit(1);
        }
        Err(e) => {
            eprintln!(
                "error: flatmesh-qnp build: cannot run {clang} ({e}); install clang (`apt-get install -y clang`) or set FLATMESH_CLANG"
            );
            exit(1);
        }
    }
}
