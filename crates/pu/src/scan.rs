//! Which TCP ports does this PU listen on? Read from `/proc/thread-self/net/tcp` and `tcp6`,
//! which show the network namespace of the calling thread (the agent's PU).
//!
//! Polling is simple and sees every program, unmodified; the cost is the window between an app's
//! `listen()` and the next poll (see docs/pu.md). The agent's own placeholder sockets listen too;
//! the agent leaves them out.

use std::collections::BTreeSet;

use crate::error::{PuError, Result};

/// TCP_LISTEN in the `st` column.
const TCP_LISTEN: &str = "0A";

/// The ports of listening sockets in the text of a `/proc/net/tcp` or `tcp6` file.
pub fn parse_listening(text: &str, out: &mut BTreeSet<u16>) -> std::result::Result<(), String> {
    let mut lines = text.lines();
    match lines.next() {
        Some(header) if header.trim_start().starts_with("sl") => {}
        _ => return Err("the first line is not the `sl local_address ...` header".to_string()),
    }
    for (i, line) in lines.enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(_sl), Some(local), Some(_remote), Some(state)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return Err(format!("line {}: fewer than 4 fields", i + 2));
        };
        if state != TCP_LISTEN {
            continue;
        }
        let port_hex = local
            .rsplit_once(':')
            .map(|(_, p)| p)
            .ok_or_else(|| format!("line {}: local address `{local}` has no port", i + 2))?;
        let port = u16::from_str_radix(port_hex, 16)
            .map_err(|_| format!("line {}: port `{port_hex}` is not hexadecimal", i + 2))?;
        if port != 0 {
            out.insert(port);
        }
    }
    Ok(())
}

/// The listening TCP ports (IPv4 and IPv6) of the calling thread's network namespace.
pub fn listening_ports() -> Result<BTreeSet<u16>> {
    let mut ports = BTreeSet::new();
    for file in ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"] {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            // No IPv6 in this kernel or namespace: nothing listens there.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && file.ends_with('6') => continue,
            Err(e) => return Err(PuError::io(format!("cannot read {file}"), e)),
        };
        parse_listening(&text, &mut ports).map_err(|message| PuError::Parse {
            what: file.to_string(),
            message,
        })?;
    }
    Ok(ports)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn finds_listening_ports_only() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:2328 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0\n   1: 0100007F:3A99 01D5FEA9:D718 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0\n";
        let mut ports = BTreeSet::new();
        parse_listening(text, &mut ports).unwrap();
        assert_eq!(ports, BTreeSet::from([9000]));
        let v6 = "  sl  local_address                         remote_address                        st\n   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A\n";
        parse_listening(v6, &mut ports).unwrap();
        assert_eq!(ports, BTreeSet::from([8080, 9000]));
    }

    #[test]
    fn bad_text_is_an_error() {
        let mut ports = BTreeSet::new();
        assert!(parse_listening("", &mut ports).is_err());
        assert!(parse_listening("sl\n 0: 0100007F:ZZZZ 0:0 0A\n", &mut ports).is_err());
        assert!(parse_listening("sl\n 0: x\n", &mut ports).is_err());
    }

    #[test]
    fn reads_this_namespace() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening_ports().unwrap().contains(&port));
    }
}
