//! The shim's state, started on first use from the `ZMEM_*` environment.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock, RwLockWriteGuard};
use zmem_common::fds::Wait;
use zmem_common::RwLockExt;

use zmem_settings::Settings;
use zmem_uffd::tree::Warning;
use zmem_uffd::{Pager, Region};

use crate::guard::{guarded, in_zmem, mark_internal_thread};
use crate::tasks::{keep_self_stat, others_than_zmem, threads};

/// A managed mapping.
pub(crate) struct Managed {
    /// The pager's region; `None` for one inherited from the parent process
    /// at fork: plain memory of this process, which its own pager adopted.
    pub(crate) region: Option<Region>,
    /// Bytes mapped.
    pub(crate) cap: usize,
    /// Bytes the program asked for (what `malloc_usable_size` reports).
    pub(crate) len: usize,
    /// Bytes the program has unmapped (partial munmaps).
    pub(crate) unmapped: usize,
}

/// A running shim: this process's pager.
pub(crate) struct Shim {
    pub(crate) pager: Pager,
    pub(crate) settings: Settings,
}

/// The managed mappings by start. Kept apart from the shim: a forked child
/// keeps the table (its entries become inherited ones) under a pager of
/// its own.
pub(crate) static REGIONS: RwLock<Table> = RwLock::new(BTreeMap::new());
/// This process's shim: null before the start, or when it could not start.
/// Each is leaked (a forked child abandons its parent's without dropping
/// it: that pager's threads are not in the child).
static CURRENT: AtomicPtr<Shim> = AtomicPtr::new(std::ptr::null_mut());
/// The first start has been tried.
static TRIED: OnceLock<()> = OnceLock::new();
/// Managed mappings alive: `free` looks up only while there are some.
pub(crate) static LIVE: AtomicUsize = AtomicUsize::new(0);
/// A forked child whose own pager could not start: it manages nothing new,
/// and the parent's regions are plain memory of the child.
pub(crate) static CHILD: AtomicBool = AtomicBool::new(false);
/// The shim panicked once: it manages no new memory.
pub(crate) static BROKEN: AtomicBool = AtomicBool::new(false);

type Table = BTreeMap<usize, Managed>;

/// What the forking thread holds from the prepare step of fork to its
/// parent or child step: no region is made or freed meanwhile, no range of
/// zmem's is being recorded, and the child starts with all of it unlocked.
struct ForkGuards {
    waiting: std::sync::MutexGuard<'static, Option<crate::waiting::Waiting>>,
    table: RwLockWriteGuard<'static, Table>,
    owned: zmem_common::owned::ForkGuard,
}

thread_local! {
    static FORK_GUARDS: RefCell<Option<ForkGuards>> = const { RefCell::new(None) };
}

/// This process's running shim, if any.
pub(crate) fn current() -> Option<&'static Shim> {
    let p = CURRENT.load(Ordering::Acquire);
    // SAFETY: CURRENT is null or a leaked `Box<Shim>`, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The process whose shim `CURRENT` is: a vfork child shares the memory
/// (and `CURRENT`) of its parent, not its threads.
static SHIM_PID: AtomicU32 = AtomicU32::new(0);

/// Whether this is the process whose shim runs (not a vfork child, and
/// with a shim).
pub(crate) fn is_shim_process() -> bool {
    SHIM_PID.load(Ordering::Relaxed) == std::process::id() && current().is_some()
}

/// Whether zmem runs threads in this process: a pager's, or the stats
/// thread of one that waits to start its pager (`waiting.rs`).
pub(crate) fn has_zmem_threads() -> bool {
    is_shim_process() || guarded(crate::waiting::is_waiting).unwrap_or(false)
}

fn install(s: Shim) {
    SHIM_PID.store(std::process::id(), Ordering::Relaxed);
    CURRENT.store(Box::into_raw(Box::new(s)), Ordering::Release);
}

/// pthread_atfork's prepare step: the child must see exactly the parent's
/// memory, and it has neither the pager's threads nor a userfaultfd
/// registration. So every evicted folio is loaded back first
/// (`Pager::fork_prepare`), with reclaim frozen until the parent step.
/// vfork and posix_spawn run no atfork handlers, and need none: the child
/// execs (or exits) without touching the parent's memory.
extern "C" fn before_fork() {
    guarded(|| {
        // The child must not inherit the mask of a thread held on the
        // handler's CPU (`zmem_uffd::unhold_current_thread`).
        zmem_uffd::unhold_current_thread();
        // First: a late start under way finishes before anything else is
        // held (it takes the locks below).
        let waiting = crate::waiting::fork_lock();
        let table = REGIONS.write_ok();
        if let Some(s) = current() {
            s.pager.fork_prepare();
        }
        let owned = zmem_common::owned::fork_lock();
        FORK_GUARDS.with(|f| *f.borrow_mut() = Some(ForkGuards { waiting, table, owned }));
        // Last: nothing above may allocate once it is held.
        crate::heap::fork_lock();
    });
}

extern "C" fn after_fork_in_parent() {
    guarded(|| {
        crate::heap::fork_unlock();
        FORK_GUARDS.with(|f| f.borrow_mut().take());
        if let Some(s) = current() {
            s.pager.fork_parent();
        }
    });
}

/// In the child: the parent's pager is the parent's (its threads are not
/// here, and its userfaultfd registration was not inherited), so it is
/// abandoned, and the child starts a pager of its own under the same
/// settings (and in the same tree). The parent's regions, whole since the
/// prepare step, become inherited entries of the table, adopted by the new
/// pager.
extern "C" fn after_fork_in_child() {
    // A child inherits no memory locks (mlockall's MCL_FUTURE included).
    LOCKED_ALL.store(false, Ordering::Relaxed);
    // The parent's other threads' descriptor sections and closes are not
    // in the child: before anything here closes a descriptor.
    zmem_common::fds::reset_in_child();
    crate::stats::after_fork_in_child();
    // SAFETY: this thread is the child's only one. First: the new pager's
    // handler takes its allocations there.
    unsafe { crate::heap::fork_child_side_heap() };
    // This thread is the child's only one, and held the guards at fork.
    let _ = guarded(|| {
        crate::heap::fork_unlock();
        let guards = FORK_GUARDS.with(|f| f.borrow_mut().take());
        let Some(parent) = current() else {
            // A waiting parent's child waits too.
            if let Some(ForkGuards { waiting, table, owned }) = guards {
                drop(owned);
                drop(table);
                crate::waiting::after_fork_in_child(waiting);
            }
            return;
        };
        CURRENT.store(std::ptr::null_mut(), Ordering::Release);
        let mut inherited = Vec::new();
        if let Some(ForkGuards { waiting, mut table, owned }) = guards {
            drop(waiting);
            drop(owned);
            for (&start, m) in table.iter_mut() {
                if let Some(r) = m.region.take() {
                    // The region's drop would reach the parent's pager.
                    std::mem::forget(r);
                    // No longer zmem's: the child's pager may adopt it.
                    zmem_common::owned::remove(start as u64);
                    inherited.push((start, m.cap));
                }
            }
        }
        if crate::stats::root_left() {
            // A pager here would need `/proc`, the swap directory and the
            // tree's segment by their paths, which lead into the new root
            // now. A hand-over link (ZMEM_FORK_EVENT) closes with the rest:
            // the parent then copies this child's memory in whole.
            if parent.pager.tree().is_none_or(|t| t.first_warning(Warning::RootChanged)) {
                log::warn!(
                    "process {} was forked after its parent changed its root (chroot): without /proc and the \
                     swap directory zmem cannot start a pager in it. It runs unmanaged (no limit), as will any \
                     other process of the tree for this reason",
                    std::process::id()
                );
            }
            // SAFETY: as below.
            unsafe { parent.pager.abandon_in_child() };
            CHILD.store(true, Ordering::Relaxed);
            return;
        }
        // Taken before the parent's pager is abandoned, which closes the
        // rest of what it kept open.
        let link = parent.pager.fork_link_in_child();
        // SAFETY: the parent's shim is leaked, and this process never
        // reaches it again (CURRENT no longer points to it).
        unsafe { parent.pager.abandon_in_child() };
        match start(parent.settings.clone(), link) {
            Some(s) => {
                s.pager.mark_forked();
                // With a hand-over these are the child's already.
                for (start, cap) in inherited {
                    if let Err(e) = s.pager.adopt(start as u64, cap) {
                        log::debug!("inherited mapping at {start:#x} not adopted: {e}");
                    }
                }
                install(s);
            }
            None => CHILD.store(true, Ordering::Relaxed),
        }
    });
}

/// Starts the shim as the library is loaded (or at a large malloc, if
/// another library's constructor makes one first). Never from mmap: that
/// mmap may run inside another allocator's start-up (jemalloc's, in
/// Debian's redis-server), whose lock the shim's own allocations would then
/// wait on for good. Mappings made before the start are not managed.
#[used]
#[unsafe(link_section = ".init_array")]
static START: extern "C" fn() = start_at_load;

extern "C" fn start_at_load() {
    guarded(crate::exec::prepare);
    guarded(crate::coredump::resolve);
    guarded(crate::uaccess::resolve);
    let _ = shim();
}

pub(crate) fn shim() -> Option<&'static Shim> {
    if let Some(s) = current() {
        return Some(s);
    }
    if CHILD.load(Ordering::Relaxed) {
        return None;
    }
    TRIED.get_or_init(|| {
        if let Some(s) = guarded(init).flatten() {
            install(s);
            guarded(crate::coredump::install);
        }
    });
    current()
}

fn init() -> Option<Shim> {
    zmem_common::init_stderr_logger();
    let settings = match Settings::from_env() {
        Ok(s) if s.disable => return None,
        Ok(s) => s,
        Err(e) => {
            log::warn!("bad setting, the shim is off: {e}");
            return None;
        }
    };
    if running_on_valgrind() {
        warn_unmanaged(
            &settings,
            Warning::OnValgrind,
            format_args!(
                "{} runs under Valgrind, which runs a program's threads one at a time: a thread that \
                 touched an evicted page would hold up zmem's handler thread, which it waits for",
                program()
            ),
        );
        return None;
    }
    if let Some(runtime) = sanitizer() {
        warn_unmanaged(
            &settings,
            Warning::Sanitized,
            format_args!(
                "{} runs with {runtime}, which stands between zmem's own threads and the C library (memcpy, \
                 malloc) and keeps its state in mappings zmem would evict: a zmem thread that touched one would \
                 wait for itself",
                program()
            ),
        );
        return None;
    }
    if let Some(signal) = crate::sandbox::filter_kills_zmem() {
        warn_unmanaged(
            &settings,
            Warning::Sandboxed,
            format_args!(
                "{} runs under a seccomp filter that kills a call zmem makes (a probe of them died of signal \
                 {signal})",
                program()
            ),
        );
        return None;
    }
    let settings = if crate::waiting::wants_to_wait(&settings) {
        match crate::waiting::begin(settings) {
            Ok(()) => {
                register_handlers();
                crate::coredump::install();
                return None;
            }
            Err(settings) => *settings,
        }
    } else {
        settings
    };
    let s = start(settings, None)?;
    register_handlers();
    Some(s)
}

/// Registers the fork and exit handlers, once the process has a pager or
/// waits to start one.
fn register_handlers() {
    // SAFETY: registers plain functions with no arguments. Each runs
    // guarded; the child step starts this process's own pager, with glibc's
    // locks (malloc's included) reset and zmem's released.
    let r = unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child)) };
    if r != 0 {
        log::warn!("pthread_atfork failed ({r}); a forked child may misbehave");
    }
    // SAFETY: registers a plain function with no arguments, which neither
    // allocates nor unwinds; the shim is never unloaded.
    if unsafe { libc::atexit(crate::stats::remove_at_exit) } != 0 {
        log::warn!("atexit failed; the stats file stays after the exit (the next start sweeps it)");
    }
    // SAFETY: as above; `leave_tree_at_exit` touches atomics only.
    if unsafe { libc::atexit(leave_tree_at_exit) } != 0 {
        log::warn!("atexit failed; this process's usage stays in the tree's count until it is swept");
    }
}

/// Says why this process runs unmanaged, once per tree: every process of
/// the tree that cannot start a pager (a pyenv shim's 35 bash processes
/// under `ulimit -v`) has the same reason.
fn warn_unmanaged(settings: &Settings, w: Warning, why: std::fmt::Arguments<'_>) {
    if first_in_tree(settings, w) {
        log::warn!("{why}. It runs unmanaged (no limit), as will any other process of the tree for this reason");
    }
}

/// The exit handler (`atexit`): this process's usage leaves the tree's
/// count now, not a second after it is gone, so that the processes that
/// stay are not held to shares cut for memory being freed (a build's
/// compilers exit one after the other). Not in a vfork child, whose
/// parent's pager it would be. Atomics only: the program may exit with
/// any lock held.
extern "C" fn leave_tree_at_exit() {
    crate::waiting::leave_at_exit();
    if is_shim_process() {
        if let Some(s) = current() {
            s.pager.leave_tree();
        }
    }
}

/// Says, once per tree, that this process's userfaultfd serves faults
/// from user mode only, and what that breaks: the kernel's own accesses to
/// a page zmem has not mapped, made for the program's system calls, fail
/// with EFAULT rather than wait for the load. The shim faults in the
/// buffers of the C library's I/O calls first (`uaccess.rs`); the rest is
/// left to that.
fn warn_user_mode_only(settings: &Settings) {
    if first_in_tree(settings, Warning::UserModeOnly) {
        log::warn!(
            "this user may only have userfaultfd for faults from user mode (vm.unprivileged_userfaultfd=0 and no \
             access to /dev/userfaultfd): zmem loads the buffers of the C library's I/O calls (read, write, recv, \
             send, stdio) before the kernel reaches them, but any other system call on a page zmem evicted (made \
             with syscall(2), through io_uring, by a statically linked program) fails with EFAULT (\"Bad \
             address\"). As root, run `sysctl vm.unprivileged_userfaultfd=1` or give this user read-write access \
             to /dev/userfaultfd"
        );
    }
}

/// Whether warning `w` is the first of its kind in this process's tree
/// (always, for a process in no tree, or whose tree's segment is gone).
fn first_in_tree(settings: &Settings, w: Warning) -> bool {
    match settings.tree.as_deref().map(zmem_uffd::tree::Tree::open) {
        Some(Ok(t)) => t.first_warning(w),
        _ => true,
    }
}

/// This process, for a message: the name the kernel keeps
/// (`/proc/self/comm`) and its pid.
/// Without `/proc` (a new root), the calling thread's name.
fn program() -> String {
    let comm = zmem_common::fds::read_to_string(Wait::Yes, Path::new("/proc/self/comm")).unwrap_or_else(|_| {
        let mut name = [0u8; 16];
        // SAFETY: PR_GET_NAME writes at most 16 bytes, NUL included, into
        // the buffer it is given, which is ours and 16 bytes long.
        unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
        String::from_utf8_lossy(&name[..name.iter().position(|&b| b == 0).unwrap_or(16)]).into_owned()
    });
    format!("{} (pid {})", comm.trim_end(), std::process::id())
}

/// The sanitizer runtime loaded in this process, if any: its entry point
/// is a global symbol (`libasan.so` and its kin, or a runtime linked into
/// the executable and exported, as clang does). Under AddressSanitizer a
/// managed run hung: its interceptors of `memcpy` and the like run on
/// zmem's threads too, and reach its allocator's metadata, in anonymous
/// mappings that a scan adopts and reclaim evicts.
fn sanitizer() -> Option<&'static str> {
    [
        (c"__asan_init", "AddressSanitizer"),
        (c"__hwasan_init", "HWAddressSanitizer"),
        (c"__tsan_init", "ThreadSanitizer"),
        (c"__msan_init", "MemorySanitizer"),
        (c"__lsan_init", "LeakSanitizer"),
    ]
    .into_iter()
    .find(|(sym, _)| {
        // SAFETY: a lookup by a NUL-terminated name in the global scope;
        // it may allocate, and this runs inside the shim (zmem's heap).
        !unsafe { libc::dlsym(libc::RTLD_DEFAULT, sym.as_ptr()) }.is_null()
    })
    .map(|(_, name)| name)
}

/// Whether this process runs on Valgrind's synthetic CPU: its
/// `RUNNING_ON_VALGRIND` client request, a sequence of rotations that
/// leaves every register as it was on a real CPU (rdx keeps the default,
/// 0), and that Valgrind answers in rdx.
fn running_on_valgrind() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        const VG_USERREQ_RUNNING_ON_VALGRIND: u64 = 0x1001;
        let args: [u64; 6] = [VG_USERREQ_RUNNING_ON_VALGRIND, 0, 0, 0, 0, 0];
        let answer: u64;
        // SAFETY: four rotations of rdi by 128 bits in all, then an exchange
        // of rbx with itself: no register or memory changes on a real CPU.
        // Valgrind reads the request from `args` (live across the asm) and
        // writes its answer to rdx only.
        unsafe {
            std::arch::asm!(
                "rol rdi, 3",
                "rol rdi, 13",
                "rol rdi, 61",
                "rol rdi, 51",
                "xchg rbx, rbx",
                in("rax") args.as_ptr(),
                inout("rdx") 0u64 => answer,
                inout("rdi") 0u64 => _,
                options(nostack, readonly),
            );
        }
        answer != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A pager under `settings`, and the thread that writes its stats file.
/// In a forked child with the parent's hand-over `link`, the pager takes
/// this process's userfaultfd and evicted pages over from the parent.
fn start(settings: Settings, link: Option<std::os::fd::OwnedFd>) -> Option<Shim> {
    let s = start_pager(settings, link)?;
    if let Err(e) = crate::stats::start_thread(s.settings.stats_dir.clone(), s.settings.stats_interval) {
        log::warn!("no stats thread: {e}");
    }
    Some(s)
}

/// The pager of a process that waited (`waiting.rs`), started from the
/// stats thread (which goes on as the stats thread), or from the program's
/// thread where it cannot wait on. A pager that cannot start leaves the
/// process unmanaged, as at load.
pub(crate) fn start_late(settings: Settings) {
    let _ = guarded(|| {
        if let Some(s) = start_pager(settings, None) {
            install(s);
        }
    });
}

/// A pager under `settings` (see [`start`]), without a stats thread.
fn start_pager(mut settings: Settings, link: Option<std::os::fd::OwnedFd>) -> Option<Shim> {
    let config = |settings: &Settings| {
        let mut cfg = settings.pager_config();
        cfg.thread_init = Some(mark_internal_thread);
        cfg.handler_init = Some(crate::heap::use_side_heap);
        cfg.keep_on_fork = true;
        cfg
    };
    let mut cfg = config(&settings);
    let new = |cfg: zmem_uffd::PagerConfig| match link {
        Some(link) => match Pager::from_parent(cfg.clone(), link) {
            // Nothing was handed over (the parent had nothing registered, or
            // let go first and copied the memory in whole): a pager of our own.
            Err(zmem_uffd::PagerError::Handover(e)) => {
                log::debug!("fork hand-over: {e}");
                Pager::new(cfg)
            }
            r => r,
        },
        None => Pager::new(cfg),
    };
    let pager = match new(cfg.clone()) {
        // A tree whose segment is gone (its `zmem run` ended): this process
        // keeps the limit to itself.
        Err(zmem_uffd::PagerError::Tree(e)) => {
            log::warn!("{e}; this process takes the whole limit");
            cfg.tree = None;
            Pager::new(cfg.clone())
        }
        r => r,
    };
    let pager = match pager {
        // No swap file where it goes (a sandbox made the directory
        // read-only, or hid it): a pool without writeback still keeps the
        // limit, where the shim turned off did not (bubblewrap with `/`
        // bound read-only).
        Err(zmem_uffd::PagerError::Tier(zmem_tier::TierError::SwapCreate(e))) => {
            log::warn!("no swap file ({e}); this process runs without writeback");
            settings.swapfile_dir = None;
            Pager::new(zmem_uffd::PagerConfig { tree: cfg.tree.take(), ..config(&settings) })
        }
        r => r,
    };
    let pager = match pager {
        Ok(p) => p,
        Err(e) => {
            log::warn!("cannot start the pager, the shim is off: {e}");
            return None;
        }
    };
    if pager.user_mode_only() {
        warn_user_mode_only(&settings);
        crate::uaccess::activate();
    }
    Some(Shim { pager, settings })
}

/// Runs `f` (`unshare(CLONE_NEWUSER)`, `setns` into a user namespace) with
/// no thread of zmem's in the process: the kernel refuses those to a
/// process with more than one thread (EINVAL), and the pager's threads
/// made every managed process one, so `unshare -r` and bubblewrap failed
/// under `zmem run`. The pager lets go of the memory (`Pager::let_go`:
/// loaded back, unregistered; zmem's mappings become plain memory of the
/// program, as at fork in a child), its threads and the stats thread are
/// joined, and once `f` has run a new pager adopts it all again. A process
/// with threads of its own is left as it is: there `f` fails as it would
/// without zmem.
pub(crate) fn single_threaded<R>(f: impl FnOnce() -> R) -> R {
    // Not in a vfork child: the pager is its parent's, and nothing may
    // allocate there.
    // The program's errno goes into the call as it came: the work below
    // (reads of /proc, sleeps, the pager's end) may leave EAGAIN there, and
    // a call that succeeds does not clear it (Python's `ctypes` read 11
    // after an `unshare` that returned 0).
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    // A waiting process's only thread of zmem's is the stats thread.
    if guarded(crate::waiting::pause).unwrap_or(false) {
        set_errno(errno);
        let r = f();
        keeping_errno(|| {
            guarded(crate::waiting::resume);
        });
        return r;
    }
    if SHIM_PID.load(Ordering::Relaxed) != std::process::id() {
        set_errno(errno);
        return f();
    }
    let Some(old) = current().filter(|_| !others_than_zmem(rustix::thread::gettid().as_raw_nonzero().get())) else {
        set_errno(errno);
        return f();
    };
    let root_left = crate::stats::root_left();
    if root_left && old.pager.tree().is_none_or(|t| t.first_warning(Warning::RootChanged)) {
        log::warn!(
            "{} changes its credentials or namespaces after changing its root (chroot): zmem gives its memory \
             back first, and without /proc and the swap directory it cannot start a pager again. It runs \
             unmanaged (no limit), as will any other process of the tree for this reason",
            program()
        );
    }
    let inherited = let_go(old);
    // The io_uring workers of the swap file the pager closed end on their own.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while threads() > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    set_errno(errno);
    let r = f();
    if !root_left {
        keeping_errno(|| take_back(old, inherited));
    }
    r
}

/// Runs `f`, a call that puts this process under a seccomp filter
/// (`sandbox.rs`), with no thread of zmem's left: the memory is given back
/// as in [`single_threaded`], the stats file goes, and the process stays
/// unmanaged after, as do the children it forks. Where `failed` says the
/// call installed nothing, a new pager takes the memory back. Other
/// threads of the program may run meanwhile: they wait at the table for
/// their own munmaps, and the handler serves their faults until every
/// region is whole.
pub(crate) fn sandboxed<R>(f: impl FnOnce() -> R, failed: impl FnOnce(&R) -> bool) -> R {
    // A waiting process stops waiting, as a managed one lets go.
    if let Some(settings) = guarded(crate::waiting::end).flatten() {
        let r = f();
        if failed(&r) && !crate::stats::root_left() {
            keeping_errno(|| {
                guarded(|| {
                    if let Err(settings) = crate::waiting::begin(settings) {
                        start_late(*settings);
                    }
                });
            });
        }
        return r;
    }
    if SHIM_PID.load(Ordering::Relaxed) != std::process::id() {
        return f();
    }
    let Some(old) = current() else { return f() };
    // Said now: once the filter is in, even a write to stderr may be
    // forbidden. And only where this thread may write to a file: OpenSSH's
    // pre-authentication child sets `RLIMIT_FSIZE` to 0 first, and a write
    // to its log file (`sshd -e` into a file) would end it with SIGXFSZ.
    let mut fsize = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given, which is ours.
    let may_write =
        unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut fsize) } == 0 && fsize.rlim_cur == libc::RLIM_INFINITY;
    if may_write {
        warn_unmanaged(
            &old.settings,
            Warning::Sandboxed,
            format_args!(
                "{} puts itself under a seccomp filter, which may forbid the calls zmem makes on its \
             threads (with TSYNC, on zmem's own): zmem gives its memory back first",
                program()
            ),
        );
    }
    let inherited = let_go(old);
    crate::stats::remove_for_good();
    let r = f();
    // Not in a new root: a pager there would need `/proc` and the swap
    // directory by their paths (see `single_threaded`).
    if failed(&r) && !crate::stats::root_left() {
        crate::stats::not_gone();
        keeping_errno(|| take_back(old, inherited));
    }
    r
}

/// Runs `f`, a call that changes this process's root (`chroot`,
/// `pivot_root`; `sandbox.rs`). The process stays managed: what its pager
/// uses from then on is open already (the userfaultfd, the swap file, the
/// tree's segment, `/proc/thread-self/maps`, `statm` and `pagemap`), and a
/// child it forks starts its pager before it runs on. What zmem finds by a
/// path that now leads into the new root goes first: the stats file
/// (`stats::leave_root`). Not in a vfork child, whose memory (the flag
/// that stops the stats) is its parent's.
pub(crate) fn leaving_root<R>(f: impl FnOnce() -> R, failed: impl FnOnce(&R) -> bool) -> R {
    // A waiting process starts its pager now, while `/proc` and the swap
    // directory are at their paths.
    keeping_errno(|| {
        guarded(crate::waiting::start_now);
    });
    if SHIM_PID.load(Ordering::Relaxed) != std::process::id() || current().is_none() {
        return f();
    }
    keep_self_stat();
    let left_before = crate::stats::leave_root();
    let r = f();
    if failed(&r) && !left_before {
        crate::stats::root_kept();
    }
    r
}

/// Lets `old`, this process's running shim, go (`Pager::let_go`): from
/// here the process has no shim, nothing new is managed, and zmem's
/// threads (the stats thread too) are joined. Returns what it managed,
/// plain memory now: (start, length).
fn let_go(old: &'static Shim) -> Vec<(usize, usize)> {
    guarded(|| {
        zmem_uffd::unhold_current_thread();
        let mut table = REGIONS.write_ok();
        CURRENT.store(std::ptr::null_mut(), Ordering::Release);
        crate::stats::stop_thread();
        // SAFETY: the old shim is leaked (CURRENT no longer points to it)
        // and its regions are forgotten below; its pager is the process's
        // only one.
        unsafe { old.pager.let_go() };
        let mut inherited = Vec::new();
        for (&start, m) in table.iter_mut() {
            if let Some(r) = m.region.take() {
                // Given back, plain memory now: a region's drop would
                // unmap it through the pager let go of.
                std::mem::forget(r);
                zmem_common::owned::remove(start as u64);
                inherited.push((start, m.cap));
            }
        }
        inherited
    })
    .unwrap_or_default()
}

/// Gives this process's memory back before a core dump (`coredump.rs`):
/// loaded back and unregistered, zmem's threads joined, as for `unshare`.
/// Not in a vfork child, whose memory is its parent's.
pub(crate) fn give_back_for_dump() {
    if SHIM_PID.load(Ordering::Relaxed) != std::process::id() {
        return;
    }
    if let Some(old) = current() {
        let _ = let_go(old);
    }
}

/// A new pager, under `old`'s settings, adopts what [`let_go`] gave back.
fn take_back(old: &'static Shim, inherited: Vec<(usize, usize)>) {
    let _ = guarded(|| {
        let Some(s) = start(old.settings.clone(), None) else { return };
        for (start, cap) in inherited {
            if let Err(e) = s.pager.adopt(start as u64, cap) {
                log::debug!("a mapping at {start:#x} not adopted again: {e}");
            }
        }
        install(s);
    });
}

/// Maps `len` bytes of managed memory, or `None` (the caller falls back).
pub(crate) fn managed_alloc(len: usize) -> Option<*mut c_void> {
    let s = shim()?;
    guarded(|| {
        let region = s.pager.map(len).map_err(|e| log::warn!("a managed mapping failed: {e}")).ok()?;
        let addr = region.addr() as usize;
        let cap = region.len();
        REGIONS.write_ok().insert(addr, Managed { region: Some(region), cap, len, unmapped: 0 });
        LIVE.fetch_add(1, Ordering::Relaxed);
        Some(addr as *mut c_void)
    })
    .flatten()
}

/// The managed mapping that contains `addr`: (start, region length, asked length).
///
/// zmem's own code never holds managed memory, so inside the shim (where
/// the table lock may be held: a BTreeMap node freed under it) every
/// pointer is glibc's.
pub(crate) fn lookup(addr: usize) -> Option<(usize, usize, usize)> {
    if in_zmem() || LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    guarded(|| {
        let regions = REGIONS.read_ok();
        let (&start, m) = regions.range(..=addr).next_back()?;
        (addr < start + m.cap).then_some((start, m.cap, m.len))
    })
    .flatten()
}

/// Drops the managed mapping at `start`. One inherited from the parent at
/// fork is plain memory: unmapped (this process's pager, if it adopted it,
/// sees the unmap).
pub(crate) fn managed_free(start: usize) {
    guarded(|| {
        let m = REGIONS.write_ok().remove(&start);
        if m.is_some() {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(Managed { region: None, cap, .. }) = m {
            // SAFETY: [start, start + cap) is this process's copy of a
            // parent's region, which the program gave up.
            unsafe { libc::syscall(libc::SYS_munmap, start, cap) };
        }
        // A region unmaps and frees its entries as it drops, outside the
        // table lock.
    });
}

/// Whether the malloc family takes a request of `len` bytes itself: only
/// with adoption off (`ZMEM_ADOPT=0`), where it is the only way glibc's
/// large chunks are managed. With adoption on, the program's allocator,
/// glibc's too, stays its own, and what it maps is adopted by mapping.
pub(crate) fn wants_malloc(len: usize) -> bool {
    wants(len) && current().is_some_and(|s| !s.settings.adopt)
}

/// The program called `mlockall(MCL_FUTURE)`: nothing new is managed.
static LOCKED_ALL: AtomicBool = AtomicBool::new(false);

/// The program locked `[addr, addr + len)`: never adopted.
pub(crate) fn locked(addr: usize, len: usize) {
    let start = addr & !(crate::PAGE - 1);
    let end = (addr + len).div_ceil(crate::PAGE) * crate::PAGE;
    guarded(|| zmem_common::owned::add(start as u64, end - start, zmem_common::owned::Kind::Locked));
}

/// The program unlocked what it locked at `addr`.
pub(crate) fn unlocked(addr: usize) {
    let start = addr & !(crate::PAGE - 1);
    guarded(|| {
        if zmem_common::owned::overlapping(start as u64, start as u64 + 1)
            .iter()
            .any(|&(s, _, k)| s == start as u64 && k == zmem_common::owned::Kind::Locked)
        {
            zmem_common::owned::remove(start as u64);
        }
    });
}

/// `mlockall(flags)` succeeded.
pub(crate) fn locked_all(flags: c_int) {
    if flags & libc::MCL_FUTURE != 0 {
        LOCKED_ALL.store(true, Ordering::Relaxed);
        if let Some(s) = current() {
            guarded(|| s.pager.stop_adopting());
        }
    }
}

/// Whether a chunk of `len` bytes that glibc's malloc mapped for itself is
/// adopted at once (adoption on: see `malloc::adopt_chunk`).
pub(crate) fn adopts_chunks(len: usize) -> bool {
    wants(len) && current().is_some_and(|s| s.settings.adopt)
}

pub(crate) fn wants(len: usize) -> bool {
    !LOCKED_ALL.load(Ordering::Relaxed)
        && !in_zmem()
        && !CHILD.load(Ordering::Relaxed)
        && !BROKEN.load(Ordering::Relaxed)
        && len >= threshold()
}

pub(crate) fn threshold() -> usize {
    // Before the shim is up, the default; the first large request starts it.
    match current() {
        Some(s) => s.settings.threshold,
        None if TRIED.get().is_some() || CHILD.load(Ordering::Relaxed) => usize::MAX,
        None => Settings::DEFAULT_THRESHOLD,
    }
}

/// Runs `f`, the shim's own work after a call of the program's, and gives
/// the program's thread back the `errno` that call left: starting a pager
/// makes calls of its own, and the program reads `errno` after ours (Python
/// read `EAGAIN` after an `unshare` that succeeded; a failed one would have
/// reported the wrong error).
pub(crate) fn keeping_errno(f: impl FnOnce()) {
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    f();
    set_errno(e);
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location has no preconditions.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: it returns this thread's errno slot, valid and aligned.
    unsafe { *slot = e };
}
