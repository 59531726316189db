//! Installs: COPYs of loaded or zeroed folios into the program, and the
//! residency bookkeeping that follows.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use zmem_common::LockExt;

use super::stats::inc;
use super::{Folio, Inner, RegionState};
use crate::sys::UffdError;
use zmem_common::PAGE_SIZE;

/// The most looks a folio that refaults soon after its eviction may pass
/// as accessed (`Inner::note_refault`).
pub(super) const REFAULT_PROTECT: u8 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Load {
    /// A fault that no walk explains: clean entries are kept.
    Fault,
    /// A fault that continues a walk of loads, or a folio read ahead of
    /// one: clean entries are kept, and the folio goes on the once list.
    Walk,
    /// A fork's load-back: clean entries are kept at any usage, and the
    /// folio goes on the once list, as a walk's. The folios were cold; a
    /// child that execs (most forks) leaves them the parent's alone again,
    /// and they go out again first, into the entries they left, without
    /// compressing.
    Fork,
    /// Memory given back for good (an adopted region released): entries
    /// go.
    Back,
}

/// What became of a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Served {
    Done,
    /// An event is unread (EAGAIN): read events, then try again.
    Again,
    /// The folio is being evicted: serve other faults, read events, and
    /// try this one again. The handler never waits for reclaim, because
    /// reclaim's MOVEs fail with EAGAIN until the handler reads events.
    Busy,
}

impl Inner {
    /// COPYs a folio, stepping over pages that are still mapped (EEXIST),
    /// and poisons the `bad` pages (or zero-fills them where the kernel
    /// lacks UFFDIO_POISON). On `Again`, what was done stays (a retry steps
    /// over it).
    ///
    /// Pages in a range being dropped (`dropping`) are stepped over too,
    /// and whoever waits on them is woken: the program dropped them, so
    /// what the tier holds for them is gone (`drop_range` is about to
    /// invalidate it), and they read as zeros on the next fault. `events`
    /// is held (read) from that check until the COPYs are done, so no
    /// REMOVE or UNMAP is read in between: one read before is in
    /// `dropping`, one not yet read fails the COPY with EAGAIN. It is only
    /// tried (the caller holds a stripe lock, and the lock order is
    /// `events` first): `Again` while a handler reads events. Under it,
    /// the folio's address and holes are current too (a REMAP or UNMAP
    /// read since the caller looked is seen here).
    ///
    /// Folio `f` of `st` gets `src`, less the pages `skip` names.
    ///
    /// `wp`: the pages go in write-protected (with write tracking), so that
    /// a write after is seen (`PAGE_IS_WRITTEN`) and a clean copy kept of
    /// them is dropped; unprotected, they read as written until the next
    /// sweep re-protects them (`lru.rs`), and the program's first write
    /// costs no fault.
    pub(super) fn copy_folio(
        &self,
        st: &RegionState,
        f: usize,
        src: &[u8],
        bad: &[bool],
        skip: Option<&[bool]>,
        wp: bool,
    ) -> Served {
        let _events = match self.gate.events.try_read() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Served::Again,
        };
        if !self.cfg.inject_copy_delay.is_zero() {
            std::thread::sleep(self.cfg.inject_copy_delay);
        }
        let ppf = src.len() / PAGE_SIZE;
        let dst = st.start.load(Ordering::Acquire) + (f * src.len()) as u64;
        let holes = st.holes_in(f * ppf, ppf);
        let fenced = self.fenced(dst, ppf);
        let fence = |p: usize| fenced.as_ref().is_some_and(|d| d[p]);
        let hole = |p: usize| skip.is_some_and(|h| h[p]) || holes.as_ref().is_some_and(|h| h[p]);
        let mut p = 0;
        while p < ppf {
            let run = (p..ppf).take_while(|&q| bad[q] == bad[p] && hole(q) == hole(p) && fence(q) == fence(p)).count();
            let (a, n) = (dst + (p * PAGE_SIZE) as u64, (run * PAGE_SIZE) as u64);
            let r = if hole(p) {
                // Unmapped by the program: not ours to fill any more.
                Served::Done
            } else if fence(p) {
                inc(&self.counters.fenced_pages);
                let _ = self.uffd.wake(a, n);
                Served::Done
            } else if bad[p] && self.poison {
                match self.uffd.poison(a, n) {
                    Err(UffdError::Again { .. }) => Served::Again,
                    Err(e) => {
                        log::warn!("UFFDIO_POISON failed: {e}");
                        Served::Done
                    }
                    Ok(_) => Served::Done,
                }
            } else {
                self.copy_run(st, a, &src[p * PAGE_SIZE..(p + run) * PAGE_SIZE], wp)
            };
            if r == Served::Again {
                return r;
            }
            p += run;
        }
        Served::Done
    }

    /// Which of the `n` pages from `addr` lie in a range being dropped
    /// (`dropping`); `None` if none do.
    pub(super) fn fenced(&self, addr: u64, n: usize) -> Option<Vec<bool>> {
        let d = self.gate.dropping.lock_ok();
        let end = addr + (n * PAGE_SIZE) as u64;
        if !d.iter().any(|&(a, b)| a < end && addr < b) {
            return None;
        }
        let page = |i: usize| addr + (i * PAGE_SIZE) as u64;
        Some((0..n).map(|i| d.iter().any(|&(a, b)| a < page(i) + PAGE_SIZE as u64 && page(i) < b)).collect())
    }

    pub(super) fn copy_run(&self, st: &RegionState, dst: u64, src: &[u8], wp: bool) -> Served {
        let mut off = 0u64;
        let len = src.len() as u64;
        while off < len {
            match st.copy_in(&self.uffd, dst + off, &src[off as usize..], wp) {
                Ok(n) if n == len - off => break,
                // Stopped at a page that is present: step over it.
                Ok(n) => off += n + PAGE_SIZE as u64,
                Err(UffdError::Again { .. }) => return Served::Again,
                Err(e) => {
                    self.stop_if_filtered(&e);
                    if super::region::gone(&e) {
                        log::debug!("{e}: no longer registered (the region is being dropped)");
                    } else {
                        log::error!("UFFDIO_COPY failed: {e}");
                    }
                    // No thread stays asleep on what was not filled.
                    let _ = self.uffd.wake(dst + off, len - off);
                    break;
                }
            }
        }
        Served::Done
    }

    /// Zero pages over folio `f` at `folio_addr`, less its holes (what
    /// lives there now is not this region's).
    pub(super) fn zero_fill_folio(&self, st: &RegionState, f: usize, folio_addr: u64) -> Result<u64, UffdError> {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        let Some(holes) = st.holes_in(f * ppf, ppf) else {
            return st.zero_fill(&self.uffd, folio_addr, fs as u64);
        };
        let mut p = 0;
        while p < ppf {
            let run = (p..ppf).take_while(|&q| holes[q] == holes[p]).count();
            if !holes[p] {
                let (a, n) = (folio_addr + (p * PAGE_SIZE) as u64, (run * PAGE_SIZE) as u64);
                match st.zero_fill(&self.uffd, a, n) {
                    Err(e @ UffdError::Again { .. }) => return Err(e),
                    Err(e) => {
                        self.stop_if_filtered(&e);
                        let _ = self.uffd.wake(a, n);
                    }
                    Ok(_) => {}
                }
            }
            p += run;
        }
        Ok(fs as u64)
    }

    /// `UFFDIO_COPY` of zeros over folio `f` at `folio_addr`, less its
    /// holes; pages already there are stepped over. `wp`: write-protected,
    /// for write tracking (see [`copy_folio`](Self::copy_folio)).
    pub(super) fn zero_copy_folio(&self, st: &RegionState, f: usize, folio_addr: u64, wp: bool) -> Served {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        let holes = st.holes_in(f * ppf, ppf);
        let hole = |p: usize| holes.as_ref().is_some_and(|h| h[p]);
        let mut p = 0;
        while p < ppf {
            let run = (p..ppf).take_while(|&q| hole(q) == hole(p)).count();
            if !hole(p) {
                let a = folio_addr + (p * PAGE_SIZE) as u64;
                if self.copy_run(st, a, &self.zeros[..run * PAGE_SIZE], wp) == Served::Again {
                    return Served::Again;
                }
            }
            p += run;
        }
        Served::Done
    }

    pub(super) fn became_resident(&self, st: &Arc<RegionState>, f: usize) {
        self.became_resident_on(st, f, false);
    }

    /// A fault loads Evicted folio `f` back: if fewer folios were evicted
    /// since it went than are resident now, a little more room would have
    /// kept it (mm/workingset.c's refault distance), so it is in use and
    /// earns looks it passes as accessed (`RegionState::protect`).
    pub(super) fn note_refault(&self, st: &RegionState, f: usize) {
        let distance = self.eviction_distance(st, f);
        let b = super::stats::refault_bucket(distance as usize, self.acct.resident.load(Ordering::Relaxed));
        inc(&self.counters.refault_distance[b]);
        if let Some(m) = &self.acct.member {
            m.add_refault(b);
        }
        if (distance as usize) < self.acct.resident.load(Ordering::Relaxed) {
            let p = st.protect[f].load(Ordering::Relaxed);
            st.protect[f].store((p + 1).min(REFAULT_PROTECT), Ordering::Relaxed);
            inc(&self.counters.workingset_refaults);
        }
        self.count_balance_refault(distance);
    }

    /// A fault on a page a partial load left in the tier of resident folio
    /// `f`: for the pool's share, a miss as much as the folio's first
    /// (`count_balance_refault`). With 4 KiB partial loads a folio comes
    /// back over ~10 faults, and counted once a folio the refaults stood
    /// for a tenth of what more resident room saves, beside swap refaults
    /// and cold pool loads counted a fault each.
    pub(super) fn note_swapped_refault(&self, st: &RegionState, f: usize) {
        self.count_balance_refault(self.eviction_distance(st, f));
    }

    /// Folio evictions since folio `f`'s last one (the refault distance).
    fn eviction_distance(&self, st: &RegionState, f: usize) -> u32 {
        self.lists.evict_clock.load(Ordering::Relaxed).wrapping_sub(st.evicted_at[f].load(Ordering::Relaxed))
    }

    /// Counts a fault on a folio evicted `distance` folio evictions ago as
    /// a refault for the pool's share (`balance_refaults`) when a step of
    /// the share holds that many folios: a step more resident memory
    /// would have saved it.
    fn count_balance_refault(&self, distance: u32) {
        if (distance as usize) < self.balance_step_folios() {
            self.acct.balance_refaults.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// [`Inner::became_resident`], onto the once list with `once` (see
    /// `Lru::once`).
    pub(super) fn became_resident_on(&self, st: &Arc<RegionState>, f: usize, once: bool) {
        self.mark_resident(st, f);
        self.lru_add_to(st, f, once);
    }

    pub(super) fn mark_resident(&self, st: &RegionState, f: usize) {
        st.set_folio(f, Folio::Resident);
        // With write tracking, loaded pages are mapped write-protected and
        // a write after the fault is what counts; without it, the fault
        // itself is the only access CLOCK can see.
        st.referenced[f].store(!self.tracking, Ordering::Relaxed);
        self.acct.resident.fetch_add(1, Ordering::Relaxed);
    }

    /// [`Inner::became_resident`] for a folio most of whose pages another
    /// process maps too (a forked child's, just adopted): it goes on the
    /// shared list at once, not after reclaim first tries it. Until then
    /// the child was charged for all it inherited, and with many children
    /// forked at once each one's share of the tree's limit shrank to next
    /// to nothing.
    pub(super) fn became_resident_shared(&self, st: &Arc<RegionState>, f: usize, shared: usize) {
        self.mark_resident(st, f);
        self.park_shared(st, f, shared);
    }
}
