//! A pager that starts late: until a process's memory nears its share of
//! the limit, the shim only counts it.
//!
//! Starting a pager costs a process about 3 ms: its threads, the
//! userfaultfd, the swap file and its key, the stats file, and a fault
//! round trip on every first touch of managed memory. A long program never
//! notices; a build, a test suite or a shell pipeline is thousands of
//! short processes, and paid it each time (`make -j2` of 100 small C files
//! ran 16% slower). So a process whose pager is to adopt the program's
//! mappings (`ZMEM_ADOPT`, the default) *waits* (`ZMEM_START_PERCENT`,
//! 50 by default; 0 starts at load, as before):
//!
//! - At load ([`begin`]) it joins the tree (`zmem_uffd::tree`) with the
//!   anonymous memory it has resident (`/proc/self/statm`: resident less
//!   shared, kept open) as its usage, so that the others' shares count it,
//!   and it starts the stats thread, which writes no file yet.
//! - The stats thread looks ([`tick`]) more often the nearer the start
//!   point is: the room left at a fill rate of 8 MB/ms, every 1 to 100 ms.
//!   Once the usage reaches `start_percent` of the share the tree gives it
//!   (of the limit, outside a tree), the stats thread starts the pager
//!   itself (`init::start_late`), never a thread of the program's (one that
//!   may hold its allocator's lock), and goes on as the stats thread. The
//!   pager's first scan adopts everything mapped so far, its resident pages
//!   included (`Pager::adopt`), as it adopts what a program maps before any
//!   pager; from the crossing on the process is managed as if it had
//!   started at load.
//! - Until then a waiting process's memory is plain memory: it may go past
//!   the start point by what it fills between two looks, and the half of
//!   the limit above the start point is the room for that.
//!
//! The state (the settings, the tree slot and the `statm` descriptor) has
//! one owner, [`WAITING`], taken by the stats thread for a look (and for
//! the start, so that a look and a start are one step), by fork's prepare
//! step first of all its locks (`init::before_fork`), and tried by the exit
//! handler. The program's own calls that need the process to have no
//! thread of zmem's stop the stats thread: `unshare` and `setns`
//! ([`pause`], [`resume`]), seccomp ([`end`]: the process stays unmanaged,
//! as a managed one does). `chroot` starts the pager first ([`start_now`]),
//! while `/proc` and the swap directory are still at their paths.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use zmem_common::fds::KeptFd;
use zmem_common::LockExt;
use zmem_settings::Settings;
use zmem_uffd::tree::{Member, Tree};

/// A process waiting to start its pager.
pub(crate) struct Waiting {
    /// The waiting process: a vfork child, which shares its memory (this
    /// state too), acts on none of it.
    pid: u32,
    settings: Settings,
    /// Its slot in the tree; `None` outside one (or where its segment
    /// could not be joined: the limit is then the process's own).
    member: Option<Member>,
    /// `/proc/thread-self/statm` of the stats thread, which opens it
    /// (`/proc/self` of a process whose main thread ended reads as empty),
    /// kept open (`zmem_common::fds`: the program may close every
    /// descriptor, or change its root), with that thread's id.
    statm: Option<(KeptFd, i32)>,
    /// The last look's figures, for the stats file.
    last: Look,
    /// `PagerConfig::share_floor` under these settings.
    floor: usize,
    /// When it last swept the tree's slots of processes gone.
    swept_at: Instant,
}

/// What the last look saw.
#[derive(Debug, Clone, Copy, Default)]
struct Look {
    /// This process's usage as published: the larger of its anonymous
    /// resident bytes and its private writable bytes ([`Held`]).
    usage: usize,
    /// The tree's usage, this process's included.
    total: usize,
    /// Where the pager starts: `start_percent` of the limit.
    at: usize,
}

/// The waiting process's state; `None` once its pager started (or where it
/// never waits).
static WAITING: Mutex<Option<Waiting>> = Mutex::new(None);

/// How fast a program may fill memory, for how long a look may wait.
const FILL_BYTES_PER_MS: usize = 8 << 20;
const LOOK_MIN: Duration = Duration::from_millis(1);
const LOOK_MAX: Duration = Duration::from_millis(100);
/// How often a waiting process frees the tree's slots of processes gone
/// (a pager's reclaim thread does it too).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Whether a process under `settings` waits rather than starts.
pub(crate) fn wants_to_wait(settings: &Settings) -> bool {
    settings.start_percent > 0 && settings.adopt
}

/// Makes this process wait (see the module's text), with the stats
/// thread looking. `Err` gives the settings back where it cannot (no
/// `/proc`, no thread): the caller starts the pager now.
pub(crate) fn begin(settings: Settings) -> Result<(), Box<Settings>> {
    let member = settings.tree.as_deref().and_then(|p| match Tree::open(p).and_then(Tree::join) {
        Ok(m) => Some(m),
        Err(e) => {
            log::warn!("{e}; this process takes the whole limit");
            None
        }
    });
    let floor = settings.share_floor();
    let (dir, interval) = (settings.stats_dir.clone(), settings.stats_interval);
    *WAITING.lock_ok() = Some(Waiting {
        pid: std::process::id(),
        settings,
        member,
        statm: None,
        last: Look::default(),
        floor,
        swept_at: Instant::now(),
    });
    // The first look, here: a process that starts in a tree past the
    // point starts its pager now, as every process did at load, and the
    // program's first large mapping finds the room set.
    if tick().is_none() {
        return Ok(());
    }
    if let Err(e) = crate::stats::start_thread(dir, interval) {
        log::debug!("no stats thread ({e}); the pager starts now");
        let w = WAITING.lock_ok().take().expect("set above");
        return Err(Box::new(w.settings));
    }
    Ok(())
}

/// The calling thread's `statm`, kept open.
fn open_statm() -> Option<(KeptFd, i32)> {
    use rustix::fs::{Mode, OFlags};
    let fd = zmem_common::fds::open_kept(zmem_common::fds::Wait::Yes, rustix::io::Errno::AGAIN, || {
        rustix::fs::open("/proc/thread-self/statm", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
    });
    match fd {
        Ok(fd) => Some((fd, rustix::thread::gettid().as_raw_nonzero().get())),
        Err(e) => {
            log::debug!("/proc/thread-self/statm: {e}");
            None
        }
    }
}

/// What a process holds, from `statm` (one `pread`).
#[derive(Clone, Copy)]
struct Held {
    /// Anonymous resident bytes: resident pages less shared ones (file
    /// pages and shared memory). What the process publishes in the tree.
    anon: usize,
    /// Private writable bytes mapped, touched or not (`VmData` and the
    /// stack): what a pager would adopt. A program that maps its memory
    /// first and fills it after (stress-ng, a database's buffer pool) is
    /// started for as soon as it maps, before it fills.
    data: usize,
}

fn held(statm: &KeptFd) -> Option<Held> {
    let mut buf = [0u8; 128];
    let n = rustix::io::pread(statm.as_fd(), &mut buf, 0).ok()?;
    let f: Vec<usize> = buf[..n]
        .split(|&c| c == b' ' || c == b'\n')
        .filter_map(|f| std::str::from_utf8(f).ok()?.parse().ok())
        .collect();
    let (resident, shared, data) = (*f.get(1)?, *f.get(2)?, *f.get(5)?);
    Some(Held { anon: resident.saturating_sub(shared) * crate::PAGE, data: data * crate::PAGE })
}

/// Bytes left to the start point at the last look (`usize::MAX`: the
/// process does not wait), and bytes of large mappings the program made
/// since: the program's threads wake the stats thread for a look at once
/// when what they mapped since the last look reaches what was left
/// ([`saw_mapping`]), rather than fill it all before the next look.
static ROOM: AtomicUsize = AtomicUsize::new(usize::MAX);
static SEEN: AtomicUsize = AtomicUsize::new(0);
/// Looks so far: a thread that woke the stats thread waits for the next.
static LOOKS: AtomicUsize = AtomicUsize::new(0);
/// How long a mapping that crosses the start point waits for the pager.
const START_WAIT: Duration = Duration::from_millis(20);

/// The program mapped `len` bytes of private anonymous memory (the shim's
/// `mmap`, or a chunk glibc's malloc mapped and returned). Where that
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
pub(crate) fn saw_mapping(len: usize) -> bool {
    let room = ROOM.load(Ordering::Relaxed);
    // Not zmem's own mappings (the stats thread's, as it starts the pager).
    if room == usize::MAX || crate::guard::in_zmem() || SEEN.fetch_add(len, Ordering::Relaxed) + len < room {
        return false;
    }
    let looks = LOOKS.load(Ordering::Acquire);
    crate::stats::wake_thread();
    let until = Instant::now() + START_WAIT;
    while LOOKS.load(Ordering::Acquire) == looks && Instant::now() < until {
        std::thread::sleep(Duration::from_micros(50));
    }
    crate::init::current().is_some()
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
    let mut guard = WAITING.lock_ok();
    let w = guard.as_mut()?;
    let me = rustix::thread::gettid().as_raw_nonzero().get();
    if w.statm.as_ref().is_none_or(|(_, tid)| *tid != me) {
        w.statm = open_statm();
    }
    // Unreadable: taken as past the start point, so that the limit holds.
    let held = w.statm.as_ref().and_then(|(fd, _)| held(fd));
    let usage = held.map_or(usize::MAX / 2, |h| h.anon.max(h.data));
    // Published: the anonymous bytes, what the process holds now. Its
    // writable mappings count only toward its own start (a program that
    // maps a lot and fills it after starts as it maps), not against the
    // others' shares.
    let anon = held.map_or(usage, |h| h.anon);
    let (limit, total) = match &w.member {
        Some(m) => {
            m.publish(anon, w.floor);
            (m.tree().limit(), (m.tree().usage() as usize).saturating_sub(anon) + usage)
        }
        None => (w.settings.limit, usage),
    };
    let at = limit / 100 * w.settings.start_percent as usize;
    w.last = Look { usage, total, at };
    if total >= at {
        start_locked(&mut guard);
        LOOKS.fetch_add(1, Ordering::Release);
        return None;
    }
    SEEN.store(0, Ordering::Relaxed);
    ROOM.store(at - total, Ordering::Relaxed);
    LOOKS.fetch_add(1, Ordering::Release);
    if let Some(m) = w.member.as_ref().filter(|_| w.swept_at.elapsed() >= SWEEP_EVERY) {
        m.tree().sweep();
        w.swept_at = Instant::now();
    }
    let ms = (at - total) / FILL_BYTES_PER_MS;
    Some(Duration::from_millis(ms as u64).clamp(LOOK_MIN, LOOK_MAX))
}

/// Starts the pager of the waiting process `guard` holds, under the lock:
/// a fork waits for the start, and no other look starts a second one.
fn start_locked(guard: &mut MutexGuard<'_, Option<Waiting>>) {
    let Some(w) = guard.take() else { return };
    ROOM.store(usize::MAX, Ordering::Relaxed);
    log::debug!("usage reached {}% of the limit: the pager starts", w.settings.start_percent);
    // The slot goes back first: the pager joins the tree itself.
    drop(w.member);
    drop(w.statm);
    crate::init::start_late(w.settings);
}

/// Starts the pager now, from the calling thread, if the process waits
/// (`modes::leaving_root`: the paths a start needs still lead where they
/// should).
pub(crate) fn start_now() {
    let mut g = WAITING.lock_ok();
    if g.as_ref().is_some_and(Waiting::is_mine) {
        start_locked(&mut g);
    }
}

impl Waiting {
    fn is_mine(&self) -> bool {
        self.pid == std::process::id()
    }
}

/// Whether this process waits now (not a vfork child of a waiting one).
pub(crate) fn is_waiting() -> bool {
    WAITING.lock_ok().as_ref().is_some_and(Waiting::is_mine)
}

/// The stats file of a waiting process: what it holds, where its pager
/// starts, and the tree, as of the last look; `None` if it does not wait.
pub(crate) fn stats_json(mem: crate::stats::ProcMem) -> Option<String> {
    let g = WAITING.lock_ok();
    let w = g.as_ref().filter(|w| w.is_mine())?;
    let tree = w
        .member
        .as_ref()
        .map_or(serde_json::Value::Null, |m| crate::stats::tree_json(m.tree(), w.settings.tree.as_deref()));
    let json = serde_json::json!({
        "pid": w.pid,
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
    let g = WAITING.lock_ok();
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
        WAITING.lock_ok().take();
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
    ROOM.store(usize::MAX, Ordering::Relaxed);
    WAITING.lock_ok().take().map(|w| w.settings)
}

/// Fork's prepare step: held until the parent or child step, so that the
/// child gets the state whole and no start is under way.
pub(crate) fn fork_lock() -> MutexGuard<'static, Option<Waiting>> {
    WAITING.lock_ok()
}

/// In a forked child (its only thread), with the state the prepare step
/// held: a child of a waiting process waits too, with a slot, a `statm`
/// and a stats thread of its own. The parent's slot and descriptor stay
/// the parent's: the slot is not given back (`Member`'s drop looks at the
/// pid), and the descriptor, which reads the parent's `statm`, is closed.
pub(crate) fn after_fork_in_child(mut guard: MutexGuard<'static, Option<Waiting>>) {
    let Some(w) = guard.take() else { return };
    drop(guard);
    if let Some((fd, _)) = w.statm {
        drop(fd.into_owned());
    }
    drop(w.member);
    if let Err(settings) = begin(w.settings) {
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
        if let Some(w) = g.take_if(|w| w.is_mine()) {
            let w = std::mem::ManuallyDrop::new(w);
            if let Some(m) = &w.member {
                m.give_back();
            }
        }
    }
}
