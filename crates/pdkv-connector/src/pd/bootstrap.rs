//! The bootstrap query of write-mode routers: `GET /query` on P's control
//! listener answers `{"0": {"engine_id": ...}}` (keys are data-parallel
//! ranks; a pdkv engine is one), which such a router asks each prefill
//! engine at start-up before it names the engine in D's requests.
//!
//! The listener tells the two protocols apart by the first 4 bytes: pdkv
//! messages open with a big-endian length of at most 1 MiB, and `GET `
//! would announce over 1 GB. Only a request head is read (bounded in size
//! and time); the answer closes the connection.

use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::core::CONTROL_IO;
use super::Shared;
use crate::wire::WireError;

/// Longest request head read, in bytes.
const MAX_HEAD: usize = 8 * 1024;

/// What the query reports about this engine.
pub fn query_body(engine_id: &str, kv_role: &str, bootstrap_addr: &str) -> Value {
    json!({"0": {"engine_id": engine_id, "kv_role": kv_role, "bootstrap_addr": bootstrap_addr}})
}

/// The status and JSON body answering a request head that followed `GET `
/// (`rest` starts with the target, e.g. `/query HTTP/1.1\r\n...`).
pub fn answer(rest: &[u8], body: impl FnOnce() -> Value) -> (u16, Value) {
    let line = rest
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let target = parts.next().unwrap_or_default();
    if !parts.next().is_some_and(|v| v.starts_with(b"HTTP/1.")) {
        return (400, json!({"error": "malformed HTTP request line"}));
    }
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    if path == b"/query" {
        (200, body())
    } else {
        let shown = String::from_utf8_lossy(path);
        (
            404,
            json!({"error": format!("no route {shown} on the KV bootstrap port; GET /query is served here")}),
        )
    }
}

/// Reads the head of a request whose `GET ` was consumed and answers it.
pub async fn serve(shared: &Arc<Shared>, mut s: TcpStream) -> Result<(), WireError> {
    let mut head = Vec::with_capacity(512);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() >= MAX_HEAD {
                return Err(std::io::Error::other(format!(
                    "request head over {MAX_HEAD} bytes"
                )));
            }
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok(())
    };
    let io = |source| WireError::Io {
        what: "reading a bootstrap query",
        source,
    };
    match tokio::time::timeout(CONTROL_IO, read).await {
        Ok(r) => r.map_err(io)?,
        Err(_) => {
            return Err(WireError::Timeout {
                what: "reading a bootstrap query",
            })
        }
    }
    let (status, body) = answer(&head, || {
        shared.inspect(|c| {
            query_body(
                c.engine_id(),
                c.config().kv_role.as_str(),
                c.bootstrap_addr(),
            )
        })
    });
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Bad Request",
    };
    let body = body.to_string();
    let resp = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        s.write_all(resp.as_bytes()).await?;
        s.shutdown().await
    };
    match tokio::time::timeout(CONTROL_IO, write).await {
        Ok(r) => r.map_err(|source| WireError::Io {
            what: "answering a bootstrap query",
            source,
        }),
        Err(_) => Err(WireError::Timeout {
            what: "answering a bootstrap query",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_the_engine_and_other_paths_are_refused() {
        let body = || query_body("p0", "kv_producer", "127.0.0.1:7100");
        let (st, v) = answer(b"/query HTTP/1.1\r\nHost: x\r\n\r\n", body);
        assert_eq!(st, 200);
        assert_eq!(v["0"]["engine_id"], "p0");
        assert_eq!(answer(b"/query?x=1 HTTP/1.0\r\n\r\n", body).0, 200);
        let (st, v) = answer(b"/other HTTP/1.1\r\n\r\n", body);
        assert_eq!(st, 404);
        assert!(v["error"].as_str().unwrap().contains("/other"), "{v}");
        assert_eq!(answer(b"/query\r\n\r\n", body).0, 400);
        assert_eq!(answer(b"\r\n\r\n", body).0, 400);
    }
}
