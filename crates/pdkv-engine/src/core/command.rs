//! What callers ask of the engine core: one [`Command`] per request, abort or
//! lifecycle operation, answered through the closures it carries (so the
//! stepper needs no channels; the production handle wraps its own).

use std::sync::Arc;
use std::time::Instant;

use pdkv_vmem::Tag;

use crate::lifecycle::{LifecycleError, PauseMode, SleepLevel};
use crate::{EngineRequest, FinishReason, RequestOutput};

/// Receives a request's outputs, in order; the last one carries a finish
/// reason. Returns whether the receiver is still there (false: the request is
/// aborted at once, as when a client disconnects).
pub type OutputSink = Box<dyn FnMut(RequestOutput) -> bool + Send>;

/// Receives the answer to a command, once.
pub type Reply<T> = Box<dyn FnOnce(T) + Send>;

/// The answer to a lifecycle command.
pub type LifecycleReply = Reply<Result<(), LifecycleError>>;

/// A request for the core, with where its outputs go. Through
/// [`Command::Add`] the sender has checked it
/// ([`crate::EngineCore::check_request`]; the handle does);
/// [`crate::EngineCore::add`] checks it itself.
pub struct AddRequest {
    /// The caller's tag for this incarnation of the request id:
    /// [`Command::Abort`] with `serial: Some(s)` aborts only the incarnation
    /// tagged `s` (a dropped stream must not abort a newer request that
    /// reuses its id). Callers that never abort by serial may pass 0.
    pub serial: u64,
    pub req: EngineRequest,
    /// The sampling seed (`SamplingParams::seed`, or one the caller drew).
    pub seed: u64,
    pub output: OutputSink,
}

/// One thing for the core to do. Applied by [`crate::EngineCore::apply`]
/// between steps, in the order given.
pub enum Command {
    Add(Box<AddRequest>),
    /// `serial` set: only that incarnation of the id (a dropped stream).
    Abort {
        id: Arc<str>,
        serial: Option<u64>,
    },
    ResetPrefixCache {
        reset_running: bool,
        /// The connector's cache too (vLLM's `reset_external`).
        reset_external: bool,
        reply: Reply<bool>,
    },
    Pause {
        mode: PauseMode,
        clear_cache: bool,
        /// When a `wait` pause gives up (on the core's clock).
        deadline: Instant,
        reply: LifecycleReply,
    },
    Resume(LifecycleReply),
    Sleep {
        level: SleepLevel,
        mode: PauseMode,
        /// When a `wait` sleep gives up (on the core's clock).
        deadline: Instant,
        reply: LifecycleReply,
    },
    Wake {
        tags: Option<Vec<Tag>>,
        reply: LifecycleReply,
    },
    ReleaseKv(LifecycleReply),
    AbortRequests {
        ids: Vec<String>,
        reply: Reply<Vec<String>>,
    },
    UpdateWeights {
        source: crate::model::WeightSource,
        version: Option<String>,
        reply: LifecycleReply,
    },
    /// The KV connector has news (a finished transfer); nothing else.
    Nudge,
    Shutdown,
}

impl Command {
    /// Whether the command refuses new requests once applied (a weight
    /// update does while it waits for transfers and while it loads). The
    /// handle counts such a command as closing admission from the moment it
    /// sends it until the core published its refusal (see
    /// [`crate::LifecycleUpdate::closed_admission`]).
    pub fn closes_admission(&self) -> bool {
        self.closing_refusal().is_some()
    }

    /// What a request refused while this admission-closing command is in
    /// flight is told; `None` for a command that does not close admission.
    pub fn closing_refusal(&self) -> Option<&'static str> {
        match self {
            Command::Pause {
                mode: PauseMode::Abort | PauseMode::Wait,
                ..
            } => Some("the engine is pausing; retry after /resume"),
            Command::Sleep { .. } => Some("the engine is going to sleep; retry after /wake_up"),
            Command::UpdateWeights { .. } => {
                Some("the engine is updating its weights; retry in a moment")
            }
            _ => None,
        }
    }

    /// Whether applying the command may change the lifecycle state (it is
    /// published afterwards).
    pub(crate) fn is_lifecycle(&self) -> bool {
        !matches!(
            self,
            Command::Add(_) | Command::Abort { .. } | Command::Nudge | Command::Shutdown
        )
    }

    /// Answers a command that will never be applied: requests end with
    /// `Abort`, lifecycle operations with `Stopped`, queries with nothing.
    pub(crate) fn refuse_stopped(self) {
        match self {
            Command::Add(add) => {
                let AddRequest {
                    req, mut output, ..
                } = *add;
                output(abort_output(&req));
            }
            Command::ResetPrefixCache { reply, .. } => reply(false),
            Command::AbortRequests { reply, .. } => reply(Vec::new()),
            Command::Pause { reply, .. }
            | Command::Resume(reply)
            | Command::Sleep { reply, .. }
            | Command::Wake { reply, .. }
            | Command::ReleaseKv(reply)
            | Command::UpdateWeights { reply, .. } => reply(Err(LifecycleError::Stopped)),
            Command::Abort { .. } | Command::Nudge | Command::Shutdown => {}
        }
    }
}

/// The final output of a request that ends before it produced anything.
pub(crate) fn abort_output(req: &EngineRequest) -> RequestOutput {
    RequestOutput {
        finish_reason: Some(FinishReason::Abort),
        ..RequestOutput::empty(req.id.clone(), req.prompt_tokens.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lifecycle_reply() -> LifecycleReply {
        Box::new(|_| {})
    }

    /// Every command after which the core may refuse requests closes the
    /// handle's gate from the moment it is sent; a request let through in
    /// between would reach a refusing core and end as an abort instead of a
    /// 503 the client retries. A weight update waiting for transfers is
    /// such a command (it once was not: a load request racing a reload on D
    /// came back aborted).
    #[test]
    fn the_commands_that_make_the_core_refuse_requests_close_admission_when_sent() {
        let deadline = Instant::now();
        let pause = |mode| Command::Pause {
            mode,
            clear_cache: false,
            deadline,
            reply: lifecycle_reply(),
        };
        let closing = [
            pause(PauseMode::Abort),
            pause(PauseMode::Wait),
            Command::Sleep {
                level: SleepLevel::L1,
                mode: PauseMode::Abort,
                deadline,
                reply: lifecycle_reply(),
            },
            Command::UpdateWeights {
                source: crate::model::WeightSource::Checkpoint("/nowhere".into()),
                version: None,
                reply: lifecycle_reply(),
            },
        ];
        for cmd in &closing {
            let reason = cmd.closing_refusal().expect("closes admission");
            assert!(reason.contains("retry"), "{reason}");
        }
        assert!(closing[3]
            .closing_refusal()
            .unwrap()
            .contains("updating its weights"));
        let open = [
            pause(PauseMode::Keep),
            Command::Resume(lifecycle_reply()),
            Command::Wake {
                tags: None,
                reply: lifecycle_reply(),
            },
            Command::ReleaseKv(lifecycle_reply()),
            Command::Nudge,
        ];
        for cmd in &open {
            assert!(!cmd.closes_admission());
        }
    }
}
