//! Moments a case needs, arranged on purpose rather than waited for: a
//! transfer P holds for a D that has not read it, and a D load held in
//! flight by a listener that never answers (see the crate docs).

use std::time::Instant;

use pdkv_deploy::TransferMode;
use serde_json::{json, Value};

use crate::bounds::{PROGRESS_DEADLINE, REQUEST_DEADLINE};
use crate::cases::Role;
use crate::context::Runner;
use crate::error::Problem;
use crate::fake::Unanswering;
use crate::prompts::PREFIXES;

impl Runner<'_> {
    /// Computes `prompt` at P for a D (`do_remote_decode`) as transfer
    /// `tid`; P's `kv_transfer_params` for D's request.
    async fn prefill_for_a_d(&self, tid: &str, prompt: &str) -> Result<Value, Problem> {
        let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": false,
                          "kv_transfer_params": pdkv_connector::params::for_prefill(tid)});
        let out = self
            .c
            .completion(Role::P, body, &format!("{tid}-p"))
            .await?;
        out.get("kv_transfer_params")
            .filter(|v| v.is_object())
            .cloned()
            .ok_or_else(|| {
                Problem::Unexpected(format!("P returned no kv_transfer_params for {tid}: {out}"))
            })
    }

    /// A prompt computed at P for a D (`do_remote_decode`) that no D has
    /// read yet: P holds its blocks READY until a D loads them or its lease
    /// ends. Returns the prompt, P's `kv_transfer_params` and the id for D's
    /// request.
    pub(crate) async fn hold_a_send_at_p(
        &self,
        tag: &str,
    ) -> Result<(String, Value, String), Problem> {
        let tid = format!("lc-held-{tag}");
        let prompt = format!("{} A transfer P sleeps under: {tid}.", PREFIXES[1]);
        let params = self.prefill_for_a_d(&tid, &prompt).await?;
        Ok((prompt, params, format!("{tid}-d")))
    }

    /// The two resets while `role` holds a transfer's blocks: refused
    /// without `reset_running_requests`, done with it.
    async fn resets_while_held(&self, role: Role, when: &str) -> Result<(), Problem> {
        self.c.expect_reset(role, false, false, when).await?;
        self.c.expect_reset(role, true, true, when).await
    }

    /// `reset_prefix_cache_p` under load: P computes a prompt for a D
    /// (`do_remote_decode`) and holds its blocks READY, as no D pulled them
    /// yet; the reset refuses without `reset_running_requests` and succeeds
    /// with it. Then D loads them (the reset did not cut the transfer).
    pub(crate) async fn reset_while_p_holds_a_send(&self, tag: &str) -> Result<String, Problem> {
        let c = &self.c;
        let tid = format!("lc-hold-{tag}");
        let prompt = format!("{} A transfer held on purpose: {tid}.", PREFIXES[1]);
        let params = self.prefill_for_a_d(&tid, &prompt).await?;
        let held = c.gauge(Role::P, "pdkv_kv_send_held_blocks").await;
        let reset = self
            .resets_while_held(Role::P, "while a transfer holds blocks")
            .await;
        // Released whatever the reset said.
        let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": true, "stream": false,
                          "kv_transfer_params": params});
        let loaded = c.completion(Role::D, body, &format!("{tid}-d")).await;
        let held = held?;
        if held < 1.0 {
            return Err(Problem::Unexpected(format!(
                "P held no blocks for {tid} ({held})"
            )));
        }
        reset?;
        match loaded?["choices"][0]["finish_reason"].as_str() {
            Some("length") => Ok(format!(
                "under load: false, and true with reset_running_requests, while P held {held} blocks for a transfer, which D then loaded"
            )),
            other => Err(Problem::Unexpected(format!(
                "D's load of the held transfer {tid} finished with {other:?}"
            ))),
        }
    }

    /// `reset_prefix_cache_d` under load: a D request whose first control
    /// exchange goes to a listener that never answers is a load in flight
    /// holding its blocks; the reset refuses without
    /// `reset_running_requests` and succeeds with it. Then the request is
    /// aborted (which ends the load).
    pub(crate) async fn reset_while_d_holds_a_load(&self, tag: &str) -> Result<String, Problem> {
        let c = &self.c;
        let mut fake = Unanswering::bind()
            .await
            .map_err(|e| Problem::Unexpected(format!("binding an unanswering listener: {e}")))?;
        let tid = format!("lc-hold-{tag}");
        let mut params = pdkv_connector::params::for_decode(
            &tid,
            Some("lc-unanswering"),
            Some(&fake.addr.to_string()),
        );
        if let TransferMode::Read = self.o.transfer_mode {
            // Never checked: the handshake that would is never answered.
            params[pdkv_connector::params::REMOTE_BLOCK_IDS] = json!([0]);
            params[pdkv_connector::params::REMOTE_REGISTRATION_GENERATION] = json!(1);
        }
        let prompt = format!("{} A load held on purpose: {tid}.", PREFIXES[2]);
        let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": false,
                          "kv_transfer_params": params});
        let id = format!("{tid}-d");
        let request = {
            let (c, id) = (c.clone(), id.clone());
            tokio::spawn(async move { c.completion(Role::D, body, &id).await })
        };
        let reached = fake.wait_accepted(Instant::now() + PROGRESS_DEADLINE).await;
        let reset = self
            .resets_while_held(Role::D, "while a load holds blocks")
            .await;
        let aborted = c
            .admin(
                Role::D,
                true,
                "/abort_requests",
                Some(json!({"request_ids": [id]})),
            )
            .await;
        let out = tokio::time::timeout(REQUEST_DEADLINE, request).await;
        if !reached {
            return Err(Problem::Unexpected(
                "D's held load never reached the unanswering listener".into(),
            ));
        }
        reset?;
        if aborted?["aborted"] != json!([id]) {
            return Err(Problem::Unexpected(format!(
                "D did not abort the held request {id}"
            )));
        }
        match out {
            Ok(Ok(Ok(v))) if v["choices"][0]["finish_reason"] == json!("abort") => Ok(
                "under load: false, and true with reset_running_requests, while a load was in flight, whose request was then aborted"
                    .into(),
            ),
            Ok(Ok(r)) => Err(Problem::Unexpected(format!(
                "the held request {id} ended with {r:?}, not aborted"
            ))),
            Ok(Err(e)) => Err(Problem::Unexpected(format!("the held request's task: {e}"))),
            Err(_) => Err(Problem::Unexpected(format!(
                "the held request {id} did not end after its abort"
            ))),
        }
    }
}
