//! The destination a CONNECT names. HBONE's `:authority` is a literal `IP:PORT` (IPv6 in
//! brackets); a host name, a missing or zero port, user info or an IPv6 zone is refused, so
//! the node never resolves a name or guesses a port on a peer's behalf.

use std::net::SocketAddr;

/// Parses an HBONE `:authority`. Err: what is wrong with it, for the log line.
pub fn parse(authority: &str) -> Result<SocketAddr, String> {
    let shown = || authority.escape_debug().to_string();
    match authority.parse::<SocketAddr>() {
        Ok(addr) if addr.port() == 0 => Err(format!("`{}` names port 0", shown())),
        Ok(addr) => Ok(addr),
        Err(_) => Err(format!(
            "`{}` is not a destination IP:PORT (such as 10.0.0.7:8080 or [fd00::7]:8080)",
            shown()
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_literal_ip_and_port_is_a_destination() {
        assert_eq!(
            parse("10.0.0.7:8080").unwrap(),
            "10.0.0.7:8080".parse().unwrap()
        );
        assert_eq!(parse("[::1]:9").unwrap(), "[::1]:9".parse().unwrap());
        for bad in [
            "example.org:80",
            "10.0.0.7",
            "10.0.0.7:0",
            "10.0.0.7:99999",
            "user@10.0.0.7:80",
            "::1:80",
            "[fe80::1%eth0]:80",
            "",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
