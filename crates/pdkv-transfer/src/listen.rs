//! Listening sockets with a listen backlog sized for bursts.
//!
//! `tokio::net::TcpListener::bind` asks the kernel for a backlog of 128
//! connections. A server that stops accepting for a few milliseconds (a
//! burst of new connections, a busy runtime) then has its backlog full, the
//! kernel drops the next SYNs, and each of those clients waits a whole second
//! for its SYN to be sent again. Every listener pdkv opens (HTTP, the proxy,
//! the KV control and transfer ports, the weight publisher) asks for
//! [`BACKLOG`] instead; the kernel caps it at `net.core.somaxconn`.

use std::io;

use tokio::net::{TcpListener, TcpSocket, ToSocketAddrs};

/// The listen backlog every pdkv listener asks for: the HTTP servers'
/// default connection cap, so a burst up to the cap waits in the backlog
/// instead of being dropped.
pub const BACKLOG: u32 = 4096;

/// Binds a listener on the first of `addr`'s addresses that binds, with
/// `SO_REUSEADDR` (as tokio's own `bind`) and a backlog of [`BACKLOG`].
pub async fn bind(addr: impl ToSocketAddrs) -> io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the address resolved to no socket address",
        )
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A listener that never accepts still completes as many handshakes as
    /// its backlog holds. With tokio's backlog the 130th connect would wait
    /// (the kernel drops its SYN) until the deadline.
    #[tokio::test]
    async fn a_listener_that_does_not_accept_holds_a_burst_in_its_backlog() {
        let listener = bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let burst = BACKLOG.min(somaxconn).min(1000);
        assert!(burst > 129, "net.core.somaxconn is {somaxconn}");
        let mut held = Vec::new();
        for i in 0..burst {
            let c = tokio::time::timeout(
                Duration::from_secs(30),
                tokio::net::TcpStream::connect(addr),
            )
            .await
            .unwrap_or_else(|_| panic!("connect {i} of {burst} waited past its deadline"))
            .unwrap();
            held.push(c);
        }
        assert_eq!(held.len(), burst as usize);
    }

    #[tokio::test]
    async fn an_address_in_use_is_an_error() {
        let held = bind("127.0.0.1:0").await.unwrap();
        let taken = held.local_addr().unwrap();
        let e = bind(taken).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
    }
}
