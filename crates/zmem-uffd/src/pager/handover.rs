//! fork without load-back (`PagerConfig::fork_event`).
//!
//! The pager's userfaultfd asks for `UFFD_FEATURE_EVENT_FORK`. At fork the
//! kernel gives the child a userfaultfd of its own holding every
//! registration of the parent's, and hands it to the parent's handler in a
//! FORK event; fork returns once that event is read. The child's evicted
//! pages stay missing there, and its faults wait on that userfaultfd:
//!
//! 1. *Prepare* (`Pager::fork_prepare`, before fork): reclaim is frozen
//!    (the pass in flight ends), a socket pair is made, the *link*, and the
//!    handlers finish what they were doing (`wait_handlers_at_rest`).
//!    Nothing is loaded back.
//! 2. *FORK read* (the handler): from here until the hand-over the handler
//!    serves the child only ([`Inner::serve_child`]): its faults, from the
//!    parent's tier, one page each, and its events. The parent's own
//!    faults and events wait in the kernel, and nothing else frees an entry
//!    (`serving_child`: a region's drop and a split mremap wait for it), so
//!    the tier holds exactly the child's missing pages as they were at fork.
//!    Events read before the FORK event are the parent's: a REMOVE or UNMAP
//!    in flight at the moment of fork drops the pages for the child too.
//! 3. *Parent step*: the parent closes its copy of the child's end, and
//!    waits until the handler is done with the child: a parent that exits
//!    at once (a daemon's first parent) would take the child's userfaultfd
//!    with it. A fork that raised no FORK event (it failed, or copied no
//!    registered mapping) is seen as such after [`SEEN_GRACE`].
//! 4. *Child step* (the shim's, right after fork): the child abandons the
//!    parent's pager and asks for its memory over the link
//!    ([`Pager::from_parent`]). The parent writes a snapshot into a memfd:
//!    the regions, then every page the child may lack with its entry as
//!    [`Tier::export`](zmem_tier::Tier::export) gives it (objects copied,
//!    not expanded), and sends it with the child's userfaultfd
//!    (`SCM_RIGHTS`). It closes its copy, lets reclaim run, and goes back to
//!    its own faults.
//! 5. The child starts a pager on that userfaultfd, adopts the regions,
//!    imports the entries of the pages it does not have (`pagemap`: the
//!    parent served some already), and only then starts its threads.
//!
//! If the child never asks within [`HANDOVER_TIMEOUT`] (a raw `fork`
//! syscall runs no atfork handler; a stopped child), the parent copies
//! every page the child lacks into it and closes the child's userfaultfd:
//! the child's memory is whole and unmanaged, as with a load-back; a child
//! that starts no pager of its own asks for that at once
//! ([`Pager::ask_for_whole_copy`]). If the child closes its end first (it
//! exec'd or died), the parent just closes the child's userfaultfd.

use std::io::{IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketFlags, SocketType,
};
use zmem_common::{LockExt, RwLockExt};
use zmem_tier::{Exported, LoadOutcome};

use super::stats::inc;
use super::{Folio, Inner, Pager, PagerConfig, PagerError, RegionState};
use crate::sys::{Event, Features, Uffd, UffdError};
use zmem_common::PAGE_SIZE;

/// How long the parent serves a child that has not asked for its memory
/// before it copies the memory into it and lets go.
pub(super) const HANDOVER_TIMEOUT: Duration = Duration::from_secs(2);

/// Pages exported per call (`Tier::export_many`).
const EXPORT_BATCH: usize = 1024;

pub(super) const MAGIC: u64 = 0x6b72_6f66_6d65_6d7a; // "zmemfork"
pub(super) const VERSION: u32 = 1;
const REQUEST: &[u8] = b"give";
/// A child that runs unmanaged asks for its memory copied in whole.
const COPY_REQUEST: &[u8] = b"copy";

/// Where the last fork is (`ForkState::stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Fork {
    Idle = 0,
    /// Prepared: the link is made, reclaim frozen.
    Prepared = 1,
    /// The handler read the FORK event (set as soon as it is read; fork
    /// returns only after that read).
    Seen = 2,
}

/// How long the parent step waits for the handler to say it read the FORK
/// event, after which it takes it that none came (the fork failed, or no
/// registered mapping was copied: all were `MADV_DONTFORK`).
const SEEN_GRACE: Duration = Duration::from_secs(1);

/// How long `fork_prepare` waits for the handlers to be at rest.
const AT_REST_WAIT: Duration = Duration::from_millis(200);

/// What a forked child's pager starts from.
pub(super) struct Handed {
    pub(super) uffd: Uffd,
    pub(super) snapshot: Snapshot,
}

/// The parent's snapshot, mapped from the memfd it came in.
pub(super) struct Snapshot {
    map: crate::mapping::Mapping,
    len: usize,
}

impl Snapshot {
    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes of the memfd, which
        // nobody writes any more (the parent closed it after sending), and
        // lives as long as self.
        unsafe { std::slice::from_raw_parts(self.map.addr() as *const u8, self.len) }
    }
}

/// What a child did to its memory while the parent served it (in the
/// child's addresses, in order).
#[derive(Debug, Default)]
struct ChildEdits {
    dropped: Vec<(u64, u64)>,
    moved: Vec<(u64, u64, u64)>,
}

impl ChildEdits {
    /// The child's address of the parent's page at `a` (now), if the child
    /// still has it.
    fn to_child(&self, mut a: u64) -> Option<u64> {
        for &(from, to, len) in &self.moved {
            if (from..from + len).contains(&a) {
                a = to + (a - from);
            }
        }
        (!self.dropped.iter().any(|&(s, e)| (s..e).contains(&a))).then_some(a)
    }

    /// The parts of the parent's range `[a, b)` that the child has not
    /// dropped (as it was at fork: `dropped` is in the child's addresses,
    /// which are the parent's where nothing moved).
    fn kept_of(&self, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut parts = vec![(a, b)];
        for &(s, e) in &self.dropped {
            parts = parts
                .into_iter()
                .flat_map(|(x, y)| {
                    if e <= x || s >= y {
                        vec![(x, y)]
                    } else {
                        [(x, s.max(x)), (e.min(y), y)].into_iter().filter(|(p, q)| p < q).collect()
                    }
                })
                .collect();
        }
        parts
    }

    /// The parent's address of the child's page at `a`; `None` if the
    /// child dropped it (it reads as zeros).
    fn to_parent(&self, a: u64) -> Option<u64> {
        if self.dropped.iter().any(|&(s, e)| (s..e).contains(&a)) {
            return None;
        }
        let mut a = a;
        for &(from, to, len) in self.moved.iter().rev() {
            if (to..to + len).contains(&a) {
                a = from + (a - to);
            }
        }
        Some(a)
    }
}

pub(super) fn io_err(what: &str, e: impl std::fmt::Display) -> PagerError {
    PagerError::Handover(format!("{what}: {e}"))
}

impl Pager {
    /// In a forked child, for a pager of the parent's made with
    /// `fork_event`: this child's end of the hand-over link, taken so that
    /// [`abandon_in_child`](Self::abandon_in_child) leaves it open. `None`
    /// if the parent's pager has no fork in flight.
    pub fn fork_link_in_child(&self) -> Option<OwnedFd> {
        Some(self.inner.fork.link_child.lock_ok().take()?.into_owned())
    }

    /// In a forked child that starts no pager of its own: asks the parent
    /// over `link` to copy every page this process lacks into it and let
    /// go of it (the child's faults wait meanwhile). Closing the link
    /// alone tells the parent the child exec'd or exited: the pages it
    /// lacks would then read as zeros.
    pub fn ask_for_whole_copy(link: OwnedFd) {
        if let Err(e) = rustix::net::send(&link, COPY_REQUEST, SendFlags::empty()) {
            log::warn!("asking the parent for this process's memory failed ({e}); it copies it in after a timeout");
        }
    }

    /// In a forked child: asks the parent for this process's userfaultfd
    /// and evicted pages over `link`, and starts a pager on them under
    /// `cfg` (as the parent's). The child's faults wait meanwhile.
    ///
    /// # Errors
    /// The parent let go first (it timed out: the child's memory was copied
    /// in whole, and the caller starts a plain pager), or the pager's errors.
    pub fn from_parent(cfg: PagerConfig, link: OwnedFd) -> Result<Pager, PagerError> {
        // A new thread reads program memory before any code of ours runs
        // on it: glibc's start_thread sets its ctype tables from the
        // process's locale, which a program that called setlocale keeps in
        // its heap. Once the parent has handed over, a fault there waits
        // for this pager's handler, and the handler's own start-up would
        // wait for itself (the child hung, its creating thread spinning
        // in pthread_create). So one thread is started and joined first,
        // while the parent still serves this process's faults: what thread
        // start-up reads is then in place, and stays (nothing evicts here
        // until the pager below runs).
        zmem_common::host::thread::spawn(std::thread::Builder::new().name("zmem-warmup".into()), || {})
            .and_then(|t| t.join().map_err(|_| std::io::Error::other("it panicked")))
            .map_err(|e| io_err("a thread before the hand-over", e))?;
        rustix::net::send(&link, REQUEST, SendFlags::empty()).map_err(|e| io_err("asking the parent", e))?;
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let mut head = [0u8; 24];
        let r = rustix::net::recvmsg(&link, &mut [IoSliceMut::new(&mut head)], &mut anc, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| io_err("the parent's answer", e))?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if r.bytes != head.len() || fds.len() != 2 {
            return Err(PagerError::Handover("the parent let go (its copy went in whole)".into()));
        }
        let features = Features(u64::from_ne_bytes(head[0..8].try_into().expect("8 bytes")));
        let ioctls = u64::from_ne_bytes(head[8..16].try_into().expect("8 bytes"));
        let len = u64::from_ne_bytes(head[16..24].try_into().expect("8 bytes")) as usize;
        let memfd = fds.pop().expect("two");
        let uffd = Uffd::handed_over(fds.pop().expect("two"), features, ioctls);
        let map = match crate::mapping::Mapping::file_read_only(&memfd, len.max(1)) {
            Ok(m) => m,
            Err(e) => {
                log::error!("a forked child cannot read its parent's snapshot ({e}): aborting");
                std::process::abort();
            }
        };
        drop(memfd);
        match Pager::start(cfg, Some(Handed { uffd, snapshot: Snapshot { map, len } })) {
            Ok(p) => Ok(p),
            Err(e) => {
                // The userfaultfd holds this process's evicted pages'
                // registrations: without a pager they would read as zeros.
                log::error!("a forked child cannot manage the memory its parent handed over ({e}): aborting");
                std::process::abort();
            }
        }
    }
}

impl Inner {
    /// `fork_prepare` with `fork_event`: reclaim frozen, the link made.
    /// With no region there is no registered mapping to copy, so no FORK
    /// event will come: nothing to do (the child starts a pager of its own).
    pub(super) fn prepare_handover(&self) {
        if self.folios.regions.read_ok().is_empty() {
            return;
        }
        self.fork.frozen.store(true, Ordering::Release);
        drop(self.fork.reclaim_gate.lock_ok());
        let pair =
            zmem_common::host::fds::open_kept_pair(zmem_common::host::fds::Wait::Yes, rustix::io::Errno::AGAIN, || {
                rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
            });
        match pair {
            Ok((a, b)) => {
                *self.fork.link_parent.lock_ok() = Some(a);
                *self.fork.link_child.lock_ok() = Some(b);
            }
            // The child then gets its memory copied in whole.
            Err(e) => log::warn!("no fork hand-over link ({e}): the child's memory will be copied in whole"),
        }
        self.fork.stage.store(Fork::Prepared as u8, Ordering::Release);
        self.wait_handlers_at_rest();
    }

    /// Waits, up to [`AT_REST_WAIT`], until no handler is busy with events
    /// it read. glibc's fork takes every malloc lock before the syscall,
    /// and the syscall waits for the FORK event to be read: a handler
    /// that, just then, frees or allocates what it used to serve this
    /// thread's last fault (the copy into the program wakes the thread
    /// first) waits for a lock the forking thread holds, and never reads
    /// the event. At rest, a handler waits for events in poll(2), which
    /// allocates nothing. Faults of other threads during the fork can still
    /// busy it: under `zmem run` the handlers allocate from a heap of
    /// their own, which fork does not lock.
    fn wait_handlers_at_rest(&self) {
        let deadline = Instant::now() + AT_REST_WAIT;
        while self.handlers_busy.load(Ordering::SeqCst) != 0 {
            if Instant::now() > deadline {
                log::debug!("forking with a handler busy");
                return;
            }
            std::thread::yield_now();
        }
    }

    /// `fork_parent` with `fork_event`: the child's end is the child's, and
    /// the parent waits until the handler is done with the child (handed
    /// over, the child gone, or its memory copied in). A parent that exits
    /// right after fork (a daemon's first parent does) would otherwise take
    /// the child's userfaultfd with it, and the child's evicted pages would
    /// read as zeros. Reclaim runs again once the handler is done.
    pub(super) fn parent_handover(&self) {
        drop(self.fork.link_child.lock_ok().take());
        let grace = Instant::now() + SEEN_GRACE;
        while self.fork.stage.load(Ordering::Acquire) == Fork::Prepared as u8 {
            if Instant::now() > grace {
                let none = self.fork.stage.compare_exchange(
                    Fork::Prepared as u8,
                    Fork::Idle as u8,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if none.is_ok() {
                    // No FORK event came: the fork failed, or copied no
                    // registered mapping.
                    drop(self.fork.link_parent.lock_ok().take());
                    self.fork.frozen.store(false, Ordering::Release);
                    self.kick_reclaim();
                    return;
                }
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        while self.fork.stage.load(Ordering::Acquire) != Fork::Idle as u8 {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// The handler read a FORK event: the parent step need not wait for it.
    pub(super) fn fork_seen(&self) {
        let _ = self.fork.stage.compare_exchange(
            Fork::Prepared as u8,
            Fork::Seen as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// A program thread about to free entries (a region's drop, a split
    /// mremap) waits while the handler serves a forked child.
    pub(super) fn wait_handover(&self) {
        while self.fork.serving_child.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The handler read a FORK event: serve the child until it takes its
    /// memory over (or exits, or times out). See the module's comment.
    pub(super) fn serve_child(&self, child: zmem_common::host::fds::KeptFd, bounce: &mut [u8]) {
        self.fork.serving_child.store(true, Ordering::Release);
        let link = self.fork.link_parent.lock_ok().take();
        let child = self.uffd.forked(child);
        // What the child did not inherit is as if it had dropped it: a
        // `MADV_DONTFORK` mapping it does not have, and a `MADV_WIPEONFORK`
        // one the kernel gave it empty. The parent's pages there would
        // hand the child what the program wiped (a random generator's
        // state), or a region over memory that is not the child's (the
        // child's pager maps its own there before it takes its memory
        // over: it adopted them, and hung).
        // (No `/proc` after a `chroot`: such a child runs unmanaged, and
        // takes nothing over.)
        let dropped = crate::vmas::not_inherited().unwrap_or_else(|e| {
            if e == rustix::io::Errno::NOENT {
                log::debug!("no /proc/thread-self/smaps: a fork's mappings are taken as all copied");
            } else {
                log::warn!("reading which mappings a fork does not copy failed ({e}): taken as none");
            }
            Vec::new()
        });
        let mut edits = ChildEdits { dropped, ..ChildEdits::default() };
        let deadline = Instant::now() + HANDOVER_TIMEOUT;
        let mut pending: Vec<u64> = Vec::new();
        let outcome = loop {
            let Some(link) = &link else { break Outcome::Push };
            let cfd = child.as_fd();
            let mut fds = [PollFd::new(&cfd, PollFlags::IN), PollFd::new(link, PollFlags::IN)];
            let wait = if pending.is_empty() { 10 } else { 0 };
            let ts = rustix::event::Timespec { tv_sec: 0, tv_nsec: wait * 1_000_000 };
            if rustix::event::poll(&mut fds, Some(&ts)).is_err() {
                continue;
            }
            let (child_ready, link_ready) = (!fds[0].revents().is_empty(), !fds[1].revents().is_empty());
            if child_ready || !pending.is_empty() {
                let events = child.read_events(64).unwrap_or_default();
                for ev in events {
                    match ev {
                        Event::PageFault { addr, .. } => pending.push(addr & !(PAGE_SIZE as u64 - 1)),
                        Event::Remove { start, end } | Event::Unmap { start, end } => edits.dropped.push((start, end)),
                        Event::Remap { from, to, len } => {
                            log::warn!("a forked child moved its memory before taking it over");
                            edits.moved.push((from, to, len));
                        }
                        Event::Fork { .. } => {
                            log::error!("a forked child forked before taking its memory over: the grandchild's evicted pages read as zeros");
                        }
                        Event::Unknown(_) => {}
                    }
                }
                pending.retain(|&a| !self.serve_child_fault(&child, &edits, a, bounce));
            }
            if link_ready {
                let mut req = [0u8; 8];
                break match rustix::net::recv(link, &mut req, RecvFlags::DONTWAIT) {
                    Ok((n, _)) if &req[..n] == REQUEST => Outcome::HandOver,
                    Ok((n, _)) if &req[..n] == COPY_REQUEST => Outcome::Copy,
                    // Closed: the child exec'd or exited.
                    _ => Outcome::Gone,
                };
            }
            if Instant::now() > deadline {
                break Outcome::Push;
            }
        };
        match outcome {
            Outcome::HandOver => {
                let link = link.as_ref().expect("asked over the link");
                let t = Instant::now();
                match self.hand_over(&child, link, &edits) {
                    Ok(pages) => {
                        self.counters.fork_handovers.fetch_add(1, Ordering::Relaxed);
                        log::debug!("handed a forked child its memory: {pages} pages in {:?}", t.elapsed());
                    }
                    Err(e) => {
                        log::warn!("handing a forked child its memory failed ({e}): copying it in whole");
                        self.push_to_child(&child, &edits, bounce);
                    }
                }
            }
            Outcome::Push => {
                log::warn!("a forked child did not take its memory over: copying it in whole");
                self.push_to_child(&child, &edits, bounce);
            }
            Outcome::Copy => self.push_to_child(&child, &edits, bounce),
            Outcome::Gone => {}
        }
        drop(child);
        drop(link);
        self.fork.stage.store(Fork::Idle as u8, Ordering::Release);
        self.fork.serving_child.store(false, Ordering::Release);
        self.fork.frozen.store(false, Ordering::Release);
        self.kick_reclaim();
    }

    /// Fills `page` with the page the child lacks at its address `a`, as
    /// it was at fork: as [`page_of`](Self::page_of).
    fn child_page(&self, edits: &ChildEdits, a: u64, page: &mut [u8]) -> Option<bool> {
        let pa = edits.to_parent(a)?;
        let st = self.region_at(pa)?;
        let base = st.start.load(Ordering::Acquire);
        let p = ((pa - base) / PAGE_SIZE as u64) as usize;
        let f = p / (self.cfg.folio_size / PAGE_SIZE);
        let (lock, _) = self.stripe(&st, f);
        let _g = lock.lock_ok();
        self.page_of(&st, f, p, page)
    }

    /// Expands page `p` (folio `f`) of `st` into `dst` (one page) if the
    /// child may lack it (its folio is Evicted, or it was left in the tier):
    /// `Some(true)`; `Some(false)` if it failed to load; `None` if the child
    /// has it, or it has no entry (it reads as zeros). The caller holds the
    /// folio's stripe lock.
    fn page_of(&self, st: &RegionState, f: usize, p: usize, dst: &mut [u8]) -> Option<bool> {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let i = p - f * ppf;
        let in_tier = match st.folio(f) {
            Folio::Evicted => true,
            Folio::Resident => i < 64 && st.swapped[f].load(Ordering::Relaxed) >> i & 1 != 0,
            _ => false,
        };
        if !in_tier {
            return None;
        }
        match self.tier.load_many(st.key(p), dst).pop() {
            Some(Ok(LoadOutcome::Loaded)) => Some(true),
            Some(Err(e)) => {
                log::error!("a forked child's page failed to load: {e}");
                Some(false)
            }
            _ => {
                let held = self.folios.held.lock_ok();
                let h = held.get(&(st.id, f)).filter(|h| h.present[i])?;
                dst.copy_from_slice(&h.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
                Some(true)
            }
        }
    }

    /// Serves the child's fault at page `a` (its address); false to try
    /// again after reading its events (EAGAIN).
    fn serve_child_fault(&self, child: &Uffd, edits: &ChildEdits, a: u64, bounce: &mut [u8]) -> bool {
        let page = &mut bounce[..PAGE_SIZE];
        match self.child_page(edits, a, page) {
            Some(true) => {}
            Some(false) => {
                // Never zeros in its place: touching it is a SIGBUS.
                let _ = child.poison(a, PAGE_SIZE as u64);
                return true;
            }
            None => page.fill(0),
        }
        // SAFETY: `a` is a page of the child's address space registered
        // with `child`; the kernel copies from our `page` into it.
        let r = unsafe { child.copy(a, page.as_ptr(), PAGE_SIZE as u64, false) };
        match r {
            Err(UffdError::Again { .. }) => false,
            Ok(_) => {
                inc(&self.counters.fork_child_faults);
                true
            }
            Err(_) => {
                let _ = child.wake(a, PAGE_SIZE as u64);
                true
            }
        }
    }

    /// Calls `each(st, folio, pages)` for every folio with pages the child
    /// may lack (`pages`: each one's page number in the region and the
    /// child's address, in order), region by region, each under its stripe
    /// lock.
    fn for_each_child_folio(
        &self,
        edits: &ChildEdits,
        mut each: impl FnMut(&Arc<RegionState>, usize, &[(usize, u64)]) -> Result<(), PagerError>,
    ) -> Result<(), PagerError> {
        let regions: Vec<_> = self.folios.regions.read_ok().values().cloned().collect();
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let mut pages = Vec::with_capacity(ppf);
        for st in regions {
            let base = st.start.load(Ordering::Acquire);
            for f in 0..st.state.len() {
                let (lock, _) = self.stripe(&st, f);
                let _g = lock.lock_ok();
                let evicted = st.folio(f) == Folio::Evicted;
                let swapped = st.swapped[f].load(Ordering::Relaxed);
                if !evicted && swapped == 0 {
                    continue;
                }
                pages.clear();
                for p in self.folio_pages(&st, f) {
                    let i = p - f * ppf;
                    if !evicted && (i >= 64 || swapped >> i & 1 == 0) {
                        continue;
                    }
                    if let Some(ca) = edits.to_child(base + (p * PAGE_SIZE) as u64) {
                        pages.push((p, ca));
                    }
                }
                if !pages.is_empty() {
                    each(&st, f, &pages)?;
                }
            }
        }
        Ok(())
    }

    /// Writes the snapshot and sends it with the child's userfaultfd.
    /// Returns the pages in it.
    fn hand_over(&self, child: &Uffd, link: &OwnedFd, edits: &ChildEdits) -> Result<usize, PagerError> {
        // Kept (`zmem_common::host::fds`): the program may be closing every
        // descriptor meanwhile.
        let memfd =
            zmem_common::host::fds::open_kept(zmem_common::host::fds::Wait::Yes, rustix::io::Errno::AGAIN, || {
                rustix::fs::memfd_create("zmem-fork", rustix::fs::MemfdFlags::CLOEXEC)
            })
            .map_err(|e| io_err("memfd_create", e))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, memfd);
        let w = |out: &mut std::io::BufWriter<zmem_common::host::fds::KeptFd>, b: &[u8]| {
            out.write_all(b).map_err(|e| io_err("writing the snapshot", e))
        };
        w(&mut out, &MAGIC.to_ne_bytes())?;
        w(&mut out, &VERSION.to_ne_bytes())?;
        let codec = self.tier.compressor();
        w(&mut out, &(codec.len() as u32).to_ne_bytes())?;
        w(&mut out, codec.as_bytes())?;
        // The regions, in the child's addresses: what it adopts.
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for st in self.folios.regions.read_ok().values() {
            let base = st.start.load(Ordering::Acquire);
            for (a, b) in st.mapped_parts() {
                for (a, b) in edits.kept_of(base + a as u64, base + b as u64) {
                    if let (Some(ca), Some(_)) = (edits.to_child(a), edits.to_child(b - 1)) {
                        spans.push((ca, ca + (b - a)));
                    }
                }
            }
        }
        w(&mut out, &(spans.len() as u64).to_ne_bytes())?;
        for (a, b) in &spans {
            w(&mut out, &a.to_ne_bytes())?;
            w(&mut out, &b.to_ne_bytes())?;
        }
        // Pages to export, in batches: their written-back objects are read
        // together (one preadv per run of neighbouring slots). (key, child
        // address, the held page of a rejected folio if it has one.)
        let mut batch: Vec<(u64, u64, Option<Vec<u8>>)> = Vec::with_capacity(EXPORT_BATCH);
        let mut pages = 0;
        let mut flush = |batch: &mut Vec<(u64, u64, Option<Vec<u8>>)>,
                         out: &mut std::io::BufWriter<zmem_common::host::fds::KeptFd>| {
            let keys: Vec<u64> = batch.iter().map(|b| b.0).collect();
            let exported = self.tier.export_many(&keys);
            for ((_, ca, held), e) in batch.drain(..).zip(exported) {
                let (kind, bytes) = match (e, held) {
                    (Ok(Some(Exported::SameFilled(v))), _) => (0u8, v.to_ne_bytes().to_vec()),
                    (Ok(Some(Exported::Object(b))), _) => (1u8, b),
                    // A rejected folio's page, held uncompressed.
                    (Ok(None), Some(h)) => (1u8, h),
                    (Ok(None), None) => continue,
                    (Err(e), _) => {
                        // As a load that fails: the child's page is poisoned.
                        log::error!("a forked child's page at {ca:#x} failed to export: {e}");
                        (2u8, Vec::new())
                    }
                };
                w(out, &ca.to_ne_bytes())?;
                w(out, &[kind])?;
                w(out, &(bytes.len() as u16).to_ne_bytes())?;
                pages += 1;
                w(out, &bytes)?;
            }
            Ok::<(), PagerError>(())
        };
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        self.for_each_child_folio(edits, |st, f, want| {
            let held = self.folios.held.lock_ok();
            let h = held.get(&(st.id, f));
            for &(p, ca) in want {
                let i = p - f * ppf;
                let raw = h.filter(|h| h.present[i]).map(|h| h.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].to_vec());
                batch.push((st.key(p), ca, raw));
            }
            drop(held);
            if batch.len() >= EXPORT_BATCH {
                flush(&mut batch, &mut out)?;
            }
            Ok(())
        })?;
        flush(&mut batch, &mut out)?;
        let memfd = out.into_inner().map_err(|e| io_err("writing the snapshot", e.error()))?;
        let len = rustix::fs::fstat(&memfd).map_err(|e| io_err("fstat", e))?.st_size as u64;
        let mut head = [0u8; 24];
        head[0..8].copy_from_slice(&child.features().0.to_ne_bytes());
        head[8..16].copy_from_slice(&child.api_ioctls().to_ne_bytes());
        head[16..24].copy_from_slice(&len.to_ne_bytes());
        let rights = [child.as_fd(), memfd.as_fd()];
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        anc.push(SendAncillaryMessage::ScmRights(&rights));
        rustix::net::sendmsg(link, &[IoSlice::new(&head)], &mut anc, SendFlags::empty())
            .map_err(|e| io_err("sending the snapshot", e))?;
        Ok(pages)
    }

    /// The child never asked: every page it lacks is copied into it, then
    /// its userfaultfd is let go (by the caller), and its memory is whole.
    fn push_to_child(&self, child: &Uffd, edits: &ChildEdits, bounce: &mut [u8]) {
        let mut pushed = 0u64;
        let _ = self.for_each_child_folio(edits, |st, f, want| {
            for &(p, ca) in want {
                let page = &mut bounce[..PAGE_SIZE];
                match self.page_of(st, f, p, page) {
                    Some(true) => {}
                    // It failed to load: poisoned (the marker stays once the
                    // child's userfaultfd is closed), never zeros.
                    Some(false) => {
                        let _ = child.poison(ca, PAGE_SIZE as u64);
                        continue;
                    }
                    // No entry: it reads as zeros, as it did at fork.
                    None => continue,
                }
                for _ in 0..100 {
                    // SAFETY: as in `serve_child_fault`.
                    match unsafe { child.copy(ca, page.as_ptr(), PAGE_SIZE as u64, false) } {
                        Err(UffdError::Again { .. }) => {
                            // An event of the child's is unread: read and drop
                            // it (the child is not ours to manage after this).
                            let _ = child.read_events(64);
                        }
                        _ => break,
                    }
                }
                pushed += 1;
            }
            Ok(())
        });
        log::debug!("copied {pushed} pages into a forked child");
    }
}

enum Outcome {
    HandOver,
    /// The child did not ask in time.
    Push,
    /// The child asked for a copy ([`Pager::ask_for_whole_copy`]).
    Copy,
    Gone,
}

#[cfg(test)]
mod tests {
    use super::ChildEdits;

    #[test]
    fn what_the_child_dropped_splits_a_range_and_the_rest_is_kept() {
        let edits =
            ChildEdits { dropped: vec![(0x3000, 0x5000), (0x8000, 0x9000), (0x20000, 0x30000)], moved: Vec::new() };
        assert_eq!(edits.kept_of(0x1000, 0xa000), vec![(0x1000, 0x3000), (0x5000, 0x8000), (0x9000, 0xa000)]);
        assert_eq!(edits.kept_of(0x3000, 0x5000), Vec::<(u64, u64)>::new());
        assert_eq!(edits.kept_of(0x10000, 0x11000), vec![(0x10000, 0x11000)]);
        assert_eq!(edits.kept_of(0x4000, 0x6000), vec![(0x5000, 0x6000)]);
    }
}
