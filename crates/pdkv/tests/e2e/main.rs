//! The integration tests of pdkv, one binary: each module is one area, from
//! the commands run on their own to whole deployments under load; they share
//! pdkv-testkit. Two run at a time (the test threads), so one waiting on a
//! deadline or a health check overlaps another that computes.

mod architecture;
mod bench_serve;
mod cli;
mod frameworks;
mod hostile;
mod lifecycle_matrix;
mod pd;
mod pd_netns;
mod python_publisher;
mod rl_api;
mod router;
mod structured;
mod tools;
mod up;
