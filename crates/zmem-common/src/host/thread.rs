//! zmem's threads take none of the program's signals.
//!
//! A signal sent to a process goes to any one of its threads that does not
//! block it, zmem's own included, and the program's handler then runs on
//! that thread. On a handler thread that is a hang: a handler that touches
//! evicted memory faults, and the thread that would serve the fault is the
//! one waiting for it. It also lost signals: a dash script trapping TERM,
//! sent one while it waited for a `sleep`, went on looping in 5 runs of
//! 22 (its process and threads blocked nothing and had nothing pending:
//! the handler had run, and the trap never did); with zmem's threads
//! blocking them, 0 of 102 (this script and one that execs `sleep`). So
//! every zmem thread starts with the asynchronous signals blocked; the
//! kernel then delivers them to the program's threads. Faults (SIGSEGV,
//! SIGBUS, SIGILL, SIGFPE, SIGTRAP, SIGSYS) stay open: they are the
//! thread's own and cannot be blocked anyway. glibc keeps its internal
//! signals (thread cancellation, `setuid` across threads) out of any mask.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{Builder, JoinHandle};
use std::time::{Duration, Instant};

/// The names zmem gives its threads, as prefixes (`comm`, at most 15
/// bytes). A thread is zmem's by one of these, not by `zmem-` alone: a
/// program whose binary is named `zmem-something` has a main thread of
/// that name.
const NAMES: [&[u8]; 6] =
    [b"zmem-handler-", b"zmem-reclaim", b"zmem-stats", b"zmem-engine-", b"zmem-warmup", b"zmem-probe"];

/// Whether a thread named `name` (a `comm`, with or without its newline or
/// NUL) is one of zmem's.
pub fn is_zmem_name(name: &[u8]) -> bool {
    NAMES.iter().any(|n| name.starts_with(n))
}

/// Signals that are a thread's own doing, left unblocked.
const SYNCHRONOUS: [libc::c_int; 6] =
    [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE, libc::SIGTRAP, libc::SIGSYS];

/// Spawns `f` as `builder` would, with every asynchronous signal blocked in
/// the new thread: the caller's mask is widened for the spawn (a new thread
/// inherits it, so no signal can land in between) and put back after.
///
/// # Errors
/// As [`Builder::spawn`].
pub fn spawn<F, T>(builder: Builder, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let _blocked = block_async_signals();
    STARTING.fetch_add(1, Ordering::SeqCst);
    // The thread's TLS vector stays resident (see `tls`): pinned by the
    // thread itself first thing, and by this thread too, in case the
    // thread faults on it before it runs a line of its own.
    let r = builder.spawn(move || {
        STARTING.fetch_sub(1, Ordering::SeqCst);
        let _listed = Listed::me();
        super::tls::keep_resident();
        f()
    });
    match &r {
        Ok(t) => {
            use std::os::unix::thread::JoinHandleExt;
            super::tls::pin_thread(t.as_pthread_t());
        }
        Err(_) => {
            STARTING.fetch_sub(1, Ordering::SeqCst);
        }
    }
    r
}

/// zmem's threads spawned that have not run their first line yet: they are
/// inside the C library's and Rust's start of a thread, which takes locks
/// of theirs and writes their state.
static STARTING: AtomicUsize = AtomicUsize::new(0);

/// Waits, at most `within`, until every thread [`spawn`] started has run
/// its first line. Whether none is left starting.
///
/// A fork while one is starting copies its start half done into a child
/// that does not have the thread. A double-forking daemon, whose middle
/// process forks right after it started its own pager, once came out with
/// a pager whose reclaim thread never ran a round: nothing adopted, nothing
/// evicted, the program unmanaged at four times its limit (CI, under load).
/// The prepare step of fork calls this before it takes any lock, so a
/// starting thread waits for nothing the fork holds.
pub fn wait_for_starting(within: Duration) -> bool {
    let until = Instant::now() + within;
    while STARTING.load(Ordering::SeqCst) != 0 {
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    true
}

/// In a forked child: the parent's starting threads are not here.
pub fn reset_in_child() {
    STARTING.store(0, Ordering::SeqCst);
}

/// zmem's threads, as many as are listed at once (a pager runs about four,
/// and the shim runs one pager a process).
pub const LISTED: usize = 64;

/// zmem's threads that are running, each `pid << 32 | tid` (0: a free
/// slot), so that the shim knows them without `/proc`, which a program
/// that changed its root no longer has: whether a thread but zmem's is
/// left (the program's last thread ended) and whose capabilities to
/// compare. A thread is listed from its first line to its last, not
/// between its clone and its first line, nor after its last line: a
/// count of the process's threads may hold one more than the list.
///
/// The pid tells this process's entries from those a forked child
/// inherited (its parent's threads, which it does not have).
static OURS: [AtomicU64; LISTED] = [const { AtomicU64::new(0) }; LISTED];

/// The calling thread's entry in [`OURS`], freed when dropped.
struct Listed(Option<&'static AtomicU64>);

impl Listed {
    fn me() -> Listed {
        let pid = std::process::id();
        // SAFETY: gettid has no preconditions and touches no memory.
        let tid = unsafe { libc::gettid() } as u32;
        let me = u64::from(pid) << 32 | u64::from(tid);
        // A free slot, or one a forked child inherited from another
        // process (its threads are not this process's).
        let slot = OURS.iter().find(|s| {
            let v = s.load(Ordering::Acquire);
            (v == 0 || (v >> 32) as u32 != pid)
                && s.compare_exchange(v, me, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        });
        if slot.is_none() {
            log::warn!("more than {LISTED} zmem threads: thread {tid} is not listed");
        }
        Listed(slot)
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            s.store(0, Ordering::Release);
        }
    }
}

/// Whether zmem's io_uring reads may go to a kernel worker thread
/// (`iou-wrk-TID`) when they would block; see [`no_new_io_workers`].
static IO_WORKERS: AtomicBool = AtomicBool::new(true);

/// From now on, zmem's io_uring reads that would block fail with EAGAIN
/// (`RWF_NOWAIT`) instead of starting a worker thread: a process that
/// changed its root can no longer tell such a worker from a thread of the
/// program's (it has no `/proc`), so the workers it has then are noted
/// and no new one may come. For the whole process, its forked children
/// included.
pub fn no_new_io_workers() {
    IO_WORKERS.store(false, Ordering::SeqCst);
}

/// Whether zmem's io_uring reads may start worker threads (see
/// [`no_new_io_workers`]).
pub fn io_workers_allowed() -> bool {
    IO_WORKERS.load(Ordering::SeqCst)
}

/// The thread ids of this process's zmem threads that are running (see
/// `OURS`), in `out`; returns how many.
pub fn ours(out: &mut [i32; LISTED]) -> usize {
    let pid = std::process::id();
    let mut n = 0;
    for s in &OURS {
        let v = s.load(Ordering::Acquire);
        if v != 0 && (v >> 32) as u32 == pid {
            out[n] = v as u32 as i32;
            n += 1;
        }
    }
    n
}

/// The CPU time this process has run, ns (`CLOCK_PROCESS_CPUTIME_ID`: its
/// threads', the ended ones' included).
pub fn process_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// The CPU time the calling thread has run, ns (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The CPU time each of zmem's running threads ([`ours`]) has run, ns,
/// keyed by thread id: read from each thread's CPU clock, so that no file
/// is opened (a program that closed its standard streams expects them back
/// from its next opens, and each open of zmem's is a moment that one of
/// their numbers is taken).
pub fn ours_cpu_ns() -> Vec<(u32, u64)> {
    let mut tids = [0; LISTED];
    let n = ours(&mut tids);
    // The kernel's clock id of a thread's CPU time (`MAKE_THREAD_CPUCLOCK(tid,
    // CPUCLOCK_SCHED)`, as glibc's `pthread_getcpuclockid` makes it).
    tids[..n].iter().map(|&tid| (tid as u32, clock_ns((!tid << 3) | 6))).collect()
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes only `ts`; a clock of a thread that
    // ended meanwhile fails (EINVAL), and reads as 0.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The calling thread's signal mask as it was before
/// [`block_async_signals`], put back when dropped.
#[must_use = "the mask is put back when this is dropped"]
pub struct AsyncSignalsBlocked {
    old: libc::sigset_t,
    blocked: bool,
    /// Not `Send`: the mask is the thread's.
    _thread: std::marker::PhantomData<*const ()>,
}

/// Blocks every asynchronous signal on the calling thread until the guard
/// drops; a signal sent meanwhile stays pending and is delivered then.
/// The shim runs its code on the program's threads so (`guarded`): a
/// program's handler that ran there, on a thread holding one of the
/// pager's locks, and touched evicted memory, waited for its fault, and the
/// handler thread serving it waited for that lock (bash's SIGCHLD handler
/// did, mid-`realloc`).
pub fn block_async_signals() -> AsyncSignalsBlocked {
    // SAFETY: sigset_t is plain data, valid zeroed.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: sigfillset and sigdelset only write the set they are given,
    // which is ours.
    unsafe { libc::sigfillset(&mut all) };
    for s in SYNCHRONOUS {
        // SAFETY: as above.
        unsafe { libc::sigdelset(&mut all, s) };
    }
    // SAFETY: both sets are ours and initialised; pthread_sigmask changes
    // only this thread's mask and writes the old one into `old`.
    let blocked = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) } == 0;
    AsyncSignalsBlocked { old, blocked, _thread: std::marker::PhantomData }
}

impl std::fmt::Debug for AsyncSignalsBlocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSignalsBlocked").field("blocked", &self.blocked).finish_non_exhaustive()
    }
}

impl Drop for AsyncSignalsBlocked {
    fn drop(&mut self) {
        // The mask read by `block_async_signals`, put back on the thread it
        // was read on (the guard is not `Send`).
        if self.blocked {
            set_signal_mask(&self.old);
        }
    }
}

/// The calling thread's signal mask.
pub fn signal_mask() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, valid zeroed.
    let mut cur: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a null new set only reads this thread's mask into `cur`.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur) };
    cur
}

/// Sets the calling thread's signal mask to `mask`.
pub fn set_signal_mask(mask: &libc::sigset_t) {
    // SAFETY: `mask` is an initialised set; this changes only this thread's mask.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
}

/// Whether `sig` is blocked on the calling thread.
pub fn blocks(sig: libc::c_int) -> bool {
    let cur = signal_mask();
    // SAFETY: `cur` is initialised; sigismember only reads it.
    unsafe { libc::sigismember(&cur, sig) == 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zmem_threads_are_known_by_their_names_not_by_the_prefix() {
        for ours in ["zmem-handler-0\n", "zmem-reclaim", "zmem-stats", "zmem-engine-1", "zmem-warmup", "zmem-probe"] {
            assert!(is_zmem_name(ours.as_bytes()), "{ours}");
        }
        for theirs in ["zmem-phases-bin", "zmem-", "python3", "zmem"] {
            assert!(!is_zmem_name(theirs.as_bytes()), "{theirs}");
        }
    }

    #[test]
    fn a_spawned_thread_blocks_asynchronous_signals_and_the_caller_keeps_its_mask() {
        assert!(!blocks(libc::SIGTERM), "the test thread starts open");
        let t = spawn(Builder::new().name("quiet".into()), || {
            (blocks(libc::SIGTERM), blocks(libc::SIGINT), blocks(libc::SIGCHLD), blocks(libc::SIGSEGV))
        })
        .unwrap();
        assert_eq!(t.join().unwrap(), (true, true, true, false));
        assert!(!blocks(libc::SIGTERM) && !blocks(libc::SIGINT), "the caller's mask is put back");
    }

    fn listed() -> Vec<i32> {
        let mut out = [0; LISTED];
        let n = ours(&mut out);
        out[..n].to_vec()
    }

    #[test]
    fn a_spawned_thread_is_listed_while_it_runs_and_no_longer_once_it_ended() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = spawn(Builder::new().name("listed".into()), move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            done_rx.recv().unwrap();
        })
        .unwrap();
        let tid = rx.recv().unwrap();
        assert!(listed().contains(&tid), "{tid} not in {:?}", listed());
        // SAFETY: as above.
        assert!(!listed().contains(&unsafe { libc::gettid() }), "a thread zmem did not spawn is listed");
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(!listed().contains(&tid), "{tid} still listed after it ended");
    }
}
