//! The HTTP connection bounds `serve` and `proxy` share.

use std::time::Duration;

use clap::Args;
use pdkv_server::listen::HttpLimits;

#[derive(Args, Debug, Clone)]
pub struct HttpArgs {
    /// Most client connections held at once; at the cap the oldest idle
    /// connection is closed to make room, and only when none is idle do new
    /// clients wait in the listen backlog.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a connection may take to send a request head (the first, or
    /// the next on an idle keep-alive connection) before it is closed.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout_s: f64,
}

impl HttpArgs {
    pub fn limits(&self) -> anyhow::Result<HttpLimits> {
        anyhow::ensure!(
            self.max_connections > 0,
            "--max-connections must be at least 1"
        );
        anyhow::ensure!(
            self.header_timeout_s.is_finite()
                && self.header_timeout_s > 0.0
                && self.header_timeout_s <= 3600.0,
            "--header-timeout-s must be a positive number of seconds (at most 3600)"
        );
        Ok(HttpLimits {
            max_connections: self.max_connections,
            header_timeout: Duration::from_secs_f64(self.header_timeout_s),
        })
    }
}
