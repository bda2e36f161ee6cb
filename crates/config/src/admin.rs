//! The `admin:` section: where the admin endpoint listens and who may use it.
//!
//! Written either as an address (`admin: 127.0.0.1:15000`, `admin: unix:/run/flatmesh/admin.sock`)
//! or as a mapping with the same address under `address:` and the access settings beside it.
//! The admin endpoint shows the config and can reload the node, so its defaults are closed:
//! loopback only, a Unix socket only for its owner, timeouts and a connection cap always on.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where the admin endpoint listens: a TCP address or a Unix socket path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AdminAddress {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl AdminAddress {
    /// The TCP address, when the admin endpoint listens on TCP.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            AdminAddress::Tcp(a) => Some(*a),
            AdminAddress::Unix(_) => None,
        }
    }

    /// Only this host can reach it: a loopback address or a Unix socket.
    pub fn is_local(&self) -> bool {
        match self {
            AdminAddress::Tcp(a) => a.ip().to_canonical().is_loopback(),
            AdminAddress::Unix(_) => true,
        }
    }
}

impl fmt::Display for AdminAddress {
    /// `127.0.0.1:15000` or `unix:/run/flatmesh/admin.sock`, the form [`FromStr`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdminAddress::Tcp(a) => write!(f, "{a}"),
            AdminAddress::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl FromStr for AdminAddress {
    type Err = String;

    /// `IP:PORT`, `unix:/path` or an absolute path (a Unix socket).
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Some(path) = text.strip_prefix("unix:") {
            return Ok(AdminAddress::Unix(PathBuf::from(path)));
        }
        if text.starts_with('/') {
            return Ok(AdminAddress::Unix(PathBuf::from(text)));
        }
        text.parse().map(AdminAddress::Tcp).map_err(|_| {
            format!(
                "invalid admin address `{text}`: write IP:PORT (e.g. 127.0.0.1:15000) or unix:/path/to/admin.sock"
            )
        })
    }
}

impl From<SocketAddr> for AdminAddress {
    fn from(a: SocketAddr) -> Self {
        AdminAddress::Tcp(a)
    }
}

impl Serialize for AdminAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for AdminAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(de::Error::custom)
    }
}

/// The default admin address, `127.0.0.1:15000`.
pub fn default_admin_address() -> AdminAddress {
    AdminAddress::Tcp(SocketAddr::from(([127, 0, 0, 1], 15000)))
}

/// The admin endpoint's settings. Every field has a safe default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admin {
    /// `IP:PORT` (loopback unless `allow_remote`) or `unix:/path`.
    pub address: AdminAddress,
    /// Listen on an address other hosts can reach. Off: such an address is refused.
    pub allow_remote: bool,
    /// Bearer token required for every endpoint but `/ready` (`Authorization: Bearer TOKEN`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// A file holding the token (its first line), read at start and at every reload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Read-only endpoints that answer without the token, e.g. `[/metrics]` for a scraper.
    /// `/ready` always does; `/reload` and `/drain` never do.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub open_paths: Vec<String>,
    /// Host names accepted in the `Host` header besides loopback names and addresses
    /// (and the admin's own IP). Anything else is refused: a DNS-rebinding defence.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Permission bits of the Unix socket; default 0o600 (only the node's user).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "octal_mode")]
    pub mode: Option<u32>,
    /// Open admin connections at most; more are answered 503 and closed.
    pub max_connections: usize,
    /// A client must send its request head within this time.
    #[serde(with = "crate::duration")]
    pub header_read_timeout: Duration,
    /// A connection is closed after this long; a request still in flight then gets as long
    /// again to finish.
    #[serde(with = "crate::duration")]
    pub request_timeout: Duration,
}

pub const DEFAULT_UNIX_MODE: u32 = 0o600;

impl Default for Admin {
    fn default() -> Self {
        Admin {
            address: default_admin_address(),
            allow_remote: false,
            token: None,
            token_file: None,
            open_paths: Vec::new(),
            hosts: Vec::new(),
            mode: None,
            max_connections: 16,
            header_read_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        }
    }
}

impl Admin {
    /// The Unix socket's permission bits.
    pub fn unix_mode(&self) -> u32 {
        self.mode.unwrap_or(DEFAULT_UNIX_MODE)
    }
}

impl From<AdminAddress> for Admin {
    fn from(address: AdminAddress) -> Self {
        Admin {
            address,
            ..Admin::default()
        }
    }
}

impl From<SocketAddr> for Admin {
    fn from(a: SocketAddr) -> Self {
        Admin::from(AdminAddress::Tcp(a))
    }
}

impl FromStr for Admin {
    type Err = String;

    /// An address alone, with every other setting at its default.
    fn from_str(text: &str) -> Result<Self, String> {
        text.parse::<AdminAddress>().map(Admin::from)
    }
}

/// `admin: ADDRESS` or `admin: { address: ADDRESS, ... }`.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Admin, D::Error> {
    struct AdminVisitor;

    impl<'de> Visitor<'de> for AdminVisitor {
        type Value = Admin;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an address (IP:PORT or unix:/path) or a mapping with `address:`")
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Admin, E> {
            text.parse().map_err(E::custom)
        }

        fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<Admin, M::Error> {
            // The derived reader of the mapping form, so unknown keys are named as everywhere.
            Admin::deserialize(de::value::MapAccessDeserializer::new(map))
        }
    }

    d.deserialize_any(AdminVisitor)
}

/// Permission bits written as an octal number (`0o600`) or octal text (`"0600"`, `"600"`):
/// YAML reads a bare `0600` as text, so both forms mean the same.
mod octal_mode {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mode: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
        match mode {
            Some(m) => s.serialize_str(&format!("0{m:o}")),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        struct Mode;
        impl Visitor<'_> for Mode {
            type Value = Option<u32>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("permission bits such as 0o600 or \"0600\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<u32>, E> {
                u32::try_from(v)
                    .map(Some)
                    .map_err(|_| E::custom(format!("mode {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<u32>, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("mode {v} is negative")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<u32>, E> {
                let digits = v.trim().trim_start_matches("0o");
                u32::from_str_radix(digits, 8).map(Some).map_err(|_| {
                    E::custom(format!(
                        "mode `{v}` is not octal permission bits: write it like 0o600 or \"0600\""
                    ))
                })
            }
        }
        d.deserialize_any(Mode)
    }
}

/// The read-only endpoints, answered to GET. `POST /reload` and `POST /drain` are the ones
/// that change the node.
pub const READ_PATHS: &[&str] = &[
    "/metrics",
    "/ready",
    "/config",
    "/rules",
    "/listeners",
    "/stats/routes",
];

/// Longest Unix socket path the kernel takes (`sun_path` is 108 bytes with its NUL).
const MAX_UNIX_PATH: usize = 107;
/// Shortest token accepted: a guessable token is no protection.
pub const MIN_TOKEN_CHARS: usize = 16;
pub const MAX_CONNECTIONS: usize = 1024;

/// The semantic checks of the section: `report(path, message, hint)` for each problem.
pub(crate) fn check(admin: &Admin, report: &mut dyn FnMut(&str, String, String)) {
    match &admin.address {
        AdminAddress::Tcp(a) if !admin.address.is_local() && !admin.allow_remote => report(
            "admin.address",
            format!(
                "admin address {a} can be reached from other hosts: whoever reaches it could read the config and reload the node"
            ),
            format!(
                "keep it on loopback (127.0.0.1:{port}) or a Unix socket (unix:/run/flatmesh/admin.sock); to expose it on purpose write `admin: {{ address: {a}, allow_remote: true, token_file: /etc/flatmesh/admin-token }}`",
                port = a.port()
            ),
        ),
        AdminAddress::Tcp(_) => {
            if admin.mode.is_some() {
                report(
                    "admin.mode",
                    "admin.mode is set but the admin endpoint listens on TCP".into(),
                    "`mode` sets the permissions of a Unix socket: remove it, or use `address: unix:/path`".into(),
                );
            }
        }
        AdminAddress::Unix(path) => {
            if !path.is_absolute() {
                report(
                    "admin.address",
                    format!("admin socket path `{}` is not absolute", path.display()),
                    "write an absolute path, e.g. unix:/run/flatmesh/admin.sock".into(),
                );
            } else if path.as_os_str().len() > MAX_UNIX_PATH {
                report(
                    "admin.address",
                    format!(
                        "admin socket path is {} bytes long; a Unix socket path has at most {MAX_UNIX_PATH}",
                        path.as_os_str().len()
                    ),
                    "choose a shorter path, e.g. /run/flatmesh/admin.sock".into(),
                );
            }
        }
    }
    let mode = admin.unix_mode();
    if mode & !0o777 != 0 {
        report(
            "admin.mode",
            format!("admin.mode 0{mode:o} has bits beyond the permission bits 0777"),
            "write permission bits such as 0o600 (owner only) or 0o660 (owner and group)".into(),
        );
    } else if mode & 0o007 != 0 && !admin.allow_remote {
        report(
            "admin.mode",
            format!("admin.mode 0{mode:o} lets every local user use the admin socket"),
            "use 0o600 (owner only) or 0o660 (owner and group), or set `allow_remote: true` to mean it".into(),
        );
    }
    match (&admin.token, &admin.token_file) {
        (Some(_), Some(_)) => report(
            "admin.token_file",
            "admin sets both `token` and `token_file`".into(),
            "keep one: `token_file` keeps the secret out of the config file".into(),
        ),
        (Some(token), None) => {
            if let Err(why) = check_token(token) {
                report("admin.token", why, token_hint());
            }
        }
        _ => {}
    }
    for (i, path) in admin.open_paths.iter().enumerate() {
        let at = format!("admin.open_paths[{i}]");
        if path == "/reload" || path == "/drain" {
            report(
                &at,
                format!("`{path}` changes the node: it always needs the token"),
                format!("list only read-only endpoints: {}", READ_PATHS.join(", ")),
            );
        } else if !READ_PATHS.contains(&path.as_str()) {
            report(
                &at,
                format!("unknown admin endpoint `{path}`"),
                format!(
                    "{}admin endpoints: {}",
                    crate::suggest::did_you_mean(path, READ_PATHS.iter().copied()),
                    READ_PATHS.join(", ")
                ),
            );
        }
    }
    for (i, host) in admin.hosts.iter().enumerate() {
        let valid = !host.is_empty()
            && host
                .split('.')
                .all(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
        if !valid {
            report(
                &format!("admin.hosts[{i}]"),
                format!("admin host `{host}` is not a host name"),
                "write a name such as `node-1.mesh.internal`, without port or wildcard".into(),
            );
        }
    }
    if !(1..=MAX_CONNECTIONS).contains(&admin.max_connections) {
        report(
            "admin.max_connections",
            format!(
                "admin.max_connections is {}: it must be between 1 and {MAX_CONNECTIONS}",
                admin.max_connections
            ),
            "the default, 16, is plenty for scrapers and operators".into(),
        );
    }
    for (key, value) in [
        ("admin.header_read_timeout", admin.header_read_timeout),
        ("admin.request_timeout", admin.request_timeout),
    ] {
        if value.is_zero() {
            report(
                key,
                format!("{key} is zero: a timeout must be longer than zero"),
                "write a positive duration such as `5s`, or remove the key to use the default"
                    .into(),
            );
        }
    }
}

/// A token is at least [`MIN_TOKEN_CHARS`] visible ASCII characters (it travels in a header).
pub fn check_token(token: &str) -> Result<(), String> {
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the admin token has characters other than visible ASCII".into());
    }
    if token.len() < MIN_TOKEN_CHARS {
        return Err(format!(
            "the admin token has {} characters; it needs at least {MIN_TOKEN_CHARS}",
            token.len()
        ));
    }
    Ok(())
}

fn token_hint() -> String {
    "generate one with `openssl rand -hex 32`".into()
}

/// Read the token from `path`: its first line, trimmed, checked like an inline token.
pub fn read_token_file(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "cannot read admin.token_file {}: {e}; check the path and that the node's user may read it",
            path.display()
        )
    })?;
    let token = text.lines().next().unwrap_or_default().trim().to_string();
    check_token(&token).map_err(|why| {
        format!(
            "admin.token_file {}: {why}; {}",
            path.display(),
            token_hint()
        )
    })?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_read_and_write_back() {
        for text in ["127.0.0.1:15000", "[::1]:9", "unix:/run/fm/admin.sock"] {
            let a: AdminAddress = text.parse().unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(a.to_string(), text);
        }
        assert_eq!(
            "/tmp/a.sock".parse::<AdminAddress>(),
            Ok(AdminAddress::Unix("/tmp/a.sock".into()))
        );
        let e = "localhost:15000"
            .parse::<AdminAddress>()
            .expect_err("host names are not resolved");
        assert!(e.contains("write IP:PORT"), "{e}");
    }

    #[test]
    fn local_means_loopback_or_unix() {
        let local = |t: &str| t.parse::<AdminAddress>().map(|a| a.is_local());
        assert_eq!(local("127.0.0.1:1"), Ok(true));
        assert_eq!(local("127.9.9.9:1"), Ok(true));
        assert_eq!(local("[::1]:1"), Ok(true));
        assert_eq!(local("[::ffff:127.0.0.1]:1"), Ok(true));
        assert_eq!(local("unix:/x"), Ok(true));
        assert_eq!(local("0.0.0.0:1"), Ok(false));
        assert_eq!(local("[::]:1"), Ok(false));
        assert_eq!(local("10.1.2.3:1"), Ok(false));
    }
}
