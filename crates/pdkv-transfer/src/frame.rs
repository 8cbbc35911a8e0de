//! Wire format: a fixed 64-byte header, then `data_len` raw bytes.
//!
//! ```text
//!  0..4   magic "PDKV"        4     version (1)     5   kind
//!  6..8   code (errors)       8..12 data_len        12..16 reserved, zero
//! 16..24  op id              24..32 segment         32..40 key
//! 40..48  epoch              48..56 offset          56..64 len
//! ```
//! All integers little-endian. Everything a frame means is in its header; the
//! data that follows is opaque bytes (written data, read data, a notification
//! payload), so a driver can validate a header and then move the data
//! straight between the socket and registered memory without a staging copy.
//!
//! [`Header::decode`] checks magic, version, kind, the reserved word and the
//! data length against [`Limits`] and never panics, whatever the input; a
//! frame it refuses closes the connection that sent it, and only that one.

use crate::error::AccessError;

pub const MAGIC: [u8; 4] = *b"PDKV";
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 64;

/// Bounds on what a peer may send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest data part of a read or write frame (one slice).
    pub max_data: u32,
    /// Largest notification payload.
    pub max_notify: u32,
    /// Most memfds (chunks) one registration may span to be shared over
    /// shared memory, on either side. Each chunk is one mapping (one entry
    /// against `vm.max_map_count`, 65530 by default) in the exporter's
    /// region, its registration and every importer: the default, 16384,
    /// is 32 GiB in 2 MiB chunks.
    pub max_map_chunks: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_data: 4 << 20,
            max_notify: 64 << 10,
            max_map_chunks: 16 << 10,
        }
    }
}

/// Most descriptors one `MapPart` carries: the kernel's SCM_RIGHTS limit
/// per message (SCM_MAX_FD).
pub const MAX_PART_FDS: usize = 253;

/// Data bytes of a `MapResp`: skew, registration length, chunk count,
/// bytes of all chunks (four little-endian u64).
pub const MAP_RESP_LEN: u32 = 32;

/// Largest data part of a `MapPart`: the first chunk's index, then one
/// length per descriptor (little-endian u64 each).
pub const MAX_MAP_PART_LEN: u32 = 8 * (1 + MAX_PART_FDS as u32);

/// The remote range an operation addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub segment: u64,
    pub key: u64,
    pub epoch: u64,
    pub offset: u64,
    pub len: u64,
}

/// A refusal carried back to the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error("the remote's notification queue is full")]
    Busy,
    #[error("registration spans {chunks} memfds; at most {limit} can be shared")]
    TooManyChunks { chunks: u64, limit: u64 },
}

/// One decoded header; `data_len()` bytes of data follow it on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    Hello {
        agent: u64,
    },
    WriteReq {
        op: u64,
        target: Target,
    },
    ReadReq {
        op: u64,
        target: Target,
    },
    WriteAck {
        op: u64,
    },
    ReadResp {
        op: u64,
        len: u32,
    },
    Error {
        op: u64,
        error: RemoteError,
    },
    Notify {
        op: u64,
        len: u32,
    },
    NotifyAck {
        op: u64,
    },
    Unmap {
        op: u64,
        segment: u64,
    },
    UnmapAck {
        op: u64,
        segment: u64,
    },
    /// Shared memory: ask for the memfds of a whole registration (`target.len` is its length).
    MapReq {
        op: u64,
        target: Target,
    },
    /// Shared memory: the layout's head ([`MAP_RESP_LEN`] bytes) follows;
    /// the memfds come in the `MapPart`s after it.
    MapResp {
        op: u64,
        len: u32,
    },
    /// Shared memory: one batch of a map reply, `len` bytes (at most
    /// [`MAX_MAP_PART_LEN`]) naming the chunks whose memfds ride along
    /// (SCM_RIGHTS, at most [`MAX_PART_FDS`]).
    MapPart {
        op: u64,
        len: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic")]
    BadMagic,
    #[error("unsupported version {0}")]
    BadVersion(u8),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("reserved field is not zero")]
    Reserved,
    #[error("unknown error code {0}")]
    BadCode(u16),
    #[error("data length {len} not allowed for this frame (limit {limit})")]
    BadLength { len: u64, limit: u64 },
    #[error("decoder buffer would exceed {0} bytes")]
    Overflow(usize),
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const WRITE_REQ: u8 = 2;
    pub const READ_REQ: u8 = 3;
    pub const WRITE_ACK: u8 = 4;
    pub const READ_RESP: u8 = 5;
    pub const ERROR: u8 = 6;
    pub const NOTIFY: u8 = 7;
    pub const NOTIFY_ACK: u8 = 8;
    pub const UNMAP: u8 = 9;
    pub const UNMAP_ACK: u8 = 10;
    pub const MAP_REQ: u8 = 11;
    pub const MAP_RESP: u8 = 12;
    pub const MAP_PART: u8 = 13;
}

/// The raw fields of a header, before their meaning is checked.
#[derive(Default)]
struct Raw {
    kind: u8,
    code: u16,
    data_len: u32,
    op: u64,
    segment: u64,
    key: u64,
    epoch: u64,
    offset: u64,
    len: u64,
}

fn u64_at(b: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn error_to_raw(e: &RemoteError, r: &mut Raw) {
    // code, then up to three numbers in segment/offset/len.
    let (code, a, b, c) = match *e {
        RemoteError::Access(AccessError::UnknownSegment { segment }) => (1, segment, 0, 0),
        RemoteError::Access(AccessError::NotRegistered { segment }) => (2, segment, 0, 0),
        RemoteError::Access(AccessError::BadKey { segment }) => (3, segment, 0, 0),
        RemoteError::Access(AccessError::StaleEpoch { have, want }) => (4, have, want, 0),
        RemoteError::Access(AccessError::OutOfBounds {
            offset,
            len,
            registered,
        }) => (5, offset, len, registered),
        RemoteError::Busy => (6, 0, 0, 0),
        RemoteError::TooManyChunks { chunks, limit } => (7, chunks, limit, 0),
        RemoteError::Access(AccessError::OutsideGrant {
            segment,
            offset,
            len,
        }) => (8, segment, offset, len),
    };
    r.code = code;
    (r.segment, r.offset, r.len) = (a, b, c);
}

fn error_from_raw(r: &Raw) -> Result<RemoteError, FrameError> {
    let (a, b, c) = (r.segment, r.offset, r.len);
    Ok(match r.code {
        1 => AccessError::UnknownSegment { segment: a }.into(),
        2 => AccessError::NotRegistered { segment: a }.into(),
        3 => AccessError::BadKey { segment: a }.into(),
        4 => AccessError::StaleEpoch { have: a, want: b }.into(),
        5 => AccessError::OutOfBounds {
            offset: a,
            len: b,
            registered: c,
        }
        .into(),
        6 => RemoteError::Busy,
        7 => RemoteError::TooManyChunks {
            chunks: a,
            limit: b,
        },
        8 => AccessError::OutsideGrant {
            segment: a,
            offset: b,
            len: c,
        }
        .into(),
        other => return Err(FrameError::BadCode(other)),
    })
}

impl Header {
    /// Bytes of data that follow this header on the wire.
    pub fn data_len(&self) -> usize {
        match *self {
            Header::WriteReq { target, .. } => target.len as usize,
            Header::ReadResp { len, .. }
            | Header::Notify { len, .. }
            | Header::MapResp { len, .. }
            | Header::MapPart { len, .. } => len as usize,
            _ => 0,
        }
    }

    /// Encodes the header. The caller checks `data_len` against the peer's
    /// limits before sending (a header the peer would refuse is a bug here).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut r = Raw::default();
        let set_target = |r: &mut Raw, t: &Target| {
            (r.segment, r.key, r.epoch, r.offset, r.len) =
                (t.segment, t.key, t.epoch, t.offset, t.len);
        };
        match self {
            Header::Hello { agent } => {
                r.kind = kind::HELLO;
                r.segment = *agent;
            }
            Header::WriteReq { op, target } => {
                (r.kind, r.op) = (kind::WRITE_REQ, *op);
                set_target(&mut r, target);
            }
            Header::ReadReq { op, target } => {
                (r.kind, r.op) = (kind::READ_REQ, *op);
                set_target(&mut r, target);
            }
            Header::WriteAck { op } => (r.kind, r.op) = (kind::WRITE_ACK, *op),
            Header::ReadResp { op, len } => {
                (r.kind, r.op, r.len) = (kind::READ_RESP, *op, *len as u64)
            }
            Header::Error { op, error } => {
                (r.kind, r.op) = (kind::ERROR, *op);
                error_to_raw(error, &mut r);
            }
            Header::Notify { op, len } => (r.kind, r.op, r.len) = (kind::NOTIFY, *op, *len as u64),
            Header::NotifyAck { op } => (r.kind, r.op) = (kind::NOTIFY_ACK, *op),
            Header::Unmap { op, segment } => {
                (r.kind, r.op, r.segment) = (kind::UNMAP, *op, *segment)
            }
            Header::UnmapAck { op, segment } => {
                (r.kind, r.op, r.segment) = (kind::UNMAP_ACK, *op, *segment)
            }
            Header::MapReq { op, target } => {
                (r.kind, r.op) = (kind::MAP_REQ, *op);
                set_target(&mut r, target);
            }
            Header::MapResp { op, len } => {
                (r.kind, r.op, r.len) = (kind::MAP_RESP, *op, *len as u64)
            }
            Header::MapPart { op, len } => {
                (r.kind, r.op, r.len) = (kind::MAP_PART, *op, *len as u64)
            }
        }
        r.data_len = self.data_len() as u32;
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = r.kind;
        b[6..8].copy_from_slice(&r.code.to_le_bytes());
        b[8..12].copy_from_slice(&r.data_len.to_le_bytes());
        for (at, v) in [
            (16, r.op),
            (24, r.segment),
            (32, r.key),
            (40, r.epoch),
            (48, r.offset),
            (56, r.len),
        ] {
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Decodes and checks a header. Never panics.
    pub fn decode(b: &[u8; HEADER_LEN], limits: &Limits) -> Result<Header, FrameError> {
        if b[0..4] != MAGIC {
            return Err(FrameError::BadMagic);
        }
        if b[4] != VERSION {
            return Err(FrameError::BadVersion(b[4]));
        }
        if b[12..16] != [0; 4] {
            return Err(FrameError::Reserved);
        }
        let r = Raw {
            kind: b[5],
            code: u16::from_le_bytes([b[6], b[7]]),
            data_len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            op: u64_at(b, 16),
            segment: u64_at(b, 24),
            key: u64_at(b, 32),
            epoch: u64_at(b, 40),
            offset: u64_at(b, 48),
            len: u64_at(b, 56),
        };
        let data = r.data_len as u64;
        let expect = |want: u64, limit: u64| {
            if data == want && want <= limit {
                Ok(())
            } else {
                Err(FrameError::BadLength {
                    len: data.max(want),
                    limit,
                })
            }
        };
        let target = Target {
            segment: r.segment,
            key: r.key,
            epoch: r.epoch,
            offset: r.offset,
            len: r.len,
        };
        let max_data = limits.max_data as u64;
        let h = match r.kind {
            kind::HELLO => {
                expect(0, 0)?;
                Header::Hello { agent: r.segment }
            }
            kind::WRITE_REQ => {
                expect(r.len, max_data)?;
                Header::WriteReq { op: r.op, target }
            }
            kind::READ_REQ => {
                expect(0, 0)?;
                if r.len > max_data {
                    return Err(FrameError::BadLength {
                        len: r.len,
                        limit: max_data,
                    });
                }
                Header::ReadReq { op: r.op, target }
            }
            kind::WRITE_ACK => {
                expect(0, 0)?;
                Header::WriteAck { op: r.op }
            }
            kind::READ_RESP => {
                expect(r.len, max_data)?;
                Header::ReadResp {
                    op: r.op,
                    len: r.data_len,
                }
            }
            kind::ERROR => {
                expect(0, 0)?;
                Header::Error {
                    op: r.op,
                    error: error_from_raw(&r)?,
                }
            }
            kind::NOTIFY => {
                expect(r.len, limits.max_notify as u64)?;
                Header::Notify {
                    op: r.op,
                    len: r.data_len,
                }
            }
            kind::NOTIFY_ACK => {
                expect(0, 0)?;
                Header::NotifyAck { op: r.op }
            }
            kind::UNMAP => {
                expect(0, 0)?;
                Header::Unmap {
                    op: r.op,
                    segment: r.segment,
                }
            }
            kind::UNMAP_ACK => {
                expect(0, 0)?;
                Header::UnmapAck {
                    op: r.op,
                    segment: r.segment,
                }
            }
            kind::MAP_REQ => {
                expect(0, 0)?;
                Header::MapReq { op: r.op, target }
            }
            kind::MAP_RESP => {
                expect(MAP_RESP_LEN as u64, MAP_RESP_LEN as u64)?;
                Header::MapResp {
                    op: r.op,
                    len: r.data_len,
                }
            }
            kind::MAP_PART => {
                // The first chunk's index and at least one length, in whole words.
                if data < 16 || !data.is_multiple_of(8) {
                    return Err(FrameError::BadLength {
                        len: data,
                        limit: MAX_MAP_PART_LEN as u64,
                    });
                }
                expect(r.len, MAX_MAP_PART_LEN as u64)?;
                Header::MapPart {
                    op: r.op,
                    len: r.data_len,
                }
            }
            other => return Err(FrameError::BadKind(other)),
        };
        Ok(h)
    }
}

/// A whole frame: header and its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub data: Vec<u8>,
}

impl Frame {
    pub fn new(header: Header, data: Vec<u8>) -> Frame {
        debug_assert_eq!(header.data_len(), data.len());
        Frame { header, data }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.header.encode());
        out.extend_from_slice(&self.data);
    }
}

/// A buffering decoder for byte streams that arrive in arbitrary pieces
/// (control channels, tests). Its buffer is bounded: one whole frame plus
/// one feed. After an error it stays failed; the connection must close.
pub struct Decoder {
    limits: Limits,
    buf: Vec<u8>,
    /// Bytes at the front of `buf` already consumed.
    start: usize,
    failed: Option<FrameError>,
}

impl Decoder {
    pub fn new(limits: Limits) -> Decoder {
        Decoder {
            limits,
            buf: Vec::new(),
            start: 0,
            failed: None,
        }
    }

    fn capacity(&self) -> usize {
        let largest = self
            .limits
            .max_data
            .max(self.limits.max_notify)
            .max(MAX_MAP_PART_LEN);
        2 * (HEADER_LEN + largest as usize)
    }

    /// Appends received bytes. Fails (and stays failed) if the peer sends
    /// more than the bound without a complete frame being taken out.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        if self.buf.len() + bytes.len() > self.capacity() {
            let e = FrameError::Overflow(self.capacity());
            self.failed = Some(e);
            return Err(e);
        }
        self.buf.extend_from_slice(bytes);
        Ok(())
    }

    /// The next complete frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let avail = &self.buf[self.start..];
        let Some(head) = avail.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let header = match Header::decode(head, &self.limits) {
            Ok(h) => h,
            Err(e) => {
                self.failed = Some(e);
                return Err(e);
            }
        };
        let total = HEADER_LEN + header.data_len();
        if avail.len() < total {
            return Ok(None);
        }
        let data = avail[HEADER_LEN..total].to_vec();
        self.start += total;
        Ok(Some(Frame { header, data }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::splitmix64;

    fn samples() -> Vec<Frame> {
        let t = Target {
            segment: 3,
            key: 0xdead_beef,
            epoch: 2,
            offset: 4096,
            len: 5,
        };
        vec![
            Frame::new(Header::Hello { agent: 42 }, vec![]),
            Frame::new(Header::WriteReq { op: 1, target: t }, vec![1, 2, 3, 4, 5]),
            Frame::new(
                Header::ReadReq {
                    op: 2,
                    target: Target { len: 1 << 20, ..t },
                },
                vec![],
            ),
            Frame::new(Header::WriteAck { op: 1 }, vec![]),
            Frame::new(Header::ReadResp { op: 2, len: 3 }, vec![7, 8, 9]),
            Frame::new(
                Header::Error {
                    op: 9,
                    error: AccessError::StaleEpoch { have: 1, want: 2 }.into(),
                },
                vec![],
            ),
            Frame::new(
                Header::Error {
                    op: 9,
                    error: AccessError::OutOfBounds {
                        offset: 10,
                        len: 20,
                        registered: 25,
                    }
                    .into(),
                },
                vec![],
            ),
            Frame::new(
                Header::Error {
                    op: 9,
                    error: RemoteError::Busy,
                },
                vec![],
            ),
            Frame::new(
                Header::Error {
                    op: 9,
                    error: AccessError::OutsideGrant {
                        segment: 3,
                        offset: 7,
                        len: 9,
                    }
                    .into(),
                },
                vec![],
            ),
            Frame::new(Header::Notify { op: 4, len: 2 }, b"ok".to_vec()),
            Frame::new(Header::NotifyAck { op: 4 }, vec![]),
            Frame::new(Header::Unmap { op: 5, segment: 3 }, vec![]),
            Frame::new(Header::UnmapAck { op: 5, segment: 3 }, vec![]),
            Frame::new(
                Header::MapReq {
                    op: 6,
                    target: Target { offset: 0, ..t },
                },
                vec![],
            ),
            Frame::new(
                Header::MapResp {
                    op: 6,
                    len: MAP_RESP_LEN,
                },
                vec![3; MAP_RESP_LEN as usize],
            ),
            Frame::new(Header::MapPart { op: 6, len: 24 }, vec![4; 24]),
            Frame::new(
                Header::Error {
                    op: 6,
                    error: RemoteError::TooManyChunks {
                        chunks: 9000,
                        limit: 8192,
                    },
                },
                vec![],
            ),
        ]
    }

    #[test]
    fn every_kind_round_trips_through_any_split() {
        let frames = samples();
        let mut wire = Vec::new();
        for f in &frames {
            f.encode(&mut wire);
        }
        for piece in [1, 7, 64, 65, 1000] {
            let mut d = Decoder::new(Limits::default());
            let mut got = Vec::new();
            for part in wire.chunks(piece) {
                d.feed(part).unwrap();
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(got, frames, "split into pieces of {piece}");
        }
    }

    #[test]
    fn bad_headers_are_refused_with_their_reason() {
        let lim = Limits {
            max_data: 1024,
            max_notify: 16,
            ..Limits::default()
        };
        let ok = Header::WriteReq {
            op: 1,
            target: Target {
                segment: 1,
                key: 1,
                epoch: 1,
                offset: 0,
                len: 8,
            },
        }
        .encode();
        let check = |mutate: &dyn Fn(&mut [u8; HEADER_LEN]), want: FrameError| {
            let mut b = ok;
            mutate(&mut b);
            assert_eq!(Header::decode(&b, &lim), Err(want));
        };
        assert!(Header::decode(&ok, &lim).is_ok());
        check(&|b| b[0] = b'X', FrameError::BadMagic);
        check(&|b| b[4] = 2, FrameError::BadVersion(2));
        check(&|b| b[5] = 99, FrameError::BadKind(99));
        check(&|b| b[13] = 1, FrameError::Reserved);
        // data_len disagreeing with len.
        check(
            &|b| b[8] = 9,
            FrameError::BadLength {
                len: 9,
                limit: 1024,
            },
        );
        // a write larger than the limit.
        check(
            &|b| {
                b[8..12].copy_from_slice(&2048u32.to_le_bytes());
                b[56..64].copy_from_slice(&2048u64.to_le_bytes());
            },
            FrameError::BadLength {
                len: 2048,
                limit: 1024,
            },
        );
        let read = Header::ReadReq {
            op: 1,
            target: Target {
                segment: 1,
                key: 1,
                epoch: 1,
                offset: 0,
                len: 4096,
            },
        };
        assert_eq!(
            Header::decode(&read.encode(), &lim),
            Err(FrameError::BadLength {
                len: 4096,
                limit: 1024
            })
        );
        let note = Header::Notify { op: 1, len: 17 };
        assert_eq!(
            Header::decode(&note.encode(), &lim),
            Err(FrameError::BadLength { len: 17, limit: 16 })
        );
        let mut err = Header::Error {
            op: 1,
            error: RemoteError::Busy,
        }
        .encode();
        err[6] = 77;
        assert_eq!(Header::decode(&err, &lim), Err(FrameError::BadCode(77)));
        // Map replies: a head of exactly its size, parts of whole words within the bound.
        let head = Header::MapResp {
            op: 1,
            len: MAP_RESP_LEN + 8,
        };
        assert_eq!(
            Header::decode(&head.encode(), &lim),
            Err(FrameError::BadLength { len: 40, limit: 32 })
        );
        for len in [0, 8, 20, MAX_MAP_PART_LEN + 8] {
            let part = Header::MapPart { op: 1, len };
            assert!(
                matches!(
                    Header::decode(&part.encode(), &lim),
                    Err(FrameError::BadLength { .. })
                ),
                "part of {len} bytes"
            );
        }
        assert!(Header::decode(
            &Header::MapPart {
                op: 1,
                len: MAX_MAP_PART_LEN
            }
            .encode(),
            &lim
        )
        .is_ok());
    }

    /// Fuzz-style: random bytes, mutated valid frames and truncations never
    /// panic; the decoder either yields frames, waits for more, or fails and
    /// stays failed. Deterministic (fixed seed), thousands of cases.
    #[test]
    fn arbitrary_bytes_never_panic() {
        let lim = Limits {
            max_data: 4096,
            max_notify: 256,
            ..Limits::default()
        };
        let mut wire = Vec::new();
        for f in samples() {
            f.encode(&mut wire);
        }
        let mut seed = 0x5eed_u64;
        let mut decoded = 0usize;
        let mut refused = 0usize;
        for case in 0..20_000 {
            let mut bytes = if case % 2 == 0 {
                let n = (splitmix64(&mut seed) % 300) as usize;
                (0..n)
                    .map(|_| splitmix64(&mut seed) as u8)
                    .collect::<Vec<_>>()
            } else {
                let mut w = wire.clone();
                for _ in 0..1 + splitmix64(&mut seed) % 4 {
                    let at = (splitmix64(&mut seed) as usize) % w.len();
                    w[at] = splitmix64(&mut seed) as u8;
                }
                let cut = (splitmix64(&mut seed) as usize) % (w.len() + 1);
                w.truncate(cut);
                w
            };
            if case % 7 == 0 {
                // A plausible header with random fields after a valid prefix.
                let mut h = [0u8; HEADER_LEN];
                for b in h.iter_mut() {
                    *b = splitmix64(&mut seed) as u8;
                }
                h[0..4].copy_from_slice(&MAGIC);
                h[4] = VERSION;
                h[5] = 1 + (splitmix64(&mut seed) % 13) as u8;
                h[12..16].fill(0);
                bytes.splice(0..0, h);
            }
            let mut d = Decoder::new(lim);
            let step = 1 + (splitmix64(&mut seed) % 97) as usize;
            'feed: for part in bytes.chunks(step) {
                if d.feed(part).is_err() {
                    refused += 1;
                    break;
                }
                loop {
                    match d.next_frame() {
                        Ok(Some(f)) => {
                            assert_eq!(f.data.len(), f.header.data_len());
                            assert!(f.data.len() <= lim.max_data.max(MAX_MAP_PART_LEN) as usize);
                            decoded += 1;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            assert_eq!(d.next_frame(), Err(e), "a failed decoder stays failed");
                            refused += 1;
                            break 'feed;
                        }
                    }
                }
            }
        }
        assert!(
            decoded > 1000 && refused > 1000,
            "both paths exercised: {decoded} decoded, {refused} refused"
        );
    }

    #[test]
    fn a_peer_cannot_grow_the_buffer_without_bound() {
        let lim = Limits {
            max_data: 1024,
            max_notify: 16,
            ..Limits::default()
        };
        let mut d = Decoder::new(lim);
        let mut fed = 0usize;
        let err = loop {
            match d.feed(&[0u8; 100]) {
                Ok(()) => fed += 100,
                Err(e) => break e,
            }
            assert!(fed < 100_000, "the bound holds");
        };
        let bound = 2 * (HEADER_LEN + MAX_MAP_PART_LEN as usize); // the largest frame these limits allow
        assert_eq!(err, FrameError::Overflow(bound));
        assert!(fed <= bound);
        assert_eq!(d.next_frame(), Err(err), "and the decoder stays failed");
    }
}
