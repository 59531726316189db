//! The stats file `DIR/zmem-PID.json`, and the JSON `zmem_stats_json` returns.

use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use zmem_common::{stats_files, LockExt};

use crate::state::{current, Shim, LIVE};

/// Set for good once the process runs its exit handlers: no stats file is
/// written from then on.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Set while the stats thread writes and renames its file (see
/// `remove_at_exit`).
static WRITING: AtomicBool = AtomicBool::new(false);
/// Set to end the stats thread ([`stop_thread`]).
static STOP: AtomicBool = AtomicBool::new(false);
/// The stats thread's handle (a leaked `Box<JoinHandle>`, or null): an
/// atomic, not a lock, since a forked child must let go of its parent's
/// without waiting or joining.
static THREAD: AtomicPtr<JoinHandle<()>> = AtomicPtr::new(std::ptr::null_mut());

/// The exit handler asks the stats thread for one last write of a file in
/// a directory `ZMEM_STATS_DIR` named ([`last_write_at_exit`]), and the
/// thread answers once it has written (or cannot).
static LAST_WRITE: AtomicBool = AtomicBool::new(false);
static LAST_WRITTEN: AtomicBool = AtomicBool::new(false);
/// The stats thread writes into a directory `ZMEM_STATS_DIR` named.
static NAMED: AtomicBool = AtomicBool::new(false);
/// The stats thread, to wake for the last write: a handle the exit handler
/// may use without allocating, with the process it belongs to (a forked
/// child has its parent's until it starts its own).
static WAKE: Mutex<Option<(u32, std::thread::Thread)>> = Mutex::new(None);
/// The stats thread's id: an exit from the stats thread itself
/// (`sandbox::end_as_the_program_did`) does not wait for it.
static STATS_TID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// How long an exit waits for the last write.
const LAST_WRITE_WAIT: Duration = Duration::from_millis(100);

/// Starts the stats thread (see [`stats_main`]).
pub(crate) fn start_thread(named: Option<PathBuf>, interval: Duration) -> std::io::Result<()> {
    STOP.store(false, Ordering::SeqCst);
    NAMED.store(named.is_some(), Ordering::SeqCst);
    let t = zmem_common::host::thread::spawn(std::thread::Builder::new().name("zmem-stats".into()), move || {
        crate::guard::mark_internal_thread();
        STATS_TID.store(rustix::thread::gettid().as_raw_nonzero().get(), Ordering::SeqCst);
        stats_main(named.as_deref(), interval);
    })?;
    *WAKE.lock_ok() = Some((std::process::id(), t.thread().clone()));
    // An older handle is a thread of the parent's (a forked child): not
    // this process's to join or detach.
    let _ = THREAD.swap(Box::into_raw(Box::new(t)), Ordering::AcqRel);
    Ok(())
}

/// Whether this process has a stats thread (a forked child has none of
/// its parent's).
pub(crate) fn has_thread() -> bool {
    !THREAD.load(Ordering::Acquire).is_null()
}

/// Wakes the stats thread for a look now (`waiting::saw_mapping`): no
/// allocation, and the lock only tried.
pub(crate) fn wake_thread() {
    if let Ok(wake) = WAKE.try_lock() {
        if let Some((pid, t)) = wake.as_ref().filter(|(pid, _)| *pid == std::process::id()) {
            let _ = pid;
            t.unpark();
        }
    }
}

/// Ends the stats thread and waits for it.
pub(crate) fn stop_thread() {
    STOP.store(true, Ordering::SeqCst);
    let p = THREAD.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !p.is_null() {
        // SAFETY: p came from Box::into_raw in `start_thread`, and the swap
        // made this the only owner.
        let t = unsafe { Box::from_raw(p) };
        t.thread().unpark();
        let _ = t.join();
    }
}

/// The default directory the file is in now, for the exit handler (which
/// must not allocate, and only tries the lock).
static DIR: Mutex<Option<CString>> = Mutex::new(None);

/// The stats file `DIR/zmem-PID.json`, rewritten every `interval` (see
/// `zmem_common::stats_files`), in the directory `named` by
/// `ZMEM_STATS_DIR` or else the effective user's default one: a forked
/// child that drops privileges before it execs (`runuser`, `su`) goes on
/// writing in its new user's. Once a second, too, the thread looks for a
/// process whose program threads are all gone (`sandbox::program_gone`),
/// and ends it, and for a pager thread the kernel killed
/// (`Pager::lost_thread`); that goes on after an error stops the stats.
pub(crate) fn stats_main(named: Option<&Path>, interval: Duration) {
    let pid = std::process::id();
    // The directory made ready, and for which effective user.
    let mut ready: Option<(u32, PathBuf)> = None;
    let mut writes = true;
    // A process that waits to start its pager writes its first file one
    // interval on: most such processes are short, and end before.
    let mut due = Instant::now() + if crate::waiting::is_waiting() { interval } else { Duration::ZERO };
    // While the process waits, its file is written by a thread of its own
    // (`None` inside: none could be spawned, and this thread writes).
    let mut io: Option<Option<Io>> = None;
    loop {
        if STOP.load(Ordering::SeqCst) {
            return;
        }
        if let Some(status) = crate::sandbox::program_gone() {
            crate::sandbox::end_as_the_program_did(status);
        }
        if let Some(name) = crate::state::current().and_then(|s| s.pager.lost_thread()) {
            crate::sandbox::lost_pager_thread(&name);
        }
        // While the process waits to start its pager (`waiting.rs`): a
        // look, and the next one's time. The file is written once the
        // pager has started.
        let look = crate::waiting::tick();
        let last = LAST_WRITE.swap(false, Ordering::SeqCst);
        if writes && (last || Instant::now() >= due) {
            due = Instant::now() + interval;
            let waiting = look.is_some() && !last;
            let handed = waiting && io.get_or_insert_with(|| Io::spawn(named, pid)).as_ref().is_some_and(Io::request);
            if !handed {
                // The last write, or the first after the start, is this
                // thread's: the writer's ends first, and no two overlap.
                if io.as_ref().is_some_and(Option::is_some) {
                    io = None;
                }
                match write_once(named, pid, &mut ready) {
                    Next::Again => {}
                    Next::NoMore => writes = false,
                    Next::Exiting => return,
                }
            }
        }
        match io.as_ref().and_then(Option::as_ref).and_then(Io::ended) {
            Some(Next::NoMore) => writes = false,
            Some(Next::Exiting) => return,
            _ => {}
        }
        if last {
            LAST_WRITTEN.store(true, Ordering::SeqCst);
        }
        // Before it sleeps (`zmem_common::host::tls`).
        zmem_common::host::tls::keep_resident();
        let until_due = due.saturating_duration_since(Instant::now());
        let wait = if writes { until_due.min(WATCH) } else { WATCH };
        std::thread::park_timeout(look.map_or(wait, |l| l.min(wait)));
    }
}

/// The writer of a waiting process's stats file. A write can wait on the
/// file system for tens of ms (an ext4 journal busy with another
/// program's `fsync`: 63 ms beside a `dd conv=fsync` loop), and a waiting
/// process's looks (`waiting::tick`) are this thread's: SBCL, under 32M,
/// filled 20 MiB unseen during one such write, and the tree peaked at
/// 47-81 MiB in 4 runs of 18 beside that loop, where it held 33-34 MiB. So while the process waits, the
/// looks go on, and the file is written beside them; once the pager runs,
/// nothing is late for a write, and the stats thread writes again (the
/// writer is dropped first: one writer at a time). Owned by the stats
/// thread, and joined as it is dropped, so the process is single-threaded
/// again whenever the stats thread is stopped (`waiting::pause`).
struct Io {
    thread: Option<JoinHandle<()>>,
    shared: std::sync::Arc<IoShared>,
}

#[derive(Default)]
struct IoShared {
    /// A write is due.
    due: AtomicBool,
    /// The writer is to end.
    stop: AtomicBool,
    /// How the writer ended: 0 it runs, 1 [`Next::NoMore`], 2
    /// [`Next::Exiting`].
    ended: std::sync::atomic::AtomicU8,
}

impl Io {
    /// The writer, or `None` where no thread could be spawned.
    fn spawn(named: Option<&Path>, pid: u32) -> Option<Io> {
        let shared = std::sync::Arc::new(IoShared::default());
        let (sh, named) = (shared.clone(), named.map(Path::to_path_buf));
        let builder = std::thread::Builder::new().name("zmem-stats-io".into());
        let thread = zmem_common::host::thread::spawn(builder, move || {
            crate::guard::mark_internal_thread();
            let mut ready = None;
            while !sh.stop.load(Ordering::SeqCst) && !STOP.load(Ordering::SeqCst) {
                if sh.due.swap(false, Ordering::SeqCst) {
                    match write_once(named.as_deref(), pid, &mut ready) {
                        Next::Again => {}
                        next => {
                            sh.ended.store(if matches!(next, Next::NoMore) { 1 } else { 2 }, Ordering::SeqCst);
                            return;
                        }
                    }
                }
                zmem_common::host::tls::keep_resident();
                std::thread::park();
            }
        })
        .map_err(|e| log::debug!("no stats writer ({e}): the stats thread writes"))
        .ok()?;
        Some(Io { thread: Some(thread), shared })
    }

    /// Asks for a write: whether the writer runs to make it.
    fn request(&self) -> bool {
        if self.ended().is_some() {
            return false;
        }
        self.shared.due.store(true, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
        true
    }

    /// How the writer ended, if it did.
    fn ended(&self) -> Option<Next> {
        match self.shared.ended.load(Ordering::SeqCst) {
            1 => Some(Next::NoMore),
            2 => Some(Next::Exiting),
            _ => None,
        }
    }
}

impl Drop for Io {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// How often the stats thread looks for a program that is gone.
const WATCH: Duration = Duration::from_secs(1);

/// What follows a write of the stats file.
enum Next {
    Again,
    /// An error: no more stats.
    NoMore,
    /// The process runs its exit handlers.
    Exiting,
}

fn write_once(named: Option<&Path>, pid: u32, ready: &mut Option<(u32, PathBuf)>) -> Next {
    // A process that waits to start its pager (`waiting.rs`) writes what
    // it holds and where its pager starts.
    let s = current();
    if s.is_none() && !crate::waiting::is_waiting() {
        return Next::Again;
    }
    // SeqCst, with `remove_file`'s: either this sees EXITING or ROOT_LEFT,
    // or the remover sees WRITING and waits for the rename. It covers
    // `prepare` too, which makes the directory by its path.
    WRITING.store(true, Ordering::SeqCst);
    let next = if EXITING.load(Ordering::SeqCst) {
        Next::Exiting
    } else if ROOT_LEFT.load(Ordering::SeqCst) {
        Next::Again
    } else {
        write_ready(s, named, pid, ready)
    };
    WRITING.store(false, Ordering::SeqCst);
    next
}

fn write_ready(s: Option<&Shim>, named: Option<&Path>, pid: u32, ready: &mut Option<(u32, PathBuf)>) -> Next {
    let euid = euid();
    if ready.as_ref().is_none_or(|(u, _)| *u != euid) {
        if let Some((_, old)) = &ready {
            // Where the old user's rights still reach it.
            let _ = std::fs::remove_file(stats_files::path(old, pid));
        }
        match prepare(named, euid, pid) {
            Ok(d) => *ready = Some((euid, d)),
            // The program changed its user meanwhile: the next write
            // prepares the new user's directory.
            Err(_) if self::euid() != euid => return Next::Again,
            Err(e) => {
                log::warn!("no stats file: {e}");
                return Next::NoMore;
            }
        }
    }
    let dir = &ready.as_ref().expect("made ready above").1;
    let mem = ProcMem::now();
    let json = match s {
        Some(s) => {
            warn_shared_once(mem.shmem, s.settings.limit);
            stats_json_with(s, mem)
        }
        None => match crate::waiting::stats_json(mem) {
            Some(j) => j,
            None => return Next::Again,
        },
    };
    if let Err(e) = stats_files::write(dir, pid, &json) {
        if self::euid() != euid {
            // As above: `runuser` dropped root between the look at its
            // user and this write, and said "Permission denied" here.
            return Next::Again;
        }
        log::warn!("stats file {}: {e}; no more stats", stats_files::path(dir, pid).display());
        return Next::NoMore;
    }
    Next::Again
}

/// Makes the stats directory ready for a process of `euid`: the one
/// `named` by ZMEM_STATS_DIR (the user's choice: each process's last stats
/// stay there after it exits, for scripts), or the user's own default one,
/// where a file lives as long as its process: removed at the exit
/// (`remove_at_exit`), and swept here after a process that could not
/// (killed by a signal).
fn prepare(named: Option<&Path>, euid: u32, pid: u32) -> std::io::Result<PathBuf> {
    if let Some(d) = named {
        stats_files::prepare_dir(d, None)?;
        return Ok(d.to_path_buf());
    }
    let d = zmem_settings::default_stats_dir(euid);
    stats_files::prepare_dir(&d, Some(euid))?;
    stats_files::sweep(&d, pid);
    // Tried: a forked child may have copied it held by its parent's stats
    // thread, and its exit handler then leaves the file to a sweep.
    match DIR.try_lock() {
        Ok(mut dir) => *dir = CString::new(d.as_os_str().as_bytes()).ok(),
        Err(TryLockError::Poisoned(p)) => *p.into_inner() = CString::new(d.as_os_str().as_bytes()).ok(),
        Err(TryLockError::WouldBlock) => {}
    }
    Ok(d)
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// In a forked child: the parent's stats thread is not here.
pub(crate) fn after_fork_in_child() {
    WRITING.store(false, Ordering::SeqCst);
    // The parent's thread: its handle is leaked (`start_thread`).
    THREAD.store(std::ptr::null_mut(), Ordering::Relaxed);
}

/// The exit handler (`atexit`): this process's stats file in the default
/// directory goes with it.
/// It waits out a write in progress, at most 200 ms (a file on a sick disk
/// must not hold up the exit), so that no rename brings the file back.
/// No allocation: the program may exit with any lock held.
pub(crate) extern "C" fn remove_at_exit() {
    last_write_at_exit();
    remove_file(&EXITING);
}

/// In a directory `ZMEM_STATS_DIR` named, where a process's file stays
/// after it exits for scripts to read, the file gets the process's last
/// counters: the stats thread writes once more, and the exit waits for it
/// at most `LAST_WRITE_WAIT`. Without it the file was up to an interval
/// stale: a program that filled 96 MiB under 32M and exited at once left
/// 454-477 evicted folios of its ~1,150 in it. The default directory's
/// file goes at the exit anyway. No allocation, and no lock but tried.
fn last_write_at_exit() {
    // A process with no pager (it waited, `waiting.rs`) has no file.
    if !NAMED.load(Ordering::SeqCst)
        || current().is_none()
        || STOP.load(Ordering::SeqCst)
        || EXITING.load(Ordering::SeqCst)
        || GONE.load(Ordering::SeqCst)
        || STATS_TID.load(Ordering::SeqCst) == rustix::thread::gettid().as_raw_nonzero().get()
    {
        return;
    }
    let Ok(wake) = WAKE.try_lock() else { return };
    match wake.as_ref() {
        Some((pid, t)) if *pid == std::process::id() => {
            LAST_WRITTEN.store(false, Ordering::SeqCst);
            LAST_WRITE.store(true, Ordering::SeqCst);
            t.unpark();
        }
        _ => return,
    }
    drop(wake);
    let until = Instant::now() + LAST_WRITE_WAIT;
    while !LAST_WRITTEN.load(Ordering::SeqCst) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Removes this process's stats file in the default directory, once
/// `stop` (which the stats thread looks at before it writes) is set.
fn remove_file(stop: &AtomicBool) {
    // Gone already (`remove_for_good`): a seccomp filter may forbid the
    // unlink now.
    if GONE.swap(true, Ordering::SeqCst) {
        return;
    }
    stop.store(true, Ordering::SeqCst);
    for _ in 0..200 {
        if !WRITING.load(Ordering::SeqCst) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let guard = match DIR.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        // The stats thread is in `prepare` this very moment: the file is
        // left for a sweep.
        Err(TryLockError::WouldBlock) => return,
    };
    let Some(dir) = guard.as_ref() else { return };
    let pid = std::process::id();
    for name in [format_args!("/zmem-{pid}.json\0"), format_args!("/.zmem-{pid}.json.tmp\0")] {
        // Formatted into a buffer on the stack: neither step allocates.
        let mut buf = [0u8; 4200];
        let mut rest = &mut buf[..];
        if rest.write_all(dir.as_bytes()).and_then(|()| rest.write_fmt(name)).is_ok() {
            // SAFETY: buf holds the path and the NUL written after it.
            unsafe { libc::unlink(buf.as_ptr().cast()) };
        }
    }
}

/// The stats file was removed for good: the exit handler does nothing.
static GONE: AtomicBool = AtomicBool::new(false);

/// Removes this process's stats file now, for good: the process leaves zmem
/// (`modes::sandboxed`), and its exit handler may not be allowed to. The
/// stats thread must be stopped.
pub(crate) fn remove_for_good() {
    remove_at_exit();
}

/// The call that the file went for failed: the process stays with zmem,
/// and the next stats thread writes the file again.
pub(crate) fn not_gone() {
    GONE.store(false, Ordering::SeqCst);
    EXITING.store(false, Ordering::SeqCst);
}

/// Set once the program changes its root (`chroot`, `pivot_root`): the
/// stats directory's path then leads into the new root, where zmem has no
/// business (it made `/tmp/zmem-stats-0` inside OpenSSH's `/run/sshd`).
/// This process and the children it forks (which inherit it) write no
/// stats file from then on; the stats thread goes on looking for a
/// program that is gone.
static ROOT_LEFT: AtomicBool = AtomicBool::new(false);

/// Whether this process (or the parent it was forked from) changed its
/// root.
pub(crate) fn root_left() -> bool {
    ROOT_LEFT.load(Ordering::SeqCst)
}

/// The program is about to change its root: the stats file goes now, by
/// its path while that still leads to it, and no other is written (see
/// [`ROOT_LEFT`]). Returns whether the root had been left already.
pub(crate) fn leave_root() -> bool {
    let before = root_left();
    remove_file(&ROOT_LEFT);
    before
}

/// The call that [`leave_root`] was for failed, and the root had not been
/// left before: the stats thread writes the file again. A root left
/// earlier stays left (a failed second `chroot`, or a failed seccomp call
/// after a `chroot`, must not bring the file back inside it).
pub(crate) fn root_kept() {
    ROOT_LEFT.store(false, Ordering::SeqCst);
    not_gone();
}

/// This process's resident memory, from `/proc/self/status` (0 where it
/// cannot be read).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcMem {
    /// All of it (`VmRSS`): the program's pages, the pool, zmem's metadata.
    pub(crate) rss: u64,
    /// Its shared memory (`RssShmem`): memfds, `/dev/shm`, shared anonymous
    /// mappings. zmem manages private anonymous memory only (UFFDIO_MOVE
    /// takes nothing else), so these pages are outside the limit, where a
    /// cgroup would charge them. A page mapped twice counts twice.
    pub(crate) shmem: u64,
}

impl ProcMem {
    pub(crate) fn now() -> ProcMem {
        let t = zmem_common::host::fds::read_to_string(
            zmem_common::host::fds::Wait::Yes,
            "/proc/thread-self/status".as_ref(),
        )
        .unwrap_or_default();
        let kb = |key| zmem_common::procfs::kb_field(&t, key).unwrap_or(0);
        ProcMem { rss: kb("VmRSS:"), shmem: kb("RssShmem:") }
    }
}

/// Shared memory above this share of the limit is worth a warning.
const SHARED_WARN_PERCENT: u64 = 25;
static SHARED_WARNED: AtomicBool = AtomicBool::new(false);

/// Says once per process, when its shared memory passes a quarter of the
/// limit, that it is outside the limit: the program runs, but uses more
/// memory than the user asked for (the JVM's ZGC keeps its heap in a
/// memfd: `java -XX:+UseZGC` under `--limit 300M` held ~800 MiB of it).
fn warn_shared_once(shmem: u64, limit: usize) {
    if shmem * 100 > limit as u64 * SHARED_WARN_PERCENT && !SHARED_WARNED.swap(true, Ordering::Relaxed) {
        log::warn!(
            "{} MiB of this process's resident memory is shared memory (a memfd, /dev/shm or a shared \
             mapping, counted once a mapping; the JVM's ZGC heap is one), which zmem does not manage: \
             it is outside the {} MiB limit",
            shmem >> 20,
            limit >> 20
        );
    }
}

pub(crate) fn stats_json(s: &Shim) -> String {
    stats_json_with(s, ProcMem::now())
}

fn stats_json_with(s: &Shim, mem: ProcMem) -> String {
    let p = s.pager.stats();
    let t = s.pager.tier().stats();
    let tier: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap_or(serde_json::Value::Null);
    // The footprint as the OS sees it: RSS (the program's pages, the pool,
    // zmem's metadata) plus the swap file's pages in the page cache. Shared
    // memory is in RSS too, and on its own line: it is not managed.
    let rss = mem.rss;
    let cached = s.pager.tier().swap_file().and_then(|f| f.page_cache_bytes()).unwrap_or(0);
    // The process tree that shares the limit: its usage and each process's.
    let tree = s.pager.tree().map_or(serde_json::Value::Null, |t| tree_json(t, s.settings.tree.as_deref()));
    serde_json::json!({
        "pid": std::process::id(),
        "state": "running",
        "footprint": {
            "rss_bytes": rss,
            "shmem_bytes": mem.shmem,
            "swap_page_cache_bytes": cached,
            "footprint_bytes": rss + cached,
            "limit": s.settings.limit,
        },
        "updated_unix_ms": unix_ms(),
        "limit": s.settings.limit,
        "compressor": s.pager.tier().compressor(),
        "recompress": s.settings.recompress.map(|c| c.to_string()),
        "managed_mappings": LIVE.load(Ordering::Relaxed),
        "pager": serde_json::to_value(p).unwrap_or(serde_json::Value::Null),
        "stall": stall_json(&p),
        "tier": tier,
        "tree": tree,
    })
    .to_string()
}

/// This process's stall samples (`zmem_common::stall`), each with the
/// refault distances so far, the meter of zmem's threads' CPU time, and
/// the process they are of (a forked child starts its own). Only tried:
/// a child forked while its parent's stats thread held it (a daemon's
/// `zmem_stats_json`, through the C API) waited for good on a lock no
/// thread of its own would release.
static STALL: Mutex<Option<(u32, StallMeter, StallHistory)>> = Mutex::new(None);
type StallHistory = zmem_common::stall::History<[u64; zmem_uffd::REFAULT_BUCKETS]>;
type StallMeter = zmem_common::stall::CpuMeter;

/// The limits, as percent of this one, at which the stall is estimated.
const ESTIMATED_AT: [u32; 3] = [50, 75, 125];

/// The `stall` object of the stats: the stall on the limit over the last
/// 10 s and 60 s, percent of the program's threads' CPU time, and an
/// estimate of it over the last 60 s at other limits
/// (`zmem_uffd::stall_at_limit`). A look less than 100 ms after the last
/// adds no sample.
fn stall_json(p: &zmem_uffd::PagerStats) -> serde_json::Value {
    use zmem_common::stall::Sample;
    let pid = std::process::id();
    let mut g = match STALL.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
        // The stats thread is sampling: this call (the C API's) gives the
        // counter alone.
        Err(TryLockError::WouldBlock) => return serde_json::json!({ "stall_ns": p.stall_ns }),
    };
    let (_, meter, hist) = match &mut *g {
        Some(s) if s.0 == pid => s,
        _ => g.insert((pid, StallMeter::default(), StallHistory::new(Duration::from_secs(61)))),
    };
    // From CPU clocks: a file opened here could take a standard stream's
    // number a program just closed (`zmem_common::host::thread::ours_cpu_ns`).
    let cpu_ns = zmem_common::stall::this_program_cpu_ns(meter);
    let now = Instant::now();
    if hist.window(Duration::MAX).is_none_or(|(_, last)| now.duration_since(last.at) >= Duration::from_millis(100)) {
        hist.push(Sample { at: now, stall_ns: p.stall_ns, cpu_ns, extra: p.refault_distance });
    }
    let pct = |w| hist.stall_percent(Duration::from_secs(w));
    // Stall percent at each of ESTIMATED_AT, over the last 60 s.
    let mut estimate = serde_json::Map::new();
    if let Some((old, new)) = hist.window(Duration::from_secs(60)).filter(|(o, n)| n.cpu_ns >= o.cpu_ns + 1_000_000) {
        let cpu = new.cpu_ns - old.cpu_ns;
        let stall = new.stall_ns.saturating_sub(old.stall_ns);
        let refaults = std::array::from_fn(|i| new.extra[i].saturating_sub(old.extra[i]));
        for at in ESTIMATED_AT {
            let ns = zmem_uffd::stall_at_limit(f64::from(at) / 100.0, stall, &refaults);
            estimate.insert(format!("limit_{at}_percent"), serde_json::json!(ns as f64 * 100.0 / cpu as f64));
        }
    }
    serde_json::json!({
        "stall_ns": p.stall_ns,
        "program_cpu_ns": cpu_ns,
        "percent_10s": pct(10),
        "percent_60s": pct(60),
        "estimate": estimate,
    })
}

/// The process tree that shares the limit: its usage and each process's.
pub(crate) fn tree_json(t: &zmem_uffd::tree::Tree, path: Option<&Path>) -> serde_json::Value {
    let members: Vec<_> = t
        .members()
        .iter()
        .map(|m| {
            serde_json::json!({
                "pid": m.pid,
                "usage_bytes": m.usage,
                "peak_usage_bytes": m.peak,
                "share_bytes": m.share,
                "pool_bytes": m.pool,
                "stall_ns": m.stall_ns,
                "evicted_folios": m.evicted,
            })
        })
        .collect();
    let controller = t
        .controller()
        .map(|(ppm, ceiling)| serde_json::json!({ "max_slowdown_percent": ppm as f64 / 10_000.0, "ceiling": ceiling }));
    serde_json::json!({
        "path": path.map(|p| p.display().to_string()),
        "limit": t.limit(),
        "controller": controller,
        "usage_bytes": t.usage(),
        "peak_usage_bytes": t.peak(),
        "processes": members,
    })
}

/// Milliseconds since the epoch, for `updated_unix_ms`.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
