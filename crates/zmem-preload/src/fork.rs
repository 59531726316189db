//! fork's three steps, as `pthread_atfork` runs them: the child gets the
//! parent's memory whole, and a pager (or a wait for one) of its own.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::RwLockWriteGuard;
use zmem_common::RwLockExt;
use zmem_uffd::tree::Warning;

use crate::guard::guarded;
use crate::init::start;
use crate::state::{current, install, Table, CHILD, CURRENT, LOCKED_ALL, REGIONS};

/// What the forking thread holds from the prepare step of fork to its
/// parent or child step: no region is made or freed meanwhile, no range of
/// zmem's is being recorded, and the child starts with all of it unlocked.
struct ForkGuards {
    waiting: std::sync::MutexGuard<'static, Option<crate::waiting::Waiting>>,
    table: RwLockWriteGuard<'static, Table>,
    owned: zmem_common::host::owned::ForkGuard,
}

/// How long fork's prepare step waits for zmem's threads to be past their
/// start (`zmem_common::host::thread::wait_for_starting`); they are
/// usually past it long before.
const STARTING_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

thread_local! {
    static FORK_GUARDS: RefCell<Option<ForkGuards>> = const { RefCell::new(None) };
}

/// pthread_atfork's prepare step: the child must see exactly the parent's
/// memory, and it has neither the pager's threads nor a userfaultfd
/// registration. So every evicted folio is loaded back first
/// (`Pager::fork_prepare`), with reclaim frozen until the parent step.
/// vfork and posix_spawn run no atfork handlers, and need none: the child
/// execs (or exits) without touching the parent's memory.
pub(crate) extern "C" fn before_fork() {
    guarded(|| {
        // No thread of zmem's is inside its start (a pager started just
        // now, by a child about to fork again). First: a starting thread
        // may need a lock taken below.
        if !zmem_common::host::thread::wait_for_starting(STARTING_WAIT) {
            log::debug!("forking while a thread of zmem's is still starting");
        }
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
        let owned = zmem_common::host::owned::fork_lock();
        FORK_GUARDS.with(|f| *f.borrow_mut() = Some(ForkGuards { waiting, table, owned }));
        // Last: nothing above may allocate once it is held.
        crate::heap::fork_lock();
    });
}

pub(crate) extern "C" fn after_fork_in_parent() {
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
pub(crate) extern "C" fn after_fork_in_child() {
    in_child(Made::Fork);
}

/// How a child was made: by glibc's `fork` (its atfork handlers), or by a
/// `clone` or `fork` system call through glibc's `syscall` ([`raw_fork`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Made {
    Fork,
    /// With `CLONE_FILES` or not: the descriptor table shared with the
    /// parent, whose pager's descriptors the child must then not close.
    Raw {
        shares_files: bool,
    },
}

/// A `clone` without `CLONE_VM`, or a `fork`, made through glibc's
/// `syscall` (`call`): bubblewrap and Chromium make their children so, and
/// no atfork handler runs. The child of a managed process would have its
/// parent's memory without the pages evicted at the moment of the clone:
/// its registration is not inherited, and those pages read as zeros. And
/// the child of any process with zmem's threads would have a lock one of
/// them held (the stats thread's look, or its allocation from zmem's heap)
/// held for good: bubblewrap's pid 1 then hung at its `fork`. So the same
/// three steps run around it as around glibc's `fork`: the prepare step
/// takes those locks, and loads every evicted folio back. The child then
/// runs unmanaged, as one forked after a change of root does: it may be in
/// new namespaces (a pid namespace, where it is pid 1), which a pager of
/// its own would not know, and it mostly execs at once (a shim starts
/// anew).
///
/// `flags` are the call's `clone` flags (none for `fork`).
pub(crate) fn raw_fork(flags: u64, call: impl FnOnce() -> std::ffi::c_long) -> std::ffi::c_long {
    if crate::guard::in_zmem() || !crate::init::has_zmem_threads() {
        return call();
    }
    before_fork();
    let r = call();
    crate::errno::keeping_errno(|| {
        if r == 0 {
            in_child(Made::Raw { shares_files: flags & libc::CLONE_FILES as u64 != 0 })
        } else {
            after_fork_in_parent()
        }
    });
    r
}

/// The child step of a fork made as `made` says.
fn in_child(made: Made) {
    // A child inherits no memory locks (mlockall's MCL_FUTURE included).
    LOCKED_ALL.store(false, Ordering::Relaxed);
    // The parent's other threads' descriptor sections and closes are not
    // in the child: before anything here closes a descriptor.
    zmem_common::host::fds::reset_in_child();
    zmem_common::host::thread::reset_in_child();
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
                crate::waiting::after_fork_in_child(waiting, made == Made::Fork);
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
                    zmem_common::host::owned::remove(start as u64);
                    inherited.push((start, m.cap));
                }
            }
        }
        let root_left = crate::stats::root_left();
        if let Made::Raw { shares_files: true } = made {
            // The parent's pager's descriptors are the parent's too: the
            // shim is left as it is, unreachable (CURRENT is null).
            CHILD.store(true, Ordering::Relaxed);
            return;
        }
        if root_left || made != Made::Fork {
            // A pager here would need `/proc`, the swap directory and the
            // tree's segment by their paths, which lead into the new root
            // now; a raw clone's child may be in namespaces of its own.
            if root_left && parent.pager.tree().is_none_or(|t| t.first_warning(Warning::RootChanged)) {
                log::warn!(
                    "process {} was forked after its parent changed its root (chroot): without /proc and the \
                     swap directory zmem cannot start a pager in it. It runs unmanaged (no limit), as will any \
                     other process of the tree for this reason",
                    std::process::id()
                );
            }
            // With a hand-over (ZMEM_FORK_EVENT), the parent copies the
            // pages this child lacks in whole.
            if let Some(link) = parent.pager.fork_link_in_child() {
                zmem_uffd::Pager::ask_for_whole_copy(link);
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
