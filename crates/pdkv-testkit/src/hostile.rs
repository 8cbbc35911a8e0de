//! Hostile peers on the KV ports: what a client that does not hold the
//! deployment's secret can try.

use pdkv_transfer::auth::{self, Port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::DEADLINE;

/// A client that does not hold the secret, at `addr`: a well-formed hello
/// for `port`, then, whatever the challenge, a made-up proof. Returns what
/// the server answered in place of its `OKAY`: its refusal (at the hello or
/// at the proof), or nothing when it closed without a word.
pub async fn forged_proof(addr: &str, port: Port) -> Vec<u8> {
    let mut s = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    let mut hello = [0u8; auth::HELLO_LEN];
    hello[..8].copy_from_slice(b"PDKVAUTH");
    hello[8] = 1;
    hello[9] = port as u8;
    s.write_all(&hello).await.unwrap();
    let mut ch = [0u8; auth::CHALLENGE_LEN];
    if tokio::time::timeout(DEADLINE, s.read_exact(&mut ch))
        .await
        .expect("a challenge or a close")
        .is_err()
    {
        return Vec::new();
    }
    if ch.starts_with(b"PDKVDENY") {
        return ch.to_vec();
    }
    let mut proof = [0x5a; auth::PROOF_LEN];
    proof[..8].copy_from_slice(b"PDKVPROF");
    s.write_all(&proof).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, s.read_to_end(&mut rest))
        .await
        .expect("the server closes");
    rest
}
