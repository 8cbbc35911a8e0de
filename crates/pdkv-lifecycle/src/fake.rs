//! The fake server of the matrix: a KV control listener that accepts
//! connections and never answers.

use std::time::Instant;

/// A control listener that accepts connections and never answers: a D load
/// whose first control exchange (bootstrap or handshake) goes here stays in
/// flight, holding its blocks, until the connector's bound on that exchange.
/// Stops (closing what it holds) on drop.
pub(crate) struct Unanswering {
    pub(crate) addr: std::net::SocketAddr,
    accepted: tokio::sync::watch::Receiver<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl Unanswering {
    /// Connections held at most; later ones are closed at once.
    const MAX_HELD: usize = 16;

    pub(crate) async fn bind() -> std::io::Result<Unanswering> {
        let listener = tokio::net::TcpListener::bind((pdkv_deploy::HOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (tx, accepted) = tokio::sync::watch::channel(0);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                if held.len() < Self::MAX_HELD {
                    held.push(stream);
                }
                tx.send_modify(|n| *n += 1);
            }
        });
        Ok(Unanswering {
            addr,
            accepted,
            task,
        })
    }

    /// Waits (until `deadline`) for a first connection.
    pub(crate) async fn wait_accepted(&mut self, deadline: Instant) -> bool {
        let wait = self.accepted.wait_for(|n| *n >= 1);
        matches!(
            tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), wait).await,
            Ok(Ok(_))
        )
    }
}

impl Drop for Unanswering {
    fn drop(&mut self) {
        self.task.abort();
    }
}
