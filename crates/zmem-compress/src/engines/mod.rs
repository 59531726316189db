//! The multi-engine device: the Intel IAA model, in software.
//!
//! `Engines` owns N worker threads ("engines"), each pinned to a core and fed
//! by its own bounded work queue of descriptors. One descriptor is one item of
//! a batch. Submitting a batch places its descriptors on the queues, so a
//! batch of 8 on 2 engines runs as two parallel streams of 4:
//!
//! ```text
//!   submit(batch) ──► wq_mode=global : round-robin over all engines' queues
//!                 └─► wq_mode=per-cpu: the submitting core's own engine
//!        │  a full queue is waited on for at most submit_timeout; then the
//!        │  item runs on the submitting thread (sw_fallback_calls++)
//!        ▼
//!   engine k: recv descriptor ─► claim item ─► codec ─► [verify] ─► complete
//!        ▼
//!   wait(ticket): spin, then park; past completion_timeout the waiter counts
//!   completion_timeouts++ and runs every not-yet-started item itself
//! ```
//!
//! With `sync_on_caller`, the synchronous calls (`compress_batch`,
//! `decompress_batch`) run on the calling thread and only submitted batches
//! go to the engines: a caller that waits anyway (a fault's load) would
//! pay a cross-core wake-up for a batch that takes less.
//!
//! Every item has a claim flag, so an item starts once: on an engine, on the
//! submit-time fallback, or on the waiter that helps. Past the completion
//! timeout the waiter runs every item not finished yet, started or not: an
//! engine that started one may have been descheduled (on a busy 2-core
//! machine, for milliseconds), and the batch must not wait for it. Each item
//! is published once, by whoever finishes it first (`finished`); the other
//! run's output is dropped. All paths use the same codec and settings, so the
//! output bytes do not depend on which path ran (tested).
//!
//! The whole device is safe Rust: descriptors carry an `Arc` of the batch.
//! An item's input is shared (`Arc`), so a run reads it without a lock; a run
//! writes into a buffer of its own and swaps it in when it publishes, under
//! the item's (uncontended) mutex, held for the swap only.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};
use zmem_common::LockExt;

use crossbeam_channel::{Receiver, SendTimeoutError, Sender};

use crate::batch::{check_shape, Batch, BatchItem, CtxPool, Factory, ItemError, Op, PendingBatch, Ticket, TicketInner};
use crate::codec::Compressor;
use crate::{BatchCompressor, CompressError, DecompressError, Error};
use std::any::Any;
use zmem_common::ConfigError;

mod config;
mod stats;
mod sync;

pub use config::{EnginesConfig, WqMode};
use stats::Counters;
pub use stats::EngineStats;

/// A batch in flight: its items, who claimed them, and who waits.
#[derive(Debug)]
pub(crate) struct Inflight {
    op: Op,
    items: Vec<sync::Mutex<Slot>>,
    /// Each item's room for output: its `dst` length at submit.
    rooms: Vec<usize>,
    /// Set by whoever starts the item first.
    claimed: Vec<sync::AtomicBool>,
    /// Set by whoever publishes the item's result: exactly one run does.
    finished: Vec<sync::AtomicBool>,
    /// The engine each item was mapped to (for counters).
    engine_of: Vec<usize>,
    /// Items kept for the submitting core: never queued, run by `poll` or
    /// `wait`.
    inline: Vec<bool>,
    remaining: sync::AtomicUsize,
    waiter: Mutex<Option<Thread>>,
}

/// An item in flight.
#[derive(Debug, Default)]
struct Slot {
    /// Shared, so that a run reads it without holding the slot's lock.
    src: Arc<Vec<u8>>,
    dst: Vec<u8>,
    result: Option<Result<usize, ItemError>>,
}

impl Inflight {
    fn claim(&self, i: usize) -> bool {
        !self.claimed[i].swap(true, Ordering::AcqRel)
    }

    /// Runs item `i` into `out` and publishes the result, unless another run
    /// published first (then this one's output is dropped). `out` comes back
    /// holding a buffer to reuse. Whether this run published.
    fn run(&self, i: usize, ctx: &mut dyn Compressor, w: &mut Worker<'_>, out: &mut Vec<u8>) -> bool {
        if self.finished[i].load(Ordering::Acquire) {
            return false;
        }
        let src = Arc::clone(&sync::lock(&self.items[i]).src);
        if out.len() != self.rooms[i] {
            out.resize(self.rooms[i], 0);
        }
        let r = w.run(self.op, &src, out, ctx);
        drop(src);
        if self.finished[i].swap(true, Ordering::AcqRel) {
            return false;
        }
        {
            let mut slot = sync::lock(&self.items[i]);
            std::mem::swap(&mut slot.dst, out);
            slot.result = Some(r);
        }
        self.complete_one();
        true
    }

    fn complete_one(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(t) = self.waiter.lock_ok().as_ref() {
                t.unpark();
            }
        }
    }

    pub(crate) fn done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// The batch back, from a waiter that cannot run its items (the ticket
    /// went to another compressor): unstarted items end with
    /// `ItemError::ForeignTicket`; started ones are waited for.
    pub(crate) fn abandon(self: Arc<Self>) -> Batch {
        for i in 0..self.items.len() {
            if self.claim(i) && !self.finished[i].swap(true, Ordering::AcqRel) {
                sync::lock(&self.items[i]).result = Some(Err(ItemError::ForeignTicket));
                self.complete_one();
            }
        }
        while !self.done() {
            thread::sleep(Duration::from_micros(50));
        }
        self.take_batch()
    }

    /// Moves the items out through their mutexes: descriptors of items a
    /// fallback path claimed may still sit in queues (or in a stalled
    /// engine) holding a clone of the Arc, so it cannot be unwrapped. A late
    /// engine finds them claimed and drops the descriptor. An input a
    /// stalled run still reads is copied (its buffer stays with that run).
    fn take_batch(&self) -> Batch {
        let items = self
            .items
            .iter()
            .map(|m| {
                let slot = std::mem::take(&mut *sync::lock(m));
                let src = Arc::try_unwrap(slot.src).unwrap_or_else(|shared| (*shared).clone());
                BatchItem { src, dst: slot.dst, result: slot.result }
            })
            .collect();
        Batch { op: self.op, items }
    }
}

/// What one engine (or the software path) does with one claimed item.
struct Worker<'a> {
    verify: bool,
    counters: &'a Counters,
    scratch: &'a mut Vec<u8>,
}

impl Worker<'_> {
    fn run(&mut self, op: Op, src: &[u8], dst: &mut [u8], ctx: &mut dyn Compressor) -> Result<usize, ItemError> {
        let r = match op {
            Op::Compress => {
                self.counters.compress_calls.fetch_add(1, Ordering::Relaxed);
                ctx.compress(src, dst).map_err(ItemError::from)
            }
            Op::Decompress => {
                self.counters.decompress_calls.fetch_add(1, Ordering::Relaxed);
                ctx.decompress(src, dst).map_err(ItemError::from)
            }
        };
        match (op, r) {
            (Op::Compress, Err(ItemError::Compress(CompressError::Poor))) => {
                self.counters.poor_outputs.fetch_add(1, Ordering::Relaxed);
                Err(ItemError::Compress(CompressError::Poor))
            }
            (Op::Compress, Ok(n)) if self.verify => {
                self.check(ctx, src, &dst[..n]).map(|()| n).map_err(ItemError::from)
            }
            (_, r) => r,
        }
    }
}

impl Worker<'_> {
    /// `verify_compress`: whether `out` decompresses back to `src`.
    fn check(&mut self, ctx: &mut dyn Compressor, src: &[u8], out: &[u8]) -> Result<(), CompressError> {
        self.scratch.resize(src.len(), 0);
        if matches!(ctx.decompress(out, self.scratch), Ok(m) if m == src.len() && self.scratch[..m] == *src) {
            return Ok(());
        }
        self.counters.verify_failures.fetch_add(1, Ordering::Relaxed);
        Err(CompressError::VerifyFailed { codec: crate::codec::static_name(ctx.name()) })
    }
}

/// Why an item runs on the calling thread rather than on an engine.
#[derive(Debug, Clone, Copy)]
enum Inline {
    /// `submit_timeout` or `completion_timeout` expired.
    Fallback,
    /// The waiter had nothing better to do (`help_on_wait`).
    Help,
}

/// Output buffers the software path keeps for reuse.
const KEEP_OUTS: usize = 8;

struct Shared {
    counters: Vec<Counters>,
    cfg: EnginesConfig,
    offload: Offload,
}

/// Who ran the recent items: for `min_offload_percent`.
#[derive(Debug, Default)]
struct Offload {
    /// Items an engine published, of…
    by_engines: AtomicU64,
    /// …the items submitted (both halved now and then: a recent window).
    submitted: AtomicU64,
    /// Calls of `runs_beside`.
    asks: AtomicU64,
}

/// `Offload`'s window: halved past this many items.
const OFFLOAD_WINDOW: u64 = 1024;
/// One `runs_beside` in this many says yes whatever the share.
const OFFLOAD_PROBE: u64 = 32;

impl Offload {
    fn submitted(&self, n: usize) {
        let all = self.submitted.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        if all > OFFLOAD_WINDOW {
            // Racy halving is fine: the share is a hint.
            self.submitted.store(all / 2, Ordering::Relaxed);
            self.by_engines.store(self.by_engines.load(Ordering::Relaxed) / 2, Ordering::Relaxed);
        }
    }

    fn beside(&self, min_percent: u32) -> bool {
        if min_percent == 0 || self.asks.fetch_add(1, Ordering::Relaxed) % OFFLOAD_PROBE == 0 {
            return true;
        }
        let all = self.submitted.load(Ordering::Relaxed);
        all < OFFLOAD_WINDOW / 4 || self.by_engines.load(Ordering::Relaxed) * 100 >= all * u64::from(min_percent)
    }
}

/// N worker engines behind the [`BatchCompressor`] API.
pub struct Engines {
    shared: Arc<Shared>,
    queues: Vec<Sender<(Arc<Inflight>, usize)>>,
    threads: Vec<JoinHandle<()>>,
    /// The software path: contexts for the submitting and waiting threads.
    sw: CtxPool,
    /// Output buffers of the software path, for reuse.
    outs: Mutex<Vec<Vec<u8>>>,
    rr: AtomicUsize,
    /// Test hook: while set, engines take no descriptors.
    paused: Arc<AtomicBool>,
    ncpus: usize,
}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engines").field("cfg", &self.shared.cfg).field("codec", &self.sw.name()).finish()
    }
}

impl Engines {
    /// Starts the engines, each with its own codec context from `factory`.
    ///
    /// # Errors
    /// [`Error::Config`] for 0 engines, a zero-depth queue, or a batch size
    /// outside 1..=32.
    pub fn new(cfg: EnginesConfig, factory: Factory) -> Result<Self, Error> {
        if cfg.engines == 0 || cfg.engines > 1024 {
            return Err(ConfigError::out_of_range("engines", cfg.engines, "1..=1024").into());
        }
        if cfg.wq_depth == 0 {
            return Err(ConfigError::out_of_range("wq_depth", cfg.wq_depth, "1..").into());
        }
        if !(1..=crate::batch::MAX_BATCH_SIZE).contains(&cfg.batch_size) {
            return Err(ConfigError::out_of_range("batch_size", cfg.batch_size, "1..=32").into());
        }
        let ncpus = thread::available_parallelism().map_or(1, |n| n.get());
        let shared = Arc::new(Shared {
            counters: (0..cfg.engines).map(|_| Counters::default()).collect(),
            cfg,
            offload: Offload::default(),
        });
        let paused = Arc::new(AtomicBool::new(false));
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        for k in 0..shared.cfg.engines {
            let (tx, rx) = crossbeam_channel::bounded(shared.cfg.wq_depth);
            queues.push(tx);
            let ctx = factory();
            let shared = Arc::clone(&shared);
            let paused = Arc::clone(&paused);
            let pin = shared.cfg.pin.then_some(k % ncpus);
            let t =
                zmem_common::host::thread::spawn(thread::Builder::new().name(format!("zmem-engine-{k}")), move || {
                    engine_main(k, rx, ctx, &shared, &paused, pin)
                })
                .map_err(|e| Error::Spawn(e.to_string()))?;
            threads.push(t);
        }
        Ok(Engines {
            shared,
            queues,
            threads,
            sw: CtxPool::new(factory),
            outs: Mutex::new(Vec::new()),
            rr: AtomicUsize::new(0),
            paused,
            ncpus,
        })
    }

    /// Per-engine counters.
    pub fn stats(&self) -> Vec<EngineStats> {
        self.shared.counters.iter().map(Counters::snapshot).collect()
    }

    pub fn config(&self) -> &EnginesConfig {
        &self.shared.cfg
    }

    /// Stops (or restarts) engines taking descriptors, as a wedged device
    /// would. For tests of the timeout and fallback paths.
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Release);
    }

    fn pick(&self, i: usize, local: usize) -> usize {
        let n = self.queues.len();
        match self.shared.cfg.wq_mode {
            WqMode::PerCpu => local % n,
            WqMode::Global => (self.rr.load(Ordering::Relaxed) + i) % n,
        }
    }

    /// Runs an item on the calling thread: the software path after a
    /// timeout, or help while waiting. Claimed by the caller, or (past the
    /// completion timeout) started by an engine that has not finished it.
    fn run_sw(&self, inf: &Inflight, i: usize, why: Inline) {
        let counters = &self.shared.counters[inf.engine_of[i]];
        match why {
            Inline::Fallback => counters.sw_fallback_calls.fetch_add(1, Ordering::Relaxed),
            Inline::Help => counters.helped_calls.fetch_add(1, Ordering::Relaxed),
        };
        let mut scratch = Vec::new();
        let mut w = Worker { verify: self.shared.cfg.verify_compress, counters, scratch: &mut scratch };
        let mut out = self.outs.lock_ok().pop().unwrap_or_default();
        self.sw.with(|ctx| inf.run(i, ctx, &mut w, &mut out));
        let mut outs = self.outs.lock_ok();
        if outs.len() < KEEP_OUTS {
            outs.push(out);
        }
    }

    fn submit_inner(&self, batch: Batch) -> Result<Arc<Inflight>, Error> {
        let n = batch.len();
        if n > self.shared.cfg.batch_size {
            return Err(Error::BatchTooLarge { got: n, max: self.shared.cfg.batch_size });
        }
        let local = match self.shared.cfg.wq_mode {
            WqMode::PerCpu => current_cpu() % self.ncpus,
            WqMode::Global => 0,
        };
        let engine_of: Vec<usize> = (0..n).map(|i| self.pick(i, local)).collect();
        self.shared.offload.submitted(n);
        if self.shared.cfg.wq_mode == WqMode::Global {
            self.rr.fetch_add(n, Ordering::Relaxed);
        }
        // With help_on_wait in global mode, the share of the engine pinned to
        // the submitting core is run by the submitter in `wait`: queueing it
        // would only make two threads take turns on one core.
        let inline_cpu =
            (self.shared.cfg.help_on_wait && self.shared.cfg.pin && self.shared.cfg.wq_mode == WqMode::Global)
                .then(|| current_cpu() % self.ncpus);
        let inline: Vec<bool> = engine_of.iter().map(|&e| inline_cpu == Some(e % self.ncpus)).collect();
        let inf = Arc::new(Inflight {
            op: batch.op,
            inline,
            claimed: (0..n).map(|_| sync::AtomicBool::new(false)).collect(),
            finished: (0..n).map(|_| sync::AtomicBool::new(false)).collect(),
            rooms: batch.items.iter().map(|it| it.dst.len()).collect(),
            items: batch
                .items
                .into_iter()
                .map(|it| sync::Mutex::new(Slot { src: Arc::new(it.src), dst: it.dst, result: None }))
                .collect(),
            engine_of,
            remaining: sync::AtomicUsize::new(n),
            waiter: Mutex::new(None),
        });
        for i in 0..n {
            let e = inf.engine_of[i];
            if inf.inline[i] {
                continue;
            }
            match self.queues[e].send_timeout((Arc::clone(&inf), i), self.shared.cfg.submit_timeout) {
                Ok(()) => {}
                Err(SendTimeoutError::Timeout(_)) => {
                    if inf.claim(i) {
                        self.run_sw(&inf, i, Inline::Fallback);
                    }
                }
                Err(SendTimeoutError::Disconnected(_)) => return Err(Error::ShutDown),
            }
        }
        Ok(inf)
    }

    fn wait_inner(&self, inf: Arc<Inflight>) -> Batch {
        let deadline = Instant::now() + self.shared.cfg.completion_timeout;
        if self.shared.cfg.help_on_wait {
            // Items kept for this core first (never queued), then from the
            // back, as engines work from the front.
            for i in (0..inf.items.len()).rev() {
                if inf.done() {
                    break;
                }
                if inf.claim(i) {
                    self.run_sw(&inf, i, Inline::Help);
                }
            }
        }
        // Spin first: what is left is running or about to run on an engine,
        // and sleeping would cost a cross-core wake-up.
        let mut spins = 0u32;
        while !inf.done() && spins < 4000 {
            std::hint::spin_loop();
            spins += 1;
            if spins % 1024 == 0 {
                thread::yield_now();
            }
        }
        if !inf.done() {
            *inf.waiter.lock_ok() = Some(thread::current());
            let mut timed_out = false;
            while !inf.done() {
                let now = Instant::now();
                if !timed_out && now >= deadline {
                    timed_out = true;
                    self.shared.counters[inf.engine_of[0]].completion_timeouts.fetch_add(1, Ordering::Relaxed);
                    // Started or not: an engine may sit descheduled in the
                    // middle of an item for longer than the item takes here.
                    for i in 0..inf.items.len() {
                        if !inf.finished[i].load(Ordering::Acquire) {
                            inf.claim(i);
                            self.run_sw(&inf, i, Inline::Fallback);
                        }
                    }
                    continue;
                }
                if timed_out {
                    // Every item is finished; a run that published has yet
                    // to count itself done.
                    thread::yield_now();
                } else {
                    thread::park_timeout(deadline - now);
                }
            }
        }
        inf.take_batch()
    }

    fn run_sync(&self, op: Op, src: &[&[u8]], dst: &mut [&mut [u8]]) -> Result<Batch, Error> {
        let mut batch = Batch::new(op);
        let mut k = 0;
        batch.refill(op, src.iter().copied(), |_| {
            k += 1;
            dst[k - 1].len()
        });
        let inf = self.submit_inner(batch)?;
        let batch = self.wait_inner(inf);
        for (item, d) in batch.items.iter().zip(dst.iter_mut()) {
            if let Some(Ok(n)) = item.result {
                d[..n].copy_from_slice(&item.dst[..n]);
            }
        }
        Ok(batch)
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        self.queues.clear();
        self.paused.store(false, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn current_cpu() -> usize {
    rustix::thread::sched_getcpu()
}

fn engine_main(
    k: usize,
    rx: Receiver<(Arc<Inflight>, usize)>,
    mut ctx: Box<dyn Compressor>,
    shared: &Shared,
    paused: &AtomicBool,
    pin: Option<usize>,
) {
    if let Some(cpu) = pin {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        // Pinning is an optimisation; an affinity error (a restricted
        // cpuset) leaves the engine floating, which is still correct.
        let _ = rustix::thread::sched_setaffinity(None, &set);
    }
    let counters = &shared.counters[k];
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    while let Some((inf, i)) = next_descriptor(&rx, shared.cfg.idle_spin) {
        while paused.load(Ordering::Acquire) {
            thread::sleep(Duration::from_millis(1));
        }
        if !inf.claim(i) {
            continue;
        }
        let mut w = Worker { verify: shared.cfg.verify_compress, counters, scratch: &mut scratch };
        if inf.run(i, ctx.as_mut(), &mut w, &mut out) {
            shared.offload.by_engines.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The next descriptor: polled for `idle_spin`, then waited for asleep.
/// `None` once the device is dropped.
fn next_descriptor(rx: &Receiver<(Arc<Inflight>, usize)>, idle_spin: Duration) -> Option<(Arc<Inflight>, usize)> {
    if let Ok(d) = rx.try_recv() {
        return Some(d);
    }
    // Before it may block (`zmem_common::host::tls`).
    zmem_common::host::tls::keep_resident();
    if !idle_spin.is_zero() {
        let start = Instant::now();
        let mut n = 0u32;
        loop {
            std::hint::spin_loop();
            n += 1;
            if n % 32 == 0 {
                match rx.try_recv() {
                    Ok(d) => return Some(d),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
                    Err(crossbeam_channel::TryRecvError::Empty) => {}
                }
                if start.elapsed() >= idle_spin {
                    break;
                }
                // Let a submitter on this core run, but rarely: a syscall is
                // costly on a PVM guest.
                if n % 2048 == 0 {
                    thread::yield_now();
                }
            }
        }
    }
    rx.recv().ok()
}

impl BatchCompressor for Engines {
    fn name(&self) -> String {
        self.sw.name().to_string()
    }

    fn batch_size(&self) -> usize {
        self.shared.cfg.batch_size
    }

    /// Yes, unless engines ran fewer than `min_offload_percent` of the
    /// recent items (see [`EnginesConfig::min_offload_percent`]).
    fn runs_beside(&self) -> bool {
        self.shared.offload.beside(self.shared.cfg.min_offload_percent)
    }

    fn compress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, CompressError>],
    ) -> Result<(), Error> {
        check_shape(src.len(), dst.len(), out.len(), self.shared.cfg.batch_size)?;
        if self.shared.cfg.sync_on_caller {
            let mut scratch = Vec::new();
            let counters = &self.shared.counters[0];
            let mut w = Worker { verify: self.shared.cfg.verify_compress, counters, scratch: &mut scratch };
            self.sw.with(|ctx| {
                for ((s, d), o) in src.iter().zip(dst.iter_mut()).zip(out.iter_mut()) {
                    counters.caller_calls.fetch_add(1, Ordering::Relaxed);
                    *o = ctx.compress(s, d).and_then(|n| {
                        if w.verify {
                            w.check(ctx, s, &d[..n]).map(|()| n)
                        } else {
                            Ok(n)
                        }
                    });
                    if *o == Err(CompressError::Poor) {
                        counters.poor_outputs.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            return Ok(());
        }
        let batch = self.run_sync(Op::Compress, src, dst)?;
        for (item, o) in batch.items.into_iter().zip(out.iter_mut()) {
            *o = match item.result {
                Some(Ok(n)) => Ok(n),
                Some(Err(ItemError::Compress(e))) => Err(e),
                Some(Err(e @ (ItemError::Decompress(_) | ItemError::ForeignTicket))) => {
                    unreachable!("our own compress batch gave {e}")
                }
                None => unreachable!("a completed batch has every result"),
            };
        }
        Ok(())
    }

    fn decompress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, DecompressError>],
    ) -> Result<(), Error> {
        check_shape(src.len(), dst.len(), out.len(), self.shared.cfg.batch_size)?;
        if self.shared.cfg.sync_on_caller {
            let counters = &self.shared.counters[0];
            self.sw.with(|ctx| {
                for ((s, d), o) in src.iter().zip(dst.iter_mut()).zip(out.iter_mut()) {
                    counters.caller_calls.fetch_add(1, Ordering::Relaxed);
                    *o = ctx.decompress(s, d);
                }
            });
            return Ok(());
        }
        let batch = self.run_sync(Op::Decompress, src, dst)?;
        for (item, o) in batch.items.into_iter().zip(out.iter_mut()) {
            *o = match item.result {
                Some(Ok(n)) => Ok(n),
                Some(Err(ItemError::Decompress(e))) => Err(e),
                Some(Err(e @ (ItemError::Compress(_) | ItemError::ForeignTicket))) => {
                    unreachable!("our own decompress batch gave {e}")
                }
                None => unreachable!("a completed batch has every result"),
            };
        }
        Ok(())
    }

    fn submit(&self, batch: Batch) -> Result<Ticket, Error> {
        Ok(Ticket::pending(Box::new(EngineBatch(self.submit_inner(batch)?))))
    }

    /// Also runs the items kept for the submitting core (see
    /// [`EnginesConfig::help_on_wait`]), so polling alone drives a batch to
    /// completion.
    fn poll(&self, ticket: &Ticket) -> bool {
        let TicketInner::Pending(p) = &ticket.inner else { return ticket.is_done() };
        let Some(EngineBatch(inf)) = (&**p as &dyn Any).downcast_ref::<EngineBatch>() else {
            return ticket.is_done();
        };
        for i in 0..inf.items.len() {
            if inf.inline[i] && inf.claim(i) {
                self.run_sw(inf, i, Inline::Help);
            }
        }
        inf.done()
    }

    fn wait(&self, ticket: Ticket) -> Batch {
        match ticket.inner {
            TicketInner::Pending(p) if (&*p as &dyn Any).is::<EngineBatch>() => {
                let ours = (p as Box<dyn Any>).downcast::<EngineBatch>().expect("checked just above");
                self.wait_inner(ours.0)
            }
            inner => Ticket { inner }.finish_foreign(),
        }
    }
}

/// A batch on the engines, as its ticket holds it. Another device's waiter
/// gets what the engines started, and the rest unrun ([`Inflight::abandon`]).
#[derive(Debug)]
struct EngineBatch(Arc<Inflight>);

impl PendingBatch for EngineBatch {
    fn is_done(&self) -> bool {
        self.0.done()
    }

    fn finish(self: Box<Self>) -> Batch {
        self.0.abandon()
    }
}

/// Loom models of the publish-once protocol, on `Inflight`'s own code: an
/// engine and a waiter past its completion timeout run the same item, or a
/// foreign waiter abandons a batch an engine is running. Whatever the
/// interleaving, exactly one run publishes, the batch completes once, and
/// what comes back is the codec's output (or `ForeignTicket` for an item
/// no engine started). Run with
/// `RUSTFLAGS="--cfg loom" cargo test -p zmem-compress --release --lib loom_model`.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use crate::codec::CodecSpec;

    fn page() -> Vec<u8> {
        (0..zmem_common::PAGE_SIZE).map(|i| (i / 64) as u8).collect()
    }

    fn inflight() -> Arc<Inflight> {
        Arc::new(Inflight {
            op: Op::Compress,
            items: vec![sync::Mutex::new(Slot {
                src: Arc::new(page()),
                dst: vec![0; zmem_common::PAGE_SIZE],
                result: None,
            })],
            rooms: vec![zmem_common::PAGE_SIZE],
            claimed: vec![sync::AtomicBool::new(false)],
            finished: vec![sync::AtomicBool::new(false)],
            engine_of: vec![0],
            inline: vec![false],
            remaining: sync::AtomicUsize::new(1),
            waiter: Mutex::new(None),
        })
    }

    fn lz4() -> Box<dyn Compressor> {
        "lz4".parse::<CodecSpec>().unwrap().build()
    }

    /// One run of item 0 as an engine or the waiter does it.
    fn run(inf: &Inflight) -> bool {
        let counters = Counters::default();
        let mut scratch = Vec::new();
        let mut w = Worker { verify: false, counters: &counters, scratch: &mut scratch };
        let mut out = Vec::new();
        inf.run(0, lz4().as_mut(), &mut w, &mut out)
    }

    fn want() -> Vec<u8> {
        let mut d = vec![0u8; zmem_common::PAGE_SIZE];
        let n = lz4().compress(&page(), &mut d).unwrap();
        d.truncate(n);
        d
    }

    /// A one-item batch and an engine thread that claims and runs it (and
    /// says whether it published).
    fn with_engine() -> (Arc<Inflight>, loom::thread::JoinHandle<bool>) {
        let inf = inflight();
        let engine = {
            let inf = Arc::clone(&inf);
            loom::thread::spawn(move || inf.claim(0) && run(&inf))
        };
        (inf, engine)
    }

    #[test]
    fn an_engine_and_a_timed_out_waiter_publish_an_item_once() {
        let want = want();
        loom::model(move || {
            let (inf, engine) = with_engine();
            // The waiter, past its timeout: started or not, it runs it.
            inf.claim(0);
            let waiter = run(&inf);
            let engine = engine.join().unwrap();
            assert!(engine ^ waiter, "exactly one run publishes");
            assert!(inf.done());
            let b = inf.take_batch();
            assert_eq!(b.items[0].output().unwrap().unwrap(), &want[..]);
            assert_eq!(b.items[0].src, page(), "the input comes back");
        });
    }

    #[test]
    fn an_abandoned_batch_completes_with_the_engines_output_or_unrun() {
        let want = want();
        loom::model(move || {
            let (inf, engine) = with_engine();
            // `abandon` without its wait: the engine may still be running.
            let unrun = inf.claim(0) && !inf.finished[0].swap(true, Ordering::AcqRel);
            if unrun {
                sync::lock(&inf.items[0]).result = Some(Err(ItemError::ForeignTicket));
                inf.complete_one();
            }
            let ran = engine.join().unwrap();
            assert!(ran ^ unrun, "the item is either run or left unrun, once");
            assert!(inf.done());
            let b = inf.take_batch();
            match b.items[0].output().unwrap() {
                Ok(got) => assert!(ran && got == &want[..]),
                Err(ItemError::ForeignTicket) => assert!(unrun),
                Err(e) => panic!("{e}"),
            }
        });
    }
}
