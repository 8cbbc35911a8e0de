//! One output's place in its grammar, as the engine's
//! [`TokenConstraint`]: the next mask is computed once per position (ahead
//! of time when the core asks), applied to each row of that position, and
//! dropped when a token is committed.

use std::sync::Arc;

use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use pdkv_engine::{ConstraintError, TokenConstraint};

pub(crate) struct Guided {
    matcher: Matcher,
    /// The mask of the next token, once computed.
    next: Option<Result<SimpleVob, ConstraintError>>,
    /// The grammar's end-of-output token.
    eos: u32,
    /// Every token that ends the output: allowed when `eos` is.
    stops: Arc<[u32]>,
}

impl Guided {
    pub(crate) fn new(matcher: Matcher, eos: u32, stops: Arc<[u32]>) -> Guided {
        Guided {
            matcher,
            next: None,
            eos,
            stops,
        }
    }
}

impl TokenConstraint for Guided {
    fn prepare(&mut self) {
        if self.next.is_none() {
            let mask = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| ConstraintError(format!("computing the allowed tokens: {e}")));
            self.next = Some(mask);
        }
    }

    fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        self.prepare();
        let mask = match self.next.as_ref().expect("prepared") {
            Ok(m) => m,
            Err(e) => return Err(e.clone()),
        };
        if mask.is_zero() {
            return Err(ConstraintError(
                "the grammar allows no token here (no token spells what it needs)".to_string(),
            ));
        }
        // The grammar knows one end token; the model may have several,
        // and each ends the output where the grammar's end may.
        let ends: Vec<(usize, f32)> = if mask.is_allowed(self.eos) {
            self.stops
                .iter()
                .filter_map(|&s| logits.get(s as usize).map(|&l| (s as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for (s, l) in ends {
            logits[s] = l;
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.next = None;
        if self.stops.contains(&token) {
            // The output ends here (the mask let it: the grammar was
            // complete); the grammar itself may have stopped already.
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(format!("token {token} does not follow the grammar: {e}")))
    }
}
