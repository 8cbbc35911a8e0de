//! The integration tests of this crate, one binary: each module is one
//! area (they share the helpers in `common` and pdkv-testkit).

mod architecture;
mod cli;
mod pd_netns;
mod python_publisher;
mod rl_api;
mod up;
