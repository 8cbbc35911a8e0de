//! The integration tests of this crate, one binary: each module is one
//! area (they share the helpers in `common` and pdkv-testkit).

mod batch_invariance;
mod common;
mod connector;
mod engine;
mod logprobs;
mod scheduler;
mod speculative;
mod stepper;
mod structured;
