//! The handler follows the thread that faults (`PagerConfig::handler_follow`).
//!
//! A thread that faults sleeps until its fault is served, so the CPU it ran
//! on is free for that time. A handler on that CPU is woken there, runs in
//! the sleeper's place and wakes it there: no cross-CPU wake-up either way.
//! A handler on the other vCPU costs two, and on this class of VM that is
//! most of a fault (BUDGET.md: ~9 µs a 4 KiB fault on the same vCPU, ~60 µs
//! from a blocked handler on the other). Left to the scheduler, the handler
//! lands on either: Python reading a dict in random order under
//! `zmem run` took 64 s with the handler free, 57 s with it pinned by hand
//! to the program's CPU and 100 s pinned to the other one.
//!
//! So, every [`WINDOW`], where one thread took at least three quarters of
//! the faults the handler read, the handler pins itself to the CPU that
//! thread last ran on (`processor` in `/proc/self/task/TID/stat`). Where no
//! thread did, it gives itself back to the scheduler. A window with few
//! faults changes nothing.
//!
//! # Holding the thread followed
//! Pinned beside the thread, the handler is still running when its COPY
//! wakes the thread, so the scheduler finds that CPU busy and puts the
//! thread on an idle one (`select_idle_sibling`); a few windows later the
//! handler follows it there, and the next wake-up sends it back. redis
//! computing `DEBUG DIGEST` under 48M migrated ~1,500 times in 5 s so, as
//! did its handler, and took 5.0-8.3 s, against 3.0-3.3 s with redis pinned
//! by hand to one CPU (`taskset`; the handler followed it there and stayed).
//! Python reading a dict at random (`tcs.py`) did not ping-pong: 90
//! migrations in 27 s.
//!
//! So where the thread followed keeps turning up on another CPU (at least
//! [`STRAYS_TO_HOLD`] windows in a second find it away from the handler),
//! the handler holds it, for [`HOLD_FOR`] at a time: while it serves one of
//! that thread's faults, the thread's affinity is the handler's CPU alone
//! (`sched_setaffinity` of the sleeping thread), so that the wake-up puts it
//! there; right after, the thread gets its own mask back (read each time,
//! so a mask the program set is kept). Three system calls a fault (~1 µs
//! on this VM), paid only where the ping-pong was seen.
//!
//! On by default (`PagerConfig::handler_hold`, `ZMEM_HANDLER_HOLD=0`).
//!
//! The program may see the narrowed mask only in the moments after a
//! wake-up that runs it before the handler has restored it, and a child
//! would inherit it: [`unhold_current_thread`] restores it first, and the
//! shim calls it before every fork, exec, spawn and `pthread_create` it
//! sees (a new thread inherits its creator's mask).

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use rustix::thread::CpuSet;
use zmem_common::host::fds::{open_kept, KeptFd, Wait};

/// How often the handler looks at whom it serves.
const WINDOW: Duration = Duration::from_millis(4);

/// Windows in a second that find the thread followed away from the
/// handler's CPU before the handler holds it there: a quarter of them
/// (redis's digest: 150-215 a second; Python's random dict reads: at most
/// 25, and held at 32 they ran 12% slower).
const STRAYS_TO_HOLD: u32 = 64;

/// How long a hold lasts before the handler lets the thread go and looks
/// again: a program whose ping-pong stopped pays for holding no longer
/// than this.
const HOLD_FOR: Duration = Duration::from_secs(5);

/// The thread a handler holds on its CPU at this moment, and the mask it
/// gets back; at most one per process (only one handler follows at a time
/// in practice, and the last one to hold wins the record).
static HELD: Mutex<Option<Held>> = Mutex::new(None);

/// The record, unless someone holds its lock (briefly; or for good in a
/// forked child whose parent's handler held it at the fork).
fn try_held() -> Option<std::sync::MutexGuard<'static, Option<Held>>> {
    match HELD.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

#[derive(Clone, Copy)]
struct Held {
    pid: i32,
    tid: u32,
    cpu: usize,
    mask: CpuSet,
}

/// Gives the calling thread its own mask back if a handler holds it on
/// one CPU (see the module's doc): before a fork, an exec or a spawn, so
/// that no child inherits the narrowed mask. In a child that shares the
/// memory (vfork), the record is the parent's: the child's thread was a
/// copy of the thread held if its mask is the one CPU held.
///
/// Never waits for the record's lock: a forked child may have a copy that
/// a handler of its parent held at the fork, which nothing would release.
/// Then it does nothing.
pub fn unhold_current_thread() {
    let Some(mut held) = try_held() else { return };
    let Some(h) = *held else { return };
    let me = rustix::thread::gettid().as_raw_nonzero().get() as u32;
    let child = rustix::process::getpid().as_raw_nonzero().get() != h.pid;
    if me == h.tid && !child {
        // The handler's `let_go` finds nothing left to do.
        *held = None;
    } else if !(child && rustix::thread::sched_getaffinity(None).is_ok_and(|m| m.count() == 1 && m.is_set(h.cpu))) {
        return;
    }
    drop(held);
    let _ = rustix::thread::sched_setaffinity(None, &h.mask);
}

/// Faults a window needs before it moves the handler: a thread that
/// faults rarely gains little from a handler beside it.
const MIN_FAULTS: u32 = 16;

/// One handler's following.
pub(super) struct Follow {
    on: bool,
    /// May hold the thread followed (`PagerConfig::handler_hold`).
    may_hold: bool,
    /// Holding it since then: the ping-pong was seen.
    holding: Option<Instant>,
    /// The thread held while its fault is served, and its own mask.
    held: Option<(u32, CpuSet)>,
    /// Windows that found the thread followed away, since `strays_since`.
    strays: u32,
    strays_since: Instant,
    /// The CPUs the handler may run on (its mask at start): where it goes
    /// back to, and the only ones it pins itself to.
    allowed: CpuSet,
    pinned: Option<usize>,
    /// The thread followed: the one `pinned` is the CPU of.
    followed: Option<u32>,
    window_start: Instant,
    /// The first thread to fault in this window, its faults, and all.
    tid: u32,
    hits: u32,
    total: u32,
    /// The stat file of the thread followed last, kept open (and kept from
    /// the program's `close`, see `zmem_common::host::fds`): opened once per
    /// thread, not once per window.
    stat: Option<(u32, KeptFd)>,
}

impl Follow {
    /// `on`: follow at all. Off as well where the handler may run on one
    /// CPU only (pinned by configuration, or a one-CPU mask). `hold`: hold
    /// the thread followed where it keeps straying (see the module's doc).
    pub(super) fn new(on: bool, hold: bool, now: Instant) -> Follow {
        let allowed = rustix::thread::sched_getaffinity(None).unwrap_or_else(|_| CpuSet::new());
        Follow {
            on: on && allowed.count() > 1,
            may_hold: hold,
            holding: None,
            held: None,
            strays: 0,
            strays_since: now,
            allowed,
            pinned: None,
            followed: None,
            window_start: now,
            tid: 0,
            hits: 0,
            total: 0,
            stat: None,
        }
    }

    /// The handler read a fault of thread `tid` (0: the kernel did not say).
    pub(super) fn fault(&mut self, tid: u32) {
        if !self.on || tid == 0 {
            return;
        }
        if self.total == 0 {
            self.tid = tid;
        }
        self.total += 1;
        if tid == self.tid {
            self.hits += 1;
        }
    }

    /// The CPU the handler is pinned to, if it is.
    pub(super) fn pinned(&self) -> Option<usize> {
        self.pinned
    }

    /// At the end of each window: pins the handler to the CPU of the
    /// thread that took most of its faults, or gives it back.
    /// `moves`: counts each pin to a new CPU and each release
    /// (`handler_follows`, `handler_releases`).
    pub(super) fn tick(&mut self, now: Instant, moves: (&AtomicU64, &AtomicU64)) {
        if !self.on || now.saturating_duration_since(self.window_start) < WINDOW {
            return;
        }
        let (tid, hits, total) = (self.tid, self.hits, self.total);
        self.window_start = now;
        self.hits = 0;
        self.total = 0;
        if total < MIN_FAULTS {
            return;
        }
        let before = self.pinned;
        match (hits * 4 >= total * 3).then(|| self.cpu_of(tid)).flatten() {
            Some(cpu) if self.allowed.is_set(cpu) => {
                if self.holding.is_some_and(|t| now.saturating_duration_since(t) >= HOLD_FOR) {
                    // Look again: strays counted afresh, unheld.
                    self.holding = None;
                    self.strays = 0;
                    self.strays_since = now;
                }
                if self.followed != Some(tid) {
                    self.holding = None;
                    self.strays = 0;
                    self.strays_since = now;
                } else if before.is_some_and(|p| p != cpu) {
                    self.stray(now);
                }
                self.pin(cpu);
                self.followed = self.pinned.map(|_| tid);
            }
            _ => self.unpin(),
        }
        if self.pinned != before {
            let n = if self.pinned.is_some() { moves.0 } else { moves.1 };
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A window found the thread followed on another CPU than the
    /// handler's.
    fn stray(&mut self, now: Instant) {
        if now.saturating_duration_since(self.strays_since) >= Duration::from_secs(1) {
            self.strays = 0;
            self.strays_since = now;
        }
        self.strays += 1;
        if self.may_hold && self.strays >= STRAYS_TO_HOLD && self.holding.is_none() {
            self.holding = Some(now);
        }
    }

    /// Before the handler serves a fault of thread `tid`: where it holds
    /// that thread, the thread's affinity becomes the handler's CPU alone
    /// (see the module's doc). Returns whether it did; then [`let_go`]
    /// must follow once the fault is served.
    ///
    /// [`let_go`]: Follow::let_go
    pub(super) fn hold(&mut self, tid: u32) -> bool {
        // Held already (a `let_go` missed): its mask now is the narrowed one.
        if self.holding.is_none() || self.followed != Some(tid) || self.held.is_some() {
            return false;
        }
        let (Some(cpu), Some(pid)) = (self.pinned, rustix::process::Pid::from_raw(tid as i32)) else { return false };
        // The thread's own mask, as it is now: one the program set since
        // the last fault is what it gets back.
        let Ok(mask) = rustix::thread::sched_getaffinity(Some(pid)) else { return false };
        if !mask.is_set(cpu) || mask.count() == 1 {
            // The program keeps it off this CPU, or on one: its choice.
            return false;
        }
        // Never wait for the record: in a forked child, a copy its
        // parent's handler held at the fork stays locked for good.
        let Some(mut held) = try_held() else { return false };
        let pid_now = rustix::process::getpid().as_raw_nonzero().get();
        if held.is_some_and(|h| h.tid != tid && h.pid == pid_now) {
            // Another handler holds a thread: one record, one holder. (A
            // record of another process is a parent's, copied by a fork
            // while one of its other threads was held: stale here.)
            return false;
        }
        *held = Some(Held { pid: pid_now, tid, cpu, mask });
        drop(held);
        let mut one = CpuSet::new();
        one.set(cpu);
        if rustix::thread::sched_setaffinity(Some(pid), &one).is_err() {
            if let Some(mut held) = try_held() {
                *held = None;
            }
            self.holding = None;
            return false;
        }
        self.held = Some((tid, mask));
        true
    }

    /// After a fault of thread `tid` that [`hold`](Follow::hold) held the
    /// thread for: its own mask back, unless it took it back itself
    /// ([`unhold_current_thread`] cleared the record).
    pub(super) fn let_go(&mut self, tid: u32) {
        let Some((t, mask)) = self.held.take().filter(|&(t, _)| t == tid) else { return };
        if let Some(mut held) = try_held() {
            if !held.is_some_and(|h| h.tid == t) {
                return;
            }
            *held = None;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(t as i32) {
            let _ = rustix::thread::sched_setaffinity(Some(pid), &mask);
        }
    }

    fn pin(&mut self, cpu: usize) {
        if self.pinned == Some(cpu) {
            return;
        }
        let mut set = CpuSet::new();
        set.set(cpu);
        match rustix::thread::sched_setaffinity(None, &set) {
            Ok(()) => self.pinned = Some(cpu),
            Err(e) => {
                // A cpuset changed under the process: stop trying.
                log::debug!("the handler cannot follow to CPU {cpu}: {e}");
                self.unpin();
                self.on = false;
            }
        }
    }

    fn unpin(&mut self) {
        self.followed = None;
        self.holding = None;
        if self.pinned.take().is_some() {
            let _ = rustix::thread::sched_setaffinity(None, &self.allowed);
        }
    }

    /// The CPU thread `tid` of this process last ran on; `None` where it
    /// is gone or its stat cannot be read.
    fn cpu_of(&mut self, tid: u32) -> Option<usize> {
        if self.stat.as_ref().is_none_or(|(t, _)| *t != tid) {
            self.stat = None;
            // No allocation: the handler may run while a forking thread
            // holds the allocator's locks.
            let mut path = [0u8; 48];
            let n = task_stat_path(tid, &mut path);
            let path = CStr::from_bytes_with_nul(&path[..n]).ok()?;
            // Not while the program closes descriptors (`zmem_common::host::fds`):
            // the handler never waits for that.
            let open = || rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty());
            let fd = open_kept(Wait::No, rustix::io::Errno::AGAIN, open).ok()?;
            self.stat = Some((tid, fd));
        }
        let (_, fd) = self.stat.as_ref()?;
        let mut buf = [0u8; 1024];
        let n = match rustix::io::pread(&**fd, &mut buf, 0) {
            Ok(n) if n > 0 => n,
            _ => {
                self.stat = None;
                return None;
            }
        };
        processor(&buf[..n])
    }
}

/// Writes `/proc/self/task/TID/stat` and a NUL into `out`; returns the
/// length with the NUL.
fn task_stat_path(tid: u32, out: &mut [u8; 48]) -> usize {
    let mut n = 0;
    let mut put = |b: &[u8]| {
        out[n..n + b.len()].copy_from_slice(b);
        n += b.len();
    };
    put(b"/proc/self/task/");
    let mut digits = [0u8; 10];
    let mut d = digits.len();
    let mut t = tid;
    loop {
        d -= 1;
        digits[d] = b'0' + (t % 10) as u8;
        t /= 10;
        if t == 0 {
            break;
        }
    }
    put(&digits[d..]);
    put(b"/stat\0");
    n
}

/// Field 39 of a `stat` line, `processor`: the CPU the task last ran on.
/// The command name (field 2) may hold spaces and parentheses, so fields
/// are counted from the last `)`.
fn processor(stat: &[u8]) -> Option<usize> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let field = stat[close + 1..].split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty()).nth(39 - 3)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_processor_field_is_read_past_a_command_name_with_spaces_and_parentheses() {
        // Fields 3 to 38 are 0..=35 here, so field 39 is 36.
        let mut line = b"1234 (a) b (c)) S".to_vec();
        for i in 1..=35 {
            line.extend_from_slice(format!(" {i}").as_bytes());
        }
        line.extend_from_slice(b" 36 0 0\n");
        assert_eq!(processor(&line), Some(36));
        assert_eq!(processor(b"1 (x) S 1 2"), None);
    }

    #[test]
    fn this_threads_cpu_is_read_from_its_stat() {
        let mut path = [0u8; 48];
        let n = task_stat_path(4_294_967_295, &mut path);
        assert_eq!(&path[..n], b"/proc/self/task/4294967295/stat\0");
        // Pinned to one CPU, this thread's stat must say that CPU.
        let allowed = rustix::thread::sched_getaffinity(None).expect("affinity");
        let cpu = (0..CpuSet::MAX_CPU).find(|&c| allowed.is_set(c)).expect("a CPU");
        let mut one = CpuSet::new();
        one.set(cpu);
        rustix::thread::sched_setaffinity(None, &one).expect("pin");
        std::thread::yield_now();
        let mut f = Follow::new(true, true, Instant::now());
        let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        assert_eq!(f.cpu_of(tid), Some(cpu));
        rustix::thread::sched_setaffinity(None, &allowed).expect("unpin");
    }

    #[test]
    fn a_window_dominated_by_one_thread_pins_the_handler_to_its_cpu_and_a_mixed_one_lets_go() {
        let allowed = rustix::thread::sched_getaffinity(None).expect("affinity");
        if allowed.count() < 2 {
            eprintln!("one CPU: nothing to follow");
            return;
        }
        // A thread pinned to the last allowed CPU faults most; this thread
        // plays the handler.
        let last = (0..CpuSet::MAX_CPU).rev().find(|&c| allowed.is_set(c)).expect("a CPU");
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let mut one = CpuSet::new();
            one.set(last);
            rustix::thread::sched_setaffinity(None, &one).expect("pin");
            std::thread::yield_now();
            tx.send(rustix::thread::gettid().as_raw_nonzero().get() as u32).expect("send");
            done_rx.recv().expect("recv");
        });
        let tid = rx.recv().expect("tid");
        let start = Instant::now();
        let mut f = Follow::new(true, true, start);
        for _ in 0..30 {
            f.fault(tid);
        }
        f.fault(tid + 1);
        let (pins, releases) = (AtomicU64::new(0), AtomicU64::new(0));
        let moves = (&pins, &releases);
        f.tick(start + WINDOW, moves);
        assert_eq!(f.pinned(), Some(last));
        assert_eq!(rustix::thread::sched_getcpu(), last, "the handler runs where it was pinned");
        // Too few faults: nothing changes.
        f.fault(tid + 1);
        f.tick(start + 2 * WINDOW, moves);
        assert_eq!(f.pinned(), Some(last));
        // No thread dominates: let go.
        for i in 0..32 {
            f.fault(tid + (i % 2));
        }
        f.tick(start + 3 * WINDOW, moves);
        assert_eq!(f.pinned(), None);
        assert_eq!((pins.into_inner(), releases.into_inner()), (1, 1));
        let back = rustix::thread::sched_getaffinity(None).expect("affinity");
        assert_eq!(back.count(), allowed.count());
        done_tx.send(()).expect("send");
        t.join().expect("join");
    }

    /// A thread that does what it is told on its own CPU: `Some(cpu)`
    /// pins it there (and it runs there once), `None` makes it take back
    /// a mask a handler held it to; it answers after each.
    fn puppet(
    ) -> (u32, std::sync::mpsc::Sender<Option<usize>>, std::sync::mpsc::Receiver<()>, std::thread::JoinHandle<()>) {
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (cmd_tx, cmd_rx) = std::sync::mpsc::channel::<Option<usize>>();
        let (ack_tx, ack_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            tid_tx.send(rustix::thread::gettid().as_raw_nonzero().get() as u32).expect("send");
            for cmd in cmd_rx {
                match cmd {
                    Some(cpu) => {
                        let mut one = CpuSet::new();
                        one.set(cpu);
                        rustix::thread::sched_setaffinity(None, &one).expect("pin");
                        std::thread::yield_now();
                    }
                    None => unhold_current_thread(),
                }
                ack_tx.send(()).expect("ack");
            }
        });
        (tid_rx.recv().expect("tid"), cmd_tx, ack_rx, t)
    }

    fn mask_of(tid: u32) -> CpuSet {
        let pid = rustix::process::Pid::from_raw(tid as i32).expect("a tid");
        rustix::thread::sched_getaffinity(Some(pid)).expect("its mask")
    }

    #[test]
    fn a_thread_that_keeps_straying_is_held_on_the_handlers_cpu_while_served_and_gets_its_mask_back() {
        let allowed = rustix::thread::sched_getaffinity(None).expect("affinity");
        let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)).collect();
        if cpus.len() < 2 {
            eprintln!("one CPU: nothing to follow");
            return;
        }
        let (a, b) = (cpus[0], cpus[1]);
        let (tid, cmd, ack, t) = puppet();
        let start = Instant::now();
        let mut f = Follow::new(true, true, start);
        let moves = (&AtomicU64::new(0), &AtomicU64::new(0));
        // The thread turns up on one CPU and then the other, window after
        // window: each window after the first that finds it away is a stray.
        for w in 1..=STRAYS_TO_HOLD + 1 {
            cmd.send(Some(if w % 2 == 0 { a } else { b })).expect("cmd");
            ack.recv().expect("ack");
            for _ in 0..MIN_FAULTS {
                f.fault(tid);
            }
            assert!(f.holding.is_none() || w > STRAYS_TO_HOLD, "held after {w} windows");
            f.tick(start + WINDOW * w, moves);
            assert_eq!(f.followed, Some(tid));
        }
        assert!(f.holding.is_some(), "{STRAYS_TO_HOLD} strays in a second hold it");
        let cpu = f.pinned().expect("pinned");
        // Its own mask now: the program's choice, which it must get back.
        let mut own = allowed;
        own.unset(cpus[cpus.len() - 1]);
        if own.count() < 2 || !own.is_set(cpu) {
            own = allowed;
        }
        let pid = rustix::process::Pid::from_raw(tid as i32).expect("a tid");
        rustix::thread::sched_setaffinity(Some(pid), &own).expect("its mask");
        assert!(f.hold(tid), "held while its fault is served");
        let m = mask_of(tid);
        assert_eq!((m.count(), m.is_set(cpu)), (1, true), "only the handler's CPU");
        assert!(!f.hold(tid), "one thread held at a time");
        // A child forked or spawned by the thread held starts on the one
        // CPU; the shim's hooks run this in it: its own mask back.
        // SAFETY: the child makes only system calls and leaves with _exit.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let mut one = CpuSet::new();
            one.set(cpu);
            let _ = rustix::thread::sched_setaffinity(None, &one);
            unhold_current_thread();
            let ok = rustix::thread::sched_getaffinity(None).is_ok_and(|m| m == own);
            // SAFETY: leaving the forked child without running anything of
            // the parent's (no destructors, no atexit handlers).
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        assert!(child > 0, "fork");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child got the held thread's mask back");
        f.let_go(tid);
        assert_eq!(mask_of(tid), own, "its own mask back");
        // Another thread's fault: not held.
        assert!(!f.hold(tid + 1));
        // Held, and it takes its mask back itself (before a fork, an exec, a
        // spawn): the handler then has nothing left to undo.
        assert!(f.hold(tid));
        cmd.send(None).expect("cmd");
        ack.recv().expect("ack");
        assert_eq!(mask_of(tid), own, "taken back by the thread itself");
        assert!(HELD.lock().expect("lock").is_none());
        f.let_go(tid);
        assert_eq!(mask_of(tid), own);
        // Let go of the thread: nothing is held any more.
        f.unpin();
        assert!(f.holding.is_none() && !f.hold(tid));
        drop(cmd);
        t.join().expect("join");
    }
}
