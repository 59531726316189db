//! Faults: the handler threads read the userfaultfd and serve faults.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zmem_common::{LockExt, RwLockExt};

use zmem_tier::LoadOutcome;

use super::stats::inc;
use super::{Folio, Inner, RegionState};
use crate::mapping::PAGE_SIZE;
use crate::sys::{Event, UffdError};

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

/// The most looks a folio that refaults soon after its eviction may pass
/// as accessed (`Inner::note_refault`).
const REFAULT_PROTECT: u8 = 3;

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
struct At {
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
    fn of(st: &RegionState, f: usize, addr: u64, folio_size: usize) -> At {
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
const STRAY_AHEAD: usize = 16;

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
    fn loaded_block(&mut self, id: u32, f: usize, mask: u64) {
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
    fn last_block(&self, id: u32, f: usize) -> Option<(usize, usize)> {
        // Region ids start at 1: an unused slot matches nothing.
        self.blocks.iter().find(|x| (x.0, x.1) == (id, f)).map(|x| (x.2, x.3))
    }

    /// Whether a fault at `at` would continue a stream of loads (changing
    /// nothing).
    fn continues(&self, at: &At) -> bool {
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
            if self.stop.load(Ordering::Acquire) && self.regions.read_ok().is_empty() {
                return;
            }
            // Busy-poll (non-blocking reads) a while (`spin.rs`), then
            // block in poll(2).
            // Not beside the program: its CPU is the one a spin would take,
            // and a wake-up there is cheap (`follow.rs`).
            let spinning = idle && follow.pinned().is_none() && spin.spinning(Instant::now());
            if !spinning && carry.is_empty() {
                // Before it blocks: a TLS vector glibc moved meanwhile is
                // locked before reclaim can evict it (`zmem_common::tls`).
                zmem_common::tls::keep_resident();
                let timeout = if pending.is_empty() { Duration::from_millis(50) } else { Duration::from_micros(50) };
                if self.uffd.wait(Some(timeout)).is_err() {
                    return;
                }
            }
            let guard = self.events.write_ok();
            if carry.is_empty() {
                if self.uffd.read_events_into(&mut events).is_err() {
                    return;
                }
            } else {
                events.clear();
                events.append(&mut carry);
            }
            if !events.is_empty() {
                busy.set(true);
            }
            // A FORK event: the events before it are handled now, the child
            // is served until it has its memory, and the rest come after.
            let fork = events.iter().position(|e| matches!(e, Event::Fork { .. })).map(|i| {
                self.fork_seen();
                carry = events.split_off(i + 1);
                events.pop().expect("the FORK event")
            });
            // Where regions are (REMAP) and which parts the program unmapped
            // (UNMAP), before anyone may look (`Region::drop`). The regions
            // each REMOVE or UNMAP drops pages of are the ones there now: a
            // region adopted once the guard is gone (the program mapped the
            // range again) is not the one the event is about. Each is taken
            // with its address then (a later REMAP may move it).
            // The kernel zaps a REMOVE's or UNMAP's range once its event is
            // read: from here until `drop_range` is done with it, no COPY
            // may put the old bytes back there (`dropping`).
            let mut drops: VecDeque<Vec<(Arc<RegionState>, u64)>> = VecDeque::new();
            if events.iter().any(|e| matches!(e, Event::Unmap { .. } | Event::Remove { .. } | Event::Remap { .. })) {
                self.unmapping();
            }
            for ev in &events {
                match *ev {
                    Event::Unmap { start, end } => {
                        self.note_unmapped(start, end);
                        drops.push_back(self.regions_at(start, end));
                        self.dropping.lock_ok().push((start, end));
                    }
                    Event::Remove { start, end } => {
                        drops.push_back(self.regions_at(start, end));
                        self.dropping.lock_ok().push((start, end));
                    }
                    Event::Remap { from, to, len } => self.remap(from, to, len),
                    _ => {}
                }
            }
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
                        let mut d = self.dropping.lock_ok();
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
            // Serve faults in order; a folio being evicted waits its turn
            // (the others go ahead), and at the first EAGAIN go back and
            // read the event that blocks them all.
            let mut i = 0;
            let had = pending.len();
            while i < pending.len() {
                let (addr, write, tid, busy_since) = pending[i];
                // The thread followed, held on this CPU while its fault is
                // served where the scheduler keeps moving it (`follow.rs`).
                let held = follow.hold(tid);
                let served = self.fault(addr, write, &mut bounce, &mut ra);
                if held {
                    follow.let_go(tid);
                    inc(&self.counters.handler_holds);
                }
                match served {
                    Served::Done => {
                        if let Some(t) = busy_since {
                            let ns = t.elapsed().as_nanos() as u64;
                            self.counters.eviction_wait_ns.fetch_add(ns, Ordering::Relaxed);
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
            if had > 0 && pending.is_empty() {
                let now = Instant::now();
                spin.went_idle(now);
                follow.tick(now, (&self.counters.handler_follows, &self.counters.handler_releases));
            }
        }
    }

    /// Serves a fault at `addr` (`write`: the access was a write).
    fn fault(&self, addr: u64, write: bool, bounce: &mut [u8], ra: &mut ReadAhead) -> Served {
        let fs = self.cfg.folio_size as u64;
        let Some(st) = self.region_at(addr) else {
            // Not a region (a staging page, or a region being torn down):
            // map a zero page so that the thread is not stuck.
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
            return Served::Done;
        };
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
                if self.zero_copy_folio(&st, f, folio_addr) == Served::Again {
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
            Folio::Evicted => {
                // A fault that continues a stream loads the whole folio (and
                // reads ahead); any other, only the block around its page.
                let page = ((addr - folio_addr) / PAGE_SIZE as u64) as usize;
                let walk = ra.continues(&At::of(&st, f, addr, fs as usize));
                let want = self
                    .cfg
                    .fault_around_pages()
                    .filter(|_| !walk && !self.held.lock_ok().contains_key(&(st.id, f)))
                    .map(|w| block_around(page, w));
                let why = if walk { Load::Walk } else { Load::Fault };
                if self.timed_load(&st, f, want, bounce, why) == Served::Again {
                    return Served::Again;
                }
                if let Some(m) = want {
                    ra.loaded_block(st.id, f, m);
                }
                inc(&self.counters.load_faults);
                if want.is_some() {
                    inc(&self.counters.partial_load_faults);
                }
                if walk {
                    inc(&self.counters.walk_load_faults);
                }
                drop(g);
                self.read_ahead(&st, f, addr, bounce, ra);
                self.throttle();
                return Served::Done;
            }
            _ if st.swapped[f].load(Ordering::Relaxed) >> ((addr - folio_addr) as usize / PAGE_SIZE) & 1 != 0 => {
                // A page a partial load left in the tier.
                let i = (addr - folio_addr) as usize / PAGE_SIZE;
                let want = self.swapped_around(st.swapped[f].load(Ordering::Relaxed), i, ra.last_block(st.id, f));
                if self.timed_load(&st, f, Some(want), bounce, Load::Fault) == Served::Again {
                    return Served::Again;
                }
                ra.loaded_block(st.id, f, want);
                if !self.tracking {
                    st.referenced[f].store(true, Ordering::Relaxed);
                }
                inc(&self.counters.swapped_page_faults);
            }
            _ => {
                // A page the program dropped from a resident folio.
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
                let mut d = self.dropped.lock_ok();
                if let Some(mask) = d.get_mut(&(st.id, f)) {
                    mask[i] = false;
                    if !mask.contains(&true) {
                        d.remove(&(st.id, f));
                    }
                }
                drop(d);
                inc(&self.counters.dropped_page_faults);
            }
        }
        drop(g);
        self.throttle();
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
        let _events = match self.events.try_read() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(Served::Again),
        };
        let key = (st.id, f);
        let (addr, present, swapped) = match self.staged.lock_ok().get(&key) {
            Some(s) if !s.rescued => (s.addr, s.present.clone(), s.swapped),
            _ => return Err(Served::Busy),
        };
        if self.dropped.lock_ok().contains_key(&key)
            || self.forwards.lock_ok().contains_key(&key)
            || st.has_holes.load(Ordering::Acquire)
            || !st.moved.lock_ok().is_empty()
        {
            return Err(Served::Busy);
        }
        let ppf = present.len();
        for (p, n) in super::reclaim::page_runs(&present) {
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
        if self.copy_folio(st, f, &bounce[..ppf * PAGE_SIZE], &vec![false; ppf], Some(&skip)) == Served::Again {
            return Err(Served::Again);
        }
        if let Some(s) = self.staged.lock_ok().get_mut(&key) {
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
        let Ok(_events) = self.events.try_read() else { return };
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
        let Some(own) = zmem_common::owned::try_overlapping(page, end) else { return };
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
        let mut bad = vec![false; ppf];
        // One call: the pages' slots in the swap file are read together
        // (one preadv per run). Pages it does not fill are zeroed after.
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
            if let Some(h) = self.held.lock_ok().get(&(st.id, f)) {
                for (i, page) in bounce.chunks_exact_mut(PAGE_SIZE).enumerate().filter(|(i, _)| h.present[*i]) {
                    page.copy_from_slice(&h.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
                }
            }
        }
        let holes = st.holes_in(f * ppf, ppf);
        // Not filled: the program's holes, and the pages not wanted.
        let skip = match (want, &holes) {
            (None, _) => holes.clone(),
            (Some(_), h) => Some((0..ppf).map(|p| !wanted(p) || h.as_ref().is_some_and(|h| h[p])).collect()),
        };
        if self.copy_folio(st, f, bounce, &bad, skip.as_deref()) == Served::Again {
            // Nothing is lost: the entries are still in the tier.
            return Served::Again;
        }
        let nbad = bad.iter().filter(|&&b| b).count() as u64;
        self.counters.poisoned_pages.fetch_add(nbad, Ordering::Relaxed);
        let evicted = st.folio(f) == Folio::Evicted;
        match want {
            None if keep && nbad == 0 => self.retain_pages(st, f, u64::MAX, bounce, once),
            None => self.invalidate_folio(st, f),
            Some(m) if keep && nbad == 0 => self.retain_pages(st, f, m, bounce, once),
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
            }
        } else {
            self.clear_swapped(st, f, want.unwrap_or(u64::MAX));
        }
        Served::Done
    }

    /// Which of the pages a partial load left in folio's tier (`swapped`)
    /// a fault on page `i` of them loads (see [`swapped_around`]).
    fn swapped_around(&self, swapped: u64, i: usize, last: Option<(usize, usize)>) -> u64 {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        swapped_around(swapped, i, last, ppf, self.cfg.fault_around_pages().unwrap_or(ppf))
    }

    /// After a write fault COPYed zeros over never-touched folio `f` of
    /// `st`: see [`ReadAhead`].
    fn zero_ahead(&self, st: &Arc<RegionState>, f: usize, addr: u64, ra: &mut ReadAhead) {
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
            if self.zero_copy_folio(st, g, addr) == Served::Again {
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
    fn read_ahead(&self, st: &Arc<RegionState>, f: usize, addr: u64, bounce: &mut [u8], ra: &mut ReadAhead) {
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
    fn prefetch_ahead(&self, st: &RegionState, folios: &[usize]) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let ranges: Vec<(u64, usize)> =
            folios.iter().filter(|&&g| st.folio(g) == Folio::Evicted).map(|&g| (st.key(g * ppf), ppf)).collect();
        if !ranges.is_empty() {
            self.tier.prefetch(&ranges);
        }
    }

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
    fn copy_folio(&self, st: &RegionState, f: usize, src: &[u8], bad: &[bool], skip: Option<&[bool]>) -> Served {
        let _events = match self.events.try_read() {
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
                self.copy_run(st, a, &src[p * PAGE_SIZE..(p + run) * PAGE_SIZE])
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
    fn fenced(&self, addr: u64, n: usize) -> Option<Vec<bool>> {
        let d = self.dropping.lock_ok();
        let end = addr + (n * PAGE_SIZE) as u64;
        if !d.iter().any(|&(a, b)| a < end && addr < b) {
            return None;
        }
        let page = |i: usize| addr + (i * PAGE_SIZE) as u64;
        Some((0..n).map(|i| d.iter().any(|&(a, b)| a < page(i) + PAGE_SIZE as u64 && page(i) < b)).collect())
    }

    fn copy_run(&self, st: &RegionState, dst: u64, src: &[u8]) -> Served {
        let mut off = 0u64;
        let len = src.len() as u64;
        while off < len {
            match st.copy_in(&self.uffd, dst + off, &src[off as usize..], self.tracking) {
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
    fn zero_fill_folio(&self, st: &RegionState, f: usize, folio_addr: u64) -> Result<u64, UffdError> {
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
    /// holes; pages already there are stepped over.
    fn zero_copy_folio(&self, st: &RegionState, f: usize, folio_addr: u64) -> Served {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        let holes = st.holes_in(f * ppf, ppf);
        let hole = |p: usize| holes.as_ref().is_some_and(|h| h[p]);
        let mut p = 0;
        while p < ppf {
            let run = (p..ppf).take_while(|&q| hole(q) == hole(p)).count();
            if !hole(p) {
                let a = folio_addr + (p * PAGE_SIZE) as u64;
                if self.copy_run(st, a, &self.zeros[..run * PAGE_SIZE]) == Served::Again {
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

    /// [`Inner::became_resident`], onto the once list with `once` (see
    /// `Lru::once`).
    /// A fault loads Evicted folio `f` back: if fewer folios were evicted
    /// since it went than are resident now, a little more room would have
    /// kept it (mm/workingset.c's refault distance), so it is in use and
    /// earns looks it passes as accessed (`RegionState::protect`).
    fn note_refault(&self, st: &RegionState, f: usize) {
        let distance = self.evict_clock.load(Ordering::Relaxed).wrapping_sub(st.evicted_at[f].load(Ordering::Relaxed));
        let b = super::stats::refault_bucket(distance as usize, self.resident.load(Ordering::Relaxed));
        inc(&self.counters.refault_distance[b]);
        if (distance as usize) < self.resident.load(Ordering::Relaxed) {
            let p = st.protect[f].load(Ordering::Relaxed);
            st.protect[f].store((p + 1).min(REFAULT_PROTECT), Ordering::Relaxed);
            inc(&self.counters.workingset_refaults);
        }
        if (distance as usize) < self.balance_step_folios() {
            self.balance_refaults.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn became_resident_on(&self, st: &Arc<RegionState>, f: usize, once: bool) {
        self.mark_resident(st, f);
        self.lru_add_to(st, f, once);
    }

    fn mark_resident(&self, st: &RegionState, f: usize) {
        st.set_folio(f, Folio::Resident);
        // With write tracking, loaded pages are mapped write-protected and
        // a write after the fault is what counts; without it, the fault
        // itself is the only access CLOCK can see.
        st.referenced[f].store(!self.tracking, Ordering::Relaxed);
        self.resident.fetch_add(1, Ordering::Relaxed);
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
fn swapped_around(swapped: u64, i: usize, last: Option<(usize, usize)>, ppf: usize, w: usize) -> u64 {
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
fn block_around(i: usize, w: usize) -> u64 {
    let lo = i / w * w;
    (if w >= 64 { !0 } else { (1u64 << w) - 1 }) << lo
}

#[cfg(test)]
mod tests {
    use super::{swapped_around, At, ReadAhead, CONFIRM, NEXT_REGION_GAP};

    fn at(id: u32, f: usize, start: u64) -> At {
        At { id, f, n: 4, start, end: start + 4 * 65536, page: 0, ppf: 16 }
    }

    /// Faults on adjacent folios continue a stream of loads only where a
    /// walk enters the next folio (its first quarter going up, its last
    /// going down); anywhere else they are a stride (sqlite's: 222 s with
    /// whole loads and read-ahead on each, 9.4 s without).
    #[test]
    fn a_stride_over_adjacent_folios_is_no_stream() {
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
    fn a_walk_goes_on_only_into_a_region_beside_the_one_it_ran_off() {
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
    fn pages(mask: u64) -> Vec<usize> {
        (0..64).filter(|p| mask >> p & 1 != 0).collect()
    }

    #[test]
    fn a_walk_up_a_folio_loads_a_growing_window_and_a_random_fault_one_page() {
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
    fn the_last_blocks_of_a_few_folios_are_remembered_at_once() {
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
