//! The address ranges that are zmem's own: its mappings (regions, staging,
//! pool arenas, its heap) and its threads' stacks, plus the stacks of the
//! program's threads and the memory it locked. The mapping scan (`zmem_uffd`'s adoption) never
//! manages a range that overlaps one of these: a zmem thread that faulted
//! on its own memory would wait for itself.
//!
//! Every mapping zmem makes with mmap is added here before it is used and
//! removed after it is unmapped. Thread stacks are added by the thread that
//! creates them (the shim's `pthread_create`), before the new thread's
//! stack can be seen by a scan: see [`spawn_lock`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::{LockExt, RwLockExt};

/// What a range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// zmem's own memory, or a zmem thread's stack: never managed.
    Zmem,
    /// A program thread's stack: managed only when the user asks for it.
    Stack,
    /// Memory the program locked (`mlock`, `mlock2`, `MAP_LOCKED`): never
    /// managed, as the kernel never reclaims it.
    Locked,
    /// The stack of a thread that exited, which the C library keeps mapped
    /// for its next thread (glibc's stack cache), and that next thread may
    /// be zmem's: never managed. Recorded as its thread exits; forgotten
    /// ([`forget_stale`]) once no mapping holds it whole any more (the C
    /// library unmapped it, and something else may be there now).
    CachedStack,
}

static RANGES: Mutex<BTreeMap<u64, (u64, Kind)>> = Mutex::new(BTreeMap::new());
static SPAWN: RwLock<()> = RwLock::new(());
/// Most arenas of the shim's heap, of all its parts and generations.
pub const MAX_HEAP_ARENAS: usize = 256;

/// One arena of the shim's heap: `[start, end)`, and its heap's tag.
struct HeapArena {
    /// 0 until the entry is filled; stored last.
    start: AtomicU64,
    end: AtomicU64,
    tag: AtomicU64,
}

/// The shim's heap arenas (appended without allocating: the heap itself
/// calls [`add_heap`]), entries claimed by `HEAP_CLAIMED`, and bounds over
/// all of them, so that most addresses are told apart at once.
static HEAP: [HeapArena; MAX_HEAP_ARENAS] =
    [const { HeapArena { start: AtomicU64::new(0), end: AtomicU64::new(0), tag: AtomicU64::new(0) } }; MAX_HEAP_ARENAS];
static HEAP_CLAIMED: AtomicUsize = AtomicUsize::new(0);
static HEAP_BOUNDS: [AtomicU64; 2] = [AtomicU64::new(u64::MAX), AtomicU64::new(0)];

/// Records `[start, start + len)` as an arena of the shim's heap whose
/// blocks are `tag`'s; false when the table is full. Allocates nothing.
/// Call it before the arena is accessible, and before any of its blocks is
/// handed out: [`heap_tag`] must find every block.
pub fn add_heap(start: u64, len: usize, tag: u64) -> bool {
    let i = HEAP_CLAIMED.fetch_add(1, Ordering::AcqRel);
    if i >= MAX_HEAP_ARENAS || start == 0 {
        return false;
    }
    let end = start + len as u64;
    // The bounds first: a reader that finds the entry finds it within them.
    HEAP_BOUNDS[0].fetch_min(start, Ordering::AcqRel);
    HEAP_BOUNDS[1].fetch_max(end, Ordering::AcqRel);
    let e = &HEAP[i];
    e.tag.store(tag, Ordering::Relaxed);
    e.end.store(end, Ordering::Relaxed);
    e.start.store(start, Ordering::Release);
    true
}

/// The tag of the heap arena that holds `addr`, if one does.
pub fn heap_tag(addr: u64) -> Option<u64> {
    if addr < HEAP_BOUNDS[0].load(Ordering::Acquire) || addr >= HEAP_BOUNDS[1].load(Ordering::Acquire) {
        return None;
    }
    heap_arenas().find(|&(s, e, _)| s <= addr && addr < e).map(|(_, _, t)| t)
}

/// The heap arenas recorded so far: (start, end, tag).
fn heap_arenas() -> impl Iterator<Item = (u64, u64, u64)> {
    let n = HEAP_CLAIMED.load(Ordering::Acquire).min(MAX_HEAP_ARENAS);
    HEAP[..n].iter().filter_map(|e| {
        let s = e.start.load(Ordering::Acquire);
        (s != 0).then(|| (s, e.end.load(Ordering::Relaxed), e.tag.load(Ordering::Relaxed)))
    })
}

/// Records `[start, start + len)` as `kind` (a range already there is
/// replaced).
pub fn add(start: u64, len: usize, kind: Kind) {
    if len > 0 {
        RANGES.lock_ok().insert(start, (start + len as u64, kind));
    }
}

/// Forgets the range that starts at `start`.
pub fn remove(start: u64) {
    RANGES.lock_ok().remove(&start);
}

/// Forgets the cached stack at `start` if it is still recorded as one: a
/// scan found no mapping that holds it whole (see [`Kind::CachedStack`]).
pub fn forget_stale(start: u64) {
    let mut ranges = RANGES.lock_ok();
    if ranges.get(&start).is_some_and(|&(_, k)| k == Kind::CachedStack) {
        ranges.remove(&start);
    }
}

/// The recorded ranges that overlap `[start, end)`, in address order.
pub fn overlapping(start: u64, end: u64) -> Vec<(u64, u64, Kind)> {
    overlapping_in(&RANGES.lock_ok(), start, end)
}

/// [`overlapping`], or `None` at once if the table is locked: for a
/// userfaultfd handler, which must never wait for a forking thread. That
/// thread holds the table from the prepare step of fork to its end
/// ([`fork_lock`]), and may itself be waiting for the handler: for a fault
/// it took meanwhile, or, with `UFFD_FEATURE_EVENT_FORK`, for its FORK
/// event to be read.
pub fn try_overlapping(start: u64, end: u64) -> Option<Vec<(u64, u64, Kind)>> {
    let ranges = match RANGES.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return None,
    };
    Some(overlapping_in(&ranges, start, end))
}

fn overlapping_in(ranges: &BTreeMap<u64, (u64, Kind)>, start: u64, end: u64) -> Vec<(u64, u64, Kind)> {
    let mut out = Vec::new();
    out.extend(heap_arenas().filter(|&(s, e, _)| s < end && start < e).map(|(s, e, _)| (s, e, Kind::Zmem)));
    // A range that starts before `start` may still reach into it.
    if let Some((&s, &(e, k))) = ranges.range(..start).next_back() {
        if e > start {
            out.push((s, e, k));
        }
    }
    out.extend(ranges.range(start..end).map(|(&s, &(e, k))| (s, e, k)));
    out.sort_unstable();
    out
}

/// Held (read) by a thread that makes a range of zmem's (a mapping, a
/// thread's stack) from the moment it may exist until it is recorded; held
/// (write) by a scan of the address space, so a scan never sees one
/// unrecorded and adopts it.
pub fn spawn_lock() -> RwLockReadGuard<'static, ()> {
    SPAWN.read_ok()
}

/// See [`spawn_lock`].
pub fn scan_lock() -> RwLockWriteGuard<'static, ()> {
    SPAWN.write_ok()
}

/// This module's locks and the list of pinned thread vectors
/// (`crate::tls`), held by a forking thread across fork: a lock another
/// thread held at fork would stay held for good in the child. (A waiting
/// process's stats thread pins its vector before each sleep, every few
/// milliseconds; a bash forked meanwhile hung as it started its own.)
#[derive(Debug)]
pub struct ForkGuard {
    _ranges: std::sync::MutexGuard<'static, BTreeMap<u64, (u64, Kind)>>,
    _spawns: RwLockWriteGuard<'static, ()>,
    _pins: std::sync::MutexGuard<'static, Vec<(usize, usize)>>,
}

/// Takes the locks (see [`ForkGuard`]); drop it after fork, in the parent
/// and in the child.
pub fn fork_lock() -> ForkGuard {
    let _spawns = scan_lock();
    let _ranges = RANGES.lock_ok();
    ForkGuard { _ranges, _spawns, _pins: super::tls::fork_lock() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_finds_ranges_that_start_before_inside_but_not_after() {
        let base = 0x7700_0000_0000u64;
        add(base, 0x1000, Kind::Zmem);
        add(base + 0x3000, 0x2000, Kind::Stack);
        add(base + 0x8000, 0x1000, Kind::Zmem);
        assert_eq!(overlapping(base + 0x800, base + 0x900), vec![(base, base + 0x1000, Kind::Zmem)]);
        assert_eq!(overlapping(base + 0x1000, base + 0x3000), vec![]);
        assert_eq!(
            overlapping(base + 0x4000, base + 0x8001),
            vec![(base + 0x3000, base + 0x5000, Kind::Stack), (base + 0x8000, base + 0x9000, Kind::Zmem)]
        );
        remove(base + 0x3000);
        assert_eq!(overlapping(base + 0x4000, base + 0x5000), vec![]);
        remove(base);
        remove(base + 0x8000);
    }

    #[test]
    fn heap_arenas_are_found_by_address_and_overlap() {
        let base = 0x7720_0000_0000u64;
        assert!(add_heap(base, 0x4000, 0));
        assert!(add_heap(base + 0x10000, 0x2000, 3));
        assert_eq!(heap_tag(base + 0x3fff), Some(0));
        assert_eq!(heap_tag(base + 0x4000), None);
        assert_eq!(heap_tag(base + 0x11000), Some(3));
        assert_eq!(heap_tag(base - 1), None);
        assert_eq!(
            overlapping(base + 0x3000, base + 0x10001),
            vec![(base, base + 0x4000, Kind::Zmem), (base + 0x10000, base + 0x12000, Kind::Zmem)]
        );
    }

    #[test]
    fn forget_stale_forgets_only_a_cached_stack() {
        let base = 0x7710_0000_0000u64;
        add(base, 0x2000, Kind::Stack);
        add(base + 0x4000, 0x2000, Kind::CachedStack);
        // A live thread's stack stays, whatever a scan thinks of it.
        forget_stale(base);
        forget_stale(base + 0x4000);
        assert_eq!(overlapping(base, base + 0x8000), vec![(base, base + 0x2000, Kind::Stack)]);
        // The thread exited: its stack is cached, then reused by a new
        // thread, which records it as its own again.
        add(base, 0x2000, Kind::CachedStack);
        add(base, 0x2000, Kind::Zmem);
        forget_stale(base);
        assert_eq!(overlapping(base, base + 0x1000), vec![(base, base + 0x2000, Kind::Zmem)]);
        remove(base);
    }
}
