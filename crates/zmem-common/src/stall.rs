//! The program's stall: the time its threads waited on zmem because of the
//! limit (`PagerStats::stall_ns`, summed over a tree in its segment), as a
//! share of the CPU time its own threads ran. PSI's `some` measures the
//! same for a cgroup from the scheduler; zmem serves the faults, so it
//! knows each wait exactly, per process and without root.
//!
//! Inside the program's process (the shim's stats), the CPU time is the
//! process's CPU clock less zmem's threads' clocks ([`this_program_cpu_ns`]):
//! no file is opened there. From outside (`zmem run`'s controller), it is
//! read from `/proc/PID/task/TID/schedstat` (run time, ns;
//! `stat`'s `utime` + `stime` in clock ticks where it is missing), for
//! every thread but zmem's own (`host::thread::is_zmem_name`: the handlers' and the
//! reclaimer's work is the stall's cause, not the program's).

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::host::fds::{self, Wait};

/// The CPU time each of a process's program threads has run, ns, keyed by
/// thread id; `pid` `None`: this process. `None` if its `/proc` cannot be
/// read (it is gone).
pub fn program_threads_cpu_ns(pid: Option<u32>) -> Option<Vec<(u32, u64)>> {
    let task = match pid {
        Some(p) => format!("/proc/{p}/task"),
        None => "/proc/self/task".to_string(),
    };
    let task = Path::new(&task);
    let names = fds::dir_names(Wait::Yes, task).ok()?;
    // USER_HZ, the unit of `stat`'s times: 100 on every Linux ABI.
    let tick_ns = 10_000_000;
    Some(
        names
            .iter()
            .filter_map(|n| {
                let tid: u32 = n.to_str()?.parse().ok()?;
                let dir = task.join(n);
                let comm = fds::read_to_string(Wait::Yes, &dir.join("comm")).ok()?;
                if crate::host::thread::is_zmem_name(comm.as_bytes()) {
                    return None;
                }
                let ns = match fds::read_to_string(Wait::Yes, &dir.join("schedstat")) {
                    Ok(t) => t.split_ascii_whitespace().next()?.parse().ok()?,
                    Err(_) => {
                        let stat = fds::read_to_string(Wait::Yes, &dir.join("stat")).ok()?;
                        let f = |n| crate::procfs::stat_field(&stat, n)?.parse::<u64>().ok();
                        (f(14)? + f(15)?) * tick_ns
                    }
                };
                Some((tid, ns))
            })
            .collect(),
    )
}

/// The CPU time this process's program threads have run, ns: the
/// process's less zmem's own threads' (`meter` adds theirs up as they come
/// and go), read from CPU clocks, with no file opened
/// (`host::thread::ours_cpu_ns`). A thread of zmem's that ended before its
/// first sample counts as the program's.
pub fn this_program_cpu_ns(meter: &mut CpuMeter) -> u64 {
    let pid = std::process::id();
    let zmem = meter.sample(crate::host::thread::ours_cpu_ns().into_iter().map(|(tid, ns)| ((pid, tid), ns)));
    crate::host::thread::process_cpu_ns().saturating_sub(zmem)
}

/// Adds up the CPU time of threads that come and go: each sample's threads
/// count by what they ran since the last sample, a new one by all it ran
/// (it started since), and one that is gone by nothing more.
#[derive(Debug, Default)]
pub struct CpuMeter {
    last: HashMap<(u32, u32), u64>,
    total: u64,
}

impl CpuMeter {
    /// Takes the threads of the processes sampled now, as (pid, tid) and
    /// ns run, and returns the total run so far.
    pub fn sample(&mut self, threads: impl IntoIterator<Item = ((u32, u32), u64)>) -> u64 {
        let mut now = HashMap::new();
        for (id, ns) in threads {
            let before = self.last.get(&id).copied().unwrap_or(0);
            self.total += ns.saturating_sub(before);
            now.insert(id, ns);
        }
        self.last = now;
        self.total
    }
}

/// One look: the stall and the CPU time so far, and what else the looker
/// keeps with them.
#[derive(Debug, Clone)]
pub struct Sample<T> {
    pub at: Instant,
    pub stall_ns: u64,
    pub cpu_ns: u64,
    pub extra: T,
}

impl<T> Sample<T> {
    /// The stall between `old` and this sample, percent of the CPU time
    /// run meanwhile; `None` where the program ran less than a millisecond
    /// (an idle program has no stall to speak of).
    pub fn stall_percent_since(&self, old: &Sample<T>) -> Option<f64> {
        let cpu = self.cpu_ns.saturating_sub(old.cpu_ns);
        (cpu >= 1_000_000).then(|| self.stall_ns.saturating_sub(old.stall_ns) as f64 * 100.0 / cpu as f64)
    }
}

/// The samples of the last `keep`: the stall over any window that long.
#[derive(Debug)]
pub struct History<T> {
    samples: VecDeque<Sample<T>>,
    keep: Duration,
}

impl<T> History<T> {
    pub fn new(keep: Duration) -> Self {
        History { samples: VecDeque::new(), keep }
    }

    pub fn push(&mut self, s: Sample<T>) {
        while self.samples.front().is_some_and(|o| s.at.duration_since(o.at) > self.keep) {
            self.samples.pop_front();
        }
        self.samples.push_back(s);
    }

    /// The oldest sample at most `window` before the newest, and the
    /// newest; `None` until there are two.
    pub fn window(&self, window: Duration) -> Option<(&Sample<T>, &Sample<T>)> {
        let last = self.samples.back()?;
        let first = self.samples.iter().find(|s| last.at.duration_since(s.at) <= window)?;
        (!std::ptr::eq(first, last)).then_some((first, last))
    }

    /// The stall over the last `window`, percent of the CPU time run.
    pub fn stall_percent(&self, window: Duration) -> Option<f64> {
        let (old, new) = self.window(window)?;
        new.stall_percent_since(old)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_count_by_what_they_ran_since_the_last_sample() {
        let mut m = CpuMeter::default();
        assert_eq!(m.sample([((1, 1), 100), ((1, 2), 50)]), 150);
        // Thread 2 is gone, thread 3 is new: 1 ran 20 more, 3 all its 30.
        assert_eq!(m.sample([((1, 1), 120), ((1, 3), 30)]), 200);
        // A pid reused for another process: a new thread, counted from 0.
        assert_eq!(m.sample([((1, 1), 125), ((1, 3), 30), ((2, 2), 7)]), 212);
    }

    #[test]
    fn the_stall_is_a_share_of_the_cpu_run_in_the_window() {
        let t0 = Instant::now();
        let s = |ms: u64, stall_ms: u64, cpu_ms: u64| Sample {
            at: t0 + Duration::from_millis(ms),
            stall_ns: stall_ms * 1_000_000,
            cpu_ns: cpu_ms * 1_000_000,
            extra: (),
        };
        let mut h = History::new(Duration::from_secs(60));
        h.push(s(0, 0, 0));
        assert_eq!(h.stall_percent(Duration::from_secs(10)), None, "one sample");
        h.push(s(5_000, 500, 5_000));
        h.push(s(10_000, 500, 10_000));
        h.push(s(20_000, 1_500, 20_000));
        // The last 10 s: 1000 ms of stall in 10000 ms of CPU.
        assert!((h.stall_percent(Duration::from_secs(10)).unwrap() - 10.0).abs() < 1e-9);
        // All of it: 1500 in 20000.
        assert!((h.stall_percent(Duration::from_secs(60)).unwrap() - 7.5).abs() < 1e-9);
        // Idle: no CPU, no figure.
        h.push(s(21_000, 1_500, 20_000));
        assert_eq!(h.stall_percent(Duration::from_millis(500)), None);
        // Samples older than `keep` go.
        h.push(s(75_000, 1_500, 20_000));
        h.push(s(90_000, 1_500, 20_000));
        assert_eq!(h.window(Duration::from_secs(3600)).unwrap().0.at, t0 + Duration::from_secs(75));
    }

    /// Spins until the calling thread has run `ms` of CPU time: by its
    /// own CPU clock, not the wall clock, so that a busy machine (the
    /// system stage runs tests beside builds) cannot leave it short.
    fn spin_cpu_ms(ms: u64) {
        let own = crate::host::thread::thread_cpu_ns;
        let t0 = own();
        while own() - t0 < ms * 1_000_000 {
            std::hint::black_box(0u64);
        }
    }

    #[test]
    fn this_programs_cpu_time_leaves_zmems_threads_out() {
        // Other tests run threads beside this one: only what is zmem's is
        // measured exactly (the process's time less the program's).
        let mut m = CpuMeter::default();
        let zmem_part = |m: &mut CpuMeter| {
            let p = this_program_cpu_ns(m);
            (crate::host::thread::process_cpu_ns() - p, p)
        };
        let (zmem_before, program_before) = zmem_part(&mut m);
        // A zmem thread (listed in `ours`) that runs 50 ms: zmem's. It is
        // sampled while it still runs, once it has.
        let (ran_tx, ran_rx) = std::sync::mpsc::channel();
        let (sampled_tx, sampled_rx) = std::sync::mpsc::channel::<()>();
        let t = crate::host::thread::spawn(std::thread::Builder::new().name("zmem-stats".into()), move || {
            spin_cpu_ms(50);
            ran_tx.send(()).unwrap();
            let _ = sampled_rx.recv();
        })
        .unwrap();
        ran_rx.recv().unwrap();
        let (zmem_mid, _) = zmem_part(&mut m);
        sampled_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(zmem_mid - zmem_before >= 45_000_000, "{} ms of zmem's", (zmem_mid - zmem_before) / 1_000_000);
        // This thread runs 50 ms: the program's.
        spin_cpu_ms(50);
        assert!(this_program_cpu_ns(&mut m) - program_before >= 45_000_000);
    }

    #[test]
    fn this_process_main_thread_has_run() {
        let t = program_threads_cpu_ns(None).unwrap();
        let main = std::process::id();
        assert!(t.iter().any(|&(tid, ns)| tid == main && ns > 0), "{t:?}");
        assert_eq!(program_threads_cpu_ns(Some(u32::MAX - 1)), None);
    }
}
