//! `host`, `host:port` and `[v6]:port`: the SSH address of a hypervisor.

use super::SshConfig;

impl SshConfig {
    /// The host part and port of `address`.
    pub fn host_and_port(&self) -> Result<(String, u16), String> {
        split_host_port(&self.address)
    }
}

pub(super) fn split_host_port(address: &str) -> Result<(String, u16), String> {
    let bad_port = |p: &str| format!("port {p:?} is not a number from 1 to 65535");
    if let Some(rest) = address.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "missing ']' after an IPv6 address".to_owned())?;
        return match after.strip_prefix(':') {
            Some(p) => Ok((host.to_owned(), parse_port(p).ok_or_else(|| bad_port(p))?)),
            None if after.is_empty() => Ok((host.to_owned(), 22)),
            None => Err(format!("unexpected {after:?} after ']'")),
        };
    }
    match address.rsplit_once(':') {
        Some((host, _)) if host.contains(':') => Ok((address.to_owned(), 22)),
        Some((host, p)) => Ok((host.to_owned(), parse_port(p).ok_or_else(|| bad_port(p))?)),
        None => Ok((address.to_owned(), 22)),
    }
}

fn parse_port(p: &str) -> Option<u16> {
    p.parse().ok().filter(|port| *port != 0)
}
