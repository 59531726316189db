//! The calls that need the process without zmem's threads, or that change
//! where its paths lead: zmem lets go of the memory first (or starts its
//! pager first), and takes it back after where it may.

use std::sync::atomic::Ordering;
use zmem_common::RwLockExt;
use zmem_uffd::tree::Warning;

use crate::errno::{keeping_errno, set_errno};
use crate::guard::guarded;
use crate::init::{program, start, start_late, warn_unmanaged};
use crate::state::{current, install, Shim, CURRENT, REGIONS, SHIM_PID};
use crate::tasks::{keep_self_stat, others_than_zmem, threads};

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
                zmem_common::host::owned::remove(start as u64);
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
