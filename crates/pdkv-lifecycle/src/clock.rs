//! Times the phases of a case.

use std::time::Instant;

use crate::bounds::SLOW_PHASE_S;

pub(crate) struct PhaseClock {
    last: Instant,
    pub(crate) laps: Vec<(&'static str, f64)>,
}

impl PhaseClock {
    pub(crate) fn new() -> PhaseClock {
        PhaseClock {
            last: Instant::now(),
            laps: Vec::new(),
        }
    }

    pub(crate) fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.laps.push((name, (now - self.last).as_secs_f64()));
        self.last = now;
    }

    /// The phases slower than [`SLOW_PHASE_S`], for the case's notes.
    pub(crate) fn slow(&self) -> Vec<String> {
        self.laps
            .iter()
            .filter(|(_, s)| *s > SLOW_PHASE_S)
            .map(|(n, s)| format!("slow: {n} {s:.1}s"))
            .collect()
    }
}
