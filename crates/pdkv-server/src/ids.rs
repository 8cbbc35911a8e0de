//! Ids no client can guess (request ids the server makes, the proxy's
//! transfer ids): 128 bits from the operating system's random source. A
//! leaf.
//!
//! Should that source fail, a per-process counter hashed with two
//! per-process random keys (SipHash) stands in: as hard to guess without
//! the keys, and still unique within the process.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

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
}
