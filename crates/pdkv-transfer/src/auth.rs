//! The KV ports' handshake: before anything else on a transfer, shared-memory
//! or control connection, both ends prove they hold the deployment's KV
//! secret, without sending it.
//!
//! ```text
//! client → server  hello      "PDKVAUTH" | version 1 | port | 6 zero | nonce_c (32)
//! server → client  challenge  "PDKVCHAL" | nonce_s (32) | mac_s (32)
//! client → server  proof      "PDKVPROF" | mac_c (32)
//! server → client  verdict    "PDKVOKAY" or "PDKVDENY" | reason | 7 zero
//!
//! mac_s = HMAC-SHA256(secret, "pdkv kv server" | port | nonce_c | nonce_s)
//! mac_c = HMAC-SHA256(secret, "pdkv kv client" | port | nonce_c | nonce_s)
//! ```
//!
//! Both nonces are fresh random bytes, so a recorded exchange proves nothing
//! on a new connection, and the two MACs carry different labels, so the
//! server's answer to a chosen `nonce_c` never serves as a client's proof.
//! The server proves itself first: a client that reaches something other
//! than a peer of its deployment learns it before it sends a proof, and
//! says so. A server that refuses a hello (not a handshake, another port,
//! another version) answers with a `DENY` in place of the challenge, and one
//! that refuses a proof answers `DENY` in place of `OKAY`, so the client's
//! error names the reason. The port (transfer, shared memory, control) is
//! bound into both MACs: a proof made for one port does not open another.
//!
//! The secret authenticates peers; it does not encrypt what follows. KV data
//! and control messages still travel in the clear, so a deployment across
//! untrusted networks runs them over an encrypted link.
//!
//! Without a secret ([`KvSecret::open`]) the handshake still runs (so
//! garbage and idle clients are refused as quickly) with an empty key: any
//! process that speaks it gets in. Servers log that at start; `pdkv up`
//! always makes a secret for its deployment.
//!
//! The exchange itself is sans-IO ([`ClientHandshake`], [`ServerHandshake`]);
//! [`accept`] / [`connect`] drive it on tokio streams and
//! [`accept_blocking`] / [`connect_blocking`] on std streams.

use std::fmt;
use std::io::{Read, Write};
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const HELLO_LEN: usize = 48;
pub const CHALLENGE_LEN: usize = 72;
pub const PROOF_LEN: usize = 40;
pub const VERDICT_LEN: usize = 16;
const VERSION: u8 = 1;
const NONCE: usize = 32;

const HELLO: &[u8; 8] = b"PDKVAUTH";
const CHALLENGE: &[u8; 8] = b"PDKVCHAL";
const PROOF: &[u8; 8] = b"PDKVPROF";
const OKAY: &[u8; 8] = b"PDKVOKAY";
const DENY: &[u8; 8] = b"PDKVDENY";

/// The shortest secret accepted (bytes).
pub const MIN_SECRET_LEN: usize = 16;

/// Which port a connection is for; bound into the proofs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Port {
    Transfer = 1,
    Shm = 2,
    Control = 3,
}

impl Port {
    fn from_u8(b: u8) -> Option<Port> {
        match b {
            1 => Some(Port::Transfer),
            2 => Some(Port::Shm),
            3 => Some(Port::Control),
            _ => None,
        }
    }
}

impl fmt::Display for Port {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Port::Transfer => "KV transfer",
            Port::Shm => "shared-memory",
            Port::Control => "KV control",
        })
    }
}

/// The deployment's KV secret (or none: [`KvSecret::open`]).
#[derive(Clone, PartialEq, Eq)]
pub struct KvSecret {
    key: Option<Vec<u8>>,
}

impl fmt::Debug for KvSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.key.is_some() {
            "KvSecret(set)"
        } else {
            "KvSecret(open)"
        })
    }
}

impl Default for KvSecret {
    fn default() -> Self {
        KvSecret::open()
    }
}

impl KvSecret {
    /// No secret: the handshake admits any peer that speaks it.
    pub fn open() -> KvSecret {
        KvSecret { key: None }
    }

    /// A secret of at least [`MIN_SECRET_LEN`] bytes.
    pub fn new(secret: &str) -> Result<KvSecret, SecretError> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort { len: secret.len() });
        }
        Ok(KvSecret {
            key: Some(secret.as_bytes().to_vec()),
        })
    }

    /// A fresh random secret (64 hex digits), for a deployment that makes its own.
    pub fn generate() -> std::io::Result<String> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(b.iter().map(|x| format!("{x:02x}")).collect())
    }

    pub fn is_open(&self) -> bool {
        self.key.is_none()
    }

    fn mac(&self, label: &[u8], port: Port, nonce_c: &[u8], nonce_s: &[u8]) -> Hmac<Sha256> {
        let key = self.key.as_deref().unwrap_or(&[]);
        let mut m =
            <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes a key of any length");
        m.update(label);
        m.update(&[port as u8]);
        m.update(nonce_c);
        m.update(nonce_s);
        m
    }
}

const SERVER_LABEL: &[u8] = b"pdkv kv server";
const CLIENT_LABEL: &[u8] = b"pdkv kv client";

/// Why a KV secret was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("the KV secret must be at least {MIN_SECRET_LEN} bytes long (got {len})")]
    TooShort { len: usize },
}

/// Why a handshake failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("not a pdkv KV handshake")]
    NotHandshake,
    #[error("unsupported handshake version {0}")]
    Version(u8),
    #[error("this is the {expected} port; the peer asked for the {asked} port")]
    WrongPort { expected: Port, asked: String },
    #[error("the peer did not prove it holds this deployment's KV secret")]
    BadProof,
    #[error("the server did not prove it holds our KV secret: it belongs to another deployment, or the engines' KV secrets (--kv-secret / PDKV_KV_SECRET) differ")]
    ServerNotAuthentic,
    #[error("the peer refused the handshake: {0}")]
    Refused(Denial),
    #[error("handshake {0}")]
    Io(String),
    #[error("handshake timed out after {0:?}")]
    Timeout(Duration),
}

/// A server's reason for a `DENY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denial {
    NotHandshake = 1,
    Version = 2,
    WrongPort = 3,
    BadProof = 4,
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Denial::NotHandshake => "it did not read a handshake",
            Denial::Version => "it speaks another handshake version",
            Denial::WrongPort => "it is not the port this client asked for",
            Denial::BadProof => {
                "our proof did not match its KV secret (the engines' --kv-secret / PDKV_KV_SECRET differ)"
            }
        })
    }
}

impl AuthError {
    fn denial(&self) -> Option<Denial> {
        match self {
            AuthError::NotHandshake => Some(Denial::NotHandshake),
            AuthError::Version(_) => Some(Denial::Version),
            AuthError::WrongPort { .. } => Some(Denial::WrongPort),
            AuthError::BadProof => Some(Denial::BadProof),
            _ => None,
        }
    }
}

fn deny(d: Denial, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    b[..8].copy_from_slice(DENY);
    b[8] = d as u8;
    b
}

/// A `DENY` in place of an expected message: the reason it carries.
fn check_denied(b: &[u8]) -> Result<(), AuthError> {
    if &b[..8] != DENY {
        return Ok(());
    }
    let d = match b[8] {
        1 => Denial::NotHandshake,
        2 => Denial::Version,
        3 => Denial::WrongPort,
        4 => Denial::BadProof,
        _ => return Err(AuthError::Io("a denial with an unknown reason".into())),
    };
    Err(AuthError::Refused(d))
}

fn nonce() -> Result<[u8; NONCE], AuthError> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| AuthError::Io(format!("drawing a nonce: {e}")))?;
    Ok(n)
}

/// The client's side of one handshake.
pub struct ClientHandshake {
    port: Port,
    nonce_c: [u8; NONCE],
}

impl ClientHandshake {
    /// Starts a handshake for `port`: the hello to send.
    pub fn new(port: Port) -> Result<(ClientHandshake, [u8; HELLO_LEN]), AuthError> {
        let nonce_c = nonce()?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(HELLO);
        hello[8] = VERSION;
        hello[9] = port as u8;
        hello[16..].copy_from_slice(&nonce_c);
        Ok((ClientHandshake { port, nonce_c }, hello))
    }

    /// Checks the server's challenge; the proof to send.
    pub fn on_challenge(
        &self,
        secret: &KvSecret,
        ch: &[u8; CHALLENGE_LEN],
    ) -> Result<[u8; PROOF_LEN], AuthError> {
        check_denied(ch)?;
        if &ch[..8] != CHALLENGE {
            return Err(AuthError::NotHandshake);
        }
        let nonce_s = &ch[8..8 + NONCE];
        secret
            .mac(SERVER_LABEL, self.port, &self.nonce_c, nonce_s)
            .verify_slice(&ch[8 + NONCE..])
            .map_err(|_| AuthError::ServerNotAuthentic)?;
        let mac_c = secret
            .mac(CLIENT_LABEL, self.port, &self.nonce_c, nonce_s)
            .finalize()
            .into_bytes();
        let mut proof = [0u8; PROOF_LEN];
        proof[..8].copy_from_slice(PROOF);
        proof[8..].copy_from_slice(&mac_c);
        Ok(proof)
    }

    /// The server's verdict on the proof.
    pub fn on_verdict(&self, v: &[u8; VERDICT_LEN]) -> Result<(), AuthError> {
        check_denied(v)?;
        if &v[..8] != OKAY {
            return Err(AuthError::NotHandshake);
        }
        Ok(())
    }
}

/// The server's side of one handshake.
pub struct ServerHandshake {
    port: Port,
    nonce_c: [u8; NONCE],
    nonce_s: [u8; NONCE],
}

impl ServerHandshake {
    /// Checks a client's hello on `port`: the challenge to send, or the
    /// refusal and the `DENY` to send in its place.
    pub fn on_hello(
        secret: &KvSecret,
        port: Port,
        hello: &[u8; HELLO_LEN],
    ) -> Result<(ServerHandshake, [u8; CHALLENGE_LEN]), (AuthError, Vec<u8>)> {
        let refuse = |e: AuthError| {
            let d = e.denial().unwrap_or(Denial::NotHandshake);
            (e, deny(d, CHALLENGE_LEN))
        };
        if &hello[..8] != HELLO || hello[10..16].iter().any(|&b| b != 0) {
            return Err(refuse(AuthError::NotHandshake));
        }
        if hello[8] != VERSION {
            return Err(refuse(AuthError::Version(hello[8])));
        }
        match Port::from_u8(hello[9]) {
            Some(p) if p == port => {}
            Some(p) => {
                return Err(refuse(AuthError::WrongPort {
                    expected: port,
                    asked: p.to_string(),
                }))
            }
            None => {
                return Err(refuse(AuthError::WrongPort {
                    expected: port,
                    asked: format!("unknown ({})", hello[9]),
                }))
            }
        }
        let mut nonce_c = [0u8; NONCE];
        nonce_c.copy_from_slice(&hello[16..]);
        let nonce_s = nonce().map_err(|e| (e, deny(Denial::NotHandshake, CHALLENGE_LEN)))?;
        let mac_s = secret
            .mac(SERVER_LABEL, port, &nonce_c, &nonce_s)
            .finalize()
            .into_bytes();
        let mut ch = [0u8; CHALLENGE_LEN];
        ch[..8].copy_from_slice(CHALLENGE);
        ch[8..8 + NONCE].copy_from_slice(&nonce_s);
        ch[8 + NONCE..].copy_from_slice(&mac_s);
        Ok((
            ServerHandshake {
                port,
                nonce_c,
                nonce_s,
            },
            ch,
        ))
    }

    /// Checks the client's proof: the verdict to send either way.
    pub fn on_proof(
        &self,
        secret: &KvSecret,
        proof: &[u8; PROOF_LEN],
    ) -> (Result<(), AuthError>, [u8; VERDICT_LEN]) {
        let ok = &proof[..8] == PROOF
            && secret
                .mac(CLIENT_LABEL, self.port, &self.nonce_c, &self.nonce_s)
                .verify_slice(&proof[8..])
                .is_ok();
        let mut v = [0u8; VERDICT_LEN];
        if ok {
            v[..8].copy_from_slice(OKAY);
            (Ok(()), v)
        } else {
            v.copy_from_slice(&deny(Denial::BadProof, VERDICT_LEN));
            (Err(AuthError::BadProof), v)
        }
    }
}

fn io_err(what: &str, e: std::io::Error) -> AuthError {
    AuthError::Io(format!("{what}: {e}"))
}

async fn bounded<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, AuthError>>,
) -> Result<T, AuthError> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| AuthError::Timeout(limit))?
}

/// The server's side on a tokio stream, all of it within `limit`.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &KvSecret,
    port: Port,
    limit: Duration,
) -> Result<(), AuthError> {
    accept_after(s, &[], secret, port, limit).await
}

/// [`accept`] on a stream whose first `prefix.len()` bytes (at most a
/// hello's) were already read by a caller telling protocols apart.
pub async fn accept_after<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    prefix: &[u8],
    secret: &KvSecret,
    port: Port,
    limit: Duration,
) -> Result<(), AuthError> {
    bounded(limit, async {
        let mut hello = [0u8; HELLO_LEN];
        let n = prefix.len().min(HELLO_LEN);
        hello[..n].copy_from_slice(&prefix[..n]);
        s.read_exact(&mut hello[n..])
            .await
            .map_err(|e| io_err("reading the hello", e))?;
        let hs = match ServerHandshake::on_hello(secret, port, &hello) {
            Ok((hs, ch)) => {
                s.write_all(&ch)
                    .await
                    .map_err(|e| io_err("sending the challenge", e))?;
                hs
            }
            Err((e, denial)) => {
                let _ = s.write_all(&denial).await;
                return Err(e);
            }
        };
        let mut proof = [0u8; PROOF_LEN];
        s.read_exact(&mut proof)
            .await
            .map_err(|e| io_err("reading the proof", e))?;
        let (r, verdict) = hs.on_proof(secret, &proof);
        let w = s
            .write_all(&verdict)
            .await
            .map_err(|e| io_err("sending the verdict", e));
        r.and(w)
    })
    .await
}

/// The client's side on a tokio stream, all of it within `limit`.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &KvSecret,
    port: Port,
    limit: Duration,
) -> Result<(), AuthError> {
    bounded(limit, async {
        let (hs, hello) = ClientHandshake::new(port)?;
        s.write_all(&hello)
            .await
            .map_err(|e| io_err("sending the hello", e))?;
        let mut ch = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut ch)
            .await
            .map_err(|e| io_err("reading the challenge", e))?;
        let proof = hs.on_challenge(secret, &ch)?;
        s.write_all(&proof)
            .await
            .map_err(|e| io_err("sending the proof", e))?;
        let mut v = [0u8; VERDICT_LEN];
        s.read_exact(&mut v)
            .await
            .map_err(|e| io_err("reading the verdict", e))?;
        hs.on_verdict(&v)
    })
    .await
}

fn read_blocking(
    s: &mut impl Read,
    buf: &mut [u8],
    what: &str,
    limit: Duration,
) -> Result<(), AuthError> {
    s.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => AuthError::Timeout(limit),
        _ => io_err(what, e),
    })
}

/// The server's side on a blocking stream whose read and write timeouts
/// the caller set to `limit`.
pub fn accept_blocking(
    s: &mut (impl Read + Write),
    secret: &KvSecret,
    port: Port,
    limit: Duration,
) -> Result<(), AuthError> {
    let mut hello = [0u8; HELLO_LEN];
    read_blocking(s, &mut hello, "reading the hello", limit)?;
    let hs = match ServerHandshake::on_hello(secret, port, &hello) {
        Ok((hs, ch)) => {
            s.write_all(&ch)
                .map_err(|e| io_err("sending the challenge", e))?;
            hs
        }
        Err((e, denial)) => {
            let _ = s.write_all(&denial);
            return Err(e);
        }
    };
    let mut proof = [0u8; PROOF_LEN];
    read_blocking(s, &mut proof, "reading the proof", limit)?;
    let (r, verdict) = hs.on_proof(secret, &proof);
    let w = s
        .write_all(&verdict)
        .map_err(|e| io_err("sending the verdict", e));
    r.and(w)
}

/// The client's side on a blocking stream whose read and write timeouts
/// the caller set to `limit`.
pub fn connect_blocking(
    s: &mut (impl Read + Write),
    secret: &KvSecret,
    port: Port,
    limit: Duration,
) -> Result<(), AuthError> {
    let (hs, hello) = ClientHandshake::new(port)?;
    s.write_all(&hello)
        .map_err(|e| io_err("sending the hello", e))?;
    let mut ch = [0u8; CHALLENGE_LEN];
    read_blocking(s, &mut ch, "reading the challenge", limit)?;
    let proof = hs.on_challenge(secret, &ch)?;
    s.write_all(&proof)
        .map_err(|e| io_err("sending the proof", e))?;
    let mut v = [0u8; VERDICT_LEN];
    read_blocking(s, &mut v, "reading the verdict", limit)?;
    hs.on_verdict(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> KvSecret {
        KvSecret::new(s).unwrap()
    }

    /// Runs both sides in memory; the client's and the server's results.
    fn run(
        client: &KvSecret,
        cport: Port,
        server: &KvSecret,
        sport: Port,
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (c, hello) = ClientHandshake::new(cport).unwrap();
        let (s, ch) = match ServerHandshake::on_hello(server, sport, &hello) {
            Ok(v) => v,
            Err((e, denial)) => {
                let ch: [u8; CHALLENGE_LEN] = denial.try_into().unwrap();
                return (c.on_challenge(client, &ch).map(|_| ()), Err(e));
            }
        };
        let proof = match c.on_challenge(client, &ch) {
            Ok(p) => p,
            Err(e) => return (Err(e), Err(AuthError::Io("the client left".into()))),
        };
        let (sr, v) = s.on_proof(server, &proof);
        (c.on_verdict(&v), sr)
    }

    #[test]
    fn equal_secrets_pass_and_unequal_ones_are_named_on_both_sides() {
        let a = secret("0123456789abcdef-one");
        let b = secret("0123456789abcdef-two");
        assert_eq!(
            run(&a, Port::Transfer, &a, Port::Transfer),
            (Ok(()), Ok(()))
        );
        assert_eq!(
            run(
                &KvSecret::open(),
                Port::Control,
                &KvSecret::open(),
                Port::Control
            ),
            (Ok(()), Ok(()))
        );
        // The client finds out first: the server's MAC does not match its key.
        let (c, s) = run(&a, Port::Transfer, &b, Port::Transfer);
        assert_eq!(c, Err(AuthError::ServerNotAuthentic));
        assert!(s.is_err());
        // An open client against a server with a secret, and the reverse.
        assert_eq!(
            run(&KvSecret::open(), Port::Control, &a, Port::Control).0,
            Err(AuthError::ServerNotAuthentic)
        );
        assert_eq!(
            run(&a, Port::Control, &KvSecret::open(), Port::Control).0,
            Err(AuthError::ServerNotAuthentic)
        );
    }

    #[test]
    fn a_proof_for_one_port_opens_no_other_and_the_client_hears_why() {
        let a = secret("0123456789abcdef");
        let (c, s) = run(&a, Port::Control, &a, Port::Transfer);
        assert_eq!(c, Err(AuthError::Refused(Denial::WrongPort)));
        assert!(
            matches!(
                s,
                Err(AuthError::WrongPort {
                    expected: Port::Transfer,
                    ..
                })
            ),
            "{s:?}"
        );
    }

    #[test]
    fn a_forged_or_replayed_proof_is_refused_with_a_denial() {
        let a = secret("0123456789abcdef");
        let (c1, hello1) = ClientHandshake::new(Port::Transfer).unwrap();
        let (s1, ch1) = ServerHandshake::on_hello(&a, Port::Transfer, &hello1).unwrap();
        let proof1 = c1.on_challenge(&a, &ch1).unwrap();
        assert!(s1.on_proof(&a, &proof1).0.is_ok());
        // The same hello and proof replayed: the server draws a new nonce.
        let (s2, _) = ServerHandshake::on_hello(&a, Port::Transfer, &hello1).unwrap();
        let (r, v) = s2.on_proof(&a, &proof1);
        assert_eq!(r, Err(AuthError::BadProof));
        assert_eq!(c1.on_verdict(&v), Err(AuthError::Refused(Denial::BadProof)));
        // The server's own MAC sent back as a proof.
        let (s3, ch3) = ServerHandshake::on_hello(&a, Port::Transfer, &hello1).unwrap();
        let mut echo = [0u8; PROOF_LEN];
        echo[..8].copy_from_slice(PROOF);
        echo[8..].copy_from_slice(&ch3[40..]);
        assert_eq!(s3.on_proof(&a, &echo).0, Err(AuthError::BadProof));
    }

    #[test]
    fn garbage_hellos_are_refused_whatever_the_bytes() {
        let a = secret("0123456789abcdef");
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for i in 0..2000 {
            let mut hello = [0u8; HELLO_LEN];
            for b in hello.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            if i % 2 == 0 {
                hello[..8].copy_from_slice(HELLO); // right magic, junk after
            }
            let r = ServerHandshake::on_hello(&a, Port::Transfer, &hello);
            if let Ok((s, _)) = r {
                // Only a well-formed hello gets a challenge, and junk as a proof fails.
                assert_eq!(hello[8], VERSION);
                assert_eq!(
                    s.on_proof(&a, &[7u8; PROOF_LEN]).0,
                    Err(AuthError::BadProof)
                );
            }
        }
    }

    #[test]
    fn short_secrets_are_refused_and_generated_ones_are_fresh() {
        assert!(KvSecret::new("short").is_err());
        let (g1, g2) = (KvSecret::generate().unwrap(), KvSecret::generate().unwrap());
        assert_eq!(g1.len(), 64);
        assert_ne!(g1, g2);
        assert!(KvSecret::new(&g1).is_ok());
        assert_eq!(
            format!("{:?}", KvSecret::new(&g1).unwrap()),
            "KvSecret(set)"
        );
    }
}
