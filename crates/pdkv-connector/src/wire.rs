//! The control protocol between a decode engine (D) and a prefill engine (P).
//!
//! One TCP connection per exchange: the client sends one message, the server
//! answers with one message, and the connection closes. A message is a JSON
//! object preceded by its length as a big-endian `u32`, at most
//! [`MAX_MESSAGE`] bytes. Every socket operation has a timeout, and the
//! decoder never panics: a bad length, truncated input or malformed JSON is
//! an error that closes that connection and nothing else.
//!
//! Write mode: `bootstrap` (D learns P's engine id and layout), `pull` (P
//! writes into D's blocks), `drop`. Read mode adds `handshake` (D also
//! learns P's transfer address and current KV registration, whose epoch is
//! the `remote_registration_generation` P stamps on its params) and
//! `read_done` (D read a leased transfer; P ends the lease and says whether
//! it still held the blocks when the read ended, which is what makes the
//! data D read valid).

use std::time::Duration;

use pdkv_transfer::auth::{self, KvSecret, Port};
use serde::{Deserialize, Serialize};

use crate::ranks::RankReg;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest message accepted or sent.
pub const MAX_MESSAGE: usize = 1 << 20;

/// Where P writes a pull's blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Destination {
    /// D's TCP transfer agent.
    Tcp { addr: String },
    /// D's shared-memory exporter socket.
    Shm { path: String },
}

/// D asks P to write a transfer's blocks into D's blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pull {
    pub transfer_id: String,
    /// D's engine id (logs).
    pub engine_id: String,
    /// Index, in the request's block table, of the first block wanted.
    pub first_block: usize,
    /// Tokens whose KV D wants (the prompt length minus one).
    pub num_tokens: usize,
    pub dst: Destination,
    /// D's KV cache, rank by rank in head order.
    pub ranks: Vec<PullRank>,
    /// D's destination blocks, one per block wanted (the same ids on every
    /// rank).
    pub blocks: Vec<u32>,
    /// The weights D serves; P refuses KV computed with others.
    #[serde(default)]
    pub weights_version: Option<String>,
}

/// One rank of D's KV cache in a pull.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRank {
    /// The rank's registration (a shared-memory peer maps all of it).
    pub rank: RankReg,
    /// A key that opens exactly the destination blocks of this rank,
    /// revoked by D when it stops waiting (its fence); TCP writes use it.
    #[serde(default)]
    pub grant_key: Option<u64>,
}

impl PullRank {
    /// The key a TCP write names: the grant's, else the registration's.
    pub fn write_key(&self) -> u64 {
        self.grant_key.unwrap_or(self.rank.reg.key)
    }
}

/// P's answer to a read-mode handshake.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeInfo {
    pub engine_id: String,
    pub layout: String,
    pub block_bytes: u64,
    /// Where P's KV cache is reached: its TCP agent, or its shared-memory
    /// exporter's socket.
    pub transfer: Destination,
    /// P's current KV cache registrations, rank by rank in head order;
    /// `None` while they are released (asleep).
    pub ranks: Option<Vec<RankReg>>,
}

impl HandshakeInfo {
    /// The epoch of P's first rank's registration: the generation P stamps
    /// on its params (every rank is registered again together).
    pub fn generation(&self) -> Option<u64> {
        self.ranks.as_ref()?.first().map(|r| r.reg.epoch)
    }
}

/// Why a transfer did not deliver its KV. It crosses the wire as this code
/// (plus a message for people), and every decision about a failed transfer
/// is made on the code, never on the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailCode {
    /// P's lifecycle released the KV on purpose (a pause that clears the
    /// cache, a sleep, a KV release, a weight reload).
    CacheReset,
    /// P's KV cache registration is released (P is asleep).
    Asleep,
    /// P's request was aborted (an abort pause, `abort_requests`, shutdown).
    PrefillAborted,
    /// P refused the request (not serving now: paused or asleep); a proxy
    /// tells P so, and P answers D's pull with it.
    PrefillRefused,
    /// P computed the KV with other weights than D serves.
    WeightsMismatch,
    /// D released the transfer (its request ended, or it gave up the load).
    Dropped,
    /// P never saw the transfer's request within the arrival timeout.
    Unknown,
    /// P's lease on the blocks ended before D took them: P reclaimed the KV
    /// after holding it as long as it promised (no D claimed it, or its
    /// claims stopped).
    LeaseExpired,
    /// P needed the blocks for new prompts: every block it had was held
    /// for transfers D had not taken yet, and P gave some back (those D
    /// would reach last first).
    Reclaimed,
    /// A deadline passed: no sender was free, or P's request outlived the
    /// longest prefill a pull waits for.
    Deadline,
    /// The pull does not match the transfer (lengths, blocks, layout, engine).
    Mismatch,
    /// The transfer was sent or read already.
    AlreadyDone,
    /// Moving the bytes failed.
    TransferFailed,
    /// P could not be reached, or the connection broke.
    PeerLost,
    /// No answer within D's deadline.
    Timeout,
    /// An answer that makes no sense here.
    Protocol,
}

impl FailCode {
    /// The transfer was ended on purpose — by a lifecycle operation, a
    /// refusal, other weights, or P reclaiming KV it held for its whole
    /// lease — not by a failure: the decode engine recomputes the prompt
    /// whatever its `kv_load_failure_policy`. What is left for the policy
    /// is what went wrong: a peer lost or silent past D's deadline, a
    /// transfer that failed, a pull that does not match, a protocol error.
    pub fn on_purpose(self) -> bool {
        matches!(
            self,
            FailCode::CacheReset
                | FailCode::Asleep
                | FailCode::PrefillAborted
                | FailCode::PrefillRefused
                | FailCode::WeightsMismatch
                | FailCode::LeaseExpired
                | FailCode::Reclaimed
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FailCode::CacheReset => "cache_reset",
            FailCode::Asleep => "asleep",
            FailCode::PrefillAborted => "prefill_aborted",
            FailCode::PrefillRefused => "prefill_refused",
            FailCode::WeightsMismatch => "weights_mismatch",
            FailCode::Dropped => "dropped",
            FailCode::Unknown => "unknown",
            FailCode::LeaseExpired => "lease_expired",
            FailCode::Reclaimed => "reclaimed",
            FailCode::Deadline => "deadline",
            FailCode::Mismatch => "mismatch",
            FailCode::AlreadyDone => "already_done",
            FailCode::TransferFailed => "transfer_failed",
            FailCode::PeerLost => "peer_lost",
            FailCode::Timeout => "timeout",
            FailCode::Protocol => "protocol",
        }
    }
}

impl std::fmt::Display for FailCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed transfer: the code decides, the message explains.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub code: FailCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: FailCode, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

/// The failure of P's write into D's blocks. A refusal by D's registry
/// (its grant revoked, its registration released or renewed) means D
/// withdrew the destination, i.e. gave the load up — in a sleep, say, where
/// D revokes the grant at the same time as it sends the drop — so it counts
/// as D's drop ([`FailCode::Dropped`], on purpose) whichever reaches P
/// first; anything else failed the transfer.
pub fn write_failure(refused_by_destination: bool, detail: impl std::fmt::Display) -> Failure {
    if refused_by_destination {
        Failure::new(
            FailCode::Dropped,
            format!("D withdrew the destination during the write: {detail}"),
        )
    } else {
        Failure::new(
            FailCode::TransferFailed,
            format!("writing the KV blocks failed: {detail}"),
        )
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

fn dropped() -> FailCode {
    FailCode::Dropped
}

/// Every control message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    Bootstrap,
    BootstrapOk {
        engine_id: String,
        layout: String,
        block_bytes: u64,
    },
    Pull(Pull),
    /// P is alive and working on the pull (sent while P computes the
    /// prompt and when the write is about to start); D's deadline restarts.
    PullProgress,
    PullOk,
    PullErr {
        code: FailCode,
        reason: String,
    },
    /// Ends the transfer at P; `code` says why (D released it, or a proxy
    /// saw P refuse the request), and a pull waiting for it gets that code.
    Drop {
        transfer_id: String,
        #[serde(default = "dropped")]
        code: FailCode,
    },
    DropOk {
        known: bool,
    },
    /// Read mode: D asks for what it needs to read P's blocks one-sided.
    Handshake,
    HandshakeOk(HandshakeInfo),
    /// Read mode: D finished reading `transfer_id`'s leased blocks.
    ReadDone {
        transfer_id: String,
    },
    /// The lease held the blocks until the read ended: the data is valid.
    ReadDoneOk,
    /// The lease had ended (expired, aborted, released): the data D read
    /// may come from reused blocks and must not be used.
    ReadDoneErr {
        code: FailCode,
        reason: String,
    },
    /// D holds requests, queued and not yet admitted, for these transfers:
    /// P keeps their KV for at least the lease it answers with, counted from
    /// now. D says so again before that lease runs out, for as long as the
    /// requests wait, so a claimed transfer never expires under a busy D.
    Claim {
        transfer_ids: Vec<String>,
    },
    /// The claim holds for `lease_ms`; `ended` names the transfers P no
    /// longer holds (or does not know yet: `unknown`) and why.
    ClaimOk {
        lease_ms: u64,
        #[serde(default)]
        ended: Vec<ClaimEnded>,
    },
    /// The server could not make sense of the request.
    Error {
        reason: String,
    },
}

/// Most transfers one claim names; a D with more queued sends several.
pub const MAX_CLAIM: usize = 512;

/// A claimed transfer P does not hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimEnded {
    pub transfer_id: String,
    pub code: FailCode,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{what}: timed out")]
    Timeout { what: &'static str },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("message of {0} bytes exceeds the limit of {MAX_MESSAGE}")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("KV handshake: {0}")]
    Auth(#[from] pdkv_transfer::auth::AuthError),
}

/// Serialises a message with its length prefix.
pub fn encode(msg: &Message) -> Result<Vec<u8>, WireError> {
    let body = serde_json::to_vec(msg).map_err(|e| WireError::Malformed(e.to_string()))?;
    if body.len() > MAX_MESSAGE {
        return Err(WireError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Checks a length prefix.
pub fn decode_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let n = u32::from_be_bytes(prefix) as usize;
    if n > MAX_MESSAGE {
        return Err(WireError::TooLarge(n));
    }
    Ok(n)
}

/// Parses a message body.
pub fn decode_body(body: &[u8]) -> Result<Message, WireError> {
    serde_json::from_slice(body).map_err(|e| WireError::Malformed(e.to_string()))
}

async fn timed<T>(
    limit: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, WireError> {
    match tokio::time::timeout(limit, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(WireError::Io { what, source }),
        Err(_) => Err(WireError::Timeout { what }),
    }
}

/// Reads one message, each socket read bounded by `limit`.
pub async fn read_message(s: &mut TcpStream, limit: Duration) -> Result<Message, WireError> {
    let prefix = read_prefix(s, limit).await?;
    read_message_after(s, prefix, limit).await
}

/// Reads the 4 bytes that open a message (its length prefix).
pub async fn read_prefix(s: &mut TcpStream, limit: Duration) -> Result<[u8; 4], WireError> {
    let mut prefix = [0u8; 4];
    timed(limit, "reading a length prefix", s.read_exact(&mut prefix)).await?;
    Ok(prefix)
}

/// Reads the rest of a message whose `prefix` was read already.
pub async fn read_message_after(
    s: &mut TcpStream,
    prefix: [u8; 4],
    limit: Duration,
) -> Result<Message, WireError> {
    let n = decode_len(prefix)?;
    let mut body = vec![0u8; n];
    timed(limit, "reading a message body", s.read_exact(&mut body)).await?;
    decode_body(&body)
}

/// Writes one message, bounded by `limit`.
pub async fn write_message(
    s: &mut TcpStream,
    msg: &Message,
    limit: Duration,
) -> Result<(), WireError> {
    let bytes = encode(msg)?;
    timed(limit, "writing a message", s.write_all(&bytes)).await?;
    timed(limit, "flushing a message", s.flush()).await
}

/// A control connection to `addr`, connected and through the handshake
/// ([`pdkv_transfer::auth`]) with `secret`, each step bounded by `io_limit`.
pub async fn open(
    addr: &str,
    secret: &KvSecret,
    io_limit: Duration,
) -> Result<TcpStream, WireError> {
    let mut s = timed(io_limit, "connecting", TcpStream::connect(addr)).await?;
    let _ = s.set_nodelay(true);
    auth::connect(&mut s, secret, Port::Control, io_limit).await?;
    Ok(s)
}

/// One exchange with the control server at `addr`: connect, send `msg`, read
/// the answer. `io_limit` bounds connecting and each write; the answer may
/// take up to `answer_limit` (a pull is answered when its write ended).
pub async fn exchange(
    addr: &str,
    secret: &KvSecret,
    msg: &Message,
    io_limit: Duration,
    answer_limit: Duration,
) -> Result<Message, WireError> {
    let mut s = open(addr, secret, io_limit).await?;
    write_message(&mut s, msg, io_limit).await?;
    read_message(&mut s, answer_limit).await
}

/// Asks the prefill engine whose control listener is at `addr` to drop
/// transfer `transfer_id` for `code` (a proxy whose decode request failed:
/// nobody will pull it; or whose prefill request P refused: D's pull gets
/// the code at once). Returns whether P knew the transfer; P frees its
/// blocks now rather than when the lease expires, and one it has not seen
/// yet is refused when its request finishes.
pub async fn drop_transfer(
    addr: &str,
    secret: &KvSecret,
    transfer_id: &str,
    code: FailCode,
    limit: Duration,
) -> Result<bool, DropError> {
    let msg = Message::Drop {
        transfer_id: transfer_id.to_string(),
        code,
    };
    match exchange(addr, secret, &msg, limit, limit).await {
        Ok(Message::DropOk { known }) => Ok(known),
        Ok(other) => Err(DropError::Unexpected(Box::new(other))),
        Err(e) => Err(DropError::Wire(e)),
    }
}

/// Why [`drop_transfer`] did not learn P's answer.
#[derive(Debug, thiserror::Error)]
pub enum DropError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("unexpected answer to a drop: {0:?}")]
    Unexpected(Box<Message>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_transfer::Registration;

    #[test]
    fn messages_round_trip_and_bad_input_is_an_error() {
        let msgs = [
            Message::Bootstrap,
            Message::BootstrapOk {
                engine_id: "p".into(),
                layout: "l".into(),
                block_bytes: 64,
            },
            Message::Pull(Pull {
                transfer_id: "t".into(),
                engine_id: "d".into(),
                first_block: 1,
                num_tokens: 40,
                dst: Destination::Shm {
                    path: "/tmp/x.sock".into(),
                },
                ranks: vec![
                    PullRank {
                        rank: RankReg {
                            heads: (0, 2),
                            reg: Registration {
                                segment: 1,
                                key: 2,
                                epoch: 3,
                                len: 128,
                            },
                        },
                        grant_key: Some(9),
                    },
                    PullRank {
                        rank: RankReg {
                            heads: (2, 3),
                            reg: Registration {
                                segment: 2,
                                key: 5,
                                epoch: 3,
                                len: 64,
                            },
                        },
                        grant_key: None,
                    },
                ],
                blocks: vec![0, 1],
                weights_version: Some("v1".into()),
            }),
            Message::PullProgress,
            Message::PullOk,
            Message::PullErr {
                code: FailCode::CacheReset,
                reason: "r".into(),
            },
            Message::Drop {
                transfer_id: "t".into(),
                code: FailCode::PrefillRefused,
            },
            Message::DropOk { known: true },
            Message::Handshake,
            Message::HandshakeOk(HandshakeInfo {
                engine_id: "p".into(),
                layout: "l".into(),
                block_bytes: 64,
                transfer: Destination::Tcp {
                    addr: "127.0.0.1:9".into(),
                },
                ranks: Some(vec![RankReg {
                    heads: (0, 3),
                    reg: Registration {
                        segment: 1,
                        key: 2,
                        epoch: 3,
                        len: 4096,
                    },
                }]),
            }),
            Message::ReadDone {
                transfer_id: "t".into(),
            },
            Message::ReadDoneOk,
            Message::ReadDoneErr {
                code: FailCode::LeaseExpired,
                reason: "expired".into(),
            },
            Message::Claim {
                transfer_ids: vec!["a".into(), "b".into()],
            },
            Message::ClaimOk {
                lease_ms: 30_000,
                ended: vec![ClaimEnded {
                    transfer_id: "b".into(),
                    code: FailCode::LeaseExpired,
                }],
            },
        ];
        for m in msgs {
            let b = encode(&m).unwrap();
            let n = decode_len(b[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, b.len() - 4);
            assert_eq!(decode_body(&b[4..]).unwrap(), m);
        }
        assert!(matches!(
            decode_len((MAX_MESSAGE as u32 + 1).to_be_bytes()),
            Err(WireError::TooLarge(_))
        ));
        assert!(matches!(decode_len([0xff; 4]), Err(WireError::TooLarge(_))));
        for junk in [
            &b""[..],
            b"{",
            b"\x00\xff",
            b"{\"type\":\"nope\"}",
            b"[1,2]",
            b"{\"type\":\"pull\"}",
        ] {
            assert!(
                matches!(decode_body(junk), Err(WireError::Malformed(_))),
                "{junk:?}"
            );
        }
    }
}
