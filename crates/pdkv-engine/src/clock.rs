//! Where the engine core gets the time.
//!
//! Every timestamp the stepper ([`crate::EngineCore`]) and the lifecycle
//! code take — deadlines of pauses, sleeps and releases, the durations in the
//! stats — comes from a [`Clock`]; nothing there reads the system time. A
//! simulator passes a virtual clock and a multi-second deadline passes in
//! microseconds. Production uses [`SystemClock`].

use std::time::Instant;

/// A source of the current time.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}
