//! Events: the program dropped (madvise, munmap) or moved (mremap) memory.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use zmem_common::{LockExt, RwLockExt};

use super::region::Within;
use super::stats::inc;
use super::{Folio, Inner, RegionState};
use zmem_common::PAGE_SIZE;

impl Inner {
    /// The program unmapped `[start, end)`: the parts of regions in it are
    /// recorded, so that dropping a region never unmaps what the kernel
    /// has since placed there.
    pub(super) fn note_unmapped(&self, start: u64, end: u64) {
        log::debug!("UNMAP {start:#x}..{end:#x}");
        for st in self.regions_in(start, end) {
            let base = st.start.load(Ordering::Acquire);
            let (a, b) = (start.max(base), end.min(base + st.len as u64));
            if a < b {
                st.add_hole((a - base) as usize, (b - base) as usize);
            }
        }
    }

    /// The program dropped `[start, end)` (madvise, munmap): the entries of
    /// `regions` (those there when the event was read) are invalidated
    /// there. An adopted region the program has unmapped all of is
    /// forgotten.
    pub(super) fn drop_range(&self, regions: &[(Arc<RegionState>, u64)], start: u64, end: u64) {
        for (st, base) in regions {
            self.drop_range_in(st, *base, start, end);
            if st.adopted && st.mapped_parts().is_empty() {
                self.retire(st);
            }
        }
    }

    /// The regions over `[start, end)` now, with their addresses.
    pub(super) fn regions_at(&self, start: u64, end: u64) -> Vec<(Arc<RegionState>, u64)> {
        self.regions_in(start, end)
            .into_iter()
            .map(|st| {
                let base = st.start.load(Ordering::Acquire);
                (st, base)
            })
            .collect()
    }

    /// `drop_range` for region `st`, which was at `base` when the event
    /// was read.
    fn drop_range_in(&self, st: &Arc<RegionState>, base: u64, start: u64, end: u64) {
        let first_page = ((start.max(base) - base) / PAGE_SIZE as u64) as usize;
        let last_page = ((end.min(base + st.len as u64) - base).div_ceil(PAGE_SIZE as u64)) as usize;
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        // Pages a partial mremap moved away are another region's now.
        let moved = {
            let m = st.moved.lock_ok();
            (!m.is_empty()).then(|| m.clone())
        };
        let moved_away =
            |p: usize| moved.as_ref().is_some_and(|m| m.iter().any(|&(a, b)| (a..b).contains(&(p * PAGE_SIZE))));
        for f in first_page / ppf..last_page.div_ceil(ppf) {
            let (lock, _) = self.stripe(st, f);
            let g = lock.lock_ok();
            let pages = (f * ppf).max(first_page)..((f + 1) * ppf).min(last_page);
            let pages: Vec<usize> = pages.filter(|&p| !moved_away(p)).collect();
            if pages.is_empty() {
                continue;
            }
            if st.folio(f) == Folio::Evicting {
                // The evictor drops these pages' entries when it finishes
                // (this thread must not wait for it: see `fault`).
                let mut d = self.folios.dropped.lock_ok();
                let mask = d.entry((st.id, f)).or_insert_with(|| vec![false; ppf]);
                pages.iter().for_each(|&p| mask[p - f * ppf] = true);
                continue;
            }
            for &p in &pages {
                self.tier.invalidate(st.key(p));
            }
            self.clear_swapped(st, f, pages.iter().map(|&p| 1u64 << ((p - f * ppf) % 64)).fold(0, |a, b| a | b));
            if let Some(h) = self.folios.held.lock_ok().get_mut(&(st.id, f)) {
                pages.iter().for_each(|&p| h.present[p - f * ppf] = false);
            }
            let whole = first_page <= f * ppf && (f + 1) * ppf <= last_page;
            // The kernel zaps the pages only after this event was read, so a
            // MOVE can still find one of them in between and carry its old
            // bytes off: a partly dropped resident folio remembers its
            // dropped pages until a fault shows the zap done, and its next
            // eviction drops them as it does for an Evicting folio.
            if !whole && st.folio(f) == Folio::Resident {
                let mut d = self.folios.dropped.lock_ok();
                let mask = d.entry((st.id, f)).or_insert_with(|| vec![false; ppf]);
                pages.iter().for_each(|&p| mask[p - f * ppf] = true);
            } else if whole {
                self.folios.dropped.lock_ok().remove(&(st.id, f));
            }
            // A whole folio dropped is as if never touched; a resident folio
            // partly dropped stays resident (its dropped pages fault to zero).
            if whole {
                st.cached[f].store(false, Ordering::Relaxed);
                st.poisoned[f].store(false, Ordering::Relaxed);
                self.clear_swapped(st, f, u64::MAX);
            }
            if whole && st.swap_folio(f, Folio::Never) == Folio::Resident {
                self.acct.resident.fetch_sub(1, Ordering::Relaxed);
            }
            drop(g);
        }
    }

    /// `mremap` moved `[from, from + len)` to `to`. A region all of whose
    /// mapped parts moved just changes its address (entries are
    /// region-relative); of one the move split, the part that moved is a
    /// hole from then on, and a region of its own at its new address
    /// (`split_moved`).
    pub(super) fn remap(&self, from: u64, to: u64, len: u64) {
        log::debug!("REMAP {from:#x}..{:#x} to {to:#x}", from + len);
        self.forget_early_adoptions(to, to + len);
        for st in self.regions_in(from, from + len) {
            let base = st.start.load(Ordering::Acquire);
            let (lo, hi) = (from, from + len);
            let inside = match st.mapped_in(lo, hi) {
                // Only a hole of this region lies there (the region that
                // moved lives in it).
                Within::Nothing => continue,
                Within::Part => false,
                Within::All => true,
            };
            let mut regions = self.folios.regions.write_ok();
            let new = (base + to).checked_sub(from);
            log::debug!(
                "REMAP: region {} at {base:#x}+{:#x}: {}",
                st.id,
                st.len,
                if inside { "moves" } else { "splits" }
            );
            if let (true, Some(new)) = (inside, new) {
                if let Some(st) = regions.remove(&(base, st.id)) {
                    st.start.store(new, Ordering::Release);
                    regions.insert((new, st.id), st);
                }
            } else {
                // Part of the region moved: here it is a hole from now on
                // (the rest stays managed), and at its new address it is a
                // region of its own whose pages keep their entries.
                drop(regions);
                let (a, b) = (lo.max(base), hi.min(base + st.len as u64));
                // The region's holes there before this move: not the new
                // region's either (below).
                let holes = st.unmapped.lock_ok().clone();
                st.moved.lock_ok().push(((a - base) as usize, (b - base) as usize));
                st.add_hole((a - base) as usize, (b - base) as usize);
                self.split_moved(&st, a, b, to + (a - from), &holes);
            }
        }
    }

    /// Before regions move to `[to, end)` (a REMAP): a region that has
    /// part of that range is an adoption of the moved mapping itself, made
    /// by a scan that saw the new mapping before the handler read the
    /// REMAP (the kernel lists it as soon as mremap made it; the event
    /// follows). Its pages there are the moved regions' from now on: they
    /// are a hole of it, and it is retired if nothing else is left.
    /// Left alone, it took faults there (it is newer, so `region_at` finds
    /// it first) and served evicted pages of the moved regions as zeros.
    /// Nothing of it was evicted: its MOVEs fail with EAGAIN until the
    /// REMAP is read, and then see the hole.
    fn forget_early_adoptions(&self, to: u64, end: u64) {
        for st in self.regions_in(to, end) {
            let base = st.start.load(Ordering::Acquire);
            let (a, b) = (to.max(base), end.min(base + st.len as u64));
            if a >= b || st.mapped_in(a, b) == Within::Nothing {
                continue;
            }
            log::debug!("region {} at {base:#x} was adopted from a mapping mremap moved: {a:#x}..{b:#x} left", st.id);
            inc(&self.counters.early_adoptions);
            st.add_hole((a - base) as usize, (b - base) as usize);
            self.drop_range_in(&st, base, a, b);
            if st.mapped_parts().is_empty() {
                self.retire(&st);
            }
        }
    }

    /// `[a, b)` of region `st` (which it now has as a hole) moved to `to`:
    /// a new, adopted region takes it there. Its folios are `st`'s, one for
    /// one (it starts `(a - base) % folio` before `to`, with a hole there,
    /// and ends in a hole), and its keys are `st`'s (`key_base`), so an
    /// evicted page's entry serves it where it is now; a folio the move
    /// split is Evicted (or Resident) in both, and each loads and drops
    /// only its own pages. A folio being evicted is passed on by its
    /// evictor when it finishes (`forwards`); held pages go with their
    /// folio.
    ///
    /// `holes` are `st`'s holes before the move. Those within `[a, b)` are
    /// holes of the new region too, and recorded as moved away from it (as
    /// are its lead and tail, which are `st`'s):
    /// their pages' keys are dead (the program unmapped them) or belong to
    /// another region (a part moved out earlier, whose address the program
    /// since grew a neighbour into), and the new region must never load,
    /// store or drop them. Without this, the new region dropped the
    /// entries of the region split off earlier when the program freed
    /// its mapping, and that region read zeros.
    ///
    /// Run by the handler while it holds `events`, before it serves any
    /// fault read after the REMAP: no fault on the new address is served
    /// before the region is there.
    fn split_moved(&self, st: &Arc<RegionState>, a: u64, b: u64, to: u64, holes: &[(usize, usize)]) {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        let base = st.start.load(Ordering::Acquire);
        let (off, end) = ((a - base) as usize, (b - base) as usize);
        let (first, lead) = (off / fs, off % fs);
        let last = end.div_ceil(fs); // one past R's last folio moved
        let len = (last - first) * fs;
        let Some(start) = to.checked_sub(lead as u64) else {
            log::error!("an mremap to {to:#x} cannot be followed: evicted pages there read as zeros");
            return;
        };
        let new = self.region_state(start, len, None, Some(st.key(first * ppf)));
        if lead > 0 {
            new.add_hole(0, lead);
        }
        if end - first * fs < len {
            new.add_hole(end - first * fs, len);
        }
        for &(ha, hb) in holes {
            let (x, y) = (ha.max(off), hb.min(end));
            if x < y {
                new.add_hole(x - first * fs, y - first * fs);
            }
        }
        // None of the new region's holes are its own: the lead and the
        // tail are the parent's pages (or another region's), the rest as
        // above. Recorded as moved away, no event makes it drop them.
        *new.moved.lock_ok() = new.unmapped.lock_ok().clone();
        let mut resident = Vec::new();
        for j in 0..last - first {
            let f = first + j;
            // The pages of folio f that moved.
            let moved: Vec<bool> = (0..ppf).map(|i| (off..end).contains(&((f * ppf + i) * PAGE_SIZE))).collect();
            let whole = moved.iter().all(|&m| m);
            let (lock, _) = self.stripe(st, f);
            let g = lock.lock_ok();
            let state = st.folio(f);
            match state {
                Folio::Never => {}
                Folio::Resident => {
                    new.set_folio(j, Folio::Resident);
                    self.acct.resident.fetch_add(1, Ordering::Relaxed);
                    // Pages left in the tier go with the pages that moved
                    // (their entries under the same keys).
                    let bits = st.swapped[f].load(Ordering::Relaxed)
                        & moved.iter().enumerate().filter(|(_, &m)| m).fold(0u64, |a, (i, _)| a | 1 << (i % 64));
                    self.clear_swapped(st, f, bits);
                    self.set_swapped(&new, j, bits);
                    // Entries kept as clean copies serve the moved pages
                    // under the same keys.
                    new.cached[j].store(st.cached[f].load(Ordering::Relaxed), Ordering::Relaxed);
                    new.poisoned[j].store(st.poisoned[f].load(Ordering::Relaxed), Ordering::Relaxed);
                    if whole {
                        st.set_folio(f, Folio::Never);
                        st.cached[f].store(false, Ordering::Relaxed);
                        self.acct.resident.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                Folio::Evicted => {
                    new.set_folio(j, Folio::Evicted);
                    self.split_held(st, f, &new, j, &moved);
                    if whole {
                        st.set_folio(f, Folio::Never);
                    }
                }
                Folio::Evicting => {
                    // Faults on it wait (Busy) until the evictor passes it on.
                    new.set_folio(j, Folio::Evicting);
                    self.folios.forwards.lock_ok().entry((st.id, f)).or_default().push(super::Forward {
                        to: Arc::clone(&new),
                        folio: j,
                        moved,
                    });
                }
            }
            drop(g);
            if state == Folio::Resident {
                resident.push(j);
            }
        }
        log::debug!(
            "split region {} at {start:#x}+{len:#x} off region {} from folio {first}, holes {:x?}",
            new.id,
            st.id,
            new.unmapped.lock_ok()
        );
        self.folios.regions.write_ok().insert((start, new.id), Arc::clone(&new));
        for j in resident {
            self.lru_add(&new, j);
        }
        self.counters.split_regions.fetch_add(1, Ordering::Relaxed);
    }

    /// Moves the held pages of folio `f` of `st` that `moved` names to
    /// folio `j` of `new`. The caller holds `st`'s stripe lock for `f`
    /// (`new` is not yet visible, or the caller holds no lock `new` needs).
    pub(super) fn split_held(&self, st: &RegionState, f: usize, new: &RegionState, j: usize, moved: &[bool]) {
        let fs = self.cfg.folio_size;
        let mut held = self.folios.held.lock_ok();
        let Some(h) = held.get_mut(&(st.id, f)) else { return };
        let present: Vec<bool> = h.present.iter().zip(moved).map(|(&p, &m)| p && m).collect();
        if !present.contains(&true) {
            return;
        }
        let data = h.data.clone();
        for (p, &m) in h.present.iter_mut().zip(moved) {
            *p &= !m;
        }
        if !h.present.contains(&true) {
            held.remove(&(st.id, f));
            self.folios.held_bytes.fetch_sub(fs, Ordering::Relaxed);
        }
        held.insert((new.id, j), super::Held { data, present });
        self.folios.held_bytes.fetch_add(fs, Ordering::Relaxed);
    }

    /// The evictor finished folio `f` of `st`, which partial mremaps
    /// moved (all or part) while it was Evicting: each split-off region's
    /// folio becomes Evicted (its pages that were evicted have entries
    /// under the same keys; those the kernel moved are mapped there and a
    /// load steps over them), with its held pages. Called with `st`'s
    /// stripe lock for `f` held; returns what to finish once it is dropped.
    pub(super) fn take_forward(&self, st: &RegionState, f: usize) -> Vec<(Arc<RegionState>, usize)> {
        let fws = self.folios.forwards.lock_ok().remove(&(st.id, f)).unwrap_or_default();
        fws.into_iter()
            .map(|fw| {
                self.split_held(st, f, &fw.to, fw.folio, &fw.moved);
                (fw.to, fw.folio)
            })
            .collect()
    }

    /// See [`take_forward`](Self::take_forward): each is finished as the
    /// evictor finishes its own folio (`finish`), so pages the program
    /// dropped from it meanwhile (`drop_range_in` left them to "the
    /// evictor", as for any Evicting folio) lose their entries and held
    /// pages, and a folio moved on while it waited passes its own forwards
    /// on in turn.
    pub(super) fn finish_forward(&self, forwards: Vec<(Arc<RegionState>, usize)>) {
        for (to, j) in forwards {
            self.finish(&to, j, |dropped| {
                let mut held = self.folios.held.lock_ok();
                if let Some(h) = held.get_mut(&(to.id, j)) {
                    h.present.iter_mut().zip(dropped).for_each(|(p, &d)| *p &= !d);
                    let empty = !h.present.contains(&true);
                    drop(held);
                    if empty {
                        self.unhold(&to, j);
                    }
                }
                if to.folio(j) == Folio::Evicting {
                    to.set_folio(j, Folio::Evicted);
                }
            });
        }
    }
}

/// The events gate: the handler's reading of events against every COPY and
/// MOVE (see "Lock order" in ARCHITECTURE.md: `events` comes first).
#[derive(Default)]
pub(super) struct EventsGate {
    /// Written by a handler from reading a batch of events until it has
    /// recorded their UNMAP and REMAP bookkeeping (see `Region::drop`) and
    /// their dropped ranges (`dropping`). Read by reclaim over its MOVEs,
    /// and by whoever COPYs pages into the program (a handler, or the
    /// thread preparing a fork) over its COPYs: tried only, under a
    /// stripe lock (`copy_folio`). Lock order: `events`, then stripe locks.
    pub(super) events: std::sync::RwLock<()>,
    /// The ranges of REMOVE and UNMAP events read but not yet dropped
    /// (`drop_range`): from the read on, the kernel may zap them at any
    /// moment, and a page COPYed there after the zap would come back with
    /// its old bytes after the program dropped it. Every COPY of data
    /// steps over them (`copy_folio`), under `events` (read).
    pub(super) dropping: std::sync::Mutex<Vec<(u64, u64)>>,
}
