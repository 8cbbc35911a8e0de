//! KV reads and writes between the engines, as the connectors ask for
//! them: P writes its blocks into D's (one frame per rank copy), or D
//! reads P's leased blocks into its own (one request per rank copy), and D
//! fences a load's grants. Every byte lands through the real registries'
//! checks, and what lands must lie in a block of a load that D still
//! writes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use pdkv_connector::pd::core::{ConnId, ReadIo, WriteIo};
use pdkv_connector::ranks::Copy as KvCopy;
use pdkv_connector::recv::LoadId;
use pdkv_connector::wire::{write_failure, Destination, FailCode, Failure, Pull};
use pdkv_transfer::Registration;

use crate::cluster::Cluster;
use crate::ctx::{Ctx, Ev, Ix};
use crate::net::Net;

struct Write {
    from: Ix,
    from_inc: u64,
    conn: ConnId,
    to: Ix,
    to_inc: u64,
    dst: Pull,
    /// Bytes of every copy together.
    bytes: u64,
    parts: usize,
    acked: BTreeSet<usize>,
    done: bool,
}

struct Read {
    node: Ix,
    inc: u64,
    load: LoadId,
    from: Ix,
    /// D's ranks' registrations, and P's.
    local: Vec<Registration>,
    remote: Vec<Registration>,
    parts: usize,
    got: BTreeSet<usize>,
    done: bool,
}

/// The writes and reads in flight (and ended: late frames find them).
#[derive(Default)]
pub struct Transfers {
    writes: BTreeMap<u64, Write>,
    reads: BTreeMap<u64, Read>,
}

impl Transfers {
    /// P writes its blocks into D's: one frame per copy, each read now
    /// from P's rank registration and addressed to one of D's ranks.
    /// Returns the node touched.
    #[allow(clippy::too_many_arguments)]
    pub fn start_write(
        &mut self,
        ctx: &mut Ctx,
        net: &mut Net,
        cluster: &Cluster,
        ix: Ix,
        io: WriteIo,
    ) -> Option<Ix> {
        let WriteIo {
            conn,
            local,
            copies,
            dst,
            deadline,
        } = io;
        let inc = cluster.inc(ix);
        let to = match &dst.dst {
            Destination::Tcp { addr } | Destination::Shm { path: addr } => cluster.by_addr(addr),
        };
        let Some(to) = to else {
            let res = Err(write_failure(false, "no engine at the pull's destination"));
            if let Some(n) = cluster.node(ix) {
                n.conn.event(|c, now| c.on_write_done(now, conn, res, 0));
            }
            return Some(ix);
        };
        if let Some(c) = copies
            .iter()
            .find(|c| c.local >= local.len() || c.remote >= dst.ranks.len())
        {
            let what = format!(
                "a write names rank {} of {} on P and rank {} of {} on D",
                c.local,
                local.len(),
                c.remote,
                dst.ranks.len()
            );
            ctx.violation(what);
            return None;
        }
        let n = cluster.node(ix).expect("the writer is up");
        let mut frames = Vec::with_capacity(copies.len());
        for c in copies {
            let mut buf = vec![0u8; c.len as usize];
            match n.registry.local(&local[c.local], c.local_offset, c.len) {
                Ok(a) => a.read_into(&mut buf),
                Err(e) => {
                    let res = Err(write_failure(
                        false,
                        format!("rank {}'s local bytes at {}: {e}", c.local, c.local_offset),
                    ));
                    n.conn.event(|c, now| c.on_write_done(now, conn, res, 0));
                    return Some(ix);
                }
            }
            frames.push((c, buf));
        }
        if local.len() != dst.ranks.len() {
            ctx.report.hetero_transfers += 1;
        }
        let write = ctx.id();
        let to_inc = cluster.inc(to);
        self.writes.insert(
            write,
            Write {
                from: ix,
                from_inc: inc,
                conn,
                to,
                to_inc,
                dst,
                bytes: frames.iter().map(|(c, _)| c.len).sum(),
                parts: frames.len(),
                acked: BTreeSet::new(),
                done: false,
            },
        );
        for (part, (copy, bytes)) in frames.into_iter().enumerate() {
            // A duplicate is scheduled before the frame it copies.
            let arrivals = net.kv_frame_arrivals(ctx, ix, to);
            let Some((&last, dups)) = arrivals.split_last() else {
                continue;
            };
            for &d in dups {
                let bytes = bytes.clone();
                ctx.at(
                    d,
                    Ev::WriteFrame {
                        write,
                        part,
                        copy,
                        bytes,
                    },
                );
            }
            ctx.at(
                last,
                Ev::WriteFrame {
                    write,
                    part,
                    copy,
                    bytes,
                },
            );
        }
        ctx.at_instant(deadline, Ev::WriteDeadline { write });
        None
    }

    /// A KV frame reaches D: through D's registry, which checks the rank's
    /// segment, epoch, key (the pull's grant on that rank) and bounds
    /// before a byte lands.
    #[allow(clippy::too_many_arguments)]
    pub fn write_frame(
        &mut self,
        ctx: &mut Ctx,
        net: &mut Net,
        cluster: &Cluster,
        write: u64,
        part: usize,
        copy: KvCopy,
        bytes: Vec<u8>,
    ) {
        let Some(w) = self.writes.get(&write) else {
            return;
        };
        if w.done {
            ctx.report.late_frames += 1;
        }
        let (to, to_inc, from) = (w.to, w.to_inc, w.from);
        let rank = &w.dst.ranks[copy.remote];
        let (key, reg, heads) = (rank.write_key(), rank.rank.reg, rank.rank.heads);
        let Some(n) = cluster.live(to, to_inc) else {
            return;
        };
        let res = match n.registry.access(
            reg.segment,
            key,
            reg.epoch,
            copy.remote_offset,
            bytes.len() as u64,
        ) {
            Ok(a) => {
                // It lands: it must lie in one block of D's rank, a block
                // of a load of this transfer that D has not given back.
                let head_bytes = n
                    .conn
                    .inspect(|c| c.kv().map(|k| k.head_bytes))
                    .unwrap_or(crate::model::HEAD_BYTES as u64);
                let rbb = (heads.1 - heads.0) as u64 * head_bytes;
                let first = copy.remote_offset / rbb;
                let last = (copy.remote_offset + bytes.len().max(1) as u64 - 1) / rbb;
                let tid = w.dst.transfer_id.clone();
                if first != last {
                    let what = format!(
                        "a KV copy of transfer {tid} spans blocks {first}..={last} of {}'s rank at heads {heads:?}",
                        n.name
                    );
                    return ctx.violation(what);
                }
                let block = first as u32;
                let alive = n
                    .conn
                    .inspect(|c| c.recv_machine().is_loading_into(&tid, block));
                if !alive {
                    let what = format!(
                        "a KV frame of transfer {tid} landed in {}'s block {block} (rank at heads {heads:?}) after D gave the load back (key {key:#x})",
                        n.name
                    );
                    ctx.violation(what);
                    return;
                }
                a.write_from(&bytes);
                ctx.report.rank_copies += 1;
                Ok(())
            }
            // Refused by D's registry: D withdrew the destination.
            Err(e) => Err(write_failure(true, e)),
        };
        ctx.report.frames += 1;
        let d = net.link_delay(ctx, to, from);
        ctx.at(
            d,
            Ev::WriteAck {
                write,
                part,
                ok: res,
            },
        );
    }

    /// D acknowledged one copy; returns the node touched.
    pub fn write_ack(
        &mut self,
        cluster: &Cluster,
        write: u64,
        part: usize,
        ok: Result<(), Failure>,
    ) -> Option<Ix> {
        let w = self.writes.get_mut(&write)?;
        if w.done {
            return None;
        }
        match ok {
            Err(e) => self.write_end(cluster, write, Err(e)),
            Ok(()) => {
                w.acked.insert(part);
                if w.acked.len() == w.parts {
                    return self.write_end(cluster, write, Ok(()));
                }
                None
            }
        }
    }

    /// The write ended (every copy acknowledged, one refused, or its
    /// deadline); P learns it. Returns the node touched.
    pub fn write_end(
        &mut self,
        cluster: &Cluster,
        write: u64,
        res: Result<(), Failure>,
    ) -> Option<Ix> {
        let w = self.writes.get_mut(&write)?;
        if w.done {
            return None;
        }
        w.done = true;
        let (from, inc, conn, bytes) = (w.from, w.from_inc, w.conn, w.bytes);
        let n = cluster.live(from, inc)?;
        n.conn
            .event(|c, now| c.on_write_done(now, conn, res, bytes));
        Some(from)
    }

    /// D reads P's leased blocks into its own: one request per copy, each
    /// to one of P's rank registrations. Returns the node touched.
    pub fn start_read(
        &mut self,
        ctx: &mut Ctx,
        net: &mut Net,
        cluster: &Cluster,
        ix: Ix,
        io: ReadIo,
    ) -> Option<Ix> {
        let ReadIo {
            load,
            local,
            remote,
            transfer,
            copies,
            deadline,
        } = io;
        let inc = cluster.inc(ix);
        let from = match &transfer {
            Destination::Tcp { addr } | Destination::Shm { path: addr } => cluster.by_addr(addr),
        };
        let Some(from) = from else {
            let f = Failure::new(FailCode::PeerLost, "no engine at the read's source");
            if let Some(n) = cluster.node(ix) {
                n.conn.event(|c, now| c.on_read_result(now, load, Err(f)));
            }
            return Some(ix);
        };
        if let Some(c) = copies
            .iter()
            .find(|c| c.local >= local.len() || c.remote >= remote.len())
        {
            let what = format!(
                "a read names rank {} of {} on D and rank {} of {} on P",
                c.local,
                local.len(),
                c.remote,
                remote.len()
            );
            ctx.violation(what);
            return None;
        }
        if local.len() != remote.len() {
            ctx.report.hetero_transfers += 1;
        }
        let read = ctx.id();
        let parts = copies.len();
        self.reads.insert(
            read,
            Read {
                node: ix,
                inc,
                load,
                from,
                local,
                remote,
                parts,
                got: BTreeSet::new(),
                done: false,
            },
        );
        for (part, copy) in copies.into_iter().enumerate() {
            if net.lost(ctx) {
                continue;
            }
            let d = net.link_delay(ctx, ix, from);
            ctx.at(d, Ev::ReadReq { read, part, copy });
        }
        ctx.at_instant(deadline, Ev::ReadDeadline { read });
        None
    }

    /// One copy's read request reaches P, which answers with its bytes
    /// (or the registry's refusal).
    pub fn read_req(
        &mut self,
        ctx: &mut Ctx,
        net: &mut Net,
        cluster: &Cluster,
        read: u64,
        part: usize,
        copy: KvCopy,
    ) {
        let Some(r) = self.reads.get(&read) else {
            return;
        };
        let (from, node, remote) = (r.from, r.node, r.remote[copy.remote]);
        let Some(p) = cluster.node(from) else { return };
        let bytes = match p.registry.access(
            remote.segment,
            remote.key,
            remote.epoch,
            copy.remote_offset,
            copy.len,
        ) {
            Ok(a) => {
                let mut buf = vec![0u8; copy.len as usize];
                a.read_into(&mut buf);
                Ok(buf)
            }
            Err(e) => Err(e.to_string()),
        };
        let d = net.link_delay(ctx, from, node);
        ctx.at(
            d,
            Ev::ReadResp {
                read,
                part,
                copy,
                bytes,
            },
        );
    }

    /// One copy's answer reaches D and lands in D's rank; returns the node
    /// touched.
    pub fn read_resp(
        &mut self,
        ctx: &mut Ctx,
        cluster: &Cluster,
        read: u64,
        part: usize,
        copy: KvCopy,
        bytes: Result<Vec<u8>, String>,
    ) -> Option<Ix> {
        let r = self.reads.get(&read)?;
        if r.done {
            // The read ended (cancelled, past its deadline): D's transfer
            // engine drops what comes late.
            return None;
        }
        let (node, inc, load, local) = (r.node, r.inc, r.load, r.local[copy.local]);
        let n = cluster.live(node, inc)?;
        let bytes = match bytes {
            Ok(b) => b,
            Err(e) => {
                return self.read_end(
                    cluster,
                    read,
                    Err(Failure::new(FailCode::TransferFailed, e)),
                )
            }
        };
        // What lands must lie in one block of D's rank that this load
        // still writes.
        let rbb = n.conn.inspect(|c| {
            c.kv()
                .and_then(|k| k.ranks.get(copy.local))
                .map(|r| r.block_bytes)
        });
        if let Some(rbb) = rbb.filter(|&b| b > 0) {
            let first = copy.local_offset / rbb;
            let last = (copy.local_offset + bytes.len().max(1) as u64 - 1) / rbb;
            let loading = n.conn.inspect(|c| {
                c.recv_machine()
                    .spec(load)
                    .is_some_and(|s| s.dst_blocks.contains(&(first as u32)))
            });
            if first != last || !loading {
                let what = format!(
                    "{}: a read's copy lands in blocks {first}..={last} of rank {}, not a block its load writes",
                    n.name, copy.local
                );
                ctx.violation(what);
                return None;
            }
        }
        match n
            .registry
            .local(&local, copy.local_offset, bytes.len() as u64)
        {
            Ok(a) => a.write_from(&bytes),
            Err(e) => {
                return self.read_end(
                    cluster,
                    read,
                    Err(Failure::new(FailCode::TransferFailed, e.to_string())),
                )
            }
        }
        ctx.report.frames += 1;
        ctx.report.rank_copies += 1;
        let r = self.reads.get_mut(&read).expect("present");
        r.got.insert(part);
        if r.got.len() == r.parts {
            return self.read_end(cluster, read, Ok(()));
        }
        None
    }

    /// The read ended (every copy landed, one failed, cancelled, or its
    /// deadline); D learns it. Returns the node touched.
    pub fn read_end(
        &mut self,
        cluster: &Cluster,
        read: u64,
        res: Result<(), Failure>,
    ) -> Option<Ix> {
        let r = self.reads.get_mut(&read)?;
        if r.done {
            return None;
        }
        r.done = true;
        let (node, inc, load) = (r.node, r.inc, r.load);
        let n = cluster.live(node, inc)?;
        n.conn.event(|c, now| c.on_read_result(now, load, res));
        Some(node)
    }

    /// D stops a load's read at once; returns the node touched.
    pub fn cancel_read(&mut self, cluster: &Cluster, ix: Ix, load: LoadId) -> Option<Ix> {
        let inc = cluster.inc(ix);
        let read = self
            .reads
            .iter()
            .find(|(_, r)| r.node == ix && r.inc == inc && r.load == load && !r.done)
            .map(|(&k, _)| k)?;
        self.read_end(
            cluster,
            read,
            Err(Failure::new(FailCode::TransferFailed, "cancelled")),
        )
    }

    /// D fences a load: every rank's grant is revoked at once (nothing
    /// holds an access across events here), and the connector hears of it
    /// a network delay later.
    pub fn fence(
        &mut self,
        ctx: &mut Ctx,
        net: &mut Net,
        cluster: &Cluster,
        ix: Ix,
        load: LoadId,
        ranks: Vec<(u64, Option<u64>)>,
    ) {
        let Some(n) = cluster.node(ix) else { return };
        let mut failed = Vec::new();
        for (segment, grant) in ranks {
            let Some(key) = grant else { continue };
            // Nothing holds an access across events here: at once.
            if let Err(e) = n.registry.revoke(segment, key, Duration::ZERO) {
                failed.push(format!(
                    "{}: revoking a grant on segment {segment} failed: {e}",
                    n.name
                ));
            }
        }
        for what in failed {
            ctx.violation(what);
        }
        let inc = cluster.inc(ix);
        let d = net.delay(ctx);
        ctx.at(
            d,
            Ev::Fenced {
                node: ix,
                inc,
                load,
            },
        );
    }

    /// Every write and read has ended.
    pub fn idle(&self) -> bool {
        self.writes.values().all(|w| w.done) && self.reads.values().all(|r| r.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Options;
    use std::time::Instant;

    fn world() -> (Ctx, Net, Cluster) {
        let mut ctx = Ctx::new(Options::for_seed(0));
        let cluster = Cluster::new(&mut ctx).expect("built");
        while ctx.pop().is_some() {}
        (ctx, Net::new(false), cluster)
    }

    fn copy(local: usize, remote: usize) -> KvCopy {
        KvCopy {
            local,
            remote,
            local_offset: 0,
            remote_offset: 0,
            len: 64,
        }
    }

    fn read_io(addr: &str, copies: Vec<KvCopy>) -> ReadIo {
        ReadIo {
            load: 7,
            local: Vec::new(),
            remote: Vec::new(),
            transfer: Destination::Tcp { addr: addr.into() },
            copies,
            deadline: Instant::now() + Duration::from_secs(3600),
        }
    }

    #[test]
    fn a_write_naming_a_rank_nobody_has_is_a_violation() {
        let (mut ctx, mut net, cluster) = world();
        let mut kv = Transfers::default();
        let dst = Pull {
            transfer_id: "t1".into(),
            engine_id: "d1".into(),
            first_block: 0,
            num_tokens: 16,
            dst: Destination::Tcp {
                addr: "127.0.0.2:7001".into(),
            },
            ranks: Vec::new(),
            blocks: vec![3],
            weights_version: None,
        };
        let deadline = ctx.now() + Duration::from_secs(1);
        let io = WriteIo {
            conn: 1,
            local: Vec::new(),
            copies: vec![copy(0, 0)],
            dst,
            deadline,
        };
        let touched = kv.start_write(&mut ctx, &mut net, &cluster, 0, io);
        assert_eq!(touched, None);
        assert_eq!(
            ctx.report.violations.len(),
            1,
            "{:?}",
            ctx.report.violations
        );
        assert!(ctx.report.violations[0].contains("a write names rank 0 of 0 on P"));
        assert!(ctx.pop().is_none() && kv.idle());
    }

    #[test]
    fn a_read_from_no_engine_fails_at_once_and_a_bad_rank_is_a_violation() {
        let (mut ctx, mut net, cluster) = world();
        let mut kv = Transfers::default();
        let io = read_io("127.0.0.9:7001", vec![copy(0, 0)]);
        assert_eq!(kv.start_read(&mut ctx, &mut net, &cluster, 1, io), Some(1));
        assert!(ctx.pop().is_none() && ctx.report.violations.is_empty());
        let io = read_io("127.0.0.1:7001", vec![copy(0, 0)]);
        assert_eq!(kv.start_read(&mut ctx, &mut net, &cluster, 1, io), None);
        assert!(ctx.report.violations[0].contains("a read names rank 0 of 0 on D"));
        assert!(ctx.pop().is_none() && kv.idle());
        assert_eq!(kv.cancel_read(&cluster, 1, 7), None);
    }
}
