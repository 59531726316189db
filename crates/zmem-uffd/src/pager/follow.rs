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

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use rustix::thread::CpuSet;
use zmem_common::fds::KeptFd;

/// How often the handler looks at whom it serves.
const WINDOW: Duration = Duration::from_millis(4);

/// Faults a window needs before it moves the handler: a thread that
/// faults rarely gains little from a handler beside it.
const MIN_FAULTS: u32 = 16;

/// One handler's following.
pub(super) struct Follow {
    on: bool,
    /// The CPUs the handler may run on (its mask at start): where it goes
    /// back to, and the only ones it pins itself to.
    allowed: CpuSet,
    pinned: Option<usize>,
    window_start: Instant,
    /// The first thread to fault in this window, its faults, and all.
    tid: u32,
    hits: u32,
    total: u32,
    /// The stat file of the thread followed last, kept open (and kept from
    /// the program's `close`, see `zmem_common::fds`): opened once per
    /// thread, not once per window.
    stat: Option<(u32, KeptFd)>,
}

impl Follow {
    /// `on`: follow at all. Off as well where the handler may run on one
    /// CPU only (pinned by configuration, or a one-CPU mask).
    pub(super) fn new(on: bool, now: Instant) -> Follow {
        let allowed = rustix::thread::sched_getaffinity(None).unwrap_or_else(|_| CpuSet::new());
        Follow {
            on: on && allowed.count() > 1,
            allowed,
            pinned: None,
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
            Some(cpu) if self.allowed.is_set(cpu) => self.pin(cpu),
            _ => self.unpin(),
        }
        if self.pinned != before {
            let n = if self.pinned.is_some() { moves.0 } else { moves.1 };
            n.fetch_add(1, Ordering::Relaxed);
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
            let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).ok()?;
            self.stat = Some((tid, KeptFd::new(fd)));
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
        let mut f = Follow::new(true, Instant::now());
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
        let mut f = Follow::new(true, start);
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
}
