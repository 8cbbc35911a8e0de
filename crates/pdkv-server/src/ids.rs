//! Ids no client can guess (request ids the server makes, the proxy's
//! transfer ids): 128 bits from the operating system's random source. A
//! leaf.
//!
//! Should that source fail, a per-process counter hashed with two
//! per-process random keys (SipHash) stands in: as hard to guess without
//! the keys, and still unique within the process.
//!
//! A client-chosen id (`X-Request-Id`, `request_id`) is *scoped*: the
//! engine runs it as `{id}@{scope}`, where the scope is a keyed hash of who
//! sent it (the peer address, the `Authorization` and `X-Forwarded-For`
//! headers). The same id from the same client is the same engine id (a
//! duplicate: 409); from anyone else it is another, so no client can claim
//! an id before its owner does. The client still sees its own id.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Between a client's id and its scope in an engine id.
const SCOPE_SEP: char = '@';
/// Hex digits of a scope.
const SCOPE_LEN: usize = 16;

/// Who sent a request, as far as the server can tell: what a client's id
/// is scoped by.
#[derive(Debug, Default, Hash)]
pub(crate) struct Sender<'a> {
    /// The peer address of the connection (`None` where the request did
    /// not come over a socket).
    pub(crate) peer: Option<IpAddr>,
    /// The `Authorization` header as sent.
    pub(crate) authorization: Option<&'a [u8]>,
    /// The `X-Forwarded-For` header as sent (a pdkv proxy sets it to its
    /// client's address, so clients behind one proxy are scoped apart).
    pub(crate) forwarded_for: Option<&'a [u8]>,
}

/// The ids of a request: the one its client sees (the response's `id`, the
/// `X-Request-Id` header) and the one the engine runs it under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestIds {
    pub(crate) shown: String,
    pub(crate) engine: String,
}

impl RequestIds {
    /// A server-made id: the same for the client and the engine.
    pub(crate) fn made(id: String) -> RequestIds {
        RequestIds {
            shown: id.clone(),
            engine: id,
        }
    }
}

/// Whether the engine id `engine` runs the request its client sees as
/// `shown`: `shown` itself, or `shown` in a client's scope, either with the
/// suffix of one of its choices or prompts (`-{i}`, `-p{k}`, `-p{k}-{i}`).
pub(crate) fn runs(engine: &str, shown: &str) -> bool {
    let Some(mut rest) = engine.strip_prefix(shown) else {
        return false;
    };
    if let Some(r) = rest.strip_prefix(SCOPE_SEP) {
        let Some(scope) = r.get(..SCOPE_LEN) else {
            return false;
        };
        if !scope.bytes().all(|b| b.is_ascii_hexdigit()) {
            return false;
        }
        rest = &r[SCOPE_LEN..];
    }
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mut parts = rest.split('-');
    if parts.next() != Some("") {
        return false;
    }
    let parts: Vec<&str> = parts.collect();
    match parts[..] {
        [] => rest.is_empty(),
        [i] => digits(i) || i.strip_prefix('p').is_some_and(digits),
        [k, i] => k.strip_prefix('p').is_some_and(digits) && digits(i),
        _ => false,
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct IdSource {
    keys: [RandomState; 2],
    next: AtomicU64,
}

impl IdSource {
    /// A fresh id: 32 lowercase hex digits.
    pub(crate) fn next_hex(&self) -> String {
        let mut b = [0u8; 16];
        if let Err(e) = getrandom::fill(&mut b) {
            tracing::warn!("no OS randomness for an id ({e}); using the keyed counter");
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            for (key, half) in self.keys.iter().zip(b.chunks_mut(8)) {
                half.copy_from_slice(&key.hash_one(n).to_le_bytes());
            }
        }
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The ids of a request whose client chose `id`: `id` shown, `id`
    /// scoped by `sender` for the engine (see the module docs).
    pub(crate) fn scoped(&self, id: &str, sender: &Sender<'_>) -> RequestIds {
        let scope = self.keys[0].hash_one(sender);
        RequestIds {
            shown: id.to_string(),
            engine: format!("{id}{SCOPE_SEP}{scope:0width$x}", width = SCOPE_LEN),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_32_hex_digits_and_distinct() {
        let s = IdSource::default();
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| s.next_hex()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids
            .iter()
            .all(|i| i.len() == 32 && i.chars().all(|c| c.is_ascii_hexdigit())));
    }

    #[test]
    fn a_client_id_is_scoped_by_its_sender() {
        let s = IdSource::default();
        let peer = |ip: &str| Some(ip.parse().unwrap());
        let a = Sender {
            peer: peer("10.0.0.1"),
            authorization: Some(b"Bearer k"),
            forwarded_for: None,
        };
        let a_again = Sender {
            peer: peer("10.0.0.1"),
            authorization: Some(b"Bearer k"),
            forwarded_for: None,
        };
        let others = [
            Sender {
                peer: peer("10.0.0.2"),
                ..a_again
            },
            Sender {
                authorization: Some(b"Bearer other"),
                ..a_again
            },
            Sender {
                forwarded_for: Some(b"192.0.2.7"),
                ..a_again
            },
        ];
        let ids = s.scoped("job-1", &a);
        assert_eq!(ids.shown, "job-1");
        assert_eq!(
            s.scoped("job-1", &a_again),
            ids,
            "the same client: a duplicate"
        );
        for o in &others {
            let other = s.scoped("job-1", o);
            assert_ne!(other.engine, ids.engine, "{o:?}");
            assert_eq!(other.shown, "job-1");
        }
        // Another server's keys scope differently: nothing to precompute.
        assert_ne!(IdSource::default().scoped("job-1", &a).engine, ids.engine);
        assert!(runs(&ids.engine, "job-1"));
        assert!(runs(&format!("{}-3", ids.engine), "job-1"));
        assert!(runs("cmpl-1", "cmpl-1"));
    }

    #[test]
    fn runs_matches_only_a_scope_of_the_same_id() {
        let scope = "0123456789abcdef";
        assert!(!runs(&format!("job-10@{scope}"), "job-1"));
        assert!(!runs(&format!("job-1@{scope}"), "job"));
        assert!(!runs("job-1@0123", "job-1"), "a short scope");
        assert!(!runs(&format!("job-1@{scope}@{scope}"), "job-1"));
        assert!(!runs(&format!("job-1@{scope}-"), "job-1"));
        assert!(!runs(&format!("job-1@{scope}-x"), "job-1"));
        assert!(runs(&format!("job-1@{scope}-p2"), "job-1"));
        assert!(runs(&format!("job-1@{scope}-p2-3"), "job-1"));
        assert!(!runs(&format!("job-1@{scope}-2-p3"), "job-1"));
        assert!(!runs(&format!("job-1@{scope}-p2-3-4"), "job-1"));
        // A server-made id's choices; another client's id that starts so
        // is not one of them.
        assert!(runs("cmpl-ab-2", "cmpl-ab"));
        assert!(!runs(&format!("cmpl-ab-2@{scope}"), "cmpl-ab"));
        // A client id that itself looks scoped is still only its own.
        assert!(runs(&format!("a@{scope}@{scope}"), &format!("a@{scope}")));
        assert!(!runs(&format!("a@{scope}@{scope}"), "a"));
    }
}
