//! The shim's start: from the `ZMEM_*` environment as the library loads
//! (or at the first large malloc), or late (`waiting.rs`); the state it
//! installs is in `state.rs`. Fork's steps are in `fork.rs`, the calls that need zmem
//! out of the way in `modes.rs`, a late start in `waiting.rs`.

use std::ffi::c_void;
use std::path::Path;
use std::sync::atomic::Ordering;
use zmem_common::host::fds::Wait;
use zmem_common::RwLockExt;

use zmem_settings::Settings;
use zmem_uffd::tree::Warning;
use zmem_uffd::Pager;

use crate::guard::{guarded, mark_internal_thread};
use crate::state::{current, install, is_shim_process, Managed, Shim, CHILD, LIVE, REGIONS, TRIED};

/// Whether zmem runs threads in this process: a pager's, or the stats
/// thread of one that waits to start its pager (`waiting.rs`).
pub(crate) fn has_zmem_threads() -> bool {
    is_shim_process() || guarded(crate::waiting::is_waiting).unwrap_or(false)
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
    let r = unsafe {
        libc::pthread_atfork(
            Some(crate::fork::before_fork),
            Some(crate::fork::after_fork_in_parent),
            Some(crate::fork::after_fork_in_child),
        )
    };
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
pub(crate) fn warn_unmanaged(settings: &Settings, w: Warning, why: std::fmt::Arguments<'_>) {
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
pub(crate) fn program() -> String {
    let comm = zmem_common::host::fds::read_to_string(Wait::Yes, Path::new("/proc/self/comm")).unwrap_or_else(|_| {
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
pub(crate) fn start(settings: Settings, link: Option<std::os::fd::OwnedFd>) -> Option<Shim> {
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
            // Where no stats thread waited with the process (its first
            // look, in `waiting::begin`, found the point reached).
            if !crate::stats::has_thread() {
                if let Err(e) = crate::stats::start_thread(s.settings.stats_dir.clone(), s.settings.stats_interval) {
                    log::warn!("no stats thread: {e}");
                }
            }
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
