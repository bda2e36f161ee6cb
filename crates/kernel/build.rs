//! Builds the tier-K eBPF objects from `bpf/*.bpf.c` with clang.
//!
//! `vmlinux.h` is generated at build time into OUT_DIR from the running kernel's BTF
//! (`bpftool btf dump file /sys/kernel/btf/vmlinux format c`), so the programs see the exact
//! kernel types; set FLATMESH_VMLINUX_H to a file to build on a machine without BTF or bpftool.
//! FLATMESH_CLANG and FLATMESH_BPFTOOL override the tool paths.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

/// Each object with the BPF instruction set it is built for: `conn_limit` takes a token with
/// a compare-and-swap (BPF_CMPXCHG), which needs v3; the others keep the compiler's default.
const PROGRAMS: [(&str, Option<&str>); 5] = [
    ("capture", None),
    ("redirect", None),
    ("dispatch", None),
    ("conn_limit", Some("v3")),
    ("pu_ports", None),
];

fn fail(msg: &str) -> ! {
    eprintln!("error: flatmesh-kernel build: {msg}");
    exit(1)
}

fn run(cmd: &mut Command, what: &str, hint: &str) -> Vec<u8> {
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => fail(&format!("cannot run {what} ({e}). {hint}")),
    };
    if !out.status.success() {
        fail(&format!(
            "{what} failed with {}:\n{}\n{hint}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    out.stdout
}

fn vmlinux_h(out_dir: &Path) -> PathBuf {
    println!("cargo:rerun-if-env-changed=FLATMESH_VMLINUX_H");
    println!("cargo:rerun-if-env-changed=FLATMESH_BPFTOOL");
    let dest = out_dir.join("vmlinux.h");
    if let Ok(given) = env::var("FLATMESH_VMLINUX_H") {
        if let Err(e) = std::fs::copy(&given, &dest) {
            fail(&format!(
                "cannot copy FLATMESH_VMLINUX_H={given}: {e}. Point it at a vmlinux.h file."
            ));
        }
        return dest;
    }
    let btf = "/sys/kernel/btf/vmlinux";
    if !Path::new(btf).exists() {
        fail(&format!(
            "{btf} is missing: this kernel has no BTF. Build on a kernel with CONFIG_DEBUG_INFO_BTF=y \
             or set FLATMESH_VMLINUX_H to a vmlinux.h generated elsewhere."
        ));
    }
    let bpftool = env::var("FLATMESH_BPFTOOL").unwrap_or_else(|_| "bpftool".to_string());
    let header = run(
        Command::new(&bpftool).args(["btf", "dump", "file", btf, "format", "c"]),
        "bpftool",
        "Install it (`apt-get install -y bpftool`) or set FLATMESH_BPFTOOL / FLATMESH_VMLINUX_H.",
    );
    if let Err(e) = std::fs::write(&dest, header) {
        fail(&format!("cannot write {}: {e}", dest.display()));
    }
    dest
}

fn main() {
    let out_dir = match env::var("OUT_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => fail("OUT_DIR is not set; run this through cargo."),
    };
    let manifest = match env::var("CARGO_MANIFEST_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => fail("CARGO_MANIFEST_DIR is not set; run this through cargo."),
    };
    println!("cargo:rerun-if-env-changed=FLATMESH_CLANG");
    let bpf_dir = manifest.join("bpf");
    println!("cargo:rerun-if-changed={}", bpf_dir.display());
    println!(
        "cargo:rerun-if-changed={}",
        bpf_dir.join("common.h").display()
    );
    vmlinux_h(&out_dir);
    let clang = env::var("FLATMESH_CLANG").unwrap_or_else(|_| "clang".to_string());
    let arch = match env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86",
        Ok("aarch64") => "arm64",
        Ok(other) => fail(&format!(
            "no BPF target-arch mapping for {other}; add one to build.rs"
        )),
        Err(_) => fail("CARGO_CFG_TARGET_ARCH is not set; run this through cargo."),
    };
    for (name, cpu) in PROGRAMS {
        let src = bpf_dir.join(format!("{name}.bpf.c"));
        println!("cargo:rerun-if-changed={}", src.display());
        let obj = out_dir.join(format!("{name}.bpf.o"));
        run(
            Command::new(&clang)
                .arg("-g")
                .arg("-O2")
                .arg("-Wall")
                .arg("-Werror")
                .args(["-target", "bpf"])
                .args(cpu.map(|cpu| format!("-mcpu={cpu}")))
                .arg(format!("-D__TARGET_ARCH_{arch}"))
                .arg("-I")
                .arg(&out_dir)
                .arg("-I")
                .arg(&bpf_dir)
                .arg("-c")
                .arg(&src)
                .arg("-o")
                .arg(&obj),
            &format!("clang on {}", src.display()),
            "clang builds the eBPF programs: install clang, llvm and libbpf-dev \
             (`apt-get install -y clang llvm libbpf-dev`) or set FLATMESH_CLANG.",
        );
    }
}
