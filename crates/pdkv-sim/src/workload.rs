//! The clients' load: requests arriving in bursts over the safety phase,
//! with prompts cut from a few shared documents (so prefixes hit the
//! cache) or of their own, some of whose clients leave early; and the
//! probes sent once the healed cluster is quiescent, each of which D must
//! load from P.

use std::time::Duration;

use crate::ctx::{Ctx, Ev};
use crate::proxy::{Proxy, Through};

/// Requests sent once the healed cluster is quiescent, each to be served
/// with KV loaded from P.
pub const PROBES: usize = 3;

pub struct Workload {
    /// Token sequences prompts are cut from.
    documents: Vec<Vec<u32>>,
    /// The probes sent once the healed cluster was quiescent, and the
    /// decode engines' successful loads before them.
    pub probes: Vec<u64>,
    pub loads_ok_before_probes: u64,
}

impl Workload {
    /// Draws the documents (the run's first draws).
    pub fn new(ctx: &mut Ctx) -> Workload {
        let documents = (0..4)
            .map(|_| (0..400).map(|_| 1 + ctx.rng.below(511) as u32).collect())
            .collect();
        Workload {
            documents,
            probes: Vec::new(),
            loads_ok_before_probes: 0,
        }
    }

    /// A client request's prompt and `max_tokens`: mostly short, now and
    /// then long, half of them with a first block of their own.
    fn draw_request(&self, ctx: &mut Ctx) -> (Vec<u32>, usize) {
        let doc = ctx.rng.below(self.documents.len() as u64) as usize;
        let len = if ctx.rng.chance(0.1) {
            ctx.rng.range(100, 380)
        } else {
            ctx.rng.range(1, 90)
        } as usize;
        let mut prompt = self.documents[doc][..len].to_vec();
        if ctx.rng.chance(0.5) {
            // A prompt of its own from the first block on (no prefix hit).
            for t in prompt.iter_mut().take(len.min(16)) {
                *t = 1 + ctx.rng.below(511) as u32;
            }
        }
        let max_tokens = ctx.rng.range(1, 8) as usize;
        (prompt, max_tokens)
    }

    /// A client arrives (in the safety phase, up to the run's number), and
    /// the next one is scheduled.
    pub fn client_arrives(&mut self, proxy: &mut Proxy, w: &mut Through) {
        if w.ctx.healed || w.ctx.report.clients >= w.ctx.opts.clients {
            return;
        }
        let (prompt, max_tokens) = self.draw_request(w.ctx);
        let client = proxy.new_client(w, prompt, max_tokens);
        let ctx = &mut *w.ctx;
        if ctx.rng.chance(0.08) {
            let t = Duration::from_millis(ctx.rng.range(0, 400));
            ctx.at(t, Ev::ClientLeaves { client });
        }
        // Bursts of arrivals, spread over the safety phase.
        let gap = ctx.opts.safety.as_millis() as u64 * 2 / ctx.opts.clients.max(1);
        let next = if ctx.rng.chance(0.7) {
            ctx.rng.range(0, 3)
        } else {
            ctx.rng.range(1, gap.max(2))
        };
        ctx.at(Duration::from_millis(next), Ev::ClientArrives);
    }

    /// The healed, quiescent cluster must serve through P again: a few
    /// requests of prompts of their own (no prefix hit anywhere), each of
    /// which D must load from P (the final checks check it).
    pub fn send_probes(&mut self, proxy: &mut Proxy, w: &mut Through) {
        self.loads_ok_before_probes = w.cluster.live_loads_ok();
        for _ in 0..PROBES {
            let len = w.ctx.rng.range(2 * 16 + 1, 120) as usize;
            let prompt: Vec<u32> = (0..len).map(|_| 1 + w.ctx.rng.below(511) as u32).collect();
            let client = proxy.new_client(w, prompt, 2);
            self.probes.push(client);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Cluster;
    use crate::net::Net;
    use crate::Options;

    fn requests(seed: u64, n: usize) -> Vec<(Vec<u32>, usize)> {
        let mut ctx = Ctx::new(Options::for_seed(seed));
        let w = Workload::new(&mut ctx);
        (0..n).map(|_| w.draw_request(&mut ctx)).collect()
    }

    /// Arrivals of a seed's run in write mode: (time in ms, event), the
    /// clients' calls included, until `until_ms`.
    fn arrivals(seed: u64, clients: u64, until_ms: u64) -> (u64, Vec<(u128, String)>) {
        let mut opts = Options::for_seed(seed);
        (opts.clients, opts.read_mode) = (clients, false);
        let mut ctx = Ctx::new(opts);
        let mut wl = Workload::new(&mut ctx);
        let mut cluster = Cluster::new(&mut ctx).expect("built");
        let (mut net, mut proxy) = (Net::new(false), Proxy::default());
        while ctx.pop().is_some() {}
        ctx.at(Duration::from_millis(1), Ev::ClientArrives);
        let mut seen = Vec::new();
        while let Some(t) = ctx.pop() {
            if t.at - ctx.t0 > Duration::from_millis(until_ms) {
                break;
            }
            ctx.clock.set(t.at);
            seen.push(((t.at - ctx.t0).as_millis(), format!("{:?}", t.ev)));
            if let Ev::ClientArrives = t.ev {
                let mut w = Through {
                    ctx: &mut ctx,
                    net: &mut net,
                    cluster: &mut cluster,
                };
                wl.client_arrives(&mut proxy, &mut w);
            }
        }
        (ctx.report.clients, seen)
    }

    #[test]
    fn requests_are_the_seeds_and_cut_from_the_documents() {
        let r = requests(11, 300);
        assert_eq!(r, requests(11, 300));
        assert_ne!(r, requests(12, 300));
        assert!(r
            .iter()
            .all(|(p, m)| (1..=380).contains(&p.len()) && (1..=8).contains(m)));
        assert!(r.iter().any(|(p, _)| p.len() >= 100));
        assert!(r
            .iter()
            .all(|(p, _)| p.iter().all(|&t| (1..512).contains(&t))));
    }

    #[test]
    fn arrivals_replay_for_a_seed_and_stop_at_the_runs_number() {
        let (n, seen) = arrivals(2, 25, 60_000);
        assert_eq!(n, 25);
        assert_eq!((n, seen.clone()), arrivals(2, 25, 60_000));
        let calls = seen.iter().filter(|(_, e)| e.starts_with("Call")).count();
        assert_eq!(
            calls, 50,
            "in write mode, a call to P and one to D per client"
        );
        let (more, _) = arrivals(2, 1000, 200);
        assert!(more > 1 && more < 1000, "{more} clients in 200 ms");
    }

    #[test]
    fn no_client_arrives_once_healed() {
        let mut ctx = Ctx::new(Options::for_seed(2));
        let mut wl = Workload::new(&mut ctx);
        let mut cluster = Cluster::new(&mut ctx).expect("built");
        let (mut net, mut proxy) = (Net::new(false), Proxy::default());
        while ctx.pop().is_some() {}
        ctx.healed = true;
        let mut w = Through {
            ctx: &mut ctx,
            net: &mut net,
            cluster: &mut cluster,
        };
        wl.client_arrives(&mut proxy, &mut w);
        assert_eq!(ctx.report.clients, 0);
        assert!(ctx.pop().is_none());
    }
}
