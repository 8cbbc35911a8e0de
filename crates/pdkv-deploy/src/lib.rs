//! `pdkv-deploy`: a P/D deployment as child processes on loopback — N
//! prefill servers, M decode servers and the proxy in front of them, each
//! running the `pdkv` executable the caller names (`pdkv serve ...`,
//! `pdkv proxy ...`). `pdkv up`, `pdkv bench serve` and the lifecycle
//! matrix start their deployments here.
//!
//! What it holds: the child process guard ([`Proc`]: stderr read line by
//! line, the URL from the child's `listening on` line, its last log lines
//! for an error report), the ports of a deployment ([`Ports`]), the command
//! lines of each child ([`serve_args`], [`proxy_args`]), [`start`] (the
//! whole deployment, bounded) and [`wait_healthy`], [`check_children`],
//! [`stop_all`].
//!
//! Invariants: every wait is bounded; secrets reach children by
//! environment, never argv; a child gets SIGTERM from the kernel if this
//! process dies (`PR_SET_PDEATHSIG`); [`stop_all`] reaps every child. The
//! caller keeps the children in a `Vec<Proc>` that it stops on every path
//! ([`start`] pushes each child as soon as it is spawned).

mod child;
mod error;
mod modes;
mod ports;
pub mod prom;
mod start;
mod wiring;

pub use child::{
    check_children, child_command, listening_addr, stop_all, stop_all_blocking, LogSink, Logs,
    Proc, STOP_GRACE,
};
pub use error::DeployError;
pub use modes::{FailurePolicy, TransferMode, Transport};
pub use ports::{PortPlan, Ports};
pub use start::{start, wait_healthy, EngineLaunch, Spec, Started};
pub use wiring::{proxy_args, serve_args, EngineRole, EngineWiring, HttpBounds, HOST};
