//! Events: the program dropped (madvise, munmap) or moved (mremap) memory.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use zmem_common::{LockExt, RwLockExt};

use super::{Folio, Inner, RegionState};
use crate::mapping::PAGE_SIZE;

impl Inner {
    /// The program unmapped `[start, end)`: the parts of regions in it are
    /// recorded, so that dropping a region never unmaps what the kernel
    /// has since placed there.
    pub(super) fn note_unmapped(&self, start: u64, end: u64) {
        for st in self.regions_in(start, end) {
            let base = st.start.load(Ordering::Acquire);
            let (a, b) = (start.max(base), end.min(base + st.len as u64));
            if a < b {
                st.add_hole((a - base) as usize, (b - base) as usize);
            }
        }
    }

    /// The program dropped `[start, end)` (madvise, munmap): the entries of
    /// every region there are invalidated. An adopted region the program
    /// has unmapped all of is forgotten.
    pub(super) fn drop_range(&self, start: u64, end: u64) {
        for st in self.regions_in(start, end) {
            self.drop_range_in(&st, start, end);
            if st.adopted && st.mapped_parts().is_empty() {
                self.retire(&st);
            }
        }
    }

    fn drop_range_in(&self, st: &Arc<RegionState>, start: u64, end: u64) {
        let base = st.start.load(Ordering::Acquire);
        let first_page = ((start.max(base) - base) / PAGE_SIZE as u64) as usize;
        let last_page = ((end.min(base + st.len as u64) - base).div_ceil(PAGE_SIZE as u64)) as usize;
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        for f in first_page / ppf..last_page.div_ceil(ppf) {
            let (lock, _) = self.stripe(st, f);
            let g = lock.lock_ok();
            let pages = (f * ppf).max(first_page)..((f + 1) * ppf).min(last_page);
            if st.folio(f) == Folio::Evicting {
                // The evictor drops these pages' entries when it finishes
                // (this thread must not wait for it: see `fault`).
                let mut d = self.dropped.lock_ok();
                let mask = d.entry((st.id, f)).or_insert_with(|| vec![false; ppf]);
                mask[pages.start - f * ppf..pages.end - f * ppf].fill(true);
                continue;
            }
            for p in pages.clone() {
                self.tier.invalidate(st.key(p));
            }
            if let Some(h) = self.held.lock_ok().get_mut(&(st.id, f)) {
                h.present[pages.start - f * ppf..pages.end - f * ppf].fill(false);
            }
            let whole = first_page <= f * ppf && (f + 1) * ppf <= last_page;
            // A whole folio dropped is as if never touched; a resident folio
            // partly dropped stays resident (its dropped pages fault to zero).
            if whole && st.swap_folio(f, Folio::Never) == Folio::Resident {
                self.resident.fetch_sub(1, Ordering::Relaxed);
            }
            drop(g);
        }
    }

    /// `mremap` moved `[from, from + len)` to `to`. A region all of whose
    /// mapped parts moved just changes its address (entries are
    /// region-relative); of one the move split, the part that moved is a
    /// hole from then on.
    pub(super) fn remap(&self, from: u64, to: u64, len: u64) {
        for st in self.regions_in(from, from + len) {
            let base = st.start.load(Ordering::Acquire);
            let parts = st.mapped_parts();
            let (lo, hi) = (from, from + len);
            if !parts.iter().any(|&(a, b)| base + (a as u64) < hi && base + b as u64 > lo) {
                // Only a hole of this region lies there (the region that
                // moved lives in it).
                continue;
            }
            let inside = parts.iter().all(|&(a, b)| base + a as u64 >= lo && base + b as u64 <= hi);
            let mut regions = self.regions.write_ok();
            let new = (base + to).checked_sub(from);
            if let (true, Some(new)) = (inside, new) {
                if let Some(st) = regions.remove(&(base, st.id)) {
                    st.start.store(new, Ordering::Release);
                    regions.insert((new, st.id), st);
                }
            } else {
                // Part of the region moved: here it is a hole now (the
                // rest stays managed), and at its new address a later scan
                // adopts it. Its resident pages moved with it; pages it had
                // evicted cannot follow (the shim loads them back before an
                // mremap it sees: `Pager::prepare_remap`).
                drop(regions);
                let (a, b) = (lo.max(base), hi.min(base + st.len as u64));
                let fs = self.cfg.folio_size as u64;
                let lost = ((a - base) / fs..(b - base).div_ceil(fs))
                    .filter(|&f| matches!(st.folio(f as usize), Folio::Evicted | Folio::Evicting))
                    .count();
                if lost > 0 {
                    log::error!(
                        "an mremap moved part of a managed region at {base:#x} with {lost} folios evicted; \
                         their pages at the new address read as zeros"
                    );
                }
                st.add_hole((a - base) as usize, (b - base) as usize);
                self.drop_range_in(&st, a, b);
            }
        }
    }
}
