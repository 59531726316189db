//! Eviction: isolate victims, MOVE them out to staging, store them in the
//! tier, and finish (or hold what the tier rejected); folios a fork left
//! shared are parked or made exclusive first.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zmem_common::{LockExt, RwLockExt};

use zmem_tier::{StoreOutcome, StoreRequest, TierError};

use super::staging::Staging;
use super::stats::inc;
use super::{Folio, Held, Inner, Pass, RegionState, Staged};
use crate::pagemap::{SharedPages, WriteTracker};
use crate::sys::UffdError;
use zmem_common::PAGE_SIZE;

/// The most folios `FolioTable::cow_broken` holds before it starts again (a
/// folio forgotten there costs one more COW break).
const COW_BROKEN_MAX: usize = 4096;

impl Inner {
    /// 1. Isolate: each victim goes Folio::Resident -> Folio::Evicting under its stripe
    ///    lock. From here faults on it are deferred (`Served::Busy`).
    /// 2. MOVE its pages into staging, with no lock held: a MOVE that gets
    ///    EAGAIN waits for the handler to read an event, and the handler
    ///    never waits for us.
    /// 3. Store the pages in the tier.
    /// 4. Finish under the stripe lock: Folio::Evicted, dropping the entries of
    ///    pages the program dropped meanwhile. A rejected folio keeps its
    ///    pages uncompressed (`held`) until a fault maps them again.
    pub(super) fn evict_batch(&self, staging: &mut Staging, tracker: Option<&mut WriteTracker>) -> Pass {
        let mut pass = Pass::default();
        // This pass's slots follow the last one's (see staging.rs).
        let freed = staging.make_room(&self.uffd);
        if !self.staging_freed(freed) {
            return pass;
        }
        let first_slot = staging.next_slot();
        let victims = self.isolate_folios(tracker);
        pass.isolated = victims.len();
        let isolated = self.begin_eviction(victims, staging, &mut pass);
        let (moved, shared, next_slot) = self.move_out(isolated, staging, first_slot, &mut pass);
        let n = moved.len();
        self.stage_moved(&moved, staging);
        let (spans, outcomes) = self.store_moved(&moved, staging);
        self.finish_moved(&moved, spans, outcomes, staging, &mut pass);
        staging.end_pass(next_slot);
        if n > 0 {
            inc(&self.counters.reclaim_passes);
        }
        for (st, f) in shared {
            self.break_cow(&st, f, staging);
            pass.unevictable += 1;
        }
        pass
    }

    /// The pass's victims, Resident, become Evicting (a fork's shared
    /// folios parked or made the parent's own first); with the pages a
    /// partial load left in the tier of each, which stay there.
    fn begin_eviction(
        &self,
        victims: Vec<(Arc<RegionState>, usize)>,
        staging: &mut Staging,
        pass: &mut Pass,
    ) -> Vec<(Arc<RegionState>, usize, u64)> {
        let mut isolated = Vec::new();
        let forked = self.fork.forked.load(Ordering::Relaxed);
        for (st, f) in victims {
            if forked && self.park_if_shared(&st, f, staging) {
                pass.parked += 1;
                continue;
            }
            if forked {
                // Pages a fork left shared cannot MOVE: make them the
                // parent's own first, while the folio is still Resident (a
                // fault this raises is then served at once).
                self.make_exclusive(&st, f, staging);
            }
            let (lock, _) = self.stripe(&st, f);
            let g = lock.lock_ok();
            if st.folio(f) != Folio::Resident {
                continue;
            }
            st.set_folio(f, Folio::Evicting);
            self.unmapping();
            self.acct.resident.fetch_sub(1, Ordering::Relaxed);
            // Pages a partial load left in the tier stay there: nothing to
            // move, and their entries are kept.
            let swapped = self.clear_swapped(&st, f, u64::MAX);
            drop(g);
            isolated.push((st, f, swapped));
        }
        isolated
    }

    /// MOVEs the Evicting folios out into staging from `first_slot`:
    /// adjacent victims of a region together, one MOVE (and one TLB
    /// shootdown) per run, into consecutive slots. Returns what moved, the
    /// folios whose pages are shared with a forked child (their COW is
    /// broken after the pass), and the slot after the last.
    #[allow(clippy::type_complexity)]
    fn move_out(
        &self,
        mut isolated: Vec<(Arc<RegionState>, usize, u64)>,
        staging: &mut Staging,
        first_slot: usize,
        pass: &mut Pass,
    ) -> (Vec<MovedOut>, Vec<(Arc<RegionState>, usize)>, usize) {
        isolated.sort_unstable_by_key(|(st, f, _)| (st.id, *f));
        let mut moved: Vec<MovedOut> = Vec::new();
        let mut shared = Vec::new();
        let mut next_slot = first_slot;
        let mut i = 0;
        while i < isolated.len() {
            let (st, f0) = (Arc::clone(&isolated[i].0), isolated[i].1);
            let k = isolated[i..].iter().enumerate().take_while(|(j, (s, f, _))| s.id == st.id && *f == f0 + j).count();
            let slot0 = next_slot;
            let swapped: Vec<u64> = isolated[i..i + k].iter().map(|v| v.2).collect();
            next_slot += k;
            i += k;
            for (j, m) in self.move_span(&st, f0, k, staging, slot0, &swapped).into_iter().enumerate() {
                let (f, slot, swapped) = (f0 + j, slot0 + j, swapped[j]);
                let Moved { present, stuck, shared: is_shared } = m;
                staging.mark(slot, &present);
                if stuck && !present.contains(&true) {
                    if self.keep_stuck(&st, f, swapped, is_shared, pass) {
                        shared.push((Arc::clone(&st), f));
                    }
                    continue;
                }
                moved.push(MovedOut { st: Arc::clone(&st), f, slot, present, swapped });
            }
        }
        (moved, shared, next_slot)
    }

    /// Folio `f` of `st`, none of whose pages could move (mlocked, pinned,
    /// shared), stays resident. Returns whether its pages are shared with
    /// a forked child and its COW is to be broken; otherwise it goes off
    /// the lists.
    fn keep_stuck(&self, st: &Arc<RegionState>, f: usize, swapped: u64, is_shared: bool, pass: &mut Pass) -> bool {
        self.finish(st, f, |dropped| {
            st.set_folio(f, Folio::Resident);
            self.acct.resident.fetch_add(1, Ordering::Relaxed);
            // Less what the program dropped meanwhile (`finish` drops
            // their entries).
            let gone = dropped.iter().enumerate().filter(|(_, &d)| d).fold(0u64, |a, (p, _)| a | 1 << (p % 64));
            self.set_swapped(st, f, swapped & !gone);
        });
        // EBUSY is a page shared with a forked child, or one pinned
        // (`folio_maybe_dma_pinned`: io_uring's registered buffers, RDMA).
        // A COW break makes a shared folio movable; one still busy right
        // after its break is pinned, and goes off the lists as a locked
        // one. A pinned one went back on the lists after every break, and
        // reclaim broke it again: fio's 64 MiB of registered buffers under
        // 32M, 400k breaks in 16 s, all of a CPU.
        let pinned = is_shared && {
            let mut broken = self.folios.cow_broken.lock_ok();
            let again = broken.remove(&(st.id, f));
            if !again {
                // Folios of regions gone since stay behind: bounded.
                if broken.len() >= COW_BROKEN_MAX {
                    broken.clear();
                }
                broken.insert((st.id, f));
            }
            again
        };
        if is_shared && !pinned {
            return true;
        }
        // Off the lists (as the kernel's unevictable LRU) until reclaim
        // looks again, now and then: it may be unlocked.
        st.queued[f].store(true, Ordering::Release);
        self.lists.lru.lock_ok().unevictable.push((Arc::clone(st), f));
        self.lists.lru_len.fetch_add(1, Ordering::Relaxed);
        inc(&self.counters.unevictable_folios);
        pass.unevictable += 1;
        false
    }

    /// The folios that moved: from here a fault on one of them is served
    /// from its slot (`rescue`), not made to wait for the pass, and a fault
    /// waiting in `throttle` goes on (usage fell at isolation), not when
    /// the pass has been compressed and stored.
    fn stage_moved(&self, moved: &[MovedOut], staging: &Staging) {
        {
            let mut broken = self.folios.cow_broken.lock_ok();
            if !broken.is_empty() {
                for m in moved {
                    broken.remove(&(m.st.id, m.f));
                }
            }
        }
        {
            let mut staged = self.folios.staged.lock_ok();
            for MovedOut { st, f, slot, present, swapped } in moved {
                let s = Staged {
                    addr: staging.slot_addr(*slot),
                    present: present.clone(),
                    swapped: *swapped,
                    rescued: false,
                };
                staged.insert((st.id, *f), s);
            }
        }
        if !moved.is_empty() && !self.cfg.inject_store_delay.is_zero() {
            std::thread::sleep(self.cfg.inject_store_delay);
        }
        if !moved.is_empty() {
            self.wake_reclaim_waiters();
        }
    }

    /// Stores the pages that moved, every run of every folio in one call,
    /// so that a compressor with engines spreads the pass over every core.
    /// Returns each folio's runs with the range of their outcomes, and the
    /// outcomes.
    fn store_moved(&self, moved: &[MovedOut], staging: &Staging) -> (Vec<Span>, Vec<Result<StoreOutcome, TierError>>) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let mut reqs = Vec::with_capacity(moved.len());
        let mut spans = Vec::with_capacity(moved.len());
        for MovedOut { st, f, slot, present, swapped } in moved {
            // Only the pages MOVE filled may be read (see staging.rs).
            let runs = page_runs(present);
            // Pages that did not move lose any entry a load kept (a page
            // gone without an event, as MADV_FREE lets the kernel do, must
            // not come back as its old bytes). In a folio loaded with its
            // entries kept, the pages that moved keep theirs where the
            // bytes are unchanged (`store_reusing` compares them).
            let reuse = st.cached[*f].swap(false, Ordering::Relaxed);
            // Pages a partial load left in the tier keep their entries.
            let in_tier = |i: usize| i < 64 && swapped >> i & 1 != 0;
            if present.contains(&false) {
                for p in self.folio_pages(st, *f).filter(|&p| !present[p - f * ppf] && !in_tier(p - f * ppf)) {
                    self.tier.invalidate(st.key(p));
                }
            }
            let first = reqs.len();
            for &(p, n) in &runs {
                reqs.push(StoreRequest { key: st.key(f * ppf + p), folio: staging.run(*slot, p, n), reuse });
            }
            spans.push((runs, first..reqs.len()));
        }
        let (stored_at, store_pages) = (Instant::now(), reqs.iter().map(|r| r.folio.len() / PAGE_SIZE).sum::<usize>());
        let outcomes = if self.tier.stores_on_caller() {
            // SAFETY: the folios are this pass's staging slots, MOVE-filled
            // above. Only this thread frees or reuses a slot (`make_room`,
            // `release`, the next pass's `place`), and MOVE writes only to
            // empty ones, so they stay mapped and unchanged until `finish`
            // returns below, whoever holds the pass then.
            let pass = Arc::new(unsafe { super::direct::PassStores::new(&reqs) });
            *self.acct.pass_stores.lock_ok() = Some(Arc::clone(&pass));
            // A fault waiting in `throttle` takes folios of it.
            self.wake_reclaim_waiters();
            let outcomes = pass.finish(&self.tier);
            *self.acct.pass_stores.lock_ok() = None;
            outcomes
        } else {
            self.tier.store_many(&reqs)
        };
        drop(reqs);
        self.counters.reclaim_store_ns.fetch_add(stored_at.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.counters.reclaim_store_pages.fetch_add(store_pages as u64, Ordering::Relaxed);
        (spans, outcomes)
    }

    /// Each folio that moved is Evicted where all its runs were stored;
    /// where one was rejected, its pages are kept as they are (held); one a
    /// fault mapped back from staging meanwhile stays resident.
    fn finish_moved(
        &self,
        moved: &[MovedOut],
        spans: Vec<Span>,
        outcomes: Vec<Result<StoreOutcome, TierError>>,
        staging: &Staging,
        pass: &mut Pass,
    ) {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        for (MovedOut { st, f, slot, present, .. }, (runs, span)) in moved.iter().zip(spans) {
            let slot = *slot;
            let run_data = |p: usize, n: usize| staging.run(slot, p, n);
            let ok = outcomes[span].iter().all(|r| matches!(r, Ok(StoreOutcome::Stored { .. })));
            // A rejected folio's pages are copied out before the lock.
            let kept = (!ok).then(|| {
                let mut data = vec![0u8; fs].into_boxed_slice();
                for &(p, n) in &runs {
                    data[p * PAGE_SIZE..(p + n) * PAGE_SIZE].copy_from_slice(run_data(p, n));
                }
                data
            });
            self.finish(st, *f, |dropped| {
                if self.folios.staged.lock_ok().remove(&(st.id, *f)).is_some_and(|s| s.rescued) {
                    // A fault mapped it back from staging (`rescue`): it is
                    // resident (or dropped since), and what this pass
                    // stored of it goes. Its pages in the tier stay.
                    for &(p, n) in &runs {
                        for q in p..p + n {
                            self.tier.invalidate(st.key(f * ppf + q));
                        }
                    }
                    pass.rescued += 1;
                    return;
                }
                if ok {
                    inc(&self.counters.evicted_folios);
                    pass.evicted += 1;
                    st.evicted_at[*f].store(self.lists.evict_clock.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
                } else {
                    // Keep the pages as they are (what was stored goes;
                    // pages left in the tier by a partial load stay there).
                    for &(p, n) in &runs {
                        for q in p..p + n {
                            self.tier.invalidate(st.key(f * ppf + q));
                        }
                    }
                    let present: Vec<bool> = present.iter().zip(dropped).map(|(&p, &d)| p && !d).collect();
                    if let Some(data) = kept.filter(|_| present.contains(&true)) {
                        let h = Held { data, present };
                        self.folios.held_bytes.fetch_add(fs, Ordering::Relaxed);
                        let old = self.folios.held.lock_ok().insert((st.id, *f), h);
                        debug_assert!(old.is_none(), "a held folio was evicted again");
                    }
                    inc(&self.counters.eviction_rejects);
                    pass.rejected += 1;
                }
                st.set_folio(*f, Folio::Evicted);
            });
        }
    }

    /// Folio `f` (Resident) could not move because its pages are shared
    /// with a forked child (UFFDIO_MOVE wants exclusive pages: EBUSY). A
    /// write would give the parent its own copy, or take the page back as
    /// exclusive once the child is gone; `MADV_POPULATE_WRITE` does what
    /// the write would to the page tables, without touching the data, and
    /// fails (rather than faulting) where the program unmapped the range
    /// meanwhile. The folio then goes back on the lists, to move next time.
    fn break_cow(&self, st: &Arc<RegionState>, f: usize, staging: &Staging) {
        self.make_exclusive(st, f, staging);
        inc(&self.counters.cow_breaks);
        self.lru_add(st, f);
    }

    /// Puts folio `f` on the shared list if another process maps at least
    /// half of its present pages (see `Lru::shared`). Returns whether it
    /// did. A folio with fewer shared pages is evicted: its few shared
    /// pages are copied first (`make_exclusive`), and the rest is freed.
    fn park_if_shared(&self, st: &Arc<RegionState>, f: usize, staging: &Staging) -> bool {
        let fs = self.cfg.folio_size;
        let src = st.start.load(Ordering::Acquire) + (f * fs) as u64;
        let Some(SharedPages { shared, .. }) =
            staging.shared_pages(src, fs / PAGE_SIZE).filter(SharedPages::mostly_shared)
        else {
            return false;
        };
        self.park_shared(st, f, shared);
        true
    }

    /// Puts folio `f`, `shared` of whose pages another process maps too, on
    /// the shared list, and charges those pages to no one.
    pub(super) fn park_shared(&self, st: &Arc<RegionState>, f: usize, shared: usize) {
        st.queued[f].store(true, Ordering::Release);
        let mut lru = self.lists.lru.lock_ok();
        lru.shared.push(((Arc::clone(st), f), shared));
        // Under the list's lock, as `rescan_shared` takes the list and
        // subtracts what it held: the count never wraps below zero.
        self.lists.shared_pages.fetch_add(shared, Ordering::Relaxed);
        drop(lru);
        self.lists.lru_len.fetch_add(1, Ordering::Relaxed);
        inc(&self.counters.shared_parks);
    }

    /// Looks at the shared folios again: those that are this process's own
    /// now (the other process wrote, evicted or exited), or mostly so, or
    /// no longer resident, go back on the inactive list and are charged in
    /// full again.
    pub(super) fn rescan_shared(&self, staging: &Staging) {
        let list = std::mem::take(&mut self.lists.lru.lock_ok().shared);
        if list.is_empty() {
            return;
        }
        let fs = self.cfg.folio_size;
        let (mut still, mut back) = (Vec::new(), Vec::new());
        let (mut was, mut now) = (0, 0);
        for ((st, f), n) in list {
            was += n;
            let src = st.start.load(Ordering::Acquire) + (f * fs) as u64;
            let resident = st.folio(f) == Folio::Resident && !st.in_hole(f * fs);
            let look = if resident { staging.shared_pages(src, fs / PAGE_SIZE) } else { None };
            match look.filter(SharedPages::mostly_shared) {
                Some(SharedPages { shared, .. }) => {
                    now += shared;
                    still.push(((st, f), shared));
                }
                None => back.push((st, f)),
            }
        }
        let mut lru = self.lists.lru.lock_ok();
        // Under the list's lock, as `park_if_shared` adds.
        self.lists.shared_pages.fetch_add(now, Ordering::Relaxed);
        self.lists.shared_pages.fetch_sub(was, Ordering::Relaxed);
        lru.shared.extend(still);
        lru.inactive.extend(back);
    }

    /// `MADV_POPULATE_WRITE` over the present pages of folio `f`: copy on
    /// write is broken where a fork left them shared (see `break_cow`). A
    /// walk of the page tables where they are the program's own already.
    fn make_exclusive(&self, st: &RegionState, f: usize, staging: &Staging) {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        let src = st.start.load(Ordering::Acquire) + (f * fs) as u64;
        // Present pages only: populating a page the program dropped would
        // bring it back as zeros and count against the limit.
        let mapped = staging.mapped(src, ppf).unwrap_or_else(|| vec![true; ppf]);
        for (p, n) in page_runs(&mapped) {
            let (addr, len) = (src + (p * PAGE_SIZE) as u64, n * PAGE_SIZE);
            // SAFETY: POPULATE_WRITE changes page tables (breaking copy on
            // write), never the bytes of the range; a range unmapped
            // meanwhile fails with ENOMEM.
            let r = unsafe { rustix::mm::madvise(addr as *mut _, len, rustix::mm::Advice::LinuxPopulateWrite) };
            if let Err(e) = r {
                log::debug!("MADV_POPULATE_WRITE of a shared folio: {e}");
            }
        }
    }

    /// MOVEs folios `[f, f + k)` (all Folio::Evicting) to slots
    /// `[slot, slot + k)` of staging: one MOVE per run of pages between the
    /// program's holes. Returns what moved of each folio.
    ///
    /// The kernel's count of what moved is not the last word. Linux 6.18's
    /// `move_pages()` keeps a stale `-EAGAIN` from a retry inside the ioctl
    /// (a PTE that changed under it, as a concurrent write does). The next
    /// step moves its pages, is not counted, and is retried. That retry
    /// fails with EEXIST on the page that just moved. Trusting the count
    /// leaves pages in staging that no entry holds, and the program later
    /// reads zeros there. So after any MOVE that failed or came up short,
    /// which pages moved is read from the slots' page tables: the slots
    /// were empty before, so what they hold now is what moved.
    ///
    /// `swapped` (one mask per folio) are pages a partial load left in the
    /// tier: they are not mapped, and are stepped over as holes are.
    ///
    /// Never MOVE from what the program unmapped: the kernel may have put
    /// someone else's pages there since (a brk heap shrunk and grown
    /// again: UFFDIO_MOVE takes pages from any anonymous VMA, registered
    /// or not). `events` is held from looking up the holes until the
    /// MOVEs are done: every UNMAP read before is a hole here, and one
    /// not yet read fails our MOVE with EAGAIN (the kernel's
    /// `mmap_changing`, raised until the event is read), after which the
    /// lock is let go for the handler and the holes looked up again.
    /// Holding it only while looking up left a window: the handler read
    /// an UNMAP, the program grew its heap back over the range and wrote
    /// there, and this MOVE took the new pages (they read as zeros).
    pub(super) fn move_span(
        &self,
        st: &RegionState,
        f: usize,
        k: usize,
        staging: &mut Staging,
        slot: usize,
        swapped: &[u64],
    ) -> Vec<Moved> {
        let fs = self.cfg.folio_size as u64;
        let ppf = fs as usize / PAGE_SIZE;
        let span = fs * k as u64;
        let exec = st.exec.load(Ordering::Relaxed);
        if !staging.place(&self.uffd, slot, k, exec) {
            staging.place(&self.uffd, slot, k, false);
        }
        let mut dst = staging.slot_addr(slot);
        // The slots' home was switched once (see below).
        let mut switched = false;
        let mut present = vec![false; k * ppf];
        // Pages whose MOVE failed with an error other than EAGAIN, and
        // which of them failed because they are shared (EBUSY).
        let mut failed = vec![false; k * ppf];
        let mut busy = vec![false; k * ppf];
        let mut recount = false;
        // Never from what the program unmapped (see above).
        let mut events = self.gate.events.read_ok();
        let mut holes = st.holes_in(f * ppf, k * ppf);
        if !self.cfg.inject_move_delay.is_zero() {
            std::thread::sleep(self.cfg.inject_move_delay);
        }
        let mut off = 0u64;
        while off < span {
            let hole = |off: u64| {
                let p = off as usize / PAGE_SIZE;
                holes.as_ref().is_some_and(|h| h[p]) || (p % ppf < 64 && swapped[p / ppf] >> (p % ppf) & 1 != 0)
            };
            if hole(off) {
                off += PAGE_SIZE as u64;
                continue;
            }
            // Up to the next hole.
            let run_end = (off..span).step_by(PAGE_SIZE).find(|&o| hole(o)).unwrap_or(span);
            // Read the address each time: a REMAP may move the region.
            let src = st.start.load(Ordering::Acquire) + f as u64 * fs;
            let page = off as usize / PAGE_SIZE;
            match st.move_out(&self.uffd, src + off, dst + off, run_end - off) {
                Ok(n) => {
                    present[page..(off + n) as usize / PAGE_SIZE].fill(true);
                    // A hole (or the end) follows what moved.
                    recount |= off + n < run_end;
                    off += n + PAGE_SIZE as u64;
                }
                // An event is unread: the handler reads it (it never waits
                // for an Folio::Evicting folio), then the MOVE goes through.
                Err(UffdError::Again { done }) => {
                    present[page..(off + done) as usize / PAGE_SIZE].fill(true);
                    recount = true;
                    off += done;
                    drop(events);
                    std::thread::sleep(Duration::from_micros(20));
                    events = self.gate.events.read_ok();
                    holes = st.holes_in(f * ppf, k * ppf);
                }
                // The protections differ (`home_differs`; an EINVAL for
                // another reason, a span across two mappings, fails below).
                Err(UffdError::Ioctl { errno: rustix::io::Errno::INVAL, .. })
                    if !switched
                        && !present.contains(&true)
                        && !failed.contains(&true)
                        && self.home_differs(src + off, staging, slot, k) =>
                {
                    switched = true;
                    let other = !staging.is_exec(slot);
                    if staging.place(&self.uffd, slot, k, other) {
                        st.exec.store(other, Ordering::Relaxed);
                        dst = staging.slot_addr(slot);
                    }
                }
                // A page that cannot move (mlocked, shared, pinned) stays;
                // or one that moved uncounted (EEXIST), found below.
                Err(e) => {
                    busy[page] = matches!(e, UffdError::Ioctl { errno: rustix::io::Errno::BUSY, .. });
                    failed[page] = true;
                    recount = true;
                    off += PAGE_SIZE as u64;
                }
            }
        }
        drop(events);
        if recount {
            if let Some(occupied) = staging.occupied(slot, k) {
                if occupied != present {
                    inc(&self.counters.move_recounts);
                }
                present = occupied;
            }
        }
        per_folio(ppf, &present, &failed, &busy)
    }

    /// Whether a MOVE from `src` into the `k` slots from `slot` failed
    /// with EINVAL because the two mappings' protections differ (the
    /// region's executable and the slots' home not, or the other way
    /// round), with nothing moved yet (the slots' page tables say so: a
    /// failed MOVE's count is not the last word): the slots may then move
    /// to the other home and the run be tried again there.
    fn home_differs(&self, src: u64, staging: &Staging, slot: usize, k: usize) -> bool {
        self.maps().ok().and_then(|fd| crate::vmas::executable(fd, src)).is_some_and(|x| x != staging.is_exec(slot))
            && staging.occupied(slot, k).is_none_or(|o| !o.contains(&true))
    }

    /// Ends an eviction of folio `f` under its stripe lock: `done` gets the
    /// pages the program dropped meanwhile (their entries are gone after
    /// it) and sets the new state; waiters are woken.
    pub(super) fn finish(&self, st: &RegionState, f: usize, done: impl FnOnce(&[bool])) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let (lock, cv) = self.stripe(st, f);
        let g = lock.lock_ok();
        let dropped = self.folios.dropped.lock_ok().remove(&(st.id, f));
        let dropped = dropped.unwrap_or_else(|| vec![false; ppf]);
        done(&dropped);
        for p in dropped.iter().enumerate().filter(|(_, &d)| d).map(|(p, _)| p) {
            self.tier.invalidate(st.key(f * ppf + p));
        }
        let forward = self.take_forward(st, f);
        // Waiters are rare (a region retired mid-eviction); a notify is a
        // futex call per evicted folio.
        if *g > 0 {
            cv.notify_all();
        }
        drop(g);
        if !forward.is_empty() {
            self.finish_forward(forward);
        }
    }
}

/// A victim whose pages moved to staging, to store.
/// A moved folio's runs of pages (first, count), and the range of their
/// store outcomes.
type Span = (Vec<(usize, usize)>, std::ops::Range<usize>);

struct MovedOut {
    st: Arc<RegionState>,
    f: usize,
    /// Its slot in staging.
    slot: usize,
    /// Which of its pages moved.
    present: Vec<bool>,
    /// Which were left in the tier by a partial load (they keep their
    /// entries).
    swapped: u64,
}

/// What [`Inner::move_span`] did to one folio.
pub(super) struct Moved {
    /// The pages that moved.
    pub(super) present: Vec<bool>,
    /// Some page could not move for a reason other than being a hole (it
    /// stays mapped).
    pub(super) stuck: bool,
    /// Some page could not move because it is shared (EBUSY: after fork).
    pub(super) shared: bool,
}

/// The runs of `true` in `present`, as (first page, pages).
pub(super) fn page_runs(present: &[bool]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut p = 0;
    while p < present.len() {
        if present[p] {
            let n = present[p..].iter().take_while(|&&x| x).count();
            runs.push((p, n));
            p += n;
        } else {
            p += 1;
        }
    }
    runs
}

/// What [`Inner::move_span`] found, folio by folio (`ppf` pages each):
/// the pages that moved, whether one failed and stayed (`stuck`), and
/// whether one of those is shared with a forked child (EBUSY).
fn per_folio(ppf: usize, present: &[bool], failed: &[bool], busy: &[bool]) -> Vec<Moved> {
    (0..present.len() / ppf)
        .map(|j| {
            let r = j * ppf..(j + 1) * ppf;
            let stuck = failed[r.clone()].iter().zip(&present[r.clone()]).any(|(&x, &moved)| x && !moved);
            Moved { present: present[r.clone()].to_vec(), stuck, shared: busy[r].contains(&true) }
        })
        .collect()
}
