//! A pager that starts late: until the tree's memory is halfway to its
//! limit, a process only counts itself in it.
//!
//! Starting a pager costs a process ~1.7 ms (its threads, the userfaultfd,
//! the swap file and its key), and its managed first touches a fault round
//! trip each. A long program never notices; a build, a test suite or a
//! shell pipeline is thousands of short processes, and paid it each time
//! (`make -j2` of 100 small C files ran 1.7x native). So a process whose
//! pager is to adopt the program's mappings (`ZMEM_ADOPT`, the default)
//! *waits* (`ZMEM_START_PERCENT`, 50 by default; 0 starts at load):
//!
//! - At load ([`begin`]) it joins the tree (`zmem_uffd::tree`), looks
//!   once, and starts the stats thread, which writes no file yet.
//! - A look ([`look`]) publishes the process's anonymous resident bytes
//!   as its usage, and those with what it has mapped and not filled yet
//!   (the large mappings the shim saw) as what it may soon hold, and
//!   starts the pager (`init::start_late`) once the tree's count
//!   (`Tree::committed`: each process at the larger of the two) reaches
//!   `start_percent` of the limit. The pager's first scan adopts what
//!   exists, resident pages included, as it adopts what a program maps
//!   before any pager; from then on the process is managed as if it had
//!   started at load.
//! - The stats thread looks every 1 to 100 ms ([`tick`]: the room left at
//!   8 MB/ms). A large mapping (or a large commit with `mprotect`, which
//!   is filled as fast) is published at once, and one that brings
//!   the tree's count to the point is looked at at once ([`saw_mapping`]):
//!   inline after glibc's malloc returned, or by the stats thread, waited
//!   for, from `mmap` (which may run under an allocator's lock).
//! - Until then the process's memory is plain memory: it may go past the
//!   point by what it fills between two looks and during the start, and
//!   the half of the limit above the point is the room for that.
//!
//! The state (the settings, the tree slot, a
//! forked child's inheritance) has one owner, [`WAITING`], held by a look
//! (and by the start it makes: a look and a start are one step), taken by
//! fork's prepare step first of all its locks (`fork::before_fork`), and
//! tried by the exit handler. The program's own calls that need the
//! process to have no thread of zmem's stop the stats thread: `unshare`,
//! `setns` and credential changes ([`pause`], [`resume`]), seccomp
//! ([`end`]: the process stays unmanaged, as a managed one does). `chroot`
//! starts the pager first ([`start_now`]), while `/proc` and the swap
//! directory are still at their paths.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use zmem_common::LockExt;
use zmem_settings::Settings;
use zmem_uffd::tree::{Member, Tree};

/// A process waiting to start its pager.
pub(crate) struct Waiting {
    settings: Settings,
    /// Its slot in the tree; `None` outside one (or where its segment
    /// could not be joined: the limit is then the process's own).
    member: Option<Member>,
    /// The last look's figures, for the stats file.
    last: Look,
    /// In a forked child, what it held at the fork and the parent it
    /// shares that with: counted as the parent's, not the child's, while
    /// the parent lives (the pages are the parent's too, and a pager
    /// charges pages shared after a fork to no one). A forking server's
    /// children, each counting the parent's 100 MiB as its own under a
    /// 512M tree, started pagers with shares of a few MiB and warned that
    /// their limits turned soft.
    inherited: Option<(usize, u32)>,
    /// `PagerConfig::share_floor` under these settings.
    floor: usize,
    /// When it last did its once-a-second chores: the tree's slots of
    /// processes gone swept, and what was mapped and not filled faded.
    second_at: Instant,
}

/// What the last look saw.
#[derive(Debug, Clone, Copy, Default)]
struct Look {
    /// This process's anonymous resident bytes (less what a forked child
    /// shares with its parent): its usage in the tree.
    anon: usize,
    /// Bytes of large mappings the shim saw the program make and that its
    /// anonymous bytes have not grown by since: mapped to be filled.
    pending: usize,
    /// Its usage with what it has mapped and not filled yet
    /// (`Member::publish_mapped`): a program that maps its memory first
    /// and fills it after (stress-ng, a database's buffer pool) starts as
    /// it maps.
    usage: usize,
    /// The tree's usage, this process's included.
    total: usize,
    /// Where the pager starts: `start_percent` of the limit.
    at: usize,
}

/// The pid of the process that waits (0: none), for [`is_waiting`]
/// without the lock: a child made by a raw `clone` (bubblewrap's) may have
/// copied it held.
static WAITING_PID: AtomicU32 = AtomicU32::new(0);

/// The waiting process's state; `None` once its pager started (or where it
/// never waits).
static WAITING: Mutex<Option<Waiting>> = Mutex::new(None);

/// How fast a program may fill memory, for how long a look may wait.
const FILL_BYTES_PER_MS: usize = 8 << 20;
const LOOK_MIN: Duration = Duration::from_millis(1);
const LOOK_MAX: Duration = Duration::from_millis(100);
/// How often a waiting process frees the tree's slots of processes gone
/// (a pager's reclaim thread does it too) and what it mapped and did not
/// fill fades by half.
const EVERY_SECOND: Duration = Duration::from_secs(1);

/// Whether a process under `settings` waits rather than starts.
pub(crate) fn wants_to_wait(settings: &Settings) -> bool {
    settings.start_percent > 0 && settings.adopt
}

/// Makes this process wait (see the module's text), with the stats
/// thread looking. `Err` gives the settings back where it cannot (no
/// `/proc`, no thread): the caller starts the pager now.
pub(crate) fn begin(settings: Settings) -> Result<(), Box<Settings>> {
    begin_with(settings, None)
}

/// [`begin`], in a forked child of parent `parent` whose memory it shares.
fn begin_with(settings: Settings, parent: Option<u32>) -> Result<(), Box<Settings>> {
    let member = settings.tree.as_deref().and_then(|p| match Tree::open(p).and_then(Tree::join) {
        Ok(m) => Some(m),
        Err(e) => {
            log::warn!("{e}; this process takes the whole limit");
            None
        }
    });
    let floor = settings.share_floor();
    let (dir, interval) = (settings.stats_dir.clone(), settings.stats_interval);
    let mut g = WAITING.lock_ok();
    *g = Some(Waiting { settings, member, last: Look::default(), inherited: None, floor, second_at: Instant::now() });
    WAITING_PID.store(std::process::id(), Ordering::Release);
    drop(g);
    if let Some(parent) = parent {
        let mut g = WAITING.lock_ok();
        let w = g.as_mut().expect("set above");
        w.inherited = anon_bytes().map(|b| (b, parent));
    }
    // The first look, here: a process that starts in a tree past the
    // point starts its pager now, as every process did at load, and the
    // program's first large mapping finds the room set.
    if tick().is_none() {
        return Ok(());
    }
    if let Err(e) = crate::stats::start_thread(dir, interval) {
        log::debug!("no stats thread ({e}); the pager starts now");
        let w = take(&mut WAITING.lock_ok(), NOT_WAITING).expect("set above");
        return Err(Box::new(w.settings));
    }
    Ok(())
}

/// The process's anonymous resident bytes: resident pages less shared
/// ones (file pages and shared memory), from the calling thread's
/// `/proc/thread-self/statm` (`/proc/self` of a process whose main thread
/// ended reads as empty). Opened, read and closed in one descriptor
/// section (`zmem_common::host::fds`), never kept: a program's `dup2` onto a
/// number it takes for free waits for the section, where a descriptor
/// kept open was replaced under zmem, and its close then closed the
/// program's file (sshd's re-exec'd child lost its configuration pipe).
fn anon_bytes() -> Option<usize> {
    let t =
        zmem_common::host::fds::read_to_string(zmem_common::host::fds::Wait::Yes, "/proc/thread-self/statm".as_ref())
            .ok()?;
    let resident = zmem_common::procfs::statm_field(&t, 1)?;
    let shared = zmem_common::procfs::statm_field(&t, 2)?;
    Some(resident.saturating_sub(shared) * zmem_common::PAGE_SIZE)
}

/// Bytes left to the start point at the last look ([`NOT_WAITING`],
/// [`STARTING`]), and bytes of large mappings the program made since: the
/// program's threads wake the stats thread for a look at once when what
/// they mapped since the last look reaches what was left
/// ([`saw_mapping`]), rather than fill it all before the next look.
static ROOM: AtomicUsize = AtomicUsize::new(NOT_WAITING);
/// The room of a process that does not wait.
const NOT_WAITING: usize = usize::MAX;
/// The room while the pager starts ([`start_locked`]): a mapping made
/// meanwhile, by another of the program's threads, waits for the start and
/// is adopted before it is filled ([`saw_mapping`]). With the room at
/// [`NOT_WAITING`] from the start on, one of stress-ng's workers mapped its
/// 48 MiB while its stats thread started the pager (the sibling's mapping
/// had brought the tree to the point), filled it unmanaged, and the tree
/// held 95 MiB under a 64M limit until the pager's first scan adopted it.
const STARTING: usize = 0;
static SEEN: AtomicUsize = AtomicUsize::new(0);
/// Looks so far: a thread that woke the stats thread waits for the next.
static LOOKS: AtomicUsize = AtomicUsize::new(0);
/// How long a mapping that crosses the start point waits for the pager.
/// The start takes ~2 ms on a quiet machine, and the wait ends with it; on
/// busy CPUs the stats thread runs late. With 20 ms, SBCL under 32M
/// (which maps its 1 GiB heap at once, then fills it) beside three busy
/// loops at nice -10 peaked at 32.9–37.6 MiB (mean 35.6, 9 runs): it
/// filled its heap unmanaged until the pager's first scan. With 250 ms,
/// 32.5–35.2 MiB (mean 33.7).
const START_WAIT: Duration = Duration::from_millis(250);

/// The program mapped `len` bytes of private anonymous memory (the shim's
/// `mmap`, or a chunk glibc's malloc mapped and returned), or committed
/// them (the shim's `mprotect`). Where that
/// reaches what was left to the start point, the stats thread looks now,
/// and the mapping thread waits for the look, at most `START_WAIT`:
/// returns whether the pager runs then, for the caller to adopt the
/// mapping before the program fills it. Without the wait, a program that
/// maps and then fills at once (stress-ng's workers: 96 MiB each under a
/// 64M tree) filled ~30 MiB before its pager had started and adopted.
/// The wait is bounded because the caller may be inside the program's
/// allocator, holding its lock; the start takes none of the program's
/// (zmem's threads allocate from zmem's heap), and a start that takes
/// longer leaves the mapping to the pager's first scan. No allocation.
///
/// Where `inline`, the caller holds no lock of an allocator's (glibc's
/// malloc has returned) and looks itself, at once: a look that finds the
/// point reached starts the pager on this thread, as a large malloc did
/// when the shim started at the first one.
pub(crate) fn saw_mapping(len: usize, inline: bool) -> bool {
    // Not zmem's own mappings (the stats thread's, as it starts the pager).
    if crate::guard::in_zmem() {
        return false;
    }
    // Another process's wait: this is a vfork child of the waiting
    // process, or a raw `clone`'s child, whose `ROOM` is the parent's.
    let waiter = WAITING_PID.load(Ordering::Acquire);
    if waiter != 0 && waiter != std::process::id() {
        return false;
    }
    let room = ROOM.load(Ordering::Relaxed);
    if room == NOT_WAITING {
        // Not waiting: no pager, or one that started after the caller
        // looked and before the start point was set back (`start_locked`),
        // which the caller adopts the mapping into.
        return crate::state::current().is_some();
    }
    let seen = SEEN.fetch_add(len, Ordering::Relaxed) + len;
    // In the tree at once, before the program fills it: four processes
    // filling at once each saw the others as of their last looks, and
    // together went ~25 MiB further past the point. Then the tree's
    // count now, not the room the last look left.
    let crossed = match WAITING.try_lock() {
        Ok(g) => match g.as_ref().filter(|_| is_waiting()).and_then(|w| Some((w, w.member.as_ref()?))) {
            Some((w, m)) => {
                m.publish_mapped(w.last.usage.saturating_add(seen));
                m.tree().committed() as usize >= w.last.at
            }
            None => seen >= room,
        },
        Err(_) => seen >= room,
    };
    if !crossed {
        return false;
    }
    if inline {
        crate::guard::guarded(look);
        return crate::state::current().is_some();
    }
    let looks = LOOKS.load(Ordering::Acquire);
    crate::stats::wake_thread();
    let until = Instant::now() + START_WAIT;
    // A look, or a start under way (which a look does not follow where a
    // look started it before this thread woke the stats thread).
    while LOOKS.load(Ordering::Acquire) == looks && crate::state::current().is_none() && Instant::now() < until {
        std::thread::sleep(Duration::from_micros(50));
    }
    crate::state::current().is_some()
}

/// A look, from the stats thread: publishes the usage, and starts the
/// pager where the tree's usage reached the start point. `Some(wait)`:
/// still waiting, look again within `wait`; `None`: not waiting (any
/// more).
///
/// The point is the tree's, not the process's share of it: four
/// processes that each filled 40 MiB at once under a 64M limit, each
/// looking at its own share (what the others had published a look ago),
/// held 125 MiB together before they started (78 MiB with pagers started
/// at load). With the tree's sum, every process of a tree whose memory
/// grows starts once the sum is halfway there, and a process started in
/// a tree that is near its limit starts at once, as it always did.
pub(crate) fn tick() -> Option<Duration> {
    look()
}

/// A look (see [`tick`]), by the stats thread or by a program thread
/// (after a large malloc).
fn look() -> Option<Duration> {
    // Not in a raw `clone`'s child (see [`start_now`]), whose `ROOM` is
    // its parent's: it takes no lock, and starts no pager.
    if !is_waiting() {
        return None;
    }
    let mut guard = WAITING.lock_ok();
    let w = guard.as_mut()?;
    // What a forked child shares with its parent is the parent's while the
    // parent lives (its parent changes when it exits).
    // SAFETY: getppid has no preconditions.
    if w.inherited.is_some_and(|(_, parent)| parent != unsafe { libc::getppid() } as u32) {
        w.inherited = None;
    }
    let base = w.inherited.map_or(0, |(b, _)| b);
    // Unreadable: taken as past the start point, so that the limit holds.
    let anon = anon_bytes().map_or(usize::MAX / 2, |b| b.saturating_sub(base));
    // What the program mapped counts until it is filled: the large
    // mappings the shim saw, less the growth of the anonymous bytes since
    // (its thread stacks, which glibc maps itself and zmem never adopts,
    // are not seen). What is never filled (a mapping unmapped untouched,
    // a reservation) fades, by half each second.
    let grew = anon.saturating_sub(w.last.anon);
    let mut pending = (w.last.pending + SEEN.swap(0, Ordering::Relaxed)).saturating_sub(grew);
    let second = w.second_at.elapsed() >= EVERY_SECOND;
    if second {
        w.second_at = Instant::now();
        pending /= 2;
    }
    let usage = anon.saturating_add(pending);
    let (limit, total) = match &w.member {
        Some(m) => {
            m.publish(anon, w.floor);
            m.publish_mapped(usage);
            (m.tree().limit(), (m.tree().committed() as usize).max(usage))
        }
        None => (w.settings.limit, usage),
    };
    let at = limit / 100 * w.settings.start_percent as usize;
    w.last = Look { anon, pending, usage, total, at };
    if total >= at {
        start_locked(&mut guard);
        LOOKS.fetch_add(1, Ordering::Release);
        return None;
    }
    ROOM.store(at - total, Ordering::Relaxed);
    LOOKS.fetch_add(1, Ordering::Release);
    if let Some(m) = w.member.as_ref().filter(|_| second) {
        m.tree().sweep();
    }
    let ms = (at - total) / FILL_BYTES_PER_MS;
    Some(Duration::from_millis(ms as u64).clamp(LOOK_MIN, LOOK_MAX))
}

/// Starts the pager of the waiting process `guard` holds, under the lock:
/// a fork waits for the start, and no other look starts a second one.
fn start_locked(guard: &mut MutexGuard<'_, Option<Waiting>>) {
    let Some(w) = take(guard, STARTING) else { return };
    log::debug!("usage reached {}% of the limit: the pager starts", w.settings.start_percent);
    // The pager joins the tree itself, into this slot, and what it holds
    // stays counted until its first scan has adopted it (`Tree::join`):
    // with the slot given back first, the tree's usage fell to nothing for
    // a moment, and `--max-slowdown`'s controller cut the limit to its
    // floor. A start that failed, or a pager outside the tree, frees it.
    let member = w.member;
    crate::init::start_late(w.settings);
    match member {
        Some(m) if crate::state::current().is_some_and(|s| s.pager.tree().is_some()) => m.hand_over(),
        m => drop(m),
    }
    ROOM.store(NOT_WAITING, Ordering::Relaxed);
}

/// Starts the pager now, from the calling thread, if the process waits
/// (`modes::leaving_root`: the paths a start needs still lead where they
/// should).
pub(crate) fn start_now() {
    // Looked at before the lock, which a process that does not wait never
    // takes: a child made by a raw `clone` (bubblewrap's, which then calls
    // `pivot_root`) copied it as it was, held for good where the stats
    // thread was looking.
    if !is_waiting() {
        return;
    }
    let mut g = WAITING.lock_ok();
    if g.is_some() && is_waiting() {
        start_locked(&mut g);
    }
}

/// Whether this process waits now (not a vfork child of a waiting one).
/// No lock.
pub(crate) fn is_waiting() -> bool {
    WAITING_PID.load(Ordering::Acquire) == std::process::id()
}

/// Takes the state out of `guard`: the process no longer waits, and its
/// room is `room` ([`NOT_WAITING`], or [`STARTING`] for a start, which
/// sets it to [`NOT_WAITING`] once the pager runs).
fn take(guard: &mut MutexGuard<'_, Option<Waiting>>, room: usize) -> Option<Waiting> {
    WAITING_PID.store(0, Ordering::Release);
    ROOM.store(room, Ordering::Relaxed);
    guard.take()
}

/// The stats file of a waiting process: what it holds, where its pager
/// starts, and the tree, as of the last look; `None` if it does not wait.
pub(crate) fn stats_json(mem: crate::stats::ProcMem) -> Option<String> {
    let g = WAITING.lock_ok();
    let w = g.as_ref().filter(|_| is_waiting())?;
    let tree = w
        .member
        .as_ref()
        .map_or(serde_json::Value::Null, |m| crate::stats::tree_json(m.tree(), w.settings.tree.as_deref()));
    let json = serde_json::json!({
        "pid": std::process::id(),
        "state": "waiting",
        "footprint": {
            "rss_bytes": mem.rss,
            "shmem_bytes": mem.shmem,
            "swap_page_cache_bytes": 0,
            "footprint_bytes": mem.rss,
            "limit": w.settings.limit,
        },
        "updated_unix_ms": crate::stats::unix_ms(),
        "limit": w.settings.limit,
        "waiting": {
            "usage_bytes": w.last.usage,
            "tree_usage_bytes": w.last.total,
            "start_at_bytes": w.last.at,
            "start_percent": w.settings.start_percent,
        },
        "tree": tree,
    });
    Some(json.to_string())
}

/// The tree's limit and usage, as the waiting process sees them.
pub(crate) fn tree_figures() -> Option<(u64, u64)> {
    let g = WAITING.try_lock().ok()?;
    let t = g.as_ref()?.member.as_ref()?.tree();
    Some((t.limit() as u64, t.usage()))
}

/// Stops the stats thread while the process waits (`modes::single_threaded`):
/// whether it did, for [`resume`]. A start under way finishes first (the
/// stop joins the thread); the process then no longer waits.
pub(crate) fn pause() -> bool {
    if !is_waiting() {
        return false;
    }
    crate::stats::stop_thread();
    is_waiting()
}

/// Restarts the stats thread [`pause`] stopped.
pub(crate) fn resume() {
    let Some((dir, interval)) =
        WAITING.lock_ok().as_ref().map(|w| (w.settings.stats_dir.clone(), w.settings.stats_interval))
    else {
        return;
    };
    if let Err(e) = crate::stats::start_thread(dir, interval) {
        log::warn!("no stats thread ({e}); this process runs unmanaged");
        take(&mut WAITING.lock_ok(), NOT_WAITING);
    }
}

/// The process stops waiting for good (`modes::sandboxed`): the stats
/// thread is stopped, and the slot given back. The settings, for a
/// [`begin`] again where the call that this was for failed.
pub(crate) fn end() -> Option<Settings> {
    if !is_waiting() {
        return None;
    }
    crate::stats::stop_thread();
    take(&mut WAITING.lock_ok(), NOT_WAITING).map(|w| w.settings)
}

/// Fork's prepare step: held until the parent or child step, so that the
/// child gets the state whole and no start is under way.
pub(crate) fn fork_lock() -> MutexGuard<'static, Option<Waiting>> {
    WAITING.lock_ok()
}

/// In a forked child (its only thread), with the state the prepare step
/// held: a child of a waiting process waits too, with a slot and a stats
/// thread of its own. The parent's slot stays the parent's (`Member`'s
/// drop looks at the pid). Where not `wait`, the child runs unmanaged.
pub(crate) fn after_fork_in_child(mut guard: MutexGuard<'static, Option<Waiting>>, wait: bool) {
    let Some(w) = take(&mut guard, NOT_WAITING) else { return };
    drop(guard);
    drop(w.member);
    if !wait {
        return;
    }
    // SAFETY: getppid has no preconditions.
    if let Err(settings) = begin_with(w.settings, Some(unsafe { libc::getppid() } as u32)) {
        // A child that cannot wait starts now: it has a single thread,
        // and no allocator lock is held.
        crate::init::start_late(*settings);
    }
}

/// The exit handler: the process stops waiting (no look starts a pager
/// during the exit), and its slot is given back now. Atomics only, and
/// the lock tried: the program may exit with any lock held, the stats
/// thread may be starting the pager (whose own exit handler then leaves
/// the tree), and a slot not given back here is swept once the process is
/// gone. Nothing is dropped (a drop would take locks): the state is
/// leaked, as the process ends.
pub(crate) fn leave_at_exit() {
    if let Ok(mut g) = WAITING.try_lock() {
        if let Some(w) = is_waiting().then(|| take(&mut g, NOT_WAITING)).flatten() {
            let w = std::mem::ManuallyDrop::new(w);
            if let Some(m) = &w.member {
                m.give_back();
            }
        }
    }
}
