//! Everything the P/D connector decides for one engine, without I/O.
//!
//! [`PdCore`] holds P's [`SendMachine`](crate::send::SendMachine) and D's
//! [`RecvMachine`](crate::recv::RecvMachine), the KV cache registration and the
//! engine-side bookkeeping. It takes the engine's connector calls and the
//! driver's I/O results, each with the time, and queues [`Io`] for the driver.
//! The production driver (`net.rs`) runs it over TCP and shared memory; a
//! simulator runs the same core over a simulated network. Registering, granting
//! and forgetting memory are in-process calls on the real
//! [`Registry`](pdkv_transfer::Registry) and happen here; only what waits on a
//! peer (the network, an unmap acknowledgement, the end of an access in flight)
//! is the driver's.
//!
//! Files, one job each: `state.rs` ([`PdCore`], the calls both sides share
//! and `drive`), `memory.rs` (the KV cache registration, release and
//! restore), `serve.rs` (P's side and the control messages every engine
//! answers), `load.rs` (D's side); the leaves `io.rs` ([`Io`], [`Op`]),
//! `kv.rs` ([`KvInfo`]) and `counters.rs` ([`Counters`], [`InFlight`]).

mod counters;
mod io;
mod kv;
mod load;
mod memory;
mod serve;
mod state;

pub use counters::{Counters, InFlight};
pub use io::{ConnId, Copy, Io, Op, ReadIo, SendIo, WriteIo, CONTROL_IO};
pub use kv::{KvInfo, RankKv};
pub use state::{validate, PdCore};

#[cfg(test)]
mod tests;
