//! The integration tests of this crate, one binary: each module is one
//! area (they share the helpers in `common` and pdkv-testkit).

mod formats;
mod hf_weights;
mod loading;
mod math;
mod numerics;
mod tp;
