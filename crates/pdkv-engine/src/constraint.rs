//! Constrained decoding's seam: a request may carry a [`Grammar`] (a JSON
//! schema, a regular expression, a grammar, compiled elsewhere); the core
//! starts a [`TokenConstraint`] from it when the request is admitted and,
//! at every output token, lets it forbid the tokens the grammar does not
//! allow next (their logits become `-inf`) before the log-probabilities are
//! taken and the token is sampled, then advances it past the token sampled.
//!
//! The constraint's state lives with the request in the core: a pause that
//! keeps requests, a sleep and a preemption keep it; tokens produced
//! elsewhere (`resume_token_ids`) are committed when the request arrives.
//! Computing the next mask may take a millisecond or more, so the core asks
//! for it ([`TokenConstraint::prepare`]) on another thread while the step's
//! forward pass runs, and [`TokenConstraint::apply`] finds it ready.

use std::fmt;
use std::sync::Arc;

/// How the error of a request whose constraint failed begins
/// ([`crate::RequestOutput::error`]).
pub const FAILED: &str = "structured output constraint failed";

/// A constraint that cannot go on (the grammar matcher failed, a token it
/// forbade was committed, a mask took more than its budget).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// A compiled constraint, shared by every request (and every choice of a
/// request with `n > 1`) that asks for it.
pub trait Grammar: Send + Sync + fmt::Debug {
    /// A matcher at the start of an output.
    fn start(&self) -> Box<dyn TokenConstraint>;
}

/// One output's position in a [`Grammar`].
pub trait TokenConstraint: Send {
    /// Computes which tokens may come next unless known already. Called
    /// from another thread while the forward pass runs; a failure is kept
    /// and returned by the next [`TokenConstraint::apply`].
    fn prepare(&mut self);

    /// Sets the logit of every token that may not come next to `-inf`
    /// (preparing first if needed). `logits` is one row of the model's
    /// vocabulary.
    fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError>;

    /// Advances past `token` (one that [`TokenConstraint::apply`] left).
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;
}

/// A request's grammar. Two are equal when they are the same compiled
/// object.
#[derive(Clone)]
pub struct GrammarRef(pub Arc<dyn Grammar>);

impl GrammarRef {
    pub fn new(grammar: Arc<dyn Grammar>) -> GrammarRef {
        GrammarRef(grammar)
    }

    pub fn start(&self) -> Box<dyn TokenConstraint> {
        self.0.start()
    }
}

impl PartialEq for GrammarRef {
    fn eq(&self, other: &GrammarRef) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for GrammarRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Constrained decoding's counters, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StructuredStats {
    /// Masks computed (one per constrained output token, drafts included).
    pub num_masks: u64,
    /// Seconds spent computing them, wherever they ran.
    pub mask_seconds: f64,
    /// Seconds steps waited for masks after their forward pass (the cost
    /// on the critical path).
    pub mask_wait_seconds: f64,
    /// Steps that computed at least one mask.
    pub num_steps: u64,
    /// Constrained requests in the core now.
    pub num_running: usize,
}
