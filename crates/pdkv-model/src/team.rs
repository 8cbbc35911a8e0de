//! A persistent team of math threads for the many short parallel regions
//! of a step (decode at batch 1 runs five a layer).
//!
//! A rayon region wakes sleeping workers through the kernel (a futex wake
//! and a context switch each, tens of microseconds on a virtual machine)
//! and its workers fall asleep again between regions. A team's threads
//! instead spin on one atomic word for a short while after each region
//! ([`SPIN`]) before they park, so the next region of the step finds them
//! awake: publishing a region is one store, claiming a job one
//! compare-and-swap.
//!
//! The calling thread is a member: it publishes the region, claims jobs
//! like the others and returns when every job has run. Which thread runs
//! which job changes nothing in the results (the kernels' invariant).
//!
//! One caller at a time: [`Team::enter`] holds the team for a closure (a
//! model step) and makes it the calling thread's current team, which
//! [`par_for`] then uses; a second caller finds it busy and runs on the
//! rayon pool instead. Inside a job, [`par_for`] runs serially.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long an idle member spins before it parks. A decode step's serial
/// gaps (norms, sampling, the scheduler between steps) are well under it.
const SPIN: Duration = Duration::from_micros(300);

/// Jobs of one region are at most this many (a [`Team::run`] of more runs
/// several regions): well inside the work word's 32 bits for each half.
const MAX_JOBS: usize = (1 << 20) - 1;

/// A job closure as the members see it: a thin pointer to a fat reference
/// on the caller's stack, valid while its region runs.
type JobRef<'a> = &'a (dyn Fn(usize) + Sync);

struct Shared {
    /// `jobs << 32 | next`: the current region's job count and the next
    /// unclaimed index. Idle when `next >= jobs`.
    work: AtomicU64,
    /// The current region's closure (a `*const JobRef`), set before `work`
    /// is published and read only by a member that has claimed a job.
    job: AtomicPtr<()>,
    /// Jobs of the current region that have finished.
    done: AtomicUsize,
    /// The first panic of a member's job in the current region.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Members parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    parked: Mutex<()>,
    wake: Condvar,
    /// Set once, when the team is dropped.
    stop: std::sync::atomic::AtomicBool,
}

fn unpack(w: u64) -> (usize, usize) {
    ((w >> 32) as usize, (w & 0xffff_ffff) as usize)
}

impl Shared {
    /// Claims the next job of the current region, if one is left.
    fn claim(&self) -> Option<usize> {
        let mut w = self.work.load(Ordering::Acquire);
        loop {
            let (jobs, next) = unpack(w);
            if next >= jobs {
                return None;
            }
            match self
                .work
                .compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(next),
                Err(now) => w = now,
            }
        }
    }

    /// Runs job `i`, just claimed (so its region cannot end before the
    /// `done` count below): a panic is kept for the caller to rethrow.
    fn run_claimed(&self, i: usize) {
        // SAFETY: a claimed job keeps its region open (the caller waits for
        // `done` to reach the job count), and the pointer was published with
        // the region: it points at the caller's live `JobRef`.
        let f = unsafe { *(self.job.load(Ordering::Relaxed) as *const JobRef<'_>) };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
            let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(p);
        }
        self.done.fetch_add(1, Ordering::Release);
    }

    fn has_work(&self) -> bool {
        let (jobs, next) = unpack(self.work.load(Ordering::SeqCst));
        next < jobs
    }

    /// A member's life: claim and run jobs; idle, spin for [`SPIN`], then park.
    fn member(&self) {
        IN_JOB.with(|c| c.set(true));
        loop {
            while let Some(i) = self.claim() {
                self.run_claimed(i);
            }
            let idle = Instant::now();
            let mut spins = 0u32;
            while !self.has_work() && !self.stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && idle.elapsed() >= SPIN {
                    self.park();
                    break;
                }
            }
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
        }
    }

    /// Sleeps until a region is published (or the team stops). The count
    /// goes up before the last look at `work`, and the publisher looks at
    /// the count after its store (both sequentially consistent), so one of
    /// them sees the other: no wake-up is lost.
    fn park(&self) {
        let mut g = self.parked.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        while !self.has_work() && !self.stop.load(Ordering::SeqCst) {
            g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

thread_local! {
    /// The team the thread has entered (a model step), if any.
    static CURRENT: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// Set on team members and while the caller runs a job: a nested
    /// [`par_for`] runs serially.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// A persistent team of math threads; see the module doc.
pub struct Team {
    shared: Arc<Shared>,
    threads: usize,
    /// Held by the caller inside [`Team::enter`].
    busy: Mutex<()>,
    members: Vec<JoinHandle<()>>,
}

impl Team {
    /// A team of `threads` threads in all: the caller and `threads - 1`
    /// members started now.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            work: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            parked: Mutex::new(()),
            wake: Condvar::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
        });
        let threads = threads.max(1);
        let mut members = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = Arc::clone(&shared);
            members.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || s.member())?,
            );
        }
        Ok(Team {
            shared,
            threads,
            busy: Mutex::new(()),
            members,
        })
    }

    /// Threads in the team, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` with this team as the thread's current one (see
    /// [`par_for`]); `None` when another thread holds the team.
    pub fn enter<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let _held = match self.busy.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::WouldBlock) => return None,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        };
        struct Restore(*const Team);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(self)));
        Some(f())
    }

    /// Runs `f(i)` for every `i` in `0..n` on the team, the caller
    /// included, and returns when all have run. A job's panic is rethrown
    /// here once every job has finished. Callers hold the team
    /// ([`Team::enter`]).
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        for start in (0..n).step_by(MAX_JOBS) {
            let len = MAX_JOBS.min(n - start);
            let g = move |i: usize| f(start + i);
            self.run_region(len, &g);
        }
    }

    fn run_region(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        let job: JobRef<'_> = f;
        s.job
            .store(&job as *const JobRef<'_> as *mut (), Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        // Publishes the closure and the count reset with the region.
        s.work.store((n as u64) << 32, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.parked.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let was = IN_JOB.with(|c| c.replace(true));
        while let Some(i) = s.claim() {
            s.run_claimed(i);
        }
        IN_JOB.with(|c| c.set(was));
        // The members still running jobs finish them (the work is bounded:
        // a job of this region); yielding after a while lets a member
        // preempted by another process run.
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            }
        }
        let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, Ordering::SeqCst);
        {
            let _g = s.parked.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for m in self.members.drain(..) {
            // A member only returns; a join error would be a member's panic
            // outside any job, which `member` does not have.
            let _ = m.join();
        }
    }
}

/// Runs `f(i)` for `i` in `0..n`: on the calling thread's current team
/// ([`Team::enter`]), serially inside a job, else on the current rayon pool.
pub fn par_for(n: usize, f: impl Fn(usize) + Sync) {
    if n == 0 {
        return;
    }
    if n == 1 || IN_JOB.with(|c| c.get()) {
        return (0..n).for_each(f);
    }
    let team = CURRENT.with(|c| c.get());
    if team.is_null() {
        return (0..n).into_par_iter().for_each(&f);
    }
    // SAFETY: `CURRENT` is set only inside `Team::enter`, which borrows the
    // team for as long as the pointer is set.
    let team = unsafe { &*team };
    team.run(n, &f);
}

/// [`par_for`] over the items of `items`, each job given its own.
pub fn par_for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    let base = ItemsPtr(items.as_mut_ptr());
    let n = items.len();
    par_for(n, |i| {
        // SAFETY: `i < n` and every index is one job's alone, so the
        // references are to distinct items of the borrowed slice.
        let item = unsafe { &mut *base.at(i) };
        f(i, item)
    });
}

/// [`par_for`] over the `len`-element chunks of `buf` (the last may be
/// shorter), each job given chunk `i`.
pub fn par_chunks_mut<T: Send>(buf: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let len = len.max(1);
    let total = buf.len();
    let base = ItemsPtr(buf.as_mut_ptr());
    par_for(total.div_ceil(len), |i| {
        let start = i * len;
        let end = (start + len).min(total);
        // SAFETY: chunk `i` is `start..end` of the borrowed slice, inside
        // it, and no other job's chunk overlaps it.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
        f(i, chunk)
    });
}

/// A slice's base pointer shared by the jobs that each take their own part.
struct ItemsPtr<T>(*mut T);
// SAFETY: the users above hand each job a disjoint part of a slice of
// `Send` items borrowed mutably for the whole region.
unsafe impl<T: Send> Send for ItemsPtr<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Send> Sync for ItemsPtr<T> {}
impl<T> ItemsPtr<T> {
    /// A method (not a field access) so closures capture the whole wrapper.
    fn at(&self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

/// A caught panic's message (`panic!`'s text, whether it was formatted or
/// a literal), or `(no message)` for another payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)")
}

/// Threads that [`par_for`] spreads jobs over on this thread: the current
/// team's, else the current rayon pool's.
pub fn threads() -> usize {
    let team = CURRENT.with(|c| c.get());
    if team.is_null() {
        rayon::current_num_threads()
    } else {
        // SAFETY: as in `par_for`.
        unsafe { (*team).threads() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_job_runs_once_in_each_of_many_regions() {
        let team = Team::new(3, "test-team").unwrap();
        team.enter(|| {
            for n in [0usize, 1, 2, 3, 7, 64, 1000] {
                for _ in 0..50 {
                    let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                    par_for(n, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert!(
                        hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                        "n = {n}"
                    );
                }
            }
        })
        .expect("the team is free");
    }

    #[test]
    fn members_that_parked_wake_for_the_next_region() {
        let team = Team::new(2, "test-team").unwrap();
        let s = Arc::clone(&team.shared);
        team.enter(|| {
            par_for(4, |_| {});
            // Wait (bounded) until the member has spun out and parked.
            let until = Instant::now() + Duration::from_secs(10);
            while s.sleepers.load(Ordering::SeqCst) == 0 {
                assert!(Instant::now() < until, "the member never parked");
                std::thread::yield_now();
            }
            // Jobs that only finish once both threads are in them: the
            // parked member must have woken.
            let arrived = AtomicU32::new(0);
            par_for(2, |_| {
                arrived.fetch_add(1, Ordering::SeqCst);
                let until = Instant::now() + Duration::from_secs(10);
                while arrived.load(Ordering::SeqCst) < 2 {
                    assert!(Instant::now() < until, "the parked member did not wake");
                    std::hint::spin_loop();
                }
            });
        })
        .expect("the team is free");
    }

    #[test]
    fn a_second_caller_finds_the_team_busy_and_nesting_runs_serially() {
        let team = Team::new(2, "test-team").unwrap();
        team.enter(|| {
            assert!(team.enter(|| ()).is_none(), "the team is held");
            assert_eq!(threads(), 2);
            let inner = AtomicU32::new(0);
            par_for(4, |_| {
                // A nested region runs on this thread, whole.
                par_for(3, |_| {
                    inner.fetch_add(1, Ordering::Relaxed);
                });
            });
            assert_eq!(inner.load(Ordering::Relaxed), 12);
        })
        .expect("the team is free");
        assert!(team.enter(|| ()).is_some(), "released after enter");
    }

    #[test]
    fn a_panics_message_is_its_text_whether_formatted_or_literal() {
        let caught = |f: fn()| std::panic::catch_unwind(f).unwrap_err();
        let literal = caught(|| panic!("a literal"));
        let formatted = caught(|| panic!("formatted {}", 7));
        let other = caught(|| std::panic::panic_any(7u8));
        assert_eq!(panic_message(&*literal), "a literal");
        assert_eq!(panic_message(&*formatted), "formatted 7");
        assert_eq!(panic_message(&*other), "(no message)");
    }

    #[test]
    fn a_jobs_panic_reaches_the_caller_after_the_region() {
        let team = Team::new(2, "test-team").unwrap();
        let ran = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.enter(|| {
                par_for(16, |i| {
                    ran.fetch_add(1, Ordering::SeqCst);
                    assert_ne!(i, 5, "job five fails");
                })
            })
        }));
        assert!(r.is_err(), "the panic is rethrown");
        assert_eq!(ran.load(Ordering::SeqCst), 16, "every job ran first");
        // The team still works afterwards.
        let n = AtomicU32::new(0);
        team.enter(|| {
            par_for(8, |_| {
                n.fetch_add(1, Ordering::Relaxed);
            })
        })
        .unwrap();
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}
