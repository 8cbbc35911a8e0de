//! How a client request ended, and why P's part may end without the
//! prompt's KV though the client loses nothing.

use pdkv_connector::wire::FailCode;

/// How a client request ended, as counted in `pdkv_proxy_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The client's own bad request (refused by the proxy, P or D).
    BadRequest,
    NoBackend,
    PrefillError,
    DecodeError,
    /// The client went away first.
    Cancelled,
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::Ok,
        Outcome::BadRequest,
        Outcome::NoBackend,
        Outcome::PrefillError,
        Outcome::DecodeError,
        Outcome::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::BadRequest => "bad_request",
            Outcome::NoBackend => "no_backend",
            Outcome::PrefillError => "prefill_error",
            Outcome::DecodeError => "decode_error",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// The place of `self` in [`Outcome::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why P's part ended without the prompt's KV in a way that is not the
/// client's failure: D computes the prompt itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnPurpose {
    /// P refused the request: 503 `engine_not_serving` (paused, asleep).
    Refused,
    /// P aborted the request (`finish_reason: "abort"`).
    Aborted,
    /// P went away: its connection refused or broken (killed, crashed, cut
    /// off), not timed out. In write mode D's pull from it then fails and
    /// D's `kv_load_failure_policy` decides (`recompute`: D computes the
    /// prompt; `fail`: the request fails, as that policy asks).
    Lost,
}

impl OnPurpose {
    pub const ALL: [OnPurpose; 3] = [OnPurpose::Refused, OnPurpose::Aborted, OnPurpose::Lost];

    /// The code P is told when the transfer is dropped.
    pub fn code(self) -> FailCode {
        match self {
            OnPurpose::Refused => FailCode::PrefillRefused,
            OnPurpose::Aborted => FailCode::PrefillAborted,
            OnPurpose::Lost => FailCode::Dropped,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OnPurpose::Refused => "refused",
            OnPurpose::Aborted => "aborted",
            OnPurpose::Lost => "lost",
        }
    }
}
