//! One pool per tensor-parallel rank, slept and woken as one.
//!
//! Invariant: after [`RankPools::offload`] or [`RankPools::wake`] returns,
//! every rank is in the same state for the tags it was given. On success
//! the operation was done on every rank. On failure, the ranks it had
//! reached were put back as they were before it (an offloaded rank is woken
//! from its backup; a woken rank sleeps again, with a backup where it had
//! one and discarded where it had none). The error names the rank that
//! failed and what was undone. A discard cannot be undone (the contents are
//! gone): it is done on every rank, and an error names the ranks that
//! failed.

use crate::{Pool, Result, Tag, TagBytes, VmemError};

/// The pools of an engine's ranks, in rank order (one for a single rank).
#[derive(Clone)]
pub struct RankPools {
    ranks: Vec<Pool>,
}

impl RankPools {
    /// `ranks` must not be empty.
    pub fn new(ranks: Vec<Pool>) -> RankPools {
        assert!(!ranks.is_empty(), "at least one rank");
        RankPools { ranks }
    }

    /// A single rank.
    pub fn single(pool: Pool) -> RankPools {
        RankPools { ranks: vec![pool] }
    }

    pub fn ranks(&self) -> &[Pool] {
        &self.ranks
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    fn on_rank(rank: usize, source: VmemError, undo: String) -> VmemError {
        VmemError::OnRank {
            rank,
            source: Box::new(source),
            undo,
        }
    }

    /// What undoing reached: "" when nothing needed it.
    fn undone(ranks: usize, what: &str, failures: Vec<String>) -> String {
        match (ranks, failures.is_empty()) {
            (0, _) => String::new(),
            (n, true) => format!("; ranks 0..{n} were {what} again"),
            (n, false) => format!(
                "; putting ranks 0..{n} back failed too ({}): wake or sleep again",
                failures.join("; ")
            ),
        }
    }

    /// Offloads `tags` on every rank, or on none.
    pub fn offload(&self, tags: &[Tag]) -> Result<()> {
        for (rank, pool) in self.ranks.iter().enumerate() {
            if let Err(e) = pool.offload(tags) {
                // The failing rank may have offloaded some of its regions.
                let failures: Vec<String> = self.ranks[..=rank]
                    .iter()
                    .enumerate()
                    .filter_map(|(r, p)| p.wake(tags).err().map(|e| format!("rank {r}: {e}")))
                    .collect();
                return Err(Self::on_rank(
                    rank,
                    e,
                    Self::undone(rank, "woken from their backups", failures),
                ));
            }
        }
        Ok(())
    }

    /// Discards `tags` on every rank (see the module docs).
    pub fn discard(&self, tags: &[Tag]) -> Result<()> {
        let mut first = None;
        for (rank, pool) in self.ranks.iter().enumerate() {
            if let Err(e) = pool.discard(tags) {
                first.get_or_insert((rank, e));
            }
        }
        match first {
            None => Ok(()),
            Some((rank, e)) => Err(Self::on_rank(
                rank,
                e,
                "; the other ranks discarded theirs".into(),
            )),
        }
    }

    /// Wakes `tags` on every rank, or on none.
    pub fn wake(&self, tags: &[Tag]) -> Result<()> {
        // Per rank, which tags sleep with a backup (restored by the wake).
        let backed: Vec<Vec<Tag>> = self
            .ranks
            .iter()
            .map(|p| tags.iter().copied().filter(|&t| p.has_backup(t)).collect())
            .collect();
        for (rank, pool) in self.ranks.iter().enumerate() {
            if let Err(e) = pool.wake(tags) {
                let failures: Vec<String> = self.ranks[..=rank]
                    .iter()
                    .zip(&backed)
                    .enumerate()
                    .filter_map(|(r, (p, with))| {
                        let without: Vec<Tag> =
                            tags.iter().copied().filter(|t| !with.contains(t)).collect();
                        p.offload(with)
                            .and_then(|()| p.discard(&without))
                            .err()
                            .map(|e| format!("rank {r}: {e}"))
                    })
                    .collect();
                return Err(Self::on_rank(
                    rank,
                    e,
                    Self::undone(rank, "put back to sleep", failures),
                ));
            }
        }
        Ok(())
    }

    /// Every rank's live regions, in rank order.
    pub fn regions(&self) -> Vec<std::sync::Arc<crate::Region>> {
        self.ranks.iter().flat_map(Pool::regions).collect()
    }

    /// Whether `tag` is awake on every rank.
    pub fn is_awake(&self, tag: Tag) -> bool {
        self.ranks.iter().all(|p| p.is_awake(tag))
    }

    /// Live physical bytes per tag, summed over the ranks.
    pub fn device_bytes(&self) -> TagBytes {
        let mut out = TagBytes::default();
        for p in &self.ranks {
            let b = p.device_bytes();
            for (o, v) in out.0.iter_mut().zip(b.0) {
                *o += v;
            }
        }
        out
    }

    /// Host memory held by offload backups, over the ranks.
    pub fn host_backup_bytes(&self) -> u64 {
        self.ranks.iter().map(Pool::host_backup_bytes).sum()
    }

    /// Pinned bytes (see [`Pool::pinned_bytes`]), over the ranks.
    pub fn pinned_bytes(&self) -> u64 {
        self.ranks.iter().map(Pool::pinned_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks, each with weights (rank `r`'s start with bytes `7 + r`)
    /// and a KV region; the regions live as long as the vector.
    fn two_ranks() -> (RankPools, Vec<std::sync::Arc<crate::Region>>) {
        let ranks: Vec<Pool> = (0..2).map(|_| Pool::default()).collect();
        let mut regions = Vec::new();
        for (r, p) in ranks.iter().enumerate() {
            let w = p.allocate(Tag::Weights, 3 << 20).unwrap();
            w.write_bytes(0, &[r as u8 + 7; 64]).unwrap();
            regions.push(w);
            regions.push(p.allocate(Tag::KvCache, 1 << 20).unwrap());
        }
        (RankPools::new(ranks), regions)
    }

    fn first_bytes(p: &Pool) -> Vec<u8> {
        let r = p
            .regions()
            .into_iter()
            .find(|r| r.tag() == Tag::Weights)
            .unwrap();
        let mut b = [0u8; 64];
        r.read_bytes(0, &mut b).unwrap();
        b.to_vec()
    }

    #[test]
    fn a_failed_offload_on_one_rank_leaves_every_rank_awake() {
        let (rp, _regions) = two_ranks();
        rp.ranks()[1].faults().fail_offloads(1);
        let e = rp.offload(&[Tag::Weights]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("rank 1: offload failed"), "{msg}");
        assert!(
            msg.contains("ranks 0..1 were woken from their backups again"),
            "{msg}"
        );
        assert!(rp.is_awake(Tag::Weights));
        assert_eq!(first_bytes(&rp.ranks()[0]), vec![7; 64]);
        assert_eq!(rp.host_backup_bytes(), 0);
        // Nothing is left that a retry trips on.
        rp.offload(&[Tag::Weights]).unwrap();
        assert!(!rp.ranks().iter().any(|p| p.is_awake(Tag::Weights)));
    }

    #[test]
    fn a_failed_wake_on_one_rank_puts_every_rank_back_to_sleep_as_it_was() {
        let (rp, _regions) = two_ranks();
        rp.offload(&[Tag::Weights]).unwrap();
        rp.discard(&[Tag::KvCache]).unwrap();
        let asleep = rp.device_bytes();
        let backups = rp.host_backup_bytes();
        rp.ranks()[1].faults().fail_wakes(1);
        let e = rp.wake(&[Tag::Weights, Tag::KvCache]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("rank 1: wake failed"), "{msg}");
        assert!(
            msg.contains("ranks 0..1 were put back to sleep again"),
            "{msg}"
        );
        for p in rp.ranks() {
            assert!(!p.is_awake(Tag::Weights) && !p.is_awake(Tag::KvCache));
            assert!(p.has_backup(Tag::Weights) && !p.has_backup(Tag::KvCache));
        }
        assert_eq!(rp.device_bytes(), asleep);
        assert_eq!(rp.host_backup_bytes(), backups);
        // The retry wakes every rank with its own contents.
        rp.wake(&[Tag::Weights, Tag::KvCache]).unwrap();
        assert!(rp.is_awake(Tag::Weights) && rp.is_awake(Tag::KvCache));
        assert_eq!(first_bytes(&rp.ranks()[0]), vec![7; 64]);
        assert_eq!(first_bytes(&rp.ranks()[1]), vec![8; 64]);
    }
}
