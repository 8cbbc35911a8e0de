//! How a registration's memfds cross the socket, and how an importer puts
//! them back together.
//!
//! A map reply is a `MapResp` carrying a [`MapHead`] (where the registration
//! lies in its chunks, how many chunks, how many bytes in all), then one
//! `MapPart` per batch of at most [`MAX_PART_FDS`] chunks, in order: the
//! index of its first chunk, each chunk's length, and the chunks' memfds
//! attached. The importer reserves the whole range when the head arrives and
//! maps each part into it as the part arrives ([`Assembly`]), then closes
//! that part's descriptors: it never holds more than one part's worth open,
//! whatever the registration's size.
//!
//! Decoding is checked and never panics; a reply that contradicts itself
//! (parts out of order, more chunks or bytes than announced, descriptors
//! missing) fails the map with [`BadMap`] and leaves nothing mapped.

use std::os::fd::{AsRawFd, OwnedFd};

use crate::frame::{Limits, MAP_RESP_LEN, MAX_PART_FDS};
use crate::registry::{Mapping, Registration};

use super::{check_shareable, BadMap, ShmError};

fn words(b: &[u8]) -> Option<Vec<u64>> {
    if !b.len().is_multiple_of(8) {
        return None;
    }
    Some(
        b.chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
    )
}

fn bytes_of(words: impl IntoIterator<Item = u64>) -> Vec<u8> {
    words.into_iter().flat_map(u64::to_le_bytes).collect()
}

/// The head of a map reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MapHead {
    /// Where byte 0 of the registration lies in the chunks laid end to end.
    pub skew: u64,
    /// The registration's length.
    pub len: u64,
    /// Chunks (memfds) to come in the parts.
    pub chunks: u64,
    /// Their lengths, summed: what the importer reserves.
    pub bytes: u64,
}

impl MapHead {
    pub fn encode(&self) -> Vec<u8> {
        let b = bytes_of([self.skew, self.len, self.chunks, self.bytes]);
        debug_assert_eq!(b.len(), MAP_RESP_LEN as usize);
        b
    }

    /// A head that describes a non-empty registration inside its chunks.
    pub fn decode(b: &[u8]) -> Option<MapHead> {
        let w = words(b)?;
        let &[skew, len, chunks, bytes] = w.as_slice() else {
            return None;
        };
        let inside = skew.checked_add(len).is_some_and(|end| end <= bytes);
        (len > 0 && chunks > 0 && inside).then_some(MapHead {
            skew,
            len,
            chunks,
            bytes,
        })
    }
}

/// The data of one part: its first chunk's index, then each chunk's length.
pub(super) fn encode_part(first: u64, lens: &[u64]) -> Vec<u8> {
    debug_assert!(!lens.is_empty() && lens.len() <= MAX_PART_FDS);
    bytes_of(std::iter::once(first).chain(lens.iter().copied()))
}

/// `(first chunk, lengths)`: at least one chunk, at most [`MAX_PART_FDS`].
pub(super) fn decode_part(b: &[u8]) -> Option<(u64, Vec<u64>)> {
    let w = words(b)?;
    let (&first, lens) = w.split_first()?;
    (!lens.is_empty() && lens.len() <= MAX_PART_FDS).then(|| (first, lens.to_vec()))
}

/// One imported registration: its whole mapping and where it starts.
pub(super) struct Imported {
    pub reg: Registration,
    pub mapping: Mapping,
    pub skew: usize,
}

/// A map reply being put together: the reservation announced by the head,
/// filled part by part.
pub(super) struct Assembly {
    reg: Registration,
    head: MapHead,
    mapping: Mapping,
    /// The index of the next chunk expected.
    next: u64,
    /// Bytes of the reservation mapped so far.
    filled: u64,
}

impl Assembly {
    /// Checks a head against the registration asked for and the limits,
    /// and reserves the address space it announces.
    pub fn start(reg: Registration, head: &[u8], limits: &Limits) -> Result<Assembly, ShmError> {
        let head = MapHead::decode(head)
            .filter(|h| h.len == reg.len)
            .ok_or(BadMap::Head)?;
        check_shareable(usize::try_from(head.chunks).unwrap_or(usize::MAX), limits)?;
        let bytes = usize::try_from(head.bytes).map_err(|_| BadMap::Head)?;
        let skew = usize::try_from(head.skew).map_err(|_| BadMap::Head)?;
        let mapping = Mapping::reserve(bytes)?;
        debug_assert!(skew <= bytes);
        Ok(Assembly {
            reg,
            head,
            mapping,
            next: 0,
            filled: 0,
        })
    }

    /// Maps one part where it belongs and closes its descriptors. Returns
    /// whether the assembly is complete.
    pub fn add(&mut self, data: &[u8], fds: Vec<OwnedFd>) -> Result<bool, ShmError> {
        let (first, lens) = decode_part(data).ok_or(BadMap::Part)?;
        if first != self.next {
            return Err(BadMap::OutOfOrder {
                want: self.next,
                got: first,
            }
            .into());
        }
        if lens.len() != fds.len() {
            return Err(BadMap::FdCount {
                lens: lens.len(),
                fds: fds.len(),
            }
            .into());
        }
        let past = BadMap::PastEnd {
            chunks: self.head.chunks,
            bytes: self.head.bytes,
        };
        let count = lens.len() as u64;
        if self.next + count > self.head.chunks {
            return Err(past.into());
        }
        for (len, fd) in lens.into_iter().zip(fds) {
            let end = self
                .filled
                .checked_add(len)
                .filter(|&e| e <= self.head.bytes)
                .ok_or(past)?;
            // Both fit in usize: they are at most `head.bytes`, reserved above.
            self.mapping
                .map_at(self.filled as usize, fd.as_raw_fd(), len as usize)?;
            self.filled = end;
            drop(fd); // the mapping keeps the pages; the descriptor is closed now
        }
        self.next += count;
        if self.next < self.head.chunks {
            return Ok(false);
        }
        if self.filled != self.head.bytes {
            return Err(BadMap::ShortTotal {
                want: self.head.bytes,
                got: self.filled,
            }
            .into());
        }
        Ok(true)
    }

    /// The segment this assembly maps.
    pub fn segment(&self) -> u64 {
        self.reg.segment
    }

    /// The complete import (after [`Assembly::add`] returned `true`).
    pub fn finish(self) -> Imported {
        Imported {
            reg: self.reg,
            mapping: self.mapping,
            skew: self.head.skew as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::splitmix64;

    #[test]
    fn heads_and_parts_round_trip_and_arbitrary_bytes_never_panic() {
        let head = MapHead {
            skew: 100,
            len: 12_000,
            chunks: 2,
            bytes: 12_288,
        };
        assert_eq!(MapHead::decode(&head.encode()), Some(head));
        assert_eq!(
            MapHead::decode(
                &MapHead {
                    len: 12_189,
                    ..head
                }
                .encode()
            ),
            None,
            "range past the chunks"
        );
        assert_eq!(
            MapHead::decode(&MapHead { chunks: 0, ..head }.encode()),
            None,
            "no chunk"
        );
        assert_eq!(
            MapHead::decode(
                &MapHead {
                    skew: u64::MAX,
                    ..head
                }
                .encode()
            ),
            None,
            "overflowing"
        );
        assert_eq!(
            decode_part(&encode_part(7, &[4096, 8192])),
            Some((7, vec![4096, 8192]))
        );
        assert_eq!(decode_part(&bytes_of([1])), None, "no chunk");
        assert_eq!(
            decode_part(&bytes_of(0..(MAX_PART_FDS as u64 + 2))),
            None,
            "more than one message can carry"
        );
        let mut seed = 3;
        for _ in 0..10_000 {
            let n = (splitmix64(&mut seed) % 80) as usize;
            let v: Vec<u8> = (0..n).map(|_| splitmix64(&mut seed) as u8).collect();
            if let Some(h) = MapHead::decode(&v) {
                assert!(h.skew + h.len <= h.bytes && h.chunks > 0);
            }
            if let Some((_, lens)) = decode_part(&v) {
                assert!(!lens.is_empty() && lens.len() <= MAX_PART_FDS);
            }
        }
    }
}
