//! The production driver: the engine core thread. It drains the bounded
//! command channel into the stepper, ticks it, and blocks on the channel
//! (with the timeout the stepper's next deadline allows) when there is
//! nothing to run, so an idle engine does not spin.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use super::command::Command;
use super::handle::Shared;
use super::stepper::EngineCore;
use crate::clock::Clock;

/// Commands waiting for the core, at most. A full channel makes
/// `add_request` wait for the core's next drain (one step).
pub(super) const COMMAND_CAPACITY: usize = 4096;

/// How long an idle core sleeps on the command channel before looking again.
const IDLE_WAIT: Duration = Duration::from_millis(200);

pub(super) struct Driver {
    core: EngineCore,
    rx: Receiver<Command>,
    shared: Arc<Shared>,
    clock: Arc<dyn Clock>,
}

/// Marks the engine stopped however the core thread ends (even by a panic),
/// so that callers get `Stopped` instead of a hang.
struct StoppedGuard(Arc<Shared>);

impl Drop for StoppedGuard {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        if let Ok(mut live) = self.0.live.lock() {
            live.clear();
        }
    }
}

impl Driver {
    pub fn new(
        core: EngineCore,
        rx: Receiver<Command>,
        shared: Arc<Shared>,
        clock: Arc<dyn Clock>,
    ) -> Driver {
        Driver {
            core,
            rx,
            shared,
            clock,
        }
    }

    /// The thread's body: runs until a shutdown command or until every
    /// sender is gone.
    pub fn run(mut self) {
        let _guard = StoppedGuard(self.shared.clone());
        tracing::debug!("engine core started");
        while self.drain_commands() {
            self.core.tick();
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.core.shutdown();
        // Commands queued behind the shutdown end too (the stopped core
        // refuses them).
        while let Ok(cmd) = self.rx.try_recv() {
            self.take(&cmd);
            self.core.apply(cmd);
        }
        tracing::debug!("engine core stopped");
    }

    /// Applies pending commands; waits for one when idle. False on shutdown.
    fn drain_commands(&mut self) -> bool {
        if !self.core.has_runnable_work() {
            let now = self.clock.now();
            let wait = self.core.next_deadline().map_or(IDLE_WAIT, |d| {
                d.saturating_duration_since(now).min(IDLE_WAIT)
            });
            match self.rx.recv_timeout(wait) {
                Ok(cmd) => {
                    if !self.apply(cmd) {
                        return false;
                    }
                }
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        // Bounded, so a flood of commands cannot starve the running requests.
        for _ in 0..COMMAND_CAPACITY {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    if !self.apply(cmd) {
                        return false;
                    }
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// Bookkeeping for a command taken from the channel.
    fn take(&self, cmd: &Command) {
        if let Command::Add(_) = cmd {
            self.shared.add_taken();
        }
    }

    /// Applies one command. False on shutdown.
    fn apply(&mut self, cmd: Command) -> bool {
        if let Command::Shutdown = cmd {
            return false;
        }
        self.take(&cmd);
        self.core.apply(cmd);
        true
    }
}
