//! The `flatmesh qnp` command-line contract (issue 5): `idl compile`, `rules compile [--explain]`,
//! `rules eval`, and smoke runs of `demo` and `bench` with tiny durations. The demo and bench
//! include the kernel mode, which needs root (CI runs as root).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn flatmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flatmesh"))
        .args(args)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../qnp/examples")
}

/// A scratch directory of this test's own, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("fm-qnp-cli-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
    fn write(&self, name: &str, body: &str) -> String {
        std::fs::write(self.0.join(name), body).unwrap();
        self.path(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn rules_compile_and_eval_follow_the_contract() {
    let dir = Scratch::new("eval");
    let rules = examples().join("rules/example.rules").display().to_string();
    let image = dir.path("example.img");
    let out = flatmesh(&[
        "qnp",
        "rules",
        "compile",
        &rules,
        "--image",
        &image,
        "--explain",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("RAM: 7 of 512 entries"), "{stdout}");
    assert!(stdout.contains("CAM: 7 of 512 entries"), "{stdout}");
    assert!(stdout.contains("exit -> queue 3"), "{stdout}");
    assert!(stdout.contains("state 1 matched \"AAA\""), "{stdout}");
    // The image file: magic, entry count, 7 RAM words of 4 bytes, 7 CAM entries of 12.
    let bytes = std::fs::read(&image).unwrap();
    assert_eq!(&bytes[..8], b"QNPIMG01");
    assert_eq!(bytes.len(), 8 + 2 + 7 * 4 + 7 * 12);

    let inputs = examples()
        .join("rules/example.inputs")
        .display()
        .to_string();
    let out = flatmesh(&[
        "qnp", "rules", "eval", "--image", &image, "--inputs", &inputs,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // FEFAAACBB -> 3, FEFBAACBB -> default 0, user:42 -> 1, "user" (too short) -> 0, app 2 -> drop.
    assert_eq!(text(&out.stdout), "3\n0\n1\n0\ndrop\n");
}

#[test]
fn bad_files_get_file_and_line_errors() {
    let dir = Scratch::new("bad");
    let image = dir.path("x.img");
    let bad = dir.write(
        "bad.rules",
        "rule 1 0 0 \"a\" -> 1\n\nrule 1 0 \"b\" -> 2\n",
    );
    let out = flatmesh(&["qnp", "rules", "compile", &bad, "--image", &image]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("{bad}:3: expected three numbers")),
        "{err}"
    );
    assert!(
        !Path::new(&image).exists(),
        "nothing is written for a bad file"
    );

    // 600 rules on 60 request types do not fit: the error says by how much.
    let many: String = (0..600)
        .map(|i| format!("rule 1 {} 0 \"{i:03}.x\" -> 1\n", i % 60))
        .collect();
    let big = dir.write("big.rules", &many);
    let out = flatmesh(&["qnp", "rules", "compile", &big, "--image", &image]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("entries over"),
        "{}",
        text(&out.stderr)
    );

    let junk = dir.write("junk.img", "not an image");
    let inputs = dir.write("in.txt", "1 0 00\n");
    let out = flatmesh(&[
        "qnp", "rules", "eval", "--image", &junk, "--inputs", &inputs,
    ]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("recompile it with `flatmesh qnp rules compile`"));

    let good = examples().join("rules/example.rules").display().to_string();
    assert!(
        flatmesh(&["qnp", "rules", "compile", &good, "--image", &image])
            .status
            .success()
    );
    let bad_in = dir.write("bad.txt", "# comment\n1 0 7g\n");
    let out = flatmesh(&[
        "qnp", "rules", "eval", "--image", &image, "--inputs", &bad_in,
    ]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(&format!("{bad_in}:2: `7g` is not hex")));

    let bad_idl = dir.write(
        "bad.qnp",
        "app kv = 1;\nmessage Get = 0 {\n  float x = 1;\n}\n",
    );
    let out = flatmesh(&["qnp", "idl", "compile", &bad_idl, "--out", &dir.path("gen")]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(&format!("{bad_idl}:3:3: unknown field type `float`")));
}

#[test]
fn idl_compile_regenerates_the_checked_in_code() {
    let dir = Scratch::new("idl");
    for app in ["kv", "pingpong"] {
        let idl = examples().join(format!("idl/{app}.qnp"));
        let out = flatmesh(&[
            "qnp",
            "idl",
            "compile",
            &idl.display().to_string(),
            "--out",
            &dir.path("gen"),
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let generated = std::fs::read_to_string(dir.0.join(format!("gen/{app}.rs"))).unwrap();
        let checked_in = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../qnp/src/apps/{app}.rs")),
        )
        .unwrap();
        assert_eq!(generated, checked_in, "{app}");
    }
}

#[test]
fn demo_prints_a_row_per_mode_for_each_app() {
    let out = flatmesh(&[
        "qnp",
        "demo",
        "--seconds",
        "0.3",
        "--keys",
        "2400",
        "--clients",
        "2",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    // The key-value app runs on RocksDB, built in with `--features kv` (scripts/test does);
    // without it the demo runs PingPong alone and `--workload kv` says how to get it.
    let apps = if cfg!(feature = "kv") {
        assert!(
            stdout.contains("kv: GETs of 2400 pre-loaded 62-byte keys on RocksDB"),
            "{stdout}"
        );
        2
    } else {
        assert!(!stdout.contains("kv:"), "{stdout}");
        let out = flatmesh(&["qnp", "demo", "--workload", "kv"]);
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("cargo build --release -p flatmesh --features kv"),
            "{}",
            text(&out.stderr)
        );
        1
    };
    assert!(stdout.contains("pingpong: 128-byte requests"), "{stdout}");
    for mode in ["reuseport", "kernel", "software-queue", "software-uds"] {
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with(mode)).collect();
        assert_eq!(rows.len(), apps, "{mode} once per app:\n{stdout}");
        for row in rows {
            let rps: f64 = row.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert!(rps > 0.0, "{row}");
        }
    }
    let out = flatmesh(&["qnp", "demo", "--workload", "redis"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("use kv or pingpong"));
}

#[test]
fn bench_smoke_run_pins_every_mode_and_reports_cpu() {
    let dir = Scratch::new("bench");
    let report = dir.path("report.md");
    let svgs = dir.path("svg");
    let out = flatmesh(&[
        "qnp",
        "bench",
        "--seconds",
        "0.2",
        "--repeats",
        "1",
        "--keys",
        "2400",
        "--checks",
        "1,48",
        "--rules",
        "508",
        "--server-cpus",
        "0",
        "--load-cpus",
        "0",
        "--out",
        &report,
        "--svg-dir",
        &svgs,
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let md = std::fs::read_to_string(&report).unwrap();
    assert_eq!(md, stdout);
    // The key-value headline needs RocksDB (`--features kv`); without it the bench says so.
    assert_eq!(
        md.contains("### Key-value GETs on RocksDB (2400 keys"),
        cfg!(feature = "kv"),
        "{md}"
    );
    if !cfg!(feature = "kv") {
        assert!(
            text(&out.stderr).contains("no key-value headline"),
            "{}",
            text(&out.stderr)
        );
    }
    assert!(
        md.contains("server threads on CPUs [0], load generator on CPUs [0]"),
        "{md}"
    );
    assert!(md.contains("server CPUs busy %"), "{md}");
    assert!(md.contains("kernel / reuseport: throughput"), "{md}");
    assert!(md.contains("kernel / software-uds: throughput"), "{md}");
    assert!(
        md.contains("| 48 | 49 |"),
        "Table 1: 48 skip-and-checks take 49 lookups\n{md}"
    );
    assert!(md.contains("| 508 | kernel |"), "{md}");
    // The L7 modes never send a request to the wrong worker.
    for line in md
        .lines()
        .filter(|l| l.starts_with("| 1 |") || l.starts_with("| 48 |") || l.starts_with("| 508 |"))
    {
        if line.contains("| kernel |") || line.contains("| software-") {
            assert!(line.ends_with("| 0 |"), "misdispatched: {line}");
        }
    }
    assert_eq!(std::fs::read_dir(&svgs).unwrap().count(), 6);

    let out = flatmesh(&["qnp", "bench", "--server-cpus", "9999"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("CPU"), "{}", text(&out.stderr));
    let out = flatmesh(&["qnp", "bench", "--seconds", "0"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--seconds 0"),
        "{}",
        text(&out.stderr)
    );
}

/// `flatmesh check` compiles a qnp listener's rules as the node does: `--explain` prints the
/// Matcher image `rules compile --explain` prints for the same rules, and a rule that names a
/// worker the listener does not list is refused with its line.
#[test]
fn check_explain_shows_a_qnp_listener_s_image() {
    let dir = Scratch::new("check");
    let rules = examples().join("rules/example.rules").display().to_string();
    let image = dir.path("example.img");
    let compiled = flatmesh(&[
        "qnp",
        "rules",
        "compile",
        &rules,
        "--image",
        &image,
        "--explain",
    ]);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    let explained = text(&compiled.stdout);
    let image_text = &explained[..explained.find("wrote ").unwrap()];
    let queues = std::fs::read_to_string(&rules)
        .unwrap()
        .lines()
        .filter_map(|l| l.rsplit_once("->"))
        .filter_map(|(_, q)| q.trim().parse::<usize>().ok())
        .max()
        .unwrap();
    let workers: Vec<String> = (0..=queues)
        .map(|q| format!("127.0.0.1:{}", 7101 + q))
        .collect();
    let config = |rules_file: &str| {
        format!(
            "listeners:\n  - name: kv\n    address: 127.0.0.1:7100\n    protocol: qnp\n    qnp: {{ workers: [ {} ], rules_file: {rules_file} }}\n",
            workers.join(", ")
        )
    };
    let ok = dir.write("ok.yaml", &config(&rules));
    let out = flatmesh(&["check", "--config", &ok, "--explain"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}{stdout}", text(&out.stderr));
    assert!(
        stdout.contains("listener 0 `kv` qnp 127.0.0.1:7100"),
        "{stdout}"
    );
    assert!(stdout.contains("qnp listener `kv`:"), "{stdout}");
    assert!(
        stdout.contains(image_text),
        "the image differs from `rules compile --explain`:\n{stdout}"
    );

    let bad = dir.write("bad.rules", "default 1 0 -> 0\nrule 1 0 0 \"a\" -> 99\n");
    let out = flatmesh(&["check", "--config", &dir.write("bad.yaml", &config(&bad))]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("bad.rules:2:") && err.contains("queue 99"),
        "{err}"
    );
}
