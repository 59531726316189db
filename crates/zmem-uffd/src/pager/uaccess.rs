//! Managed pages the kernel may find unmapped: what the preload shim
//! faults in before the program's system calls on a userfaultfd that
//! serves faults from user mode only ([`Uffd::user_mode_only`]).
//!
//! There, the kernel's own access to a missing page of a registered range
//! (`copy_to_user` for a `read(2)` into it, `copy_from_user` for a
//! `write(2)` from it) is not handed to the pager: it fails at once, and
//! the system call returns EFAULT ("Bad address") or a short count. A page
//! of a Resident folio is mapped unless a partial load left it in the tier
//! (`swapped`) or the program dropped it (`dropped`): adoption gives a
//! folio's untouched pages the zero page, and every fault maps a whole
//! folio. The pages of any other folio are not mapped.
//!
//! [`Uffd::user_mode_only`]: crate::sys::Uffd::user_mode_only

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use zmem_common::{LockExt, RwLockExt};

use super::region::RegionState;
use super::{Folio, Inner, Pager};
use zmem_common::PAGE_SIZE;

/// Where the next pager's epoch starts: each a 2^48 step apart, so that
/// no two pagers of a process (a new one after `single_threaded`, a
/// forked child's, which inherits this counter) share an epoch.
static EPOCH_BASES: AtomicU64 = AtomicU64::new(1 << 48);

pub(super) fn epoch_base() -> u64 {
    EPOCH_BASES.fetch_add(1 << 48, Ordering::Relaxed)
}

impl Pager {
    /// This pager's epoch: it moves before any page the program had
    /// mapped may stop being mapped. Read it before
    /// [`unmapped_run`](Self::unmapped_run): a range that had no unmapped
    /// page has none while the epoch reads the same. Never 0.
    pub fn epoch(&self) -> u64 {
        self.inner.folios.epoch.load(Ordering::SeqCst)
    }

    /// As [`unmapped_run`](Self::unmapped_run), with every page of managed
    /// memory counted as maybe unmapped, whatever the pager's state says:
    /// for a system call that failed with EFAULT where the state showed
    /// nothing (the program dropped the page, and the handler has not
    /// caught up with the event yet).
    pub fn managed_run(&self, from: u64, end: u64) -> Option<(u64, u64)> {
        self.inner.unmapped_run(from, end, true)
    }

    /// The first run `[a, b)` of pages within `[from, end)` that lie in
    /// managed memory and may not be mapped now, in address order: pages
    /// the kernel cannot reach for a system call where faults are served
    /// from user mode only. The caller touches them from user mode (a
    /// fault the pager serves) and asks again from `b`.
    ///
    /// Takes no lock across the look at a folio, and allocates nothing: it
    /// runs on the program's threads, before their I/O calls.
    pub fn unmapped_run(&self, from: u64, end: u64) -> Option<(u64, u64)> {
        self.inner.unmapped_run(from, end, false)
    }
}

/// What may be unmapped of a folio.
#[derive(Clone, Copy)]
enum Unmapped {
    /// Every page: the folio is not Resident.
    All,
    /// A Resident folio's pages a partial load left in the tier (bit `i`:
    /// page `i`), and whether the program dropped some.
    Some { swapped: u64, dropped: bool },
}

/// Where [`Inner::region_or_next`] finds the walk.
enum Step {
    /// The region that holds the page.
    In(Arc<RegionState>),
    /// The page starts `[a, b)`, part of a region's tail (registered, not
    /// managed) before the walk's end.
    Tail(u64, u64),
    /// No region holds it; the next page that may be managed.
    Skip(u64),
}

impl Inner {
    /// Bumps the epoch: called before a page may stop being mapped.
    pub(super) fn unmapping(&self) {
        self.folios.epoch.fetch_add(1, Ordering::SeqCst);
    }

    fn unmapped_run(&self, from: u64, end: u64, every: bool) -> Option<(u64, u64)> {
        let ps = PAGE_SIZE as u64;
        let fs = self.cfg.folio_size;
        let mut p = from & !(ps - 1);
        let mut run: Option<(u64, u64)> = None;
        while p < end {
            let st = match self.region_or_next(p, end) {
                Step::In(st) => st,
                Step::Tail(a, b) => {
                    // Some pages of [a, b) may be mapped (touched before).
                    let mut present = [0u8; 512];
                    let n = ((b - a) as usize).div_ceil(PAGE_SIZE).min(present.len());
                    let b = a + (n * PAGE_SIZE) as u64;
                    // SAFETY: mincore writes one byte per page of [a, b)
                    // into `present`, which holds n. Pages not mapped at
                    // all (ENOMEM) are none of the pager's.
                    let r = unsafe { libc::mincore(a as *mut libc::c_void, n * PAGE_SIZE, present.as_mut_ptr()) };
                    for (i, &v) in present[..n].iter().enumerate() {
                        let q = a + (i * PAGE_SIZE) as u64;
                        if r == 0 && v & 1 == 0 {
                            run = Some((run.map_or(q, |(x, _)| x), q + ps));
                        } else if run.is_some() {
                            return run;
                        }
                    }
                    p = b;
                    continue;
                }
                Step::Skip(next) => {
                    if run.is_some() {
                        break;
                    }
                    p = next;
                    continue;
                }
            };
            let start = st.start.load(Ordering::Acquire);
            let stop = end.min(start + st.len as u64);
            // The folio the walk is in, looked at once.
            let mut seen: Option<(usize, Unmapped)> = None;
            while p < stop {
                let off = (p - start) as usize;
                if st.in_hole(off) {
                    // Another region may lie there: the outer walk looks.
                    break;
                }
                let f = off / fs;
                let u = match seen {
                    _ if every => Unmapped::All,
                    Some((g, u)) if g == f => u,
                    _ => {
                        let u = self.unmapped_in_folio(&st, f);
                        seen = Some((f, u));
                        u
                    }
                };
                if self.page_unmapped(&st, f, u, off % fs / PAGE_SIZE) {
                    run = Some((run.map_or(p, |(a, _)| a), p + ps));
                } else if run.is_some() {
                    return run;
                }
                p += ps;
            }
        }
        run
    }

    /// What may be unmapped of folio `f` of `st`.
    fn unmapped_in_folio(&self, st: &RegionState, f: usize) -> Unmapped {
        match st.folio(f) {
            Folio::Resident => Unmapped::Some {
                swapped: st.swapped[f].load(Ordering::Relaxed),
                dropped: self.folios.dropped.lock_ok().contains_key(&(st.id, f)),
            },
            Folio::Never | Folio::Evicting | Folio::Evicted => Unmapped::All,
        }
    }

    /// Whether page `i` of folio `f` of `st` may be unmapped (`u`: what
    /// [`unmapped_in_folio`](Self::unmapped_in_folio) found of it).
    fn page_unmapped(&self, st: &RegionState, f: usize, u: Unmapped, i: usize) -> bool {
        match u {
            Unmapped::All => true,
            Unmapped::Some { swapped, dropped } => {
                (i < 64 && swapped >> i & 1 != 0)
                    || (dropped
                        && self.folios.dropped.lock_ok().get(&(st.id, f)).is_some_and(|m| m.get(i) == Some(&true)))
            }
        }
    }

    /// The region that holds page `p` (as `region_at`), or the part of a
    /// region's tail from `p`, or where the walk goes on: a page on, inside
    /// some region's hole; else the start of the next region before `end`,
    /// or `end`.
    fn region_or_next(&self, p: u64, end: u64) -> Step {
        let regions = self.folios.regions.read_ok();
        let mut in_hole = false;
        for r in regions.range(..=(p, u32::MAX)).rev().map(|(_, r)| r) {
            let s = r.start.load(Ordering::Acquire);
            let e = s + r.len as u64;
            if p < e {
                if !r.in_hole((p - s) as usize) {
                    return Step::In(Arc::clone(r));
                }
                in_hole = true;
            } else if p < e + r.tail.load(Ordering::Relaxed) as u64 {
                return Step::Tail(p, end.min(e + r.tail.load(Ordering::Relaxed) as u64));
            }
        }
        if in_hole {
            return Step::Skip(p + PAGE_SIZE as u64);
        }
        Step::Skip(regions.range((p, 0)..(end, 0)).next().map_or(end, |(&(s, _), _)| s))
    }
}
