//! The integration tests of this crate, one binary: each module is one
//! area (they share the helpers in `common` and pdkv-testkit).

mod claims;
mod common;
mod config;
mod engines;
mod failures;
mod long_prefill;
mod offload;
mod peers;
mod read_mode;
mod reset;
mod sleep_engines;
mod tp;
mod transfer;
