//! Swap-in read-ahead: slots read before a load asks for them.
//!
//! A sequential walk over written-back memory loads folio after folio, and
//! with synchronous `O_DIRECT` reads each one waits out the disk (~60 µs for
//! 4 KiB here, ~200 µs for 128 KiB) while the CPU that could decompress and
//! map it sits idle. [`SwapFile::prefetch`] instead submits the reads of
//! the slots a walk will want next through an io_uring, without waiting;
//! their blocks land, decrypted and checked, in a small cache that
//! [`SwapFile::read_batch`] takes from. The kernel's swap-in read-ahead
//! (`swap_vma_readahead`) plays the same part for zswap's writeback.
//!
//! # Correctness
//! A cached block must be the slot's current content. The cache lives
//! under the same lock as the slot map (`Slots::ahead`):
//! - a prefetch snapshots the slot's checksum and marks it `InFlight(ticket)`
//!   in one critical section, and submits the read after;
//! - freeing a slot (its last object dropped) removes its mark or block,
//!   and a slot is only ever written after it was allocated free;
//! - a completed read becomes `Ready` only if the mark is still its own and
//!   the decrypted block matches the snapshot's checksum. A read that raced
//!   a rewrite of the slot either lost its mark or fails the checksum (it
//!   read the old bytes against the new sum, or a torn block): it is
//!   dropped, and the load reads the slot itself, as without read-ahead.
//!
//! A failed or short read is dropped the same way: read-ahead never
//! reports an error, the load that needs the slot does.
//!
//! # Fork
//! The ring is shared memory with the kernel: a forked child (zmem follows
//! forks) must never touch the parent's. Every use checks the process id
//! it was made in, and the child's loads read slots themselves.
//!
//! Lock order: `Ring::state`, then `SwapFile::slots`.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use zmem_common::LockExt;
use zmem_common::PAGE_SIZE;
use zmem_zsmalloc::Page;

use super::{Slot, SwapFile};

/// Ring entries: the most runs in flight at once.
const RING_ENTRIES: u32 = 64;

/// The most blocks the cache holds, in flight and ready: 2 MiB.
pub(crate) const MAX_BLOCKS: usize = 512;

/// The most slots one read-ahead read covers.
const MAX_RUN: usize = 32;

/// How long a load waits for a read in flight before it reads the slot
/// itself (a device that stopped answering must not stop the handler).
const WAIT_LIMIT: Duration = Duration::from_millis(100);

/// A slot's read-ahead state, in `Slots::ahead`.
#[derive(Debug)]
pub(crate) enum Block {
    /// Read by run `ticket`; the slot's checksum when it was asked.
    InFlight { ticket: u64, sum: u32 },
    /// Read, decrypted and checked.
    Ready(Page),
}

/// The cache's part of `Slots`.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    pub(crate) blocks: HashMap<Slot, Block>,
    /// Ready blocks, oldest first (some may be gone since): the bound.
    ready: VecDeque<Slot>,
}

impl Cache {
    /// Queues `slot` (Ready now) for `make_room`. Slots forgotten since
    /// they were queued are left in the queue until it is twice the bound,
    /// then swept.
    fn push_ready(&mut self, slot: Slot) {
        self.ready.push_back(slot);
        if self.ready.len() > 2 * MAX_BLOCKS {
            let blocks = &self.blocks;
            self.ready.retain(|s| matches!(blocks.get(s), Some(Block::Ready(_))));
        }
    }

    /// Forgets the oldest ready blocks until `n` more fit under the bound
    /// (or none is left to forget); their pages go to `free`.
    fn make_room(&mut self, n: usize, free: &mut Vec<Page>) {
        while self.blocks.len() + n > MAX_BLOCKS {
            let Some(s) = self.ready.pop_front() else { break };
            if matches!(self.blocks.get(&s), Some(Block::Ready(_))) {
                self.forget(s, free);
            }
        }
    }

    /// Forgets `slot` (freed, or about to be written): its page, if it had
    /// one, goes to `free`.
    pub(crate) fn forget(&mut self, slot: Slot, free: &mut Vec<Page>) {
        if let Some(Block::Ready(p)) = self.blocks.remove(&slot) {
            free.push(p);
        }
    }
}

/// A read in flight: its pages must outlive it, whatever happens to the
/// slots meanwhile.
struct Run {
    first: Slot,
    pages: Vec<Page>,
    iov: Box<[libc::iovec]>,
}

// SAFETY: `iov` points into `pages`, which the run owns and which no one
// else touches until the kernel is done with them (the run is only taken out
// of `Ring::state` when its completion arrives); moving the run between
// threads moves neither the pages' memory nor the boxed iovecs.
unsafe impl Send for Run {}

struct State {
    ring: IoUring,
    runs: HashMap<u64, Run>,
    next: u64,
}

/// The swap file's io_uring, for read-ahead only.
pub(crate) struct Ring {
    state: Mutex<State>,
    pid: u32,
    fd: i32,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("pid", &self.pid).finish()
    }
}

impl Ring {
    /// A ring, or `None` where the kernel (or a seccomp filter, as
    /// container runtimes install) refuses io_uring: loads then read
    /// slots themselves.
    pub(crate) fn new() -> Option<Ring> {
        // Not inherited by a forked child (MADV_DONTFORK on its mappings):
        // the child never uses it, and must not hold the kernel's shared
        // pages of it.
        match IoUring::builder().dontfork().build(RING_ENTRIES) {
            Ok(ring) => {
                let fd = ring.as_raw_fd();
                // Kept from the program's `close` family, as the file is.
                zmem_common::host::fds::keep(fd);
                let state = State { ring, runs: HashMap::new(), next: 1 };
                Some(Ring { state: Mutex::new(state), pid: std::process::id(), fd })
            }
            Err(e) => {
                log::info!("no io_uring ({e}): swap-in reads are synchronous");
                None
            }
        }
    }

    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd
    }

    /// Whether this process made the ring (a forked child did not).
    pub(crate) fn ours(&self) -> bool {
        std::process::id() == self.pid
    }
}

impl SwapFile {
    /// Starts reading `slots` ahead of the loads that will want them: one
    /// read per run of neighbouring slots, submitted without waiting.
    /// Slots not in use, already cached or in flight are skipped, as is
    /// everything past the cache's bound. Does nothing without a ring.
    pub fn prefetch(&self, slots: &[Slot]) {
        let Some(ring) = self.ahead.as_ref().filter(|r| r.ours()) else { return };
        let mut want: Vec<Slot> = slots.to_vec();
        want.sort_unstable();
        want.dedup();
        // Runs of neighbouring slots, with each slot's checksum.
        let mut runs: Vec<(Slot, Vec<u32>)> = Vec::new();
        let mut free = Vec::new();
        {
            let mut g = self.lock();
            // Room first: the oldest ready blocks go (a walk is past them).
            g.ahead.make_room(want.len().min(MAX_BLOCKS / 2), &mut free);
            let mut room = MAX_BLOCKS.saturating_sub(g.ahead.blocks.len());
            for &s in &want {
                if room == 0 {
                    break;
                }
                if !g.map.in_use(s) || g.ahead.blocks.contains_key(&s) {
                    continue;
                }
                let sum = g.sums.get(s as usize).copied().unwrap_or(0);
                match runs.last_mut() {
                    Some((first, sums)) if *first + sums.len() as u32 == s && sums.len() < MAX_RUN => sums.push(sum),
                    _ => runs.push((s, vec![sum])),
                }
                room -= 1;
            }
        }
        self.mempool.free_pages(free);
        if runs.is_empty() {
            return;
        }
        let n: usize = runs.iter().map(|r| r.1.len()).sum();
        let mut pages = self.mempool.alloc_pages_bulk_array(n).pages;
        if pages.len() < n {
            self.mempool.free_pages(pages);
            return;
        }
        let mut st = ring.state.lock_ok();
        // Marked under both locks, so a completion reaped meanwhile cannot
        // see a mark before its run is known.
        let mut g = self.lock();
        let mut submitted = false;
        for (first, sums) in runs {
            let ticket = st.next;
            st.next += 1;
            // A slot freed or cached since the look above is left out: the
            // run ends before it.
            let k = (0..sums.len())
                .take_while(|&j| {
                    let s = first + j as u32;
                    g.map.in_use(s) && !g.ahead.blocks.contains_key(&s) && g.sums.get(s as usize) == Some(&sums[j])
                })
                .count();
            if k == 0 {
                continue;
            }
            let run_pages: Vec<Page> = pages.drain(pages.len() - k..).collect();
            let mut run = Run { first, pages: run_pages, iov: Box::new([]) };
            run.iov = run
                .pages
                .iter_mut()
                .map(|p| libc::iovec { iov_base: p.as_mut_slice().as_mut_ptr().cast(), iov_len: PAGE_SIZE })
                .collect();
            // A read that would block (the inode's lock taken by a write, a
            // busy queue) goes to a kernel worker thread (`iou-wrk-*`), a
            // thread of the program's process; the last one idle stays as
            // long as the handler. Once the program has changed its root
            // (`zmem_common::host::thread::no_new_io_workers`), zmem can no longer
            // tell a new one from a thread of the program's: then
            // RWF_NOWAIT, and such a read fails with EAGAIN and is dropped
            // (a walk's reads served ahead: 91-96%, against 96-99%).
            let nowait = if zmem_common::host::thread::io_workers_allowed() { 0 } else { libc::RWF_NOWAIT };
            let entry = opcode::Readv::new(types::Fd(self.file.as_raw_fd()), run.iov.as_ptr(), k as u32)
                .offset(u64::from(first) * PAGE_SIZE as u64)
                .rw_flags(nowait)
                .build()
                .user_data(ticket);
            // SAFETY: the iovecs and the pages they point to belong to
            // `run`, which goes into `st.runs` right below and leaves it
            // only when this entry's completion is reaped (or, at drop,
            // once every run has completed): they outlive the read. The
            // file descriptor lives as long as `self`, whose drop waits for
            // every run.
            if unsafe { st.ring.submission().push(&entry) }.is_err() {
                // The ring is full: what is left waits for the next call
                // (its pages go back with the rest, below).
                pages.extend(run.pages);
                break;
            }
            for (j, &sum) in sums.iter().enumerate().take(k) {
                g.ahead.blocks.insert(first + j as u32, Block::InFlight { ticket, sum });
            }
            st.runs.insert(ticket, run);
            submitted = true;
        }
        drop(g);
        self.mempool.free_pages(pages);
        if submitted {
            if let Err(e) = st.ring.submit() {
                log::debug!("io_uring submit: {e}");
            }
        }
        self.reap(&mut st);
    }

    /// Handles the completions that have arrived: blocks read whole and
    /// checked become `Ready` (if their mark is still theirs); the rest is
    /// dropped.
    fn reap(&self, st: &mut State) {
        let done: Vec<(u64, i32)> = st.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        if done.is_empty() {
            return;
        }
        let mut ready: Vec<(Slot, u64, Page)> = Vec::new();
        let mut free = Vec::new();
        for (ticket, res) in done {
            let Some(run) = st.runs.remove(&ticket) else { continue };
            let Run { first, pages, .. } = run;
            let whole = usize::try_from(res).is_ok_and(|n| n == pages.len() * PAGE_SIZE);
            for (j, mut p) in pages.into_iter().enumerate() {
                let slot = first + j as u32;
                if whole {
                    if let Some(c) = &self.crypt {
                        c.decrypt(slot, p.as_mut_slice());
                    }
                    ready.push((slot, ticket, p));
                } else {
                    free.push(p);
                }
            }
            if !whole {
                let mut g = self.lock();
                g.ahead.blocks.retain(|_, b| !matches!(b, Block::InFlight { ticket: t, .. } if *t == ticket));
            }
        }
        // The checksums, outside the lock.
        let sums: Vec<u32> = ready.iter().map(|(_, _, p)| crc32fast::hash(p.as_slice())).collect();
        let mut g = self.lock();
        for ((slot, ticket, p), sum) in ready.into_iter().zip(sums) {
            match g.ahead.blocks.get(&slot) {
                Some(&Block::InFlight { ticket: t, sum: want }) if t == ticket => {
                    if sum == want {
                        g.ahead.blocks.insert(slot, Block::Ready(p));
                        g.ahead.push_ready(slot);
                        self.ahead_ready.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    } else {
                        // Raced a rewrite of the slot: the load reads it.
                        g.ahead.blocks.remove(&slot);
                        free.push(p);
                    }
                }
                _ => free.push(p),
            }
        }
        drop(g);
        self.mempool.free_pages(free);
    }

    /// For `read_batch`: copies the cached blocks of `reqs` into place,
    /// first waiting (a while) for those in flight. Returns which requests
    /// it served; the rest are read from the file.
    pub(crate) fn take_ahead(&self, reqs: &mut [(Slot, &mut [u8])]) -> Vec<bool> {
        let mut served = vec![false; reqs.len()];
        let Some(ring) = self.ahead.as_ref().filter(|r| r.ours()) else { return served };
        let in_flight = |g: &super::Slots| -> Vec<u64> {
            let mut t: Vec<u64> = reqs
                .iter()
                .filter_map(|(s, _)| match g.ahead.blocks.get(s) {
                    Some(Block::InFlight { ticket, .. }) => Some(*ticket),
                    _ => None,
                })
                .collect();
            t.sort_unstable();
            t.dedup();
            t
        };
        let waiting = {
            let g = self.lock();
            if g.ahead.blocks.is_empty() {
                return served;
            }
            in_flight(&g)
        };
        if !waiting.is_empty() {
            let mut st = ring.state.lock_ok();
            let deadline = Instant::now() + WAIT_LIMIT;
            loop {
                self.reap(&mut st);
                if waiting.iter().all(|t| !st.runs.contains_key(t)) || Instant::now() >= deadline {
                    break;
                }
                // Wait for a completion, 1 ms at most a time: an error or a
                // signal only loops, bounded by the deadline.
                let ts = types::Timespec::new().nsec(1_000_000);
                let _ = st.ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&ts));
            }
        }
        let g = self.lock();
        for (i, (slot, dst)) in reqs.iter_mut().enumerate() {
            if let Some(Block::Ready(p)) = g.ahead.blocks.get(slot) {
                if dst.len() == PAGE_SIZE {
                    dst.copy_from_slice(p.as_slice());
                    served[i] = true;
                }
            }
        }
        let n = served.iter().filter(|&&s| s).count() as u64;
        self.ahead_hits.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        served
    }

    /// At drop: waits for every read in flight (the kernel writes into the
    /// runs' pages until it completes them), then frees the cache.
    pub(crate) fn drain_ahead(&mut self) {
        let Some(ring) = self.ahead.take() else { return };
        if !ring.ours() {
            // A forked child's copy: the parent's reads are not ours to
            // wait for, and its pages are only this process's copy.
            std::mem::forget(ring);
            return;
        }
        let mut st = ring.state.lock_ok();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !st.runs.is_empty() && Instant::now() < deadline {
            let done: Vec<u64> = st.ring.completion().map(|c| c.user_data()).collect();
            for t in done {
                if let Some(run) = st.runs.remove(&t) {
                    self.mempool.free_pages(run.pages);
                }
            }
            if !st.runs.is_empty() {
                let _ = st.ring.submit_and_wait(1);
            }
        }
        if !st.runs.is_empty() {
            // Never completed: leave their pages to the kernel, for good.
            log::warn!("{} swap read-ahead reads never completed", st.runs.len());
            std::mem::forget(std::mem::take(&mut st.runs));
        }
        drop(st);
        zmem_common::host::fds::forget(ring.fd);
        let mut free = Vec::new();
        let mut g = self.lock();
        for (_, b) in g.ahead.blocks.drain() {
            if let Block::Ready(p) = b {
                free.push(p);
            }
        }
        drop(g);
        self.mempool.free_pages(free);
    }
}
