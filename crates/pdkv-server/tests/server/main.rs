//! The integration tests of this crate, one binary: each module is one
//! area (they share the helpers in `common` and pdkv-testkit).

mod admin;
mod common;
mod connections;
mod http;
mod proxy;
mod rl;
