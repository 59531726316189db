//! Faults: the handler threads read the userfaultfd and serve faults.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zmem_common::{LockExt, RwLockExt};

use smallvec::SmallVec;
use zmem_tier::LoadOutcome;

use super::install::{Load, Served};
use super::readahead::{At, ReadAhead, STRAY_AHEAD};
use super::stats::inc;
use super::{Folio, Inner, RegionState};
use crate::sys::{Event, UffdError};
use zmem_common::PAGE_SIZE;

/// One handler's part in `Inner::handlers_busy`: counted from reading
/// events until it is done with them, and let go when the handler stops.
struct Busy<'a> {
    n: &'a AtomicUsize,
    on: bool,
}

impl Busy<'_> {
    fn set(&mut self, on: bool) {
        if on != self.on {
            self.on = on;
            if on {
                self.n.fetch_add(1, Ordering::SeqCst);
            } else {
                self.n.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set(false);
    }
}

impl Inner {
    pub(super) fn handler_main(self: Arc<Self>, cpu: Option<usize>) {
        if let Some(cpu) = cpu {
            let mut set = rustix::thread::CpuSet::new();
            set.set(cpu);
            if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
                log::warn!("pinning a handler to CPU {cpu} failed: {e}");
            }
        }
        let mut bounce = vec![0u8; self.cfg.folio_size];
        let mut ra = ReadAhead::default();
        // Faults read and not yet served: address, write, thread, and since
        // when it waits for an eviction.
        let mut pending: VecDeque<(u64, bool, u32, Option<Instant>)> = VecDeque::new();
        let mut spin = super::spin::Spin::new(self.cfg.handler_spin, self.cfg.handler_spin_hot, Instant::now());
        let mut follow =
            super::follow::Follow::new(cpu.is_none() && self.cfg.handler_follow, self.cfg.handler_hold, Instant::now());
        // Read into without allocating: fork waits for its event to be read
        // while the forking thread holds the allocator's locks.
        let mut events: Vec<Event> = Vec::with_capacity(64);
        // Events read after a FORK event in the same batch: handled once
        // the child has its memory.
        let mut carry: Vec<Event> = Vec::new();
        let mut busy = Busy { n: &self.handlers_busy, on: false };
        loop {
            // Done with what the last events asked: everything that served
            // them is freed (`drops` included).
            let idle = pending.is_empty() && carry.is_empty();
            if idle {
                busy.set(false);
            }
            if self.stop.load(Ordering::Acquire) && self.folios.regions.read_ok().is_empty() {
                return;
            }
            // Busy-poll (non-blocking reads) a while (`spin.rs`), then
            // block in poll(2).
            // Not beside the program: its CPU is the one a spin would take,
            // and a wake-up there is cheap (`follow.rs`).
            let spinning = idle && follow.pinned().is_none() && spin.spinning(Instant::now());
            if !spinning && carry.is_empty() {
                // Before it blocks: a TLS vector glibc moved meanwhile is
                // locked before reclaim can evict it (`zmem_common::host::tls`).
                zmem_common::host::tls::keep_resident();
                let timeout = if pending.is_empty() { Duration::from_millis(50) } else { Duration::from_micros(50) };
                if self.uffd.wait(Some(timeout)).is_err() {
                    return;
                }
            }
            let guard = self.gate.events.write_ok();
            let Ok(fork) = self.read_batch(&mut events, &mut carry) else { return };
            if !events.is_empty() {
                busy.set(true);
            }
            let mut drops = self.note_events(&events);
            drop(guard);
            if events.is_empty() {
                if spinning {
                    std::hint::spin_loop();
                }
            } else {
                let fault = events.iter().any(|e| matches!(e, Event::PageFault { .. }));
                spin.events_arrived(Instant::now(), idle && fault);
            }
            for ev in events.drain(..) {
                match ev {
                    Event::PageFault { addr, write, thread_id, .. } => {
                        follow.fault(thread_id);
                        pending.push_back((addr, write, thread_id, None));
                    }
                    Event::Remove { start, end } | Event::Unmap { start, end } => {
                        let regions = drops.pop_front().expect("one list per REMOVE or UNMAP");
                        self.drop_range(&regions, start, end);
                        let mut d = self.gate.dropping.lock_ok();
                        if let Some(i) = d.iter().position(|&r| r == (start, end)) {
                            d.swap_remove(i);
                        }
                    }
                    Event::Remap { .. } | Event::Fork { .. } | Event::Unknown(_) => {}
                }
            }
            if let Some(Event::Fork { uffd }) = fork {
                if self.cfg.fork_event {
                    self.serve_child(uffd, &mut bounce);
                }
                // The parent's faults read before the fork wait: serving
                // them now could free entries the child needed.
                continue;
            }
            let had = pending.len();
            self.serve_pending(&mut pending, &mut follow, &mut bounce, &mut ra);
            if had > 0 && pending.is_empty() {
                let now = Instant::now();
                spin.went_idle(now);
                follow.tick(now, (&self.counters.handler_follows, &self.counters.handler_releases));
            }
        }
    }

    /// Reads the next batch of events into `events`, or takes the ones a
    /// FORK event held back (`carry`). A FORK event is returned apart: the
    /// events before it are handled now, the child is served until it has
    /// its memory, and the rest (left in `carry`) come after. `Err`: the
    /// userfaultfd is gone.
    fn read_batch(&self, events: &mut Vec<Event>, carry: &mut Vec<Event>) -> Result<Option<Event>, ()> {
        if carry.is_empty() {
            self.uffd.read_events_into(events).map_err(|_| ())?;
        } else {
            events.clear();
            events.append(carry);
        }
        Ok(events.iter().position(|e| matches!(e, Event::Fork { .. })).map(|i| {
            self.fork_seen();
            *carry = events.split_off(i + 1);
            events.pop().expect("the FORK event")
        }))
    }

    /// Where regions are (REMAP) and which parts the program unmapped
    /// (UNMAP), from a batch of events just read, under the `events` guard,
    /// before anyone may look (`Region::drop`). Returns one list of regions
    /// per REMOVE or UNMAP, for `drop_range` once the guard is gone: the
    /// regions there now, each with its address then (a later REMAP may
    /// move it); a region adopted once the guard is gone (the program
    /// mapped the range again) is not the one the event is about. The
    /// kernel zaps a REMOVE's or UNMAP's range once its event is read: from
    /// here until `drop_range` is done with it, no COPY may put the old
    /// bytes back there (`dropping`).
    fn note_events(&self, events: &[Event]) -> VecDeque<Vec<(Arc<RegionState>, u64)>> {
        let mut drops = VecDeque::new();
        if events.iter().any(|e| matches!(e, Event::Unmap { .. } | Event::Remove { .. } | Event::Remap { .. })) {
            self.unmapping();
        }
        for ev in events {
            match *ev {
                Event::Unmap { start, end } => {
                    self.note_unmapped(start, end);
                    drops.push_back(self.regions_at(start, end));
                    self.gate.dropping.lock_ok().push((start, end));
                }
                Event::Remove { start, end } => {
                    drops.push_back(self.regions_at(start, end));
                    self.gate.dropping.lock_ok().push((start, end));
                }
                Event::Remap { from, to, len } => self.remap(from, to, len),
                _ => {}
            }
        }
        drops
    }

    /// Serves the faults read and not yet served, in order; a folio being
    /// evicted waits its turn (the others go ahead), and at the first
    /// EAGAIN it returns to read the event that blocks them all.
    fn serve_pending(
        &self,
        pending: &mut VecDeque<(u64, bool, u32, Option<Instant>)>,
        follow: &mut super::follow::Follow,
        bounce: &mut [u8],
        ra: &mut ReadAhead,
    ) {
        let mut i = 0;
        while i < pending.len() {
            let (addr, write, tid, busy_since) = pending[i];
            // The thread followed, held on this CPU while its fault is
            // served where the scheduler keeps moving it (`follow.rs`).
            let held = follow.hold(tid);
            let served = self.fault(addr, write, bounce, ra);
            if held {
                follow.let_go(tid);
                inc(&self.counters.handler_holds);
            }
            match served {
                Served::Done => {
                    if let Some(t) = busy_since {
                        let ns = t.elapsed().as_nanos() as u64;
                        self.counters.eviction_wait_ns.fetch_add(ns, Ordering::Relaxed);
                        self.stalled(ns);
                    }
                    pending.remove(i);
                }
                Served::Busy => {
                    if busy_since.is_none() {
                        inc(&self.counters.eviction_waits);
                        pending[i].3 = Some(Instant::now());
                    }
                    i += 1
                }
                Served::Again => break,
            }
        }
    }

    /// Serves a fault at `addr` (`write`: the access was a write).
    fn fault(&self, addr: u64, write: bool, bounce: &mut [u8], ra: &mut ReadAhead) -> Served {
        let fs = self.cfg.folio_size as u64;
        let Some(st) = self.region_at(addr) else { return self.stray_fault(addr) };
        let start = st.start.load(Ordering::Acquire);
        let f = ((addr - start) / fs) as usize;
        let folio_addr = start + f as u64 * fs;
        let (lock, _) = self.stripe(&st, f);
        let g = lock.lock_ok();
        match st.folio(f) {
            Folio::Evicting => {
                // Its pages may be in staging already: mapped back from
                // there, the folio is resident again at once.
                match self.rescue(&st, f, bounce) {
                    Ok(present) => {
                        drop(g);
                        let page = ((addr - folio_addr) / PAGE_SIZE as u64) as usize;
                        if present.get(page).copied().unwrap_or(false) {
                            // Its COPY woke the thread.
                            self.throttle();
                            return Served::Done;
                        }
                        // A page a partial load left in the tier: served
                        // as in any resident folio.
                        return self.fault(addr, write, bounce, ra);
                    }
                    Err(Served::Again) => return Served::Again,
                    // Never wait here: the evictor may need this thread to
                    // read an event before its MOVE can finish.
                    Err(_) => return Served::Busy,
                }
            }
            Folio::Never if write => {
                // Written at once: one COPY of zeros gives the folio its
                // own pages. The zero page would cost a copy-on-write
                // fault per page as the program goes on writing.
                // Writable: the program writes it now, so the folio counts
                // as written either way, and a protected page would fault
                // again at that write.
                if self.zero_copy_folio(&st, f, folio_addr, false) == Served::Again {
                    return Served::Again;
                }
                self.became_resident(&st, f);
                inc(&self.counters.zero_faults);
                drop(g);
                self.zero_ahead(&st, f, addr, ra);
                self.throttle();
                return Served::Done;
            }
            Folio::Never => {
                match self.zero_fill_folio(&st, f, folio_addr) {
                    Err(UffdError::Again { .. }) => return Served::Again,
                    // A thread asleep on a page nothing was put in must not
                    // stay asleep.
                    Err(e) => {
                        self.stop_if_filtered(&e);
                        let _ = self.uffd.wake(addr & !(PAGE_SIZE as u64 - 1), PAGE_SIZE as u64);
                    }
                    Ok(_) => {}
                }
                self.became_resident(&st, f);
                inc(&self.counters.zero_faults);
            }
            Folio::Evicted => return self.load_fault(&st, f, folio_addr, addr, (bounce, ra), g),
            _ if st.swapped[f].load(Ordering::Relaxed) >> ((addr - folio_addr) as usize / PAGE_SIZE) & 1 != 0 => {
                // A page a partial load left in the tier.
                let i = (addr - folio_addr) as usize / PAGE_SIZE;
                let want = self.swapped_around(st.swapped[f].load(Ordering::Relaxed), i, ra.last_block(st.id, f));
                if self.timed_load(&st, f, Some(want), bounce, Load::Fault) == Served::Again {
                    return Served::Again;
                }
                ra.loaded_block(st.id, f, want);
                self.note_swapped_refault(&st, f);
                if st.swapped[f].load(Ordering::Relaxed) == 0 {
                    self.note_filled(&st, f);
                }
                if !self.tracking {
                    st.referenced[f].store(true, Ordering::Relaxed);
                }
                inc(&self.counters.swapped_page_faults);
            }
            _ => {
                if self.dropped_page_fault(&st, f, start, addr) == Served::Again {
                    return Served::Again;
                }
            }
        }
        drop(g);
        self.throttle();
        Served::Done
    }

    /// A fault on evicted folio `f` of `st`, under its stripe lock `g`:
    /// one that continues a stream loads the whole folio (and reads ahead);
    /// so does one on a folio the program read all of after its last
    /// partial load (`RegionState::dense`); any other, only the block
    /// around its page.
    fn load_fault(
        &self,
        st: &Arc<RegionState>,
        f: usize,
        folio_addr: u64,
        addr: u64,
        (bounce, ra): (&mut [u8], &mut ReadAhead),
        g: std::sync::MutexGuard<'_, u32>,
    ) -> Served {
        let page = ((addr - folio_addr) / PAGE_SIZE as u64) as usize;
        let walk = ra.continues(&At::of(st, f, addr, self.cfg.folio_size));
        let around = self.cfg.fault_around_pages().filter(|_| !walk);
        // Taken only once the load is done: a fault served again later
        // must not use up the folio's whole loads.
        let dense = around.is_some() && st.dense[f].load(Ordering::Relaxed) > 0;
        let want = around
            .filter(|_| !dense && !self.folios.held.lock_ok().contains_key(&(st.id, f)))
            .map(|w| block_around(page, w));
        let why = if walk { Load::Walk } else { Load::Fault };
        if self.timed_load(st, f, want, bounce, why) == Served::Again {
            return Served::Again;
        }
        if let Some(m) = want {
            ra.loaded_block(st.id, f, m);
        }
        inc(&self.counters.load_faults);
        if want.is_some() {
            inc(&self.counters.partial_load_faults);
        }
        if dense {
            // Still above zero: it changes only under the stripe lock,
            // which this fault holds.
            st.dense[f].fetch_sub(1, Ordering::Relaxed);
            inc(&self.counters.dense_load_faults);
        }
        if walk {
            inc(&self.counters.walk_load_faults);
        }
        drop(g);
        self.read_ahead(st, f, addr, bounce, ra);
        self.throttle();
        Served::Done
    }

    /// A fault in no region (a staging page, or a region being torn down):
    /// a zero page, so that the thread is not stuck.
    fn stray_fault(&self, addr: u64) -> Served {
        inc(&self.counters.stray_faults);
        let page = addr & !(PAGE_SIZE as u64 - 1);
        log::debug!("a fault at {addr:#x} lies in no region: a zero page");
        // Not woken yet: the pages after it are filled first, so that
        // a thread walking on finds them there.
        // SAFETY: an address of a range registered with our uffd, which
        // no Rust reference covers.
        let r = unsafe { self.uffd.zeropage(page, PAGE_SIZE as u64, true) };
        if matches!(r, Err(UffdError::Again { .. })) {
            return Served::Again;
        }
        if r.is_ok() {
            self.zero_stray_ahead(page);
        }
        // Never leave a thread asleep: it finds the page, or touches it
        // again and faults anew.
        let _ = self.uffd.wake(page, PAGE_SIZE as u64);
        Served::Done
    }

    /// A fault on a page the program dropped from resident folio `f` of
    /// `st` (region start `start`), under the folio's stripe lock.
    fn dropped_page_fault(&self, st: &RegionState, f: usize, start: u64, addr: u64) -> Served {
        let page = addr & !(PAGE_SIZE as u64 - 1);
        match st.zero_fill(&self.uffd, page, PAGE_SIZE as u64) {
            Err(UffdError::Again { .. }) => return Served::Again,
            Err(e) => {
                self.stop_if_filtered(&e);
                let _ = self.uffd.wake(page, PAGE_SIZE as u64);
            }
            Ok(_) => {}
        }
        // The fault shows the kernel's zap done: what the page holds
        // from now on is the program's (see `drop_range_in`).
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let i = ((page - start) as usize / PAGE_SIZE) % ppf;
        let mut d = self.folios.dropped.lock_ok();
        if let Some(mask) = d.get_mut(&(st.id, f)) {
            mask[i] = false;
            if !mask.contains(&true) {
                d.remove(&(st.id, f));
            }
        }
        drop(d);
        inc(&self.counters.dropped_page_faults);
        Served::Done
    }

    /// Folio `f` of `st` is Evicting (the caller holds its stripe lock):
    /// if MOVE has put its pages in staging (`staged`), they are COPYed
    /// back from there and the folio is Resident again, its pages that a
    /// partial load left in the tier still there. The kernel's swap cache
    /// does the same for a folio under writeback; without it the fault
    /// waits for its whole pass to be stored (~1.4 ms a fault under `xz`
    /// at 200M, ARCHITECTURE.md). Returns which pages came back.
    ///
    /// `Err(Busy)`: the pages are not in staging yet, or the program
    /// dropped, moved or unmapped part of the folio or region meanwhile
    /// (the evictor's `finish` sorts those out): the fault waits for the
    /// pass. `Err(Again)`: an event is unread; pages COPYed so far are
    /// stepped over when it is tried again, as for any load.
    fn rescue(&self, st: &Arc<RegionState>, f: usize, bounce: &mut [u8]) -> Result<Vec<bool>, Served> {
        // Held to the end, so that no REMAP, UNMAP or REMOVE is recorded
        // between the looks below and the COPY (a part moved away meanwhile
        // would wait for its forward, and get entries this rescue drops).
        // Only tried, as in `copy_folio` (which tries it again: a read lock
        // twice, never a wait).
        let _events = match self.gate.events.try_read() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(Served::Again),
        };
        let key = (st.id, f);
        let (addr, present, swapped) = match self.folios.staged.lock_ok().get(&key) {
            Some(s) if !s.rescued => (s.addr, s.present.clone(), s.swapped),
            _ => return Err(Served::Busy),
        };
        if self.folios.dropped.lock_ok().contains_key(&key)
            || self.folios.forwards.lock_ok().contains_key(&key)
            || st.has_holes.load(Ordering::Acquire)
            || !st.moved.lock_ok().is_empty()
        {
            return Err(Served::Busy);
        }
        let ppf = present.len();
        for (p, n) in super::evict::page_runs(&present) {
            let at = addr as usize + p * PAGE_SIZE;
            // SAFETY: pages of the folio's staging slot that MOVE filled
            // (`present`), so reading them faults nothing. The slot is
            // freed or reused only once its pass is over (`make_room` and
            // `release` come after `finish`), and `finish` takes the
            // folio's `staged` entry under its stripe lock, which the
            // caller holds: the entry was there above, so the pages stay
            // mapped, and nothing writes them (MOVE fills empty slots only;
            // the pass's stores only read).
            let src = unsafe { std::slice::from_raw_parts(at as *const u8, n * PAGE_SIZE) };
            bounce[p * PAGE_SIZE..(p + n) * PAGE_SIZE].copy_from_slice(src);
        }
        let skip: Vec<bool> = present.iter().map(|&x| !x).collect();
        if self.copy_folio(st, f, &bounce[..ppf * PAGE_SIZE], &vec![false; ppf], Some(&skip), self.tracking)
            == Served::Again
        {
            return Err(Served::Again);
        }
        if let Some(s) = self.folios.staged.lock_ok().get_mut(&key) {
            s.rescued = true;
        }
        self.became_resident(st, f);
        self.set_swapped(st, f, swapped);
        inc(&self.counters.rescued_folios);
        Ok(present)
    }

    /// After a fault at `page`, which lies in no region and got the zero
    /// page: the pages after it, up to [`STRAY_AHEAD`] pages on, get one
    /// too, while they lie in no region either. Such faults come in runs:
    /// the registered tail past an adopted mapping's last whole folio
    /// (registered so that the kernel keeps the mapping one VMA), or a
    /// mapping mremap grew in place before a scan adopts the growth (Python:
    /// ~450 a run, in ~25 runs of up to 63 pages). A page never touched
    /// reads as zeros, and one present fails (EEXIST), which ends the run,
    /// as does the end of the mapping that faulted. Never in zmem's own mappings (the staging
    /// area takes stray faults too, and a page mapped there would stop a
    /// MOVE), and only while no handler is reading events (a region moving
    /// there is seen).
    fn zero_stray_ahead(&self, page: u64) {
        let mut end = page + (STRAY_AHEAD * PAGE_SIZE) as u64;
        let Ok(_events) = self.gate.events.try_read() else { return };
        // Only within the mapping that took the fault. Registration is per
        // mapping, so all of that one is registered with our uffd; but the
        // kernel's fills check only that a page is registered with *a*
        // userfaultfd, and the next mapping may be another's: the
        // program's own, or another pager's in the same process (a test's
        // zero pages once went over 11 pages another pager had evicted).
        match self.maps().and_then(|fd| crate::vmas::covering(fd, page)) {
            Ok(Some((s, e))) if s <= page => end = end.min(e),
            _ => return,
        }
        // Up to the first of zmem's own mappings (mmap hands out addresses
        // downwards, so the program's mapping often ends right below a
        // pool arena); none if the page is in one (a staging page). None
        // either while anyone holds zmem's table of them: a forking thread
        // holds it across fork, the thread that faulted is not woken until
        // this returns, and it may be that forking thread (or, with
        // `fork_event`, the fork waits for this handler to read its event).
        // A skipped fill costs only the faults it would have saved.
        let Some(own) = zmem_common::host::owned::try_overlapping(page, end) else { return };
        for (a, _, _) in own {
            if a <= page {
                return;
            }
            end = end.min(a);
        }
        let mut filled = 0;
        let mut a = page + PAGE_SIZE as u64;
        while a < end && self.region_at(a).is_none() {
            // SAFETY: a page of the mapping that faulted, so registered
            // with our uffd (checked above, under `events`: a REMAP or
            // UNMAP since would fail the fill with EAGAIN), in no region and
            // not zmem's own: no Rust reference covers it.
            if unsafe { self.uffd.zeropage(a, PAGE_SIZE as u64, false) }.is_err() {
                break;
            }
            filled += 1;
            a += PAGE_SIZE as u64;
        }
        self.counters.stray_zero_pages.fetch_add(filled, Ordering::Relaxed);
    }

    /// [`Inner::load_pages`] for a fault, timed: the time goes to
    /// `swap_load_fault_ns` where the load read the swap file, else to
    /// `pool_load_fault_ns` (what a miss of each kind costs; `balance.rs`
    /// says why the share is not moved by them). A read by another handler
    /// of this pager meanwhile counts for this one.
    fn timed_load(&self, st: &Arc<RegionState>, f: usize, want: Option<u64>, bounce: &mut [u8], why: Load) -> Served {
        let (t, reads) = (Instant::now(), self.tier.swap_reads());
        let served = self.load_pages(st, f, want, bounce, why);
        if served == Served::Done {
            let ns = t.elapsed().as_nanos() as u64;
            let c = &self.counters;
            let (n, total) = if self.tier.swap_reads() != reads {
                (&c.swap_load_faults, &c.swap_load_fault_ns)
            } else {
                (&c.pool_load_faults, &c.pool_load_fault_ns)
            };
            inc(n);
            total.fetch_add(ns, Ordering::Relaxed);
            self.stalled(ns);
            if let Some(m) = &self.acct.member {
                m.add_load_stall(ns);
            }
        }
        served
    }

    /// Loads pages of folio `f` of `st` back into the program (the caller
    /// holds its stripe lock): `want` names them (bit `i`: page `i`), or
    /// `None`, the whole folio. The folio is Evicted, and becomes Resident
    /// with the pages not wanted left in the tier (`RegionState::swapped`);
    /// or it is Resident and `want` are pages left so. The pages come from
    /// the tier in one call, then COPY; a page that fails to load is
    /// poisoned. On `Again` nothing is lost: the entries stay in the tier
    /// until a COPY succeeds.
    ///
    /// For a fault (`Load::Fault`, `Load::Walk`) or a fork, pages that loaded keep
    /// their pool entries as clean copies (`Tier::retain_clean`): evicted
    /// again unchanged, they are stored without compressing (as the kernel
    /// drops a clean swap-cache page without writing it).
    pub(super) fn load_pages(
        &self,
        st: &Arc<RegionState>,
        f: usize,
        want: Option<u64>,
        bounce: &mut [u8],
        why: Load,
    ) -> Served {
        let keep = why != Load::Back;
        // Kept at any usage, and put on the once list.
        let once = matches!(why, Load::Walk | Load::Fork);
        let ppf = bounce.len() / PAGE_SIZE;
        let (lo, hi) = want.map_or((0, ppf), |m| (m.trailing_zeros() as usize, 64 - m.leading_zeros() as usize));
        let wanted = |p: usize| want.is_none_or(|m| m >> p & 1 != 0);
        let span = &mut bounce[lo * PAGE_SIZE..hi * PAGE_SIZE];
        // Inline for folios of up to 64 pages: a fault allocates nothing here.
        let mut bad: SmallVec<[bool; 64]> = smallvec::smallvec![false; ppf];
        // One call: the pages' slots in the swap file are read together
        // (one preadv per run). Pages it does not fill are zeroed after.
        let swap_reads = self.tier.swap_reads();
        let outcomes = self.tier.load_many(st.key(f * ppf + lo), span);
        for (i, page) in span.chunks_exact_mut(PAGE_SIZE).enumerate() {
            if !matches!(outcomes.get(i), Some(Ok(LoadOutcome::Loaded))) {
                page.fill(0);
            }
        }
        for (i, r) in outcomes.into_iter().enumerate() {
            match r {
                Ok(LoadOutcome::Loaded | LoadOutcome::NotFound) => {}
                Err(_) if !wanted(lo + i) => {}
                Err(e) => {
                    // Never hand the program wrong data: the
                    // page is poisoned below (SIGBUS on touch).
                    log::error!("page {} of a region failed to load: {e}", f * ppf + lo + i);
                    bad[lo + i] = true;
                }
            }
        }
        if want.is_none() {
            if let Some(h) = self.folios.held.lock_ok().get(&(st.id, f)) {
                for (i, page) in bounce.chunks_exact_mut(PAGE_SIZE).enumerate().filter(|(i, _)| h.present[*i]) {
                    page.copy_from_slice(&h.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
                }
            }
        }
        let holes = st.holes_in(f * ppf, ppf);
        // Not filled: the program's holes, and the pages not wanted.
        let skip: Option<SmallVec<[bool; 64]>> = match (want, &holes) {
            (None, _) => holes.as_deref().map(SmallVec::from_slice),
            (Some(_), h) => Some((0..ppf).map(|p| !wanted(p) || h.as_ref().is_some_and(|h| h[p])).collect()),
        };
        // Write-protected only where a clean copy may be kept (its page has
        // to be seen written to drop it): a fault's load at any usage over
        // the low watermark keeps no pool entry, and one that read the swap
        // file may keep its slot (`retain_pages`). Elsewhere the page goes
        // in writable: a write after it costs the program no fault, and the
        // folio counts as written, in use, until the next sweep
        // (docs/benchmarks.md, "Loads that keep no copy go in writable").
        // Decided once, before the COPY, and handed to `retain_pages`: the
        // pages are write-protected wherever their pool entries are kept.
        let keep_pool = keep && self.keeps_pool_copies(once);
        let wp = self.tracking && (!keep || keep_pool || self.tier.swap_reads() != swap_reads);
        if self.copy_folio(st, f, bounce, &bad, skip.as_deref(), wp) == Served::Again {
            // Nothing is lost: the entries are still in the tier.
            return Served::Again;
        }
        let nbad = bad.iter().filter(|&&b| b).count() as u64;
        self.counters.poisoned_pages.fetch_add(nbad, Ordering::Relaxed);
        let evicted = st.folio(f) == Folio::Evicted;
        match want {
            None if keep && nbad == 0 => self.retain_pages(st, f, u64::MAX, bounce, (once, keep_pool)),
            None => self.invalidate_folio(st, f),
            Some(m) if keep && nbad == 0 => self.retain_pages(st, f, m, bounce, (once, keep_pool)),
            Some(m) => {
                for p in self.folio_pages(st, f).filter(|p| m >> (p - f * ppf) & 1 != 0) {
                    self.tier.invalidate(st.key(p));
                }
            }
        }
        if nbad > 0 {
            st.poisoned[f].store(true, Ordering::Relaxed);
        }
        if evicted {
            if why == Load::Fault {
                self.note_refault(st, f);
            }
            self.became_resident_on(st, f, once);
            if let Some(m) = want {
                // What was not loaded stays in the tier: the pages whose
                // entries are this region's (not its holes).
                let rest = self.folio_pages(st, f).map(|p| 1u64 << (p - f * ppf)).fold(0, |a, b| a | b) & !m;
                self.set_swapped(st, f, rest);
                st.loaded_at[f].store(self.lists.evict_clock.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        } else {
            self.clear_swapped(st, f, want.unwrap_or(u64::MAX));
        }
        Served::Done
    }

    /// The program has come back for every page that folio `f`'s partial
    /// load left in the tier: if it did so soon, its next loads take the
    /// folio whole (`RegionState::dense`).
    fn note_filled(&self, st: &RegionState, f: usize) {
        let since =
            self.lists.evict_clock.load(Ordering::Relaxed).wrapping_sub(st.loaded_at[f].load(Ordering::Relaxed));
        inc(&self.counters.filled_folios);
        if filled_soon(since as usize, self.acct.resident.load(Ordering::Relaxed)) {
            st.dense[f].store(DENSE_LOADS, Ordering::Relaxed);
            inc(&self.counters.filled_soon_folios);
        }
    }

    /// Which of the pages a partial load left in folio's tier (`swapped`)
    /// a fault on page `i` of them loads (see [`swapped_around`]).
    fn swapped_around(&self, swapped: u64, i: usize, last: Option<(usize, usize)>) -> u64 {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        swapped_around(swapped, i, last, ppf, self.cfg.fault_around_pages().unwrap_or(ppf))
    }
}

/// Which of the pages a partial load left in a folio of `ppf` pages in the
/// tier (`swapped`) a fault on page `i` of them loads, with blocks of `w`
/// pages. `last` is the pages `[lo, hi)` the handler's last partial load of
/// this folio brought in (`ReadAhead::last_block`).
/// - A walk up the folio faults at `hi`, just past what it loaded last:
///   it gets twice the run of mapped pages below `i`, from `i` up.
/// - A walk down faults at `lo - 1`: the same, mirrored.
/// - Anything else gets the block around `i`.
///
/// A walk from a cold start so takes a few faults to the folio's end, as
/// the kernel's read-ahead window grows with its hits; two objects side by
/// side on a page boundary (a random access that crosses it) cost two
/// pages, not the rest of the folio (redis's `DEBUG DIGEST` under 24M:
/// 8.6-9.6 s, against 12-13 s loading the rest of the folio). A mapped run
/// below `i` alone is no walk: random faults fill a folio in over time, and
/// growing from any mapped run loaded 1.7 pages a fault on redis's digest
/// under 48M (185-214k pages, 4.2-6.0 s), against 1.1 (94-106k, 3.5-5.0 s)
/// this way.
pub(super) fn swapped_around(swapped: u64, i: usize, last: Option<(usize, usize)>, ppf: usize, w: usize) -> u64 {
    let is_swapped = |p: usize| swapped >> p & 1 != 0;
    let ones = |n: usize| if n >= 64 { !0u64 } else { (1u64 << n) - 1 };
    let span = |run: usize| (2 * run).max(w);
    let below = (0..i).rev().take_while(|&p| !is_swapped(p)).count();
    let above = (i + 1..ppf).take_while(|&p| !is_swapped(p)).count();
    let up = last.is_some_and(|(_, hi)| hi == i);
    let down = last.is_some_and(|(lo, _)| lo == i + 1);
    let mask = if below > 0 && up {
        ones(span(below)) << i
    } else if above > 0 && down {
        let n = span(above).min(i + 1);
        ones(n) << (i + 1 - n)
    } else {
        block_around(i, w)
    };
    swapped & mask
}

/// The aligned block of `w` pages (a power of two) around page `i`, as a
/// mask of a folio's pages.
pub(super) fn block_around(i: usize, w: usize) -> u64 {
    let lo = i / w * w;
    (if w >= 64 { !0 } else { (1u64 << w) - 1 }) << lo
}

/// Whole loads a folio earns when the program comes back for every page its
/// partial load left in the tier soon enough (`DENSE_FILL_SHARE`); after
/// them a partial load tests it again.
const DENSE_LOADS: u8 = 3;

/// "Soon enough": within this share of a turn of the resident folios
/// (folio evictions since the partial load, against the folios resident),
/// so that the pages a whole load maps ahead of their use hold room for
/// a short part of the folio's stay. Partial loads come back for every
/// page on most programs, as their 4 KiB faults land all over a folio in
/// time: ~11 faults a folio on `scripts/node-random.js` under 200M and on
/// `scripts/redis-digest` under 160M alike. Their distances differ: 45%
/// of node's folios filled up within an eighth of a turn, and InnoDB's
/// 16 KiB pages under `scripts/mariadb-load` 62%, but 2% of redis's
/// digest, which walks its keys in hash order; loaded whole on any
/// fill-up, its digest ran 10% slower.
const DENSE_FILL_SHARE: usize = 8;

/// Whether a folio filled up `since` folio evictions after its partial
/// load, with `resident` folios resident, did so soon (`DENSE_FILL_SHARE`).
fn filled_soon(since: usize, resident: usize) -> bool {
    since < resident / DENSE_FILL_SHARE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fill_up_within_an_eighth_of_the_resident_turn_is_soon() {
        // 2,400 folios resident (150 MiB): 299 evictions since the partial
        // load is soon, 300 is not.
        assert!(filled_soon(0, 2_400));
        assert!(filled_soon(299, 2_400));
        assert!(!filled_soon(300, 2_400));
        // Too few resident folios to tell: never.
        assert!(!filled_soon(0, 7));
    }
}
