//! Read-ahead: the streams a handler follows, and the folios it loads or
//! zero-fills ahead of a walk.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::install::{Load, Served};
use super::stats::inc;
use super::{Folio, Inner, RegionState};
use zmem_common::PAGE_SIZE;

/// Read-ahead, per handler thread: a fault that loads the folio right after (or
/// right before) the last one a stream loaded in the same region loads the next
/// `window` folios in that direction too, while the program works on the first:
/// the COPY woke it, so the two run side by side. The window doubles with each
/// sequential fault up to `PagerConfig::read_ahead` bytes.
///
/// The handler follows [`STREAMS`] streams at once, as the kernel keeps
/// read-ahead state per open file: a program walking a list reads the list's array
/// and the objects it points to, two sequences whose faults interleave, and one
/// state reset by each the other's fault. Going down is a program freeing a
/// list last to first (Python's exit). A stream that ran to its region's end
/// goes on at the first folio of a region beside it (the last, going down;
/// within [`NEXT_REGION_GAP`], above or below), keeping its window: an
/// allocator's arenas are mappings of their own (Python's are 1 MiB), and a
/// walk in allocation order goes from one to the next. A fault that continues no stream starts one, in place of the one used
/// least recently. A folio is loaded ahead only with headroom under the high
/// watermark, so read-ahead never makes reclaim run (the kernel's 64K swap-in
/// thrashed near the limit without such a check), and only if its stripe lock
/// is free and it is Evicted. Folios loaded ahead are not referenced:
/// untouched, they are the first to go again.
///
/// Read-ahead guards against strides. A fault continues a stream of loads
/// only where a walk enters the next folio (its first quarter going up, its
/// last going down), and a stream is believed, to load whole folios and read
/// ahead, only from its [`CONFIRM`]th fault on; until then its faults load
/// the block around their page, as random ones do. sqlite inserting 1.5M
/// rows under half its peak faulted on adjacent folios all the time, in
/// short runs and mostly mid-folio (a stride through its page cache's
/// buffers), and each such fault loaded a whole folio and read ahead: 615k
/// load faults, 28 GB written to the swap file, 222 s (2.1 s native). With
/// both guards: 52k load faults, 9.4 s. Either alone: 48 s (entry page
/// only), 105 s (confirmation only).
///
/// Sequential *write* faults on never-touched folios do the same with zeros
/// (`zero_ahead_folios`): the next folios that are Never get one COPY of zeros
/// each (~18 µs for 64K) instead of a fault round trip each (60–100 µs across
/// vCPUs), as a large anonymous folio would give them in the kernel. This is
/// allowed up to the limit, not only under the high watermark: a program
/// filling memory in order at the limit is what it is for, and a page it is
/// about to write costs the same either way. A read fault never zero-fills
/// ahead (the zero page costs nothing).
#[derive(Debug, Default)]
pub(super) struct ReadAhead {
    streams: [Stream; STREAMS],
    clock: u64,
    /// The pages `[lo, hi)` the last partial load of each of the last few
    /// folios this handler loaded in part brought in: `(region, folio, lo,
    /// hi)` (see [`swapped_around`]). A few, as for streams: a program
    /// walks two arrays at once (Python: a list and the objects it points
    /// to). A ring: a new folio takes the slot after `blocks_at`, the one
    /// written last.
    blocks: [(u32, usize, usize, usize); STREAMS],
    blocks_at: usize,
}

/// Read-ahead streams a handler follows.
const STREAMS: usize = 4;

/// How many read-ahead windows ahead of a walk the swap file's reads are
/// started (`Inner::prefetch_ahead`).
const PREFETCH_WINDOWS: usize = 3;

/// The fault of a stream (its first is 1) from which on it loads whole
/// folios and reads ahead (2: at once; 3 took sqlite 31 s, 4 took 9.4 s).
const CONFIRM: u32 = 4;

#[derive(Debug, Default, Clone, Copy)]
struct Stream {
    region: u32,
    /// The last folio faulted or loaded ahead.
    last: usize,
    /// +1 up, -1 down, 0 not known yet (one fault so far).
    dir: i8,
    window: usize,
    /// The sequence is of write faults on never-touched folios (up only).
    zeros: bool,
    /// The stream ran past its region's end (or start, going down).
    ended: bool,
    /// Its region's addresses, `[start, end)`, when last used.
    span: (u64, u64),
    /// `ReadAhead::clock` when last used.
    used: u64,
    /// Its faults so far.
    faults: u32,
    /// The furthest folio whose swap-file reads were started ahead
    /// (`Inner::prefetch_ahead`).
    fetched: Option<usize>,
}

/// Where a fault is: folio `f` of region `id`, of `n` folios, which lies
/// at `[start, end)`.
#[derive(Debug, Clone, Copy)]
pub(super) struct At {
    id: u32,
    f: usize,
    n: usize,
    start: u64,
    end: u64,
    /// The faulting page within the folio, and the folio's pages.
    page: usize,
    ppf: usize,
}

impl At {
    pub(super) fn of(st: &RegionState, f: usize, addr: u64, folio_size: usize) -> At {
        let start = st.start.load(Ordering::Acquire);
        let page = (addr.saturating_sub(start) as usize % folio_size) / PAGE_SIZE;
        At { id: st.id, f, n: st.state.len(), start, end: start + st.len as u64, page, ppf: folio_size / PAGE_SIZE }
    }

    /// The fault is where a walk enters its folio: in its first quarter
    /// going up, its last going down.
    fn enters(&self, dir: i8) -> bool {
        let q = (self.ppf / 4).max(1);
        if dir > 0 {
            self.page < q
        } else {
            self.page + q >= self.ppf
        }
    }
}

/// Pages after a stray fault that get the zero page with it
/// (`zero_stray_ahead`).
pub(super) const STRAY_AHEAD: usize = 16;

/// How far apart (bytes) two regions may lie for a walk that ran off one
/// to go on into the other.
const NEXT_REGION_GAP: u64 = 4 << 20;

impl Stream {
    /// Whether a fault at `at` is this stream's next, and in which
    /// direction.
    fn continued_by(&self, at: &At) -> Option<i8> {
        let At { id, f, n, .. } = *at;
        if self.ended {
            // A walk goes on from one region into another beside it (above
            // or below: mmap hands out addresses downwards), entered at its
            // first folio (its last, going down). Only beside it: a heap
            // grown a little at a time is hundreds of small regions, and
            // every fault at some region's first folio looked like a walk.
            let (a, b) = self.span;
            let beside = id != self.region
                && ((at.start >= b && at.start - b <= NEXT_REGION_GAP)
                    || (at.end <= a && a - at.end <= NEXT_REGION_GAP));
            return match self.dir {
                1 if f == 0 && beside && (self.zeros || at.enters(1)) => Some(1),
                -1 if f + 1 == n && beside && at.enters(-1) => Some(-1),
                _ => None,
            };
        }
        // A walk of loads enters the next folio at its first page (its
        // last, going down): faults at other pages of adjacent folios are
        // a stride, which whole loads would only waste memory on.
        if self.region != id {
            None
        } else if self.dir >= 0 && f == self.last + 1 && (self.zeros || at.enters(1)) {
            Some(1)
        } else if self.dir <= 0 && !self.zeros && f + 1 == self.last && at.enters(-1) {
            Some(-1)
        } else {
            None
        }
    }

    /// The folios to load ahead of fault `f`: the window, in the stream's
    /// direction, within the region's `n` folios.
    fn ahead(&self, f: usize, n: usize) -> impl Iterator<Item = usize> {
        self.ahead_by(f, self.window, n)
    }

    /// The `w` folios after fault `f` in the stream's direction, nearest
    /// first, within the region's `n` folios.
    fn ahead_by(&self, f: usize, w: usize, n: usize) -> impl Iterator<Item = usize> {
        let up = self.dir > 0;
        let (lo, hi) = if up { (f + 1, (f + 1 + w).min(n)) } else { (f.saturating_sub(w), f) };
        (lo..hi).map(move |i| if up { i } else { hi - 1 - (i - lo) })
    }

    /// Of the `w` folios after fault `f`, those whose reads were not
    /// started yet; they count as started from here.
    fn fetch_next(&mut self, f: usize, w: usize, n: usize) -> Vec<usize> {
        let up = self.dir > 0;
        let new = |g: &usize| self.fetched.is_none_or(|x| if up { *g > x } else { *g < x });
        let v: Vec<usize> = self.ahead_by(f, w, n).filter(new).collect();
        if let Some(&last) = v.last() {
            self.fetched = Some(last);
        }
        v
    }

    /// After loading `done` folios ahead of fault `f`.
    fn advance(&mut self, f: usize, done: usize, n: usize) {
        self.last = if self.dir > 0 { f + done } else { f - done };
        self.ended = if self.dir > 0 { self.last + 1 >= n } else { self.last == 0 };
    }
}

impl ReadAhead {
    /// Notes a partial load of pages `mask` of folio `f` of region `id`.
    pub(super) fn loaded_block(&mut self, id: u32, f: usize, mask: u64) {
        if mask == 0 {
            return;
        }
        let b = (id, f, mask.trailing_zeros() as usize, 64 - mask.leading_zeros() as usize);
        match self.blocks.iter_mut().find(|x| (x.0, x.1) == (id, f)) {
            Some(x) => *x = b,
            None => {
                self.blocks_at = (self.blocks_at + 1) % STREAMS;
                self.blocks[self.blocks_at] = b;
            }
        }
    }

    /// The pages the last partial load of folio `f` of region `id` brought
    /// in, if it is among the last few.
    pub(super) fn last_block(&self, id: u32, f: usize) -> Option<(usize, usize)> {
        // Region ids start at 1: an unused slot matches nothing.
        self.blocks.iter().find(|x| (x.0, x.1) == (id, f)).map(|x| (x.2, x.3))
    }

    /// Whether a fault at `at` would continue a stream of loads (changing
    /// nothing).
    pub(super) fn continues(&self, at: &At) -> bool {
        self.streams.iter().any(|s| s.used > 0 && !s.zeros && s.faults + 1 >= CONFIRM && s.continued_by(at).is_some())
    }

    /// The stream a fault at `at` continues, its window doubled; `None` if
    /// it continues none, and then a new stream starts there.
    fn stream(&mut self, at: &At, zeros: bool, max: usize) -> Option<&mut Stream> {
        let At { id, f, .. } = *at;
        self.clock += 1;
        let found = self
            .streams
            .iter()
            .enumerate()
            // Region ids start at 1, and a stream never used has `used` 0.
            .filter(|(_, s)| s.used > 0 && s.zeros == zeros)
            .find_map(|(i, s)| s.continued_by(at).map(|d| (i, d)));
        let Some((i, dir)) = found else {
            let lru = (0..STREAMS).min_by_key(|&i| self.streams[i].used).expect("STREAMS > 0");
            self.streams[lru] = Stream {
                region: id,
                last: f,
                dir: 0,
                window: 0,
                zeros,
                ended: false,
                span: (at.start, at.end),
                used: self.clock,
                faults: 1,
                fetched: None,
            };
            return None;
        };
        let s = &mut self.streams[i];
        if s.region != id || s.dir != dir {
            // On into another region, or the direction just learnt.
            s.region = id;
            s.dir = dir;
            s.fetched = None;
        }
        s.used = self.clock;
        s.span = (at.start, at.end);
        s.faults = s.faults.saturating_add(1);
        // Writes on never-touched folios are believed at once (zeros cost
        // no load); loads only once the stream is confirmed.
        s.window = if zeros || s.faults >= CONFIRM { (s.window * 2).clamp(1, max) } else { 0 };
        Some(s)
    }
}

/// Why `Inner::load_pages` loads.
impl Inner {
    /// After a write fault COPYed zeros over never-touched folio `f` of
    /// `st`: see [`ReadAhead`].
    pub(super) fn zero_ahead(&self, st: &Arc<RegionState>, f: usize, addr: u64, ra: &mut ReadAhead) {
        if self.cfg.read_ahead_folios() == 0 {
            return;
        }
        let n = st.state.len();
        let at = At::of(st, f, addr, self.cfg.folio_size);
        let Some(ra) = ra.stream(&at, true, self.cfg.read_ahead_folios()) else { return };
        let ahead = ra.ahead(f, n);
        let fs = self.cfg.folio_size;
        let mut done = 0;
        for g in ahead {
            if self.usage() + fs > self.limit() {
                break;
            }
            let (lock, _) = self.stripe(st, g);
            let Ok(guard) = lock.try_lock() else { break };
            if st.folio(g) != Folio::Never {
                break;
            }
            let addr = st.start.load(Ordering::Acquire) + (g * fs) as u64;
            if self.zero_copy_folio(st, g, addr, self.tracking) == Served::Again {
                break;
            }
            self.became_resident(st, g);
            inc(&self.counters.zero_ahead_folios);
            drop(guard);
            done += 1;
        }
        ra.advance(f, done, n);
    }

    /// After a fault loaded folio `f` of `st`: see [`ReadAhead`].
    pub(super) fn read_ahead(&self, st: &Arc<RegionState>, f: usize, addr: u64, bounce: &mut [u8], ra: &mut ReadAhead) {
        if self.cfg.read_ahead_folios() == 0 {
            return;
        }
        let n = st.state.len();
        let at = At::of(st, f, addr, self.cfg.folio_size);
        let Some(ra) = ra.stream(&at, false, self.cfg.read_ahead_folios()) else { return };
        // The swap file's reads for this window and the next ones go out
        // first, all at once and without waiting: the window's loads below
        // then wait for the disk once, not once a folio, and the next
        // windows' are on their way while this one is decompressed.
        let fetch = ra.fetch_next(f, PREFETCH_WINDOWS * ra.window, n);
        self.prefetch_ahead(st, &fetch);
        let ahead = ra.ahead(f, n);
        let mut done = 0;
        for g in ahead {
            if self.usage() + self.cfg.folio_size > self.high() {
                break;
            }
            let (lock, _) = self.stripe(st, g);
            let Ok(guard) = lock.try_lock() else { break };
            if st.folio(g) == Folio::Evicted {
                if self.load_pages(st, g, None, bounce, Load::Walk) == Served::Again {
                    break;
                }
                inc(&self.counters.readahead_folios);
            }
            drop(guard);
            done += 1;
        }
        ra.advance(f, done, n);
    }

    /// Starts the swap file's reads of the evicted `folios` of `st`
    /// (`Tier::prefetch`).
    pub(super) fn prefetch_ahead(&self, st: &RegionState, folios: &[usize]) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let ranges: Vec<(u64, usize)> =
            folios.iter().filter(|&&g| st.folio(g) == Folio::Evicted).map(|&g| (st.key(g * ppf), ppf)).collect();
        if !ranges.is_empty() {
            self.tier.prefetch(&ranges);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fault::swapped_around;
    use super::{At, ReadAhead, CONFIRM, NEXT_REGION_GAP};

    pub(super) fn at(id: u32, f: usize, start: u64) -> At {
        At { id, f, n: 4, start, end: start + 4 * 65536, page: 0, ppf: 16 }
    }

    /// Faults on adjacent folios continue a stream of loads only where a
    /// walk enters the next folio (its first quarter going up, its last
    /// going down); anywhere else they are a stride (sqlite's: 222 s with
    /// whole loads and read-ahead on each, 9.4 s without).
    #[test]
    pub(super) fn a_stride_over_adjacent_folios_is_no_stream() {
        let base = 1u64 << 40;
        let on = |f: usize, page: usize| At { f, n: 64, end: base + 64 * 65536, page, ..at(1, f, base) };
        // Up, entering each folio at page 9: never a stream.
        let mut ra = ReadAhead::default();
        for f in 0..8 {
            assert!(!ra.continues(&on(f, 9)), "folio {f}");
            assert!(ra.stream(&on(f, 9), false, 8).is_none(), "folio {f}");
        }
        // Up, entering at page 0 (or 3): a stream, believed from its
        // CONFIRMth fault on (whole loads, a window to read ahead).
        let mut ra = ReadAhead::default();
        assert!(ra.stream(&on(10, 5), false, 8).is_none());
        for (i, (f, page)) in [(11, 0), (12, 3), (13, 0), (14, 1), (15, 0)].into_iter().enumerate() {
            let believed = i as u32 + 2 >= CONFIRM;
            assert_eq!(ra.continues(&on(f, page)), believed, "folio {f}");
            let s = ra.stream(&on(f, page), false, 8).expect("a stream");
            assert_eq!(s.window > 0, believed, "folio {f}");
            s.advance(f, 0, 64);
        }
        // Down, entering at the last quarter; the first page is a stride.
        let mut ra = ReadAhead::default();
        assert!(ra.stream(&on(40, 2), false, 8).is_none());
        for f in (30..40).rev() {
            assert!(ra.stream(&on(f, 0), false, 8).is_none(), "folio {f}");
        }
        let mut ra = ReadAhead::default();
        assert!(ra.stream(&on(40, 2), false, 8).is_none());
        for f in (30..40).rev() {
            let s = ra.stream(&on(f, 13), false, 8).expect("a stream down");
            s.advance(f, 0, 64);
        }
        assert!(ra.continues(&on(29, 15)));
        assert!(!ra.continues(&on(29, 8)));
        // Writes on never-touched folios (zeros) go on at any page.
        let mut ra = ReadAhead::default();
        assert!(ra.stream(&on(20, 7), true, 8).is_none());
        assert!(ra.stream(&on(21, 7), true, 8).is_some());
    }

    /// A walk that ran off its region goes on into a region beside it,
    /// above or below, and not into one far away: a heap grown a little at
    /// a time is hundreds of small regions, and a random fault at the first
    /// folio of any of them was taken for a walk (perl's hash under 48M:
    /// 327k folios read ahead, 107 s; 15k, 58 s).
    #[test]
    pub(super) fn a_walk_goes_on_only_into_a_region_beside_the_one_it_ran_off() {
        let base = 1u64 << 40;
        for (next, beside) in [
            (base + 4 * 65536, true),
            (base + 4 * 65536 + NEXT_REGION_GAP, true),
            (base - 4 * 65536 - 8192, true),
            (base + 4 * 65536 + NEXT_REGION_GAP + 4096, false),
            (base + (1 << 30), false),
        ] {
            let mut ra = ReadAhead::default();
            for f in 0..4 {
                if let Some(s) = ra.stream(&at(1, f, base), false, 8) {
                    s.advance(f, 0, 4);
                }
            }
            assert_eq!(ra.continues(&at(2, 0, next)), beside, "a region at {next:#x}");
            assert!(!ra.continues(&at(2, 1, next)), "only at its first folio");
        }
    }

    /// The pages of a 16-page folio a fault loads, as a list.
    pub(super) fn pages(mask: u64) -> Vec<usize> {
        (0..64).filter(|p| mask >> p & 1 != 0).collect()
    }

    #[test]
    pub(super) fn a_walk_up_a_folio_loads_a_growing_window_and_a_random_fault_one_page() {
        let mut ra = ReadAhead::default();
        // Page 4 of folio 3 loaded alone (the fault that found it evicted).
        let mut swapped = 0xffffu64 & !(1 << 4);
        ra.loaded_block(1, 3, 1 << 4);
        let mut walk = Vec::new();
        for i in 5..16 {
            if swapped >> i & 1 == 0 {
                continue;
            }
            let m = swapped_around(swapped, i, ra.last_block(1, 3), 16, 1);
            ra.loaded_block(1, 3, m);
            swapped &= !m;
            walk.push(pages(m));
        }
        assert_eq!(walk, [vec![5, 6], (7..13).collect(), (13..16).collect()]);
        // A fault beside pages random faults brought in long ago (or
        // another handler's) is random: its page alone, in either direction.
        let swapped = 0xffff & !0b0111_0000_0111_0000;
        assert_eq!(pages(swapped_around(swapped, 7, None, 16, 1)), [7]);
        assert_eq!(pages(swapped_around(swapped, 11, Some((4, 7)), 16, 1)), [11]);
        assert_eq!(pages(swapped_around(swapped, 3, Some((12, 15)), 16, 1)), [3]);
        // Down: the fault just below what was loaded last.
        assert_eq!(pages(swapped_around(swapped, 11, Some((12, 15)), 16, 1)), [7, 8, 9, 10, 11]);
        // Pages still mapped are never loaded again.
        assert_eq!(pages(swapped_around(swapped, 7, Some((4, 7)), 16, 1)), [7, 8, 9, 10, 11]);
        // Blocks of 4: the aligned block, less what is mapped.
        assert_eq!(pages(swapped_around(swapped, 13, None, 16, 4)), [15]);
    }

    #[test]
    pub(super) fn the_last_blocks_of_a_few_folios_are_remembered_at_once() {
        let mut ra = ReadAhead::default();
        assert_eq!(ra.last_block(1, 0), None, "nothing loaded yet");
        // Two walks at once (a list and the objects it points to), and a
        // later load of the same folio replaces its block.
        ra.loaded_block(1, 0, 0b11 << 2);
        ra.loaded_block(2, 5, 1 << 9);
        ra.loaded_block(1, 0, 1 << 4);
        assert_eq!(ra.last_block(1, 0), Some((4, 5)));
        assert_eq!(ra.last_block(2, 5), Some((9, 10)));
        assert_eq!(ra.last_block(2, 0), None);
        // Past STREAMS other folios, the oldest is forgotten.
        for f in 10..14 {
            ra.loaded_block(3, f, 1);
        }
        assert_eq!(ra.last_block(1, 0), None);
        assert_eq!(ra.last_block(3, 10), Some((0, 1)));
    }
}
