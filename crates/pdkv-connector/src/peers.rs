//! `kv_peers`: the prefill engines a decode engine may connect to for KV.
//! A client's `kv_transfer_params` name the address D connects to; with
//! `kv_peers` set, an address outside the list is refused when the request
//! is added (a 400 naming the setting), before any connection is opened.
//! A leaf.
//!
//! An entry is an exact `host:port`, an IP address (any port), or a network
//! in CIDR form (`10.0.0.0/8`, `fd00::/8`). A host name matches only an
//! exact `host:port` entry: nothing is resolved to decide.

use std::net::IpAddr;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Rule {
    Exact(String),
    Net { net: IpAddr, prefix: u8 },
}

/// Why a `kv_peers` list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeersError {
    #[error("{0:?} is not a host:port, an IP address or a network (CIDR)")]
    BadEntry(String),
    #[error("the list is empty (leave kv_peers out to allow any peer)")]
    Empty,
}

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPeers {
    rules: Vec<Rule>,
    /// The entries as given, for messages.
    listed: Vec<String>,
}

impl KvPeers {
    /// Parses the entries; an error names the first bad one.
    pub fn parse(entries: &[String]) -> Result<KvPeers, PeersError> {
        let mut rules = Vec::with_capacity(entries.len());
        for e in entries {
            rules.push(rule(e).ok_or_else(|| PeersError::BadEntry(e.clone()))?);
        }
        if rules.is_empty() {
            return Err(PeersError::Empty);
        }
        Ok(KvPeers {
            rules,
            listed: entries.to_vec(),
        })
    }

    /// Whether `addr` (`host:port`, IPv6 hosts in brackets) is allowed.
    pub fn allows(&self, addr: &str) -> bool {
        let ip = addr
            .rsplit_once(':')
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
            .and_then(|h| h.parse::<IpAddr>().ok());
        self.rules.iter().any(|r| match r {
            Rule::Exact(e) => e == addr,
            Rule::Net { net, prefix } => ip.is_some_and(|ip| in_net(ip, *net, *prefix)),
        })
    }

    /// The entries as configured.
    pub fn listed(&self) -> &[String] {
        &self.listed
    }
}

fn rule(e: &str) -> Option<Rule> {
    if let Some((net, bits)) = e.split_once('/') {
        let net: IpAddr = net.parse().ok()?;
        let prefix: u8 = bits.parse().ok()?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        return (prefix <= max).then_some(Rule::Net { net, prefix });
    }
    if let Ok(ip) = e
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        return Some(Rule::Net { net: ip, prefix });
    }
    let (host, port) = e.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then(|| Rule::Exact(e.to_string()))
}

fn in_net(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    let (a, b, width) = match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a) as u128, u32::from(b) as u128, 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    if prefix == 0 {
        return true;
    }
    let shift = width - u32::from(prefix);
    (a >> shift) == (b >> shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(e: &[&str]) -> KvPeers {
        KvPeers::parse(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn exact_addresses_ips_and_networks() {
        let p = peers(&["p0.internal:7000", "10.1.2.3", "192.168.0.0/16", "fd00::/8"]);
        assert!(p.allows("p0.internal:7000"));
        assert!(
            !p.allows("p0.internal:7001"),
            "an exact entry names its port"
        );
        assert!(p.allows("10.1.2.3:1") && !p.allows("10.1.2.4:1"));
        assert!(p.allows("192.168.7.9:5000") && !p.allows("192.169.0.1:5000"));
        assert!(p.allows("[fd12::1]:80") && !p.allows("[fe80::1]:80"));
        assert!(!p.allows("127.0.0.1:1"));
        assert!(!p.allows("evil.example:7000"), "names are not resolved");
        let lo = peers(&["127.0.0.0/8", "::1"]);
        assert!(lo.allows("127.0.0.1:9") && lo.allows("[::1]:9") && !lo.allows("10.0.0.1:9"));
        assert!(peers(&["0.0.0.0/0"]).allows("8.8.8.8:53"));
    }

    #[test]
    fn bad_entries_are_named() {
        for bad in ["10.0.0.0/33", "nonsense", "host:port", ":80", "::1/200"] {
            let e = KvPeers::parse(&[bad.to_string()]).unwrap_err();
            assert_eq!(e, PeersError::BadEntry(bad.to_string()));
            assert!(e.to_string().contains(bad), "{e}");
        }
        assert_eq!(KvPeers::parse(&[]), Err(PeersError::Empty));
    }
}
