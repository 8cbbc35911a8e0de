//! What pdkv's tests share, written once: child `pdkv` processes under one
//! guard ([`proc`]), deployments on `pdkv up`'s own wiring ([`deploy`]), the HTTP, admin and SSE clients ([`http`], [`sse`]),
//! one Prometheus text parser ([`prom`]), a client forging the KV ports'
//! handshake ([`hostile`]), the models tests run on
//! ([`models`]), in-process engines on them ([`engine`]), and the bound every wait in a test has ([`DEADLINE`]).
//!
//! A dev-dependency only: nothing here is part of a server. Every wait is
//! bounded; a helper that cannot do its job panics with what it saw, so a
//! failing test explains itself.

pub mod deploy;
pub mod engine;
pub mod hostile;
pub mod http;
pub mod models;
pub mod proc;
pub mod sse;

/// The one Prometheus text parser, the clients' (pdkv-deploy's).
pub use pdkv_deploy::prom;

use std::time::Duration;

/// Bound on every wait in a test: a server's start, a health check, a
/// metric reaching a value, a child's exit.
pub const DEADLINE: Duration = Duration::from_secs(180);

/// How often a bounded wait polls what it waits for.
pub const POLL: Duration = Duration::from_millis(20);
