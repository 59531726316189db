//! fork: with [`PagerConfig::keep_on_fork`](super::PagerConfig), a child
//! inherits the regions and sees exactly the parent's memory at the moment
//! of fork; afterwards the two diverge, and neither loses a page.
//!
//! A child has no userfaultfd registration (the kernel clears it, as the
//! pager does not ask for `UFFD_FEATURE_EVENT_FORK`) and none of the
//! pager's threads: a page that is evicted at fork would read as zeros
//! there. So [`Pager::fork_prepare`], run just before fork (the prepare
//! step of `pthread_atfork`):
//! 1. freezes reclaim: it waits for the pass in flight, and no folio is
//!    isolated until [`Pager::fork_parent`];
//! 2. loads every Evicted folio back into the program, as a fault would,
//!    so that the child's copy is whole. Usage may pass the limit until
//!    `fork_parent` lets reclaim run again.
//!
//! In the child the regions are plain memory of the child's own. It must
//! not use the pager, whose threads live only in the parent.
//!
//! After fork the parent's pages are shared with the child, and stay not
//! exclusive even after the child exits, until the parent writes them:
//! UFFDIO_MOVE refuses such pages (EBUSY). So once the process has forked,
//! reclaim runs `MADV_POPULATE_WRITE` over a folio's present pages before
//! it isolates the folio (a write fault without a write: a copy while the
//! child lives, the page made exclusive again once it is gone). A folio
//! that still cannot move is given back the same way (`cow_breaks`).

use std::sync::atomic::Ordering;
use zmem_common::{LockExt, RwLockExt};

use super::Pager;

impl Pager {
    /// Makes the regions' memory whole in the program, for a fork: freezes
    /// reclaim and loads every evicted folio back. Call it right before
    /// `fork`, with no region being dropped meanwhile, and
    /// [`fork_parent`](Self::fork_parent) after it in the parent.
    ///
    /// With [`PagerConfig::fork_event`](super::PagerConfig) nothing is
    /// loaded: the child takes its evicted pages over (`handover.rs`).
    pub fn fork_prepare(&self) {
        let inner = &self.inner;
        if inner.cfg.fork_event {
            inner.prepare_handover();
            return;
        }
        inner.fork.frozen.store(true, Ordering::Release);
        // The pass in flight ends at its next batch; no new one starts.
        drop(inner.fork.reclaim_gate.lock_ok());
        let regions: Vec<_> = inner.folios.regions.read_ok().values().cloned().collect();
        let mut bounce = vec![0u8; inner.cfg.folio_size];
        for st in regions {
            inner.load_region(&st, &mut bounce, true);
        }
    }

    /// In a forked child, for a pager of the parent's: closes what it holds
    /// open (its userfaultfd, swap file, pagemap and statm readers), which
    /// would otherwise live as long as the child (a daemon's swap file would
    /// keep its disk space).
    /// Nothing else is touched: its threads are not in the child.
    ///
    /// # Safety
    /// The pager is never used or dropped afterwards (the caller leaks it):
    /// its descriptors' numbers may be reused by anything.
    pub unsafe fn abandon_in_child(&self) {
        // Every descriptor a pager keeps open is in `zmem_common::host::fds`
        // (its userfaultfd, swap file, pagemap and statm readers), and in a
        // child that abandons its parent's pager, they are all that pager's.
        let mut fds = [0; zmem_common::host::fds::SLOTS];
        let n = zmem_common::host::fds::take_all(&mut fds);
        for &fd in &fds[..n] {
            // The result is not looked at: a descriptor the parent's reclaim
            // thread opened and kept while the fork ran (`/proc/self/maps`,
            // for a scan) may be in the table without being in the child,
            // since the kernel copies the descriptor table before memory.
            // That close is EBADF, and rustix's close would assert on it.
            // SAFETY: fd is owned by this pager, which (the caller's
            // contract) never uses or closes it again; if the number is not
            // open, close(2) does nothing.
            unsafe { libc::close(fd) };
        }
    }

    /// Gives every region back to the program, whole and unregistered, as
    /// [`Drop`] gives adopted ones, those it mapped too (their mappings
    /// stay, the program's now); stops and joins the pager's threads; and
    /// closes what it holds open. For a moment in which the process must
    /// have no thread but the caller's: the kernel refuses
    /// `unshare(CLONE_NEWUSER)` to a process with more (EINVAL), and the
    /// pager's threads made every managed process one (`unshare -r`,
    /// bubblewrap). What was managed is plain memory after, which a new
    /// pager may adopt.
    ///
    /// # Safety
    /// The pager is never used or dropped afterwards (the caller leaks it
    /// and forgets the [`Region`](super::Region)s it made): its
    /// descriptors' numbers may be reused by anything. It is the process's
    /// only pager: every descriptor in `zmem_common::host::fds` is closed.
    pub unsafe fn let_go(&self) {
        let inner = &self.inner;
        // A forked child may still need the regions' entries.
        inner.wait_handover();
        inner.fork.frozen.store(true, Ordering::Release);
        // The pass in flight ends at its next batch; no new one starts.
        drop(inner.fork.reclaim_gate.lock_ok());
        let regions: Vec<_> = inner.folios.regions.read_ok().values().cloned().collect();
        let mut bounce = vec![0u8; inner.cfg.folio_size];
        for st in regions {
            inner.give_back(&st, &mut bounce);
        }
        // With no region left, the handler returns at its next wake-up
        // (50 ms at the most), and reclaim at its kick.
        inner.stop.store(true, Ordering::Release);
        inner.kick_reclaim();
        for t in self.threads.lock_ok().drain(..) {
            let _ = t.join();
        }
        // What was managed is the program's now: outside the tree's count
        // until a new pager takes the slot over.
        if let Some(m) = &inner.acct.member {
            m.publish(0, 0);
        }
        // SAFETY: no thread of this pager is left to use its descriptors,
        // and the caller's contract: it is never used again.
        unsafe { self.abandon_in_child() };
    }

    /// A pager started in a forked child: the child's pages are shared with
    /// its parent until one of them writes, so reclaim makes a folio's pages
    /// this process's own before it moves them, as after a fork of its own.
    pub fn mark_forked(&self) {
        self.inner.fork.forked.store(true, Ordering::Relaxed);
    }

    /// After a fork, in the parent: reclaim runs again.
    pub fn fork_parent(&self) {
        self.inner.fork.forked.store(true, Ordering::Relaxed);
        if self.inner.cfg.fork_event {
            // Reclaim runs again once the handler has handed over.
            self.inner.parent_handover();
            return;
        }
        self.inner.fork.frozen.store(false, Ordering::Release);
        self.inner.kick_reclaim();
    }
}

/// Where a fork is, and what it holds still (see `handover.rs`).
#[derive(Default)]
pub(super) struct ForkState {
    /// A fork is being prepared: reclaim isolates nothing, faults do not
    /// wait for it (see `fork.rs`).
    pub(super) frozen: std::sync::atomic::AtomicBool,
    /// Held by reclaim over a run of passes, so `fork_prepare` can wait for
    /// the one in flight.
    pub(super) reclaim_gate: std::sync::Mutex<()>,
    /// The process has forked: pages may be shared with a child, and
    /// reclaim makes a folio's pages the parent's own before it moves them.
    pub(super) forked: std::sync::atomic::AtomicBool,
    /// With `fork_event`: the two ends of the socket pair a fork's
    /// hand-over goes through, made by `fork_prepare`; the parent's end is
    /// taken by the handler as it reads the FORK event, the child's by the
    /// child (and closed by the parent step). See `handover.rs`.
    pub(super) link_parent: std::sync::Mutex<Option<zmem_common::host::fds::KeptFd>>,
    pub(super) link_child: std::sync::Mutex<Option<zmem_common::host::fds::KeptFd>>,
    /// `handover::Fork` as a number: where the last fork is.
    pub(super) stage: std::sync::atomic::AtomicU8,
    /// The handler is serving a forked child until it hands over: nothing
    /// may free an entry the child may still need (`wait_handover`).
    pub(super) serving_child: std::sync::atomic::AtomicBool,
}
