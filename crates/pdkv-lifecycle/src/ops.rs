//! A case's lifecycle operations, one function per operation, run while
//! the load runs; each records what it observed in an [`OpReport`].

use std::time::Instant;

use pdkv_deploy::TransferMode;
use serde_json::json;

use crate::bounds::{POLL, PROGRESS_DEADLINE};
use crate::cases::{Case, Op, Role, Target};
use crate::context::{OpReport, Runner};
use crate::load::Load;

impl Runner<'_> {
    /// Runs the case's lifecycle operations (the load is running).
    pub(crate) async fn operate(&self, case: &Case, cycle: usize, load: &Load) -> OpReport {
        let mut rep = OpReport::default();
        let t = case.target;
        let fresh = format!("lc-{}-{cycle}", case.name);
        match case.op {
            Op::Pause { mode, clear } => self.pause(&mut rep, t, mode, clear).await,
            Op::Sleep { level } => self.sleep(&mut rep, t, level, &fresh).await,
            Op::SelectiveWake { weights_first } => {
                self.selective_wake(&mut rep, t, weights_first).await
            }
            Op::AbortRequests => self.abort_requests(&mut rep, load).await,
            Op::ResetPrefixCache => {
                let tag = format!("{}-{}-{cycle}", self.run_id, case.name);
                self.reset_prefix_cache(&mut rep, t, &tag).await
            }
            Op::ReleaseKv => self.release_kv(&mut rep, t).await,
            Op::WeightReload => self.weight_reload(&mut rep, t, &fresh).await,
            Op::PSleepsWhileDPulls => {
                let tag = format!("{}-{cycle}", case.name);
                self.p_sleeps_while_d_pulls(&mut rep, &tag).await
            }
            Op::TrainerSequence => self.trainer_sequence(&mut rep, t).await,
        }
        rep
    }

    /// `/pause?mode=..&clear_cache=..`, checked, hold, `/resume`.
    async fn pause(&self, rep: &mut OpReport, t: Target, mode: &str, clear: bool) {
        let c = &self.c;
        let timeout = self.o.op_timeout;
        rep.check(
            c.on_all(
                t,
                true,
                &format!("/pause?mode={mode}&clear_cache={clear}&timeout={timeout}"),
                None,
            )
            .await,
        );
        for role in [Role::P, Role::D] {
            if t.has(role) {
                match c.admin(role, false, "/is_paused", None).await {
                    Ok(v) if v["is_paused"] == json!(true) => {}
                    Ok(v) => rep.fail(format!("{} after /pause: {v}", role.name())),
                    Err(e) => rep.fail(e),
                }
            }
        }
        tokio::time::sleep(self.hold()).await;
        rep.check(c.on_all(t, true, "/resume", None).await);
    }

    /// `/sleep?level=..&mode=keep`, hold, `/wake_up`; level 2 inside an
    /// explicit keep pause, with a weight reload (version `fresh`) before
    /// `/resume`.
    async fn sleep(&self, rep: &mut OpReport, t: Target, level: u32, fresh: &str) {
        let c = &self.c;
        let timeout = self.o.op_timeout;
        if level == 2 {
            rep.check(c.on_all(t, true, &self.keep_pause(), None).await);
        }
        rep.check(
            c.on_all(
                t,
                true,
                &format!("/sleep?level={level}&mode=keep&timeout={timeout}"),
                None,
            )
            .await,
        );
        self.record_asleep(rep, t).await;
        tokio::time::sleep(self.hold()).await;
        rep.check(c.on_all(t, true, "/wake_up", None).await);
        if level == 2 {
            rep.check(self.reload(t, fresh).await);
            rep.check(c.on_all(t, true, "/resume", None).await);
        }
    }

    /// Level-1 sleep of D, then `/wake_up` for one tag and the other.
    async fn selective_wake(&self, rep: &mut OpReport, t: Target, weights_first: bool) {
        let c = &self.c;
        let timeout = self.o.op_timeout;
        rep.check(
            c.on_all(
                t,
                true,
                &format!("/sleep?level=1&mode=keep&timeout={timeout}"),
                None,
            )
            .await,
        );
        self.record_asleep(rep, t).await;
        tokio::time::sleep(self.hold()).await;
        let (first, second) = if weights_first {
            ("weights", "kv_cache")
        } else {
            ("kv_cache", "weights")
        };
        match c
            .admin(Role::D, true, &format!("/wake_up?tags={first}"), None)
            .await
        {
            Ok(v) if v["is_sleeping"] == json!(true) && v["asleep_tags"] == json!([second]) => {}
            Ok(v) => rep.fail(format!(
                "D after waking {first}: {v} (expected {second} still asleep)"
            )),
            Err(e) => rep.fail(e),
        }
        match c
            .admin(Role::D, true, &format!("/wake_up?tags={second}"), None)
            .await
        {
            Ok(v) if v["is_sleeping"] == json!(false) => {}
            Ok(v) => rep.fail(format!("D after waking {second}: {v} (expected awake)")),
            Err(e) => rep.fail(e),
        }
    }

    /// `/abort_requests` on D with ids of load requests in flight; retried
    /// until D had some live.
    async fn abort_requests(&self, rep: &mut OpReport, load: &Load) {
        let deadline = Instant::now() + PROGRESS_DEADLINE;
        loop {
            let ids = load.inflight_ids();
            if !ids.is_empty() {
                let body = json!({"request_ids": ids});
                match self
                    .c
                    .admin(Role::D, true, "/abort_requests", Some(body))
                    .await
                {
                    Ok(v) => {
                        let aborted: Vec<String> = v["aborted"]
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(|x| x.as_str().map(str::to_string))
                                    .collect()
                            })
                            .unwrap_or_default();
                        if !aborted.is_empty() {
                            rep.notes.push(format!(
                                "aborted {} of {} ids",
                                aborted.len(),
                                ids.len()
                            ));
                            rep.aborted_ids.extend(aborted);
                            return;
                        }
                    }
                    Err(e) => return rep.fail(e),
                }
            }
            if Instant::now() >= deadline {
                return rep.fail("D never had a live load request to abort");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `/reset_prefix_cache` under load, refused while a transfer holds
    /// blocks (held on purpose: a send at P, or a load at D).
    async fn reset_prefix_cache(&self, rep: &mut OpReport, t: Target, tag: &str) {
        let r = match t {
            Target::P => self.reset_while_p_holds_a_send(tag).await,
            _ => self.reset_while_d_holds_a_load(tag).await,
        };
        match r {
            Ok(note) => rep.notes.push(note),
            Err(e) => rep.fail(e),
        }
    }

    /// Pause (keep), `/release_kv_cache_memory`, hold, `/resume`.
    async fn release_kv(&self, rep: &mut OpReport, t: Target) {
        let c = &self.c;
        rep.check(c.on_all(t, true, &self.keep_pause(), None).await);
        rep.check(c.on_all(t, true, "/release_kv_cache_memory", None).await);
        self.record_asleep(rep, t).await;
        tokio::time::sleep(self.hold()).await;
        rep.check(c.on_all(t, true, "/resume", None).await);
    }

    /// Pause (keep), `/update_weights` with the same checkpoint, `/resume`.
    async fn weight_reload(&self, rep: &mut OpReport, t: Target, fresh: &str) {
        let c = &self.c;
        rep.check(c.on_all(t, true, &self.keep_pause(), None).await);
        rep.check(self.reload(t, fresh).await);
        rep.check(c.on_all(t, true, "/resume", None).await);
    }

    /// Level-1 sleep (keep) of P while a transfer waits at P, then wake.
    async fn p_sleeps_while_d_pulls(&self, rep: &mut OpReport, tag: &str) {
        let c = &self.c;
        let timeout = self.o.op_timeout;
        // Hold the transfers at P: write mode pauses P (D's pulls park
        // there), read mode pauses D (the blocks P leased stay held).
        let (paused, gauge) = match self.o.transfer_mode {
            TransferMode::Write => (Target::P, "pdkv_kv_pulls_pending"),
            TransferMode::Read => (Target::D, "pdkv_kv_send_held_blocks"),
        };
        rep.check(c.on_all(paused, true, &self.keep_pause(), None).await);
        // Read mode: a transfer caught between P and D when D paused is
        // luck (the proxy starts none while D is paused), so one is made on
        // purpose: a prompt computed at P for a D that has not read it. D
        // asks for it after the wake (P's sleep ended it, so D computes the
        // prompt itself).
        let held = match self.o.transfer_mode {
            TransferMode::Read => match self.hold_a_send_at_p(tag).await {
                Ok(h) => Some(h),
                Err(e) => {
                    rep.fail(e);
                    None
                }
            },
            TransferMode::Write => None,
        };
        match c
            .wait_gauge(Role::P, gauge, 1.0, Instant::now() + PROGRESS_DEADLINE)
            .await
        {
            Ok(n) => rep.notes.push(format!("P slept with {gauge} {n}")),
            Err(e) => rep.fail(format!("no transfer waited at P to sleep it under: {e}")),
        }
        rep.check(
            c.on_all(
                Target::P,
                true,
                &format!("/sleep?level=1&mode=keep&timeout={timeout}"),
                None,
            )
            .await,
        );
        // Release, then reset: the sleep ended every transfer first.
        match c.gauge(Role::P, "pdkv_kv_send_held_blocks").await {
            Ok(0.0) => {}
            Ok(v) => rep.fail(format!("P holds {v} blocks for transfers while asleep")),
            Err(e) => rep.fail(e),
        }
        self.record_asleep(rep, Target::P).await;
        tokio::time::sleep(self.hold()).await;
        rep.check(c.on_all(Target::P, true, "/wake_up", None).await);
        rep.check(c.on_all(paused, true, "/resume", None).await);
        if let Some((prompt, params, id)) = held {
            let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0,
                              "ignore_eos": true, "stream": false,
                              "kv_transfer_params": params});
            match c.completion(Role::D, body, &id).await {
                Ok(v) if v["choices"][0]["finish_reason"] == "length" => {}
                Ok(v) => rep.fail(format!("D's request for the transfer P's sleep ended: {v}")),
                Err(e) => rep.fail(e),
            }
        }
    }

    /// The RL trainer's calls: `/pause?mode=keep`, `/sleep?level=1` (no
    /// mode), `/wake_up` (checked: awake and still paused), `/resume`.
    async fn trainer_sequence(&self, rep: &mut OpReport, t: Target) {
        let c = &self.c;
        let timeout = self.o.op_timeout;
        rep.check(c.on_all(t, true, &self.keep_pause(), None).await);
        // No mode: the sleep keeps the pause's (keep), aborting nothing.
        rep.check(
            c.on_all(t, true, &format!("/sleep?level=1&timeout={timeout}"), None)
                .await,
        );
        self.record_asleep(rep, t).await;
        tokio::time::sleep(self.hold()).await;
        rep.check(c.on_all(t, true, "/wake_up", None).await);
        for role in [Role::P, Role::D] {
            if !t.has(role) {
                continue;
            }
            let paused = c.admin(role, false, "/is_paused", None).await;
            let sleeping = c.admin(role, false, "/is_sleeping", None).await;
            match (paused, sleeping) {
                (Ok(p), Ok(s))
                    if p["is_paused"] == json!(true) && s["is_sleeping"] == json!(false) => {}
                (Ok(p), Ok(s)) => rep.fail(format!(
                    "{} after /wake_up: {p} {s} (expected awake and still paused until /resume)",
                    role.name()
                )),
                (Err(e), _) | (_, Err(e)) => rep.fail(e),
            }
        }
        rep.check(c.on_all(t, true, "/resume", None).await);
    }
}
