//! One limit for a process tree, as memory.high bounds a cgroup: the
//! shared accounting segment that `zmem run` creates and every process of
//! the tree joins (its path is in `ZMEM_TREE`, inherited across fork and
//! exec).
//!
//! The segment is a small file in `/dev/shm`, mapped shared: a header (the
//! tree's limit, its peak usage) and one slot per process (pid, start time,
//! usage, peak, share). Everything in it is an atomic; there is no lock,
//! so a process that dies at any point leaves nothing held.
//!
//! Each process publishes its own usage (every fault that throttles, every
//! reclaim wake-up) and reads the others'. Its share of the limit is
//!
//! ```text
//! share = max(limit - others, limit * own / total, floor)
//! ```
//!
//! Under the limit, a process may grow into what the others leave; over
//! it, the excess is taken from each process in proportion to its usage,
//! so that together they reclaim the excess once (each taking all of it
//! would over-reclaim by the number of processes). The floor keeps a
//! process that has just started from being throttled to nothing.
//!
//! A slot whose process is gone (exited, killed, or a zombie) is freed by
//! whichever process sweeps next ([`Tree::sweep`], from every reclaim
//! thread about once a second); the start time, from `/proc/PID/stat`,
//! tells a reused pid apart. After an exec the new image takes over its
//! own pid's slot.
//!
//! A slot holds the pid as `/proc` shows it (`tree_pid`), not the
//! process's own: a process in a pid namespace of its own (bubblewrap's
//! `--unshare-pid`) is pid 2 or so there, and that pid, looked up by
//! `zmem run` and the other processes, named another process (pid 2 is
//! the kernel's `kthreadd`). Its slot never looked gone: a sandbox's
//! process killed with its usage in the slot throttled the rest of the
//! tree for good, and `zmem run` left the segment behind. Two sandboxes
//! shared one slot.

use std::os::fd::AsFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::pager::REFAULT_BUCKETS;

/// "zmemtree" in ASCII, and the layout's version.
const MAGIC: u64 = 0x7a6d_656d_7472_6565;
const VERSION: u64 = 4;
/// Slots in a segment: processes that may hold a share at once.
pub const SLOTS: usize = 255;
/// How far over a controlled tree's limit (`zmem run --max-slowdown`) a
/// process's usage goes before its faults wait for reclaim: a 32nd of the
/// limit. A controller's probe cuts the limit under the usage to see what
/// the program misses, and closing that gap is reclaim's work in the
/// background, as the kernel's `memory.reclaim` does it for Senpai, not a
/// wait on the program's faults: each such wait was a tick's stall of
/// 20-40% on a loaded machine, which the controller took for a failed
/// probe. The probe's cut (2.5% of the usage) stays under it.
pub const CONTROLLED_OVERAGE_DIV: usize = 32;
const SLOT_SIZE: usize = std::mem::size_of::<Slot>();
const SIZE: usize = 64 + SLOT_SIZE * SLOTS;

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    version: AtomicU64,
    limit: AtomicU64,
    /// Peak of the tree's summed usage, as the processes saw it.
    peak: AtomicU64,
    /// One past the highest slot ever claimed: readers stop there.
    high_slot: AtomicU32,
    /// The warnings given so far, one bit each ([`Warning`]): each is given
    /// by the tree's first process that has it to give.
    warned: AtomicU32,
    /// The stall target of the controller that moves `limit` (`zmem run
    /// --max-slowdown`), parts per million of the program's CPU time; 0:
    /// the limit is fixed.
    slowdown_ppm: AtomicU64,
    /// The most that controller may move `limit` to.
    ceiling: AtomicU64,
}

#[repr(C, align(64))]
struct Slot {
    /// 0: free.
    pid: AtomicU32,
    /// The process's start time (clock ticks after boot, `/proc/PID/stat`).
    start: AtomicU64,
    usage: AtomicU64,
    peak: AtomicU64,
    share: AtomicU64,
    /// Folios this process has evicted, for `zmem stats`.
    evicted: AtomicU64,
    /// What a process that has not started its pager yet holds with what
    /// it has mapped and not filled: memory it may hold before its next
    /// look (`Member::publish_mapped`). A pager that took the slot over
    /// from its process's wait keeps it until its first scan has adopted
    /// that memory ([`Tree::join`]), then 0.
    mapped: AtomicU64,
    /// Nanoseconds this process's threads have waited on its pager because
    /// of the limit (`PagerStats::stall_ns`), for the controller.
    stall_ns: AtomicU64,
    /// Bytes of `usage` that are the compressed pool.
    pool: AtomicU64,
    /// The part of `stall_ns` spent on loads…
    load_stall_ns: AtomicU64,
    /// …and those loads by refault distance (`PagerStats::refault_distance`):
    /// what a larger limit would save of it.
    refaults: [AtomicU64; REFAULT_BUCKETS],
}

const _: () = assert!(std::mem::size_of::<Header>() == 64 && std::mem::size_of::<Slot>() == 192);

/// A warning given once per tree ([`Tree::first_warning`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Warning {
    /// The limit turned soft: a process's share is at its floor.
    SoftLimit = 0,
    /// A process runs unmanaged: it runs under Valgrind.
    OnValgrind = 1,
    /// A process runs unmanaged: it put itself under a seccomp filter.
    Sandboxed = 2,
    /// A process runs unmanaged: its parent forked it after changing its
    /// root.
    RootChanged = 3,
    /// A process runs unmanaged: a sanitizer's runtime (AddressSanitizer
    /// and its kin) is loaded in it.
    Sanitized = 4,
    /// A process's userfaultfd serves faults from user mode only.
    UserModeOnly = 5,
}

/// A mapped segment.
#[derive(Debug)]
pub struct Tree {
    base: NonNull<u8>,
}

// SAFETY: the segment is only ever accessed through atomics (`header`,
// `slot`), which any thread may use.
unsafe impl Send for Tree {}
// SAFETY: as for Send.
unsafe impl Sync for Tree {}

/// One process of the tree, as [`Tree::members`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberStats {
    pub pid: u32,
    /// Its usage, or what it has mapped where that is more: as
    /// [`Tree::committed`] counts it.
    pub usage: u64,
    pub peak: u64,
    pub share: u64,
    pub evicted: u64,
    /// See [`Member::add_stall`].
    pub stall_ns: u64,
    /// The pool's part of `usage`.
    pub pool: u64,
    /// The part of `stall_ns` spent on loads, and the loads by refault
    /// distance (see [`Member::add_load_stall`]).
    pub load_stall_ns: u64,
    pub refaults: [u64; REFAULT_BUCKETS],
}

/// Why a segment cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TreeError {
    #[error("{path}: {err}")]
    Io { path: String, err: rustix::io::Errno },
    #[error("{0}: not a zmem tree segment (wrong size, magic or version)")]
    Format(String),
    #[error("all {SLOTS} slots of the tree's segment are taken")]
    Full,
}

impl Drop for Tree {
    fn drop(&mut self) {
        zmem_common::host::owned::remove(self.base.as_ptr() as u64);
        // SAFETY: the mapping is this Tree's own, and nothing borrows from
        // it past the Tree's life.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), SIZE) };
    }
}

/// A descriptor of the segment at `path` among those this process holds
/// (one `zmem run` opened and every process since inherited), kept from
/// the program's `close` for good (a forked child keeps it too). A process that dropped privileges on
/// the way (`runuser -u postgres -- postgres …` under a root `zmem run`)
/// cannot open the segment (`0600`, root's) by its name: without this it
/// took the tree's whole limit to itself, and the tree's footprint went
/// past the limit. The file must be the one `path` names now (same device
/// and inode): a descriptor number the program reused for something else
/// is never taken for it.
///
/// Where `path` names nothing (a sandbox's own `/dev/shm`: bubblewrap's
/// `--dev`), the descriptor is the one whose link in `/proc/self/fd` is
/// `path` (the name it was opened by), and the caller checks what it maps.
fn inherited(path: &Path) -> Option<std::os::fd::RawFd> {
    let want = match rustix::fs::stat(path) {
        Ok(st) => Some(st),
        Err(rustix::io::Errno::NOENT) => None,
        Err(_) => return None,
    };
    let names =
        zmem_common::host::fds::dir_names(zmem_common::host::fds::Wait::Yes, Path::new("/proc/thread-self/fd")).ok()?;
    let fds: Vec<std::os::fd::RawFd> = names.iter().filter_map(|n| n.to_str().and_then(|n| n.parse().ok())).collect();
    let fd = fds.into_iter().find(|&fd| {
        // SAFETY: fstat on a number that may be closed meanwhile reads
        // nothing of ours: it fails with EBADF or describes whatever the
        // number names now, which the inode (or name) check then rejects.
        let b = unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) };
        rustix::fs::fstat(b).is_ok_and(|st| {
            st.st_size == SIZE as i64
                && match want {
                    Some(w) => st.st_dev == w.st_dev && st.st_ino == w.st_ino,
                    None => std::fs::read_link(format!("/proc/thread-self/fd/{fd}")).is_ok_and(|l| l == path),
                }
        })
    })?;
    zmem_common::host::fds::keep_for_good(fd);
    Some(fd)
}

impl Tree {
    /// Creates a segment at `path` (which must not exist) for a tree under
    /// `limit` bytes.
    ///
    /// # Errors
    /// The file's creation or mapping.
    pub fn create(path: &Path, limit: usize) -> Result<Tree, TreeError> {
        use rustix::fs::{Mode, OFlags};
        let io = |err| TreeError::Io { path: path.display().to_string(), err };
        let fd = rustix::fs::open(
            path,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(io)?;
        rustix::fs::ftruncate(&fd, SIZE as u64).map_err(io)?;
        let t = Tree::map(fd.as_fd()).map_err(io)?;
        let h = t.header();
        h.limit.store(limit as u64, Ordering::Relaxed);
        h.version.store(VERSION, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(t)
    }

    /// Opens the segment at `path` by its name, or where this process
    /// may not (it dropped privileges since `zmem run` made it), through a
    /// descriptor of it that it inherited (see `inherited`).
    ///
    /// # Errors
    /// The file cannot be opened or mapped, or is not a segment.
    pub fn open(path: &Path) -> Result<Tree, TreeError> {
        use rustix::fs::{Mode, OFlags};
        use rustix::io::Errno;
        let io = |err| TreeError::Io { path: path.display().to_string(), err };
        let t = match rustix::fs::open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => {
                if rustix::fs::fstat(&fd).map_err(io)?.st_size != SIZE as i64 {
                    return Err(TreeError::Format(path.display().to_string()));
                }
                Tree::map(fd.as_fd()).map_err(io)?
            }
            Err(e @ (Errno::ACCESS | Errno::PERM | Errno::NOENT)) => {
                let fd = inherited(path).ok_or_else(|| io(e))?;
                // SAFETY: `inherited` found fd open, and keeps it open for
                // the rest of the process's life.
                let fd = unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) };
                Tree::map(fd).map_err(io)?
            }
            Err(e) => return Err(io(e)),
        };
        let h = t.header();
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version.load(Ordering::Relaxed) != VERSION {
            return Err(TreeError::Format(path.display().to_string()));
        }
        Ok(t)
    }

    /// A descriptor of the segment at `path` that this process may pass
    /// on: `zmem run` keeps one open, without close-on-exec, for the
    /// program to inherit (`inheritable`).
    ///
    /// # Errors
    /// Opening it.
    pub fn inheritable(path: &Path) -> Result<rustix::fd::OwnedFd, TreeError> {
        use rustix::fs::{Mode, OFlags};
        rustix::fs::open(path, OFlags::RDWR, Mode::empty())
            .map_err(|err| TreeError::Io { path: path.display().to_string(), err })
    }

    fn map(fd: rustix::fd::BorrowedFd<'_>) -> rustix::io::Result<Tree> {
        // zmem's own mapping (shared, so never adopted; recorded all the
        // same, as every mapping of zmem's is).
        let _recording = zmem_common::host::owned::spawn_lock();
        // SAFETY: a fresh shared mapping of the whole file at an address the
        // kernel picks aliases nothing of ours; it lives as long as the Tree.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                SIZE,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        zmem_common::host::owned::add(p as u64, SIZE, zmem_common::host::owned::Kind::Zmem);
        Ok(Tree { base: NonNull::new(p.cast()).ok_or(rustix::io::Errno::NOMEM)? })
    }

    fn header(&self) -> &Header {
        // SAFETY: base is page-aligned and the mapping is SIZE bytes; the
        // header is its first 64, made only of atomics, valid for any bit
        // pattern and shared safely with other processes.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }

    fn slot(&self, i: usize) -> &Slot {
        assert!(i < SLOTS);
        // SAFETY: slot i lies at 64 + SLOT_SIZE * i, and ends at or before
        // SIZE: inside the mapping.
        let p = unsafe { self.base.as_ptr().add(64 + SLOT_SIZE * i) };
        // SAFETY: p is 64-aligned and valid for SLOT_SIZE bytes for the
        // Tree's life; a slot is made only of atomics (as for `header`).
        unsafe { &*p.cast::<Slot>() }
    }

    fn slots(&self) -> impl Iterator<Item = &Slot> {
        let n = (self.header().high_slot.load(Ordering::Acquire) as usize).min(SLOTS);
        (0..n).map(|i| self.slot(i))
    }

    pub fn limit(&self) -> usize {
        self.header().limit.load(Ordering::Relaxed) as usize
    }

    /// Moves the tree's limit (the controller of `zmem run
    /// --max-slowdown`): each process takes its new share at its next
    /// fault or reclaim wake-up (every 10 ms at most).
    pub fn set_limit(&self, bytes: usize) {
        self.header().limit.store(bytes as u64, Ordering::Relaxed);
    }

    /// Records that a controller moves the limit, toward a stall of
    /// `slowdown_ppm` (parts per million of CPU time), never above
    /// `ceiling`: for `zmem stats`.
    pub fn set_controller(&self, slowdown_ppm: u64, ceiling: usize) {
        let h = self.header();
        h.ceiling.store(ceiling as u64, Ordering::Relaxed);
        h.slowdown_ppm.store(slowdown_ppm, Ordering::Relaxed);
    }

    /// The controller's stall target (ppm) and ceiling, if one moves the
    /// limit.
    pub fn controller(&self) -> Option<(u64, usize)> {
        let h = self.header();
        let ppm = h.slowdown_ppm.load(Ordering::Relaxed);
        (ppm != 0).then(|| (ppm, h.ceiling.load(Ordering::Relaxed) as usize))
    }

    /// Whether the caller is the tree's first process to give warning `w`
    /// (and the last: this says yes once per tree and warning). Forty
    /// children of a forking server, each squeezed to a small share, each
    /// printed the same warning; 35 bash processes of pyenv's shims each
    /// said that they ran unmanaged.
    pub fn first_warning(&self, w: Warning) -> bool {
        let bit = 1 << w as u32;
        self.header().warned.fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    /// The peak of the tree's summed usage so far.
    pub fn peak(&self) -> u64 {
        self.header().peak.load(Ordering::Relaxed)
    }

    /// The tree's usage now: the sum over its processes.
    pub fn usage(&self) -> u64 {
        self.slots().filter(|s| s.pid.load(Ordering::Acquire) != 0).map(|s| s.usage.load(Ordering::Relaxed)).sum()
    }

    /// The tree's usage with each process that waits to start its pager
    /// counted at what it has mapped, where that is more: how full the
    /// tree may be before those processes look again.
    pub fn committed(&self) -> u64 {
        self.slots()
            .filter(|s| s.pid.load(Ordering::Acquire) != 0)
            .map(|s| s.usage.load(Ordering::Relaxed).max(s.mapped.load(Ordering::Relaxed)))
            .sum()
    }

    /// The processes that hold a slot.
    pub fn members(&self) -> Vec<MemberStats> {
        self.slots()
            .filter_map(|s| {
                let pid = s.pid.load(Ordering::Acquire);
                (pid != 0).then(|| MemberStats {
                    pid,
                    usage: s.usage.load(Ordering::Relaxed).max(s.mapped.load(Ordering::Relaxed)),
                    peak: s.peak.load(Ordering::Relaxed),
                    share: s.share.load(Ordering::Relaxed),
                    evicted: s.evicted.load(Ordering::Relaxed),
                    stall_ns: s.stall_ns.load(Ordering::Relaxed),
                    pool: s.pool.load(Ordering::Relaxed),
                    load_stall_ns: s.load_stall_ns.load(Ordering::Relaxed),
                    refaults: std::array::from_fn(|i| s.refaults[i].load(Ordering::Relaxed)),
                })
            })
            .collect()
    }

    /// Takes a slot for this process: its own pid's (an exec'd image takes
    /// over its predecessor's), or a free one.
    ///
    /// # Errors
    /// [`TreeError::Full`].
    pub fn join(self) -> Result<Member, TreeError> {
        let pid = tree_pid();
        let start = start_time(pid).unwrap_or(0);
        let mine = (0..SLOTS).find(|&i| self.slot(i).pid.load(Ordering::Acquire) == pid);
        let claim = || {
            (0..SLOTS).find(|&i| self.slot(i).pid.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed).is_ok())
        };
        let i = match mine {
            Some(i) => i,
            // Full: the slots of processes gone since the last sweep are
            // freed first. A tree of short processes that never start a
            // pager (`ZMEM_START_PERCENT`) has no reclaim thread to sweep,
            // and one that ends with `_exit` or a signal keeps its slot.
            None => claim()
                .or_else(|| {
                    self.sweep();
                    claim()
                })
                .ok_or(TreeError::Full)?,
        };
        let s = self.slot(i);
        // A slot this process already holds keeps what it has mapped: a
        // waiting process hands its slot to the pager it starts
        // (`Member::hand_over`), whose usage counts nothing until its first
        // scan has adopted the memory, and the tree's count must not fall
        // meanwhile (the limit's controller took a usage of 0 for a cue to
        // cut the limit to its floor). The pager sets it to 0 after that
        // scan; an exec'd image that waits publishes its own at its first
        // look. A slot of a process gone whose pid this one reuses (another
        // start time; not swept yet) starts from nothing.
        let same = mine.is_some() && s.start.load(Ordering::Relaxed) == start;
        s.start.store(start, Ordering::Relaxed);
        if !same {
            s.mapped.store(0, Ordering::Relaxed);
        }
        s.usage.store(0, Ordering::Relaxed);
        s.peak.store(0, Ordering::Relaxed);
        s.evicted.store(0, Ordering::Relaxed);
        s.stall_ns.store(0, Ordering::Relaxed);
        s.pool.store(0, Ordering::Relaxed);
        s.load_stall_ns.store(0, Ordering::Relaxed);
        for r in &s.refaults {
            r.store(0, Ordering::Relaxed);
        }
        self.header().high_slot.fetch_max(i as u32 + 1, Ordering::AcqRel);
        Ok(Member {
            tree: self,
            slot: i,
            pid,
            own_pid: std::process::id(),
            left: AtomicBool::new(false),
            handed: false,
        })
    }

    /// Frees the slots of processes that are gone.
    pub fn sweep(&self) {
        for s in self.slots() {
            let pid = s.pid.load(Ordering::Acquire);
            if pid != 0 && !alive(pid, s.start.load(Ordering::Relaxed)) {
                // Usage first: a reader that still sees the pid counts 0.
                s.usage.store(0, Ordering::Relaxed);
                s.mapped.store(0, Ordering::Relaxed);
                let _ = s.pid.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }
}

/// This process's slot in a tree.
#[derive(Debug)]
pub struct Member {
    tree: Tree,
    slot: usize,
    /// The pid in the slot ([`tree_pid`]).
    pid: u32,
    /// The process's own pid when it joined: a forked child's copy of its
    /// parent's `Member` is not its own.
    own_pid: u32,
    /// The process is exiting ([`Member::leave`]): it publishes no usage.
    left: AtomicBool,
    /// The slot is another `Member`'s of this process now
    /// ([`Member::hand_over`]): this one never frees it.
    handed: bool,
}

impl Member {
    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    /// Publishes this process's usage and returns its share of the limit,
    /// never below `floor`.
    pub fn publish(&self, usage: usize, floor: usize) -> usize {
        let s = self.tree.slot(self.slot);
        if self.left.load(Ordering::Relaxed) {
            return s.share.load(Ordering::Relaxed) as usize;
        }
        s.usage.store(usage as u64, Ordering::Relaxed);
        s.peak.fetch_max(usage as u64, Ordering::Relaxed);
        let total = self.tree.usage().max(usage as u64);
        self.tree.header().peak.fetch_max(total, Ordering::Relaxed);
        let limit = self.tree.limit() as u64;
        let others = total - usage as u64;
        let proportional = if total == 0 { limit } else { (limit as u128 * usage as u128 / total as u128) as u64 };
        let share = limit.saturating_sub(others).max(proportional).max(floor as u64).min(limit);
        s.share.store(share, Ordering::Relaxed);
        share as usize
    }

    /// Publishes what this process has mapped to write, for
    /// [`Tree::committed`] (a process that has not started its pager), or
    /// 0 once its pager has adopted what it held (see [`Tree::join`]).
    pub fn publish_mapped(&self, bytes: usize) {
        if !self.left.load(Ordering::Relaxed) {
            self.tree.slot(self.slot).mapped.store(bytes as u64, Ordering::Relaxed);
        }
    }

    /// The process is exiting: its usage leaves the tree's count now, not
    /// at the next sweep (about a second later, once it is gone), during
    /// which the others' shares were cut for memory about to be freed.
    /// Atomics only: it runs from an exit handler.
    pub fn leave(&self) {
        self.left.store(true, Ordering::Relaxed);
        let s = self.tree.slot(self.slot);
        s.usage.store(0, Ordering::Relaxed);
        s.mapped.store(0, Ordering::Relaxed);
    }

    /// Records folios evicted (for `zmem stats`).
    pub fn add_evicted(&self, n: u64) {
        self.tree.slot(self.slot).evicted.fetch_add(n, Ordering::Relaxed);
    }

    /// Records `ns` more of the program's threads' time spent waiting on
    /// the pager because of the limit: the stall the controller of `zmem
    /// run --max-slowdown` holds near its target.
    pub fn add_stall(&self, ns: u64) {
        self.tree.slot(self.slot).stall_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records that `ns` of the stall ([`Member::add_stall`]) was a load:
    /// the controller weighs it by what a larger limit would save.
    pub fn add_load_stall(&self, ns: u64) {
        self.tree.slot(self.slot).load_stall_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records a load of refault-distance bucket `bucket`.
    pub fn add_refault(&self, bucket: usize) {
        if let Some(r) = self.tree.slot(self.slot).refaults.get(bucket) {
            r.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Publishes the part of this process's usage that is its pool.
    pub fn publish_pool(&self, bytes: usize) {
        if !self.left.load(Ordering::Relaxed) {
            self.tree.slot(self.slot).pool.store(bytes as u64, Ordering::Relaxed);
        }
    }
}

impl Member {
    /// Lets go of the slot without freeing it: this process joined the tree
    /// again meanwhile (its pager, [`Tree::join`]), and that `Member` owns
    /// the slot now.
    pub fn hand_over(mut self) {
        self.handed = true;
    }

    /// Gives the slot back now, if it is still this process's (a forked
    /// child that drops its copy must not free its parent's). Atomics
    /// only: an exit handler may call it.
    pub fn give_back(&self) {
        if std::process::id() == self.own_pid && !self.handed {
            self.left.store(true, Ordering::Relaxed);
            let s = self.tree.slot(self.slot);
            s.usage.store(0, Ordering::Relaxed);
            s.mapped.store(0, Ordering::Relaxed);
            let _ = s.pid.compare_exchange(self.pid, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

impl Drop for Member {
    /// Gives the slot back ([`Member::give_back`]).
    fn drop(&mut self) {
        self.give_back();
    }
}

/// Field 22 of `/proc/PID/stat` (the start time), and whether the process
/// is a zombie or dead.
fn stat(pid: u32) -> Option<(u64, bool)> {
    let path = format!("/proc/{pid}/stat");
    let text = zmem_common::host::fds::read_to_string(zmem_common::host::fds::Wait::Yes, path.as_ref()).ok()?;
    let state = zmem_common::procfs::stat_field(&text, 3)?;
    let start = zmem_common::procfs::stat_field(&text, 22)?.parse().ok()?;
    Some((start, matches!(state, "Z" | "X" | "x")))
}

/// This process's pid as `/proc` shows it (`NSpid`'s first): the pid the
/// other processes of the tree look up, `zmem run` included, wherever it
/// runs in a pid namespace of its own under the same `/proc`. Its own pid
/// where `/proc` does not show it (a sandbox with a `/proc` of its own).
fn tree_pid() -> u32 {
    let own = std::process::id();
    let path = std::path::Path::new("/proc/self/status");
    zmem_common::host::fds::read_to_string(zmem_common::host::fds::Wait::Yes, path)
        .ok()
        .and_then(|t| zmem_common::procfs::outer_pid(&t))
        .unwrap_or(own)
}

fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(s, _)| s)
}

/// Whether the process that took a slot as `pid`, started at `start`, is
/// still there. Where its `/proc` entry cannot be read although the pid is
/// in use (a process that changed its root to a directory without `/proc`
/// sweeps too), it is taken as alive: a slot freed under a live process
/// would let its usage out of the tree's sum, and its pid out of the slot
/// it goes on writing.
fn alive(pid: u32, start: u64) -> bool {
    match stat(pid) {
        Some((s, dead)) => !dead && (start == 0 || s == start),
        None => exists(pid),
    }
}

/// Whether a process `pid` exists: signal 0 sends nothing and checks only
/// that (EPERM: it exists, and is another user's).
fn exists(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: kill with signal 0 delivers nothing and touches no memory.
    let sent = unsafe { libc::kill(pid, 0) } == 0;
    sent || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("zmem-tree-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    /// The descriptor `zmem run` passes on is how a process joins the
    /// tree (it may no longer have the right to open the segment by name),
    /// and it is kept from the program's `close` for good; a descriptor of
    /// another segment is never taken for it.
    #[test]
    fn a_process_joins_through_an_inherited_descriptor_of_its_own_segment_only() {
        use std::os::fd::AsRawFd;
        let (p, q) = (path("inherit"), path("inherit-other"));
        let _t = Tree::create(&p, 64 << 20).unwrap();
        let _u = Tree::create(&q, 32 << 20).unwrap();
        let fd = Tree::inheritable(&p).unwrap();
        let raw = fd.as_raw_fd();
        assert!(!zmem_common::host::fds::is_kept(raw));
        // q's segment: p's descriptor is not it, and q is opened by name.
        assert_eq!(inherited(&q), None);
        assert_eq!(Tree::open(&q).unwrap().limit(), 32 << 20);
        assert_eq!(inherited(&p), Some(raw));
        assert!(zmem_common::host::fds::is_kept(raw), "an inherited segment must be kept from the program's close");
        assert_eq!(Tree::open(&p).unwrap().limit(), 64 << 20);
        // Without CLOEXEC: the program's children inherit it in turn.
        let flags = rustix::io::fcntl_getfd(&fd).unwrap();
        assert!(!flags.contains(rustix::io::FdFlags::CLOEXEC));
        for f in [&p, &q] {
            std::fs::remove_file(f).unwrap();
        }
    }

    #[test]
    fn shares_give_headroom_under_the_limit_and_split_the_excess_over_it() {
        let p = path("shares");
        let limit = 100 << 20;
        let a = Tree::create(&p, limit).unwrap().join().unwrap();
        // A second member in the same segment (another slot, as a child's).
        let t2 = Tree::open(&p).unwrap();
        let s = t2.slot(1);
        s.pid.store(1, Ordering::Release); // pid 1 is alive
        t2.header().high_slot.fetch_max(2, Ordering::AcqRel);
        s.usage.store(30 << 20, Ordering::Relaxed);
        // Under: a may have what b leaves.
        assert_eq!(a.publish(20 << 20, 1 << 20), 70 << 20);
        // Over by 60 MiB (a 120, b 40 of 160): a's share is 3/4 of 100.
        s.usage.store(40 << 20, Ordering::Relaxed);
        assert_eq!(a.publish(120 << 20, 1 << 20), 75 << 20);
        assert_eq!(a.tree().peak(), 160 << 20);
        // Nothing yet: the floor.
        s.usage.store(100 << 20, Ordering::Relaxed);
        assert_eq!(a.publish(0, 4 << 20), 4 << 20);
        let m = a.tree().members();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].pid, std::process::id());
        drop(a);
        assert_eq!(t2.members().len(), 1, "a member's drop frees its slot");
        let _ = std::fs::remove_file(&p);
    }

    /// An exiting process's usage leaves the count at once, and what its
    /// last threads publish after does not bring it back.
    #[test]
    fn a_member_that_leaves_counts_nothing_and_publishes_nothing_after() {
        let p = path("leave");
        let a = Tree::create(&p, 100 << 20).unwrap().join().unwrap();
        let t = Tree::open(&p).unwrap();
        assert_eq!(a.publish(60 << 20, 1 << 20), 100 << 20);
        assert_eq!(t.usage(), 60 << 20);
        a.leave();
        assert_eq!(t.usage(), 0);
        assert_eq!(a.publish(70 << 20, 1 << 20), 100 << 20, "the share it had");
        assert_eq!(t.usage(), 0);
        assert_eq!(t.members().len(), 1, "the slot stays until the drop or a sweep");
        drop(a);
        let _ = std::fs::remove_file(&p);
    }

    /// A waiting process hands its slot to the pager it starts: the tree's
    /// count keeps what the process published until the pager's first scan
    /// (`publish_mapped(0)`), never 0 in between, and the slot stays taken.
    #[test]
    fn a_slot_handed_to_a_pager_keeps_its_count_until_the_pager_has_adopted() {
        let p = path("hand-over");
        let t = Tree::create(&p, 100 << 20).unwrap();
        let waiting = Tree::open(&p).unwrap().join().unwrap();
        waiting.publish(40 << 20, 1 << 20);
        waiting.publish_mapped(48 << 20);
        let usage = |t: &Tree| t.members().iter().map(|m| m.usage).sum::<u64>();
        assert_eq!(usage(&t), 48 << 20);
        let pager = Tree::open(&p).unwrap().join().unwrap();
        assert_eq!(pager.slot, waiting.slot, "this process's own slot");
        waiting.hand_over();
        assert_eq!(t.members().len(), 1, "a handed-over slot stays taken");
        assert_eq!(usage(&t), 48 << 20, "the pager has adopted nothing yet");
        assert_eq!(t.committed(), 48 << 20);
        pager.publish(10 << 20, 1 << 20);
        assert_eq!(usage(&t), 48 << 20);
        pager.publish_mapped(0);
        assert_eq!(usage(&t), 10 << 20);
        // A process joining a free slot starts from nothing…
        drop(pager);
        assert!(t.members().is_empty());
        t.slot(0).mapped.store(7, Ordering::Relaxed);
        let again = Tree::open(&p).unwrap().join().unwrap();
        assert_eq!(usage(&t), 0);
        // …as does one that takes over the slot of a process gone with the
        // same pid (another start time).
        t.slot(again.slot).mapped.store(7, Ordering::Relaxed);
        t.slot(again.slot).start.fetch_add(1, Ordering::Relaxed);
        let reused = Tree::open(&p).unwrap().join().unwrap();
        assert_eq!(reused.slot, again.slot);
        assert_eq!(usage(&t), 0);
        again.hand_over();
        drop(reused);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_sweep_frees_the_slots_of_processes_that_are_gone() {
        let p = path("sweep");
        let t = Tree::create(&p, 1 << 30).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        for (i, pid) in [(0, gone), (1, std::process::id())] {
            t.slot(i).pid.store(pid, Ordering::Release);
            t.slot(i).usage.store(5, Ordering::Relaxed);
        }
        t.header().high_slot.store(2, Ordering::Release);
        t.sweep();
        assert_eq!(t.usage(), 5);
        assert_eq!(t.members().iter().map(|m| m.pid).collect::<Vec<_>>(), vec![std::process::id()]);
        // The same pid with another start time is another process.
        t.slot(1).start.store(1, Ordering::Relaxed);
        t.sweep();
        assert!(t.members().is_empty());
        let _ = std::fs::remove_file(&p);
    }

    /// A segment whose every slot is taken frees those of processes gone
    /// before it refuses one: short processes that ended with `_exit` keep
    /// their slots, and a tree of them may have no reclaim thread to sweep.
    #[test]
    fn a_full_segment_sweeps_before_it_refuses_a_process() {
        let p = path("full");
        let t = Tree::create(&p, 1 << 30).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let init_start = start_time(1).unwrap();
        for i in 0..SLOTS {
            // pid 1 is alive; one slot holds a process that is gone.
            t.slot(i).start.store(init_start, Ordering::Relaxed);
            t.slot(i).pid.store(if i == 7 { gone } else { 1 }, Ordering::Release);
        }
        t.header().high_slot.store(SLOTS as u32, Ordering::Release);
        let me = Tree::open(&p).unwrap().join().expect("the gone process's slot");
        assert_eq!(me.slot, 7);
        // Every slot a live process's: refused.
        t.slot(7).start.store(init_start, Ordering::Relaxed);
        t.slot(7).pid.store(1, Ordering::Release);
        assert!(matches!(Tree::open(&p).unwrap().join(), Err(TreeError::Full)));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_file_that_is_not_a_segment_is_refused() {
        let p = path("bad");
        std::fs::write(&p, vec![0u8; SIZE]).unwrap();
        assert!(matches!(Tree::open(&p), Err(TreeError::Format(_))));
        std::fs::write(&p, b"short").unwrap();
        assert!(matches!(Tree::open(&p), Err(TreeError::Format(_))));
        let _ = std::fs::remove_file(&p);
        assert!(matches!(Tree::open(&p), Err(TreeError::Io { .. })));
    }
}
