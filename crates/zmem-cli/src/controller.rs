//! `zmem run --max-slowdown P%`: the least memory a program runs in at the
//! slowdown its user chose. A thread of `zmem run` looks at the tree every
//! [`TICK`] and moves the tree's limit so that the program's stall on it
//! stays near P% of the CPU time its threads run; `--report FILE` draws
//! what it saw.
//!
//! The stall is what zmem measures as it serves faults
//! (`PagerStats::stall_ns`: loads, eviction waits, the throttle), summed
//! over the tree's processes in its segment; the CPU time is their program
//! threads' (`zmem_common::stall`). PSI gives Meta's Senpai the same ratio
//! for a cgroup, from the scheduler, with root and cgroup v2.
//!
//! The control is Senpai's, made fast enough for programs that run for
//! seconds ([`Controller::step`]):
//! - **Probe down** while the stall over the last second is under half the
//!   target, from the usage (a limit above it reclaims nothing, and one
//!   further under it than a probe throttles the program), by up to the
//!   probe a tick, less as the stall nears half the target. The probe
//!   starts at [`DOWN_STEP`], halves at every failed probe (down to
//!   [`MIN_PROBE`]) and grows back by a tenth at every step down: where
//!   the whole working set is hot, a cut of 2.5% is a fault for 2.5% of
//!   its re-reads, many times the target, and the probe shrinks.
//! - **Back off up** as soon as one tick's stall is over the target, by
//!   [`UP_GAIN`] times the overshoot, at most [`UP_STEP`] a tick: a limit
//!   cut below the working set costs a fault per re-read, so the way up is
//!   taken ten times as fast as the way down. Where most of the tick's
//!   stall is loads that a limit [`UP_STEP`] larger would not have saved,
//!   by their refault distances (`zmem_uffd::refaults_within`: a program
//!   reading data it evicted long ago), a small rise buys nothing, and the
//!   rise is [`UP_STEP`] at once. A rise starts from the usage: a limit
//!   above it is not what holds the program back.
//! - **Hold** between half the target and the target: the dead band keeps
//!   a program whose stall sits near its target from being pushed in and
//!   out of its working set every tick. A held limit is trimmed to
//!   [`HEADROOM`] over the usage, which costs nothing (it evicts nothing).
//!   Hold too while the usage grows faster than a probe would take it back
//!   (by more than [`DOWN_STEP`] of it over the last second): a program
//!   building its data would wait on the throttle for every folio a probe
//!   made room for, where the same folios are evicted by the reclaimer in
//!   the background, off the program's path, once it stops growing.
//!
//! A probe into a working set that is hot all through (a cache read at
//! random) costs more than its cut: reclaim evicts to the low watermark,
//! and every folio it takes comes back a fault at a time, so until the
//! rise a tick later the program pays a burst of loads. So after a rise
//! the next probe waits a second; after a rise within a second of a step
//! down (a failed probe) it waits twice as long as the last time (up to
//! [`MAX_BACKOFF`] ticks), and each step down takes a tick off: a working
//! set that does not shrink is probed less and less often, while a
//! program that grows (its rises follow no probe) is probed again a
//! second after it stops.
//!
//! A tick whose program ran under a millisecond of CPU has no stall to
//! speak of and counts as none: the memory of an idle program is
//! reclaimed, down to the floor.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use zmem_common::stall::{CpuMeter, History, Sample};

use zmem_uffd::tree::Tree;

/// How often the controller looks and moves the limit.
pub(crate) const TICK: Duration = Duration::from_millis(100);
/// The most a tick lowers the limit: 2.5% of the usage (about a fifth a
/// second, where nothing stalls).
pub(crate) const DOWN_STEP: f64 = 0.025;
/// The least a probe down cuts: a tenth of a percent of the usage.
pub(crate) const MIN_PROBE: f64 = 0.001;
/// A held limit comes down to the usage and this much more, where the
/// usage does not grow. The high watermark (99% of the limit) stays above
/// the usage, so the trim evicts nothing; the low watermark (97%) falls
/// below it, so loads keep no clean copies in the pool (a pager keeps them
/// only under the low watermark): with 5%, the copies each trim made room
/// for raised the usage, and the next trim with it, and a working set of
/// 160 MiB ended with a limit of 203 MiB.
pub(crate) const HEADROOM: f64 = 0.025;
/// After a rise, no probe down for this many ticks at first (a second)…
const MIN_BACKOFF: u32 = 10;
/// …doubled at every rise, up to this (ten seconds), and a tick less at
/// every step down.
const MAX_BACKOFF: u32 = 100;
/// A tick raises the limit by this much per target of stall over the
/// target (at twice the target, 10%)…
pub(crate) const UP_GAIN: f64 = 0.10;
/// …and at most by half.
pub(crate) const UP_STEP: f64 = 0.5;
/// The window over which the stall must be low before the limit goes down.
const DOWN_WINDOW: Duration = Duration::from_secs(1);

/// The limit's controller: the arithmetic, apart from the looking.
#[derive(Debug, Clone)]
pub(crate) struct Controller {
    /// The stall to hold, percent of CPU time.
    pub(crate) target: f64,
    pub(crate) floor: usize,
    pub(crate) ceiling: usize,
    pub(crate) limit: usize,
    /// The most the next probe down cuts, a share of the usage.
    pub(crate) probe: f64,
    /// Ticks to wait after a rise before probing down again, and the
    /// tick that wait ends.
    backoff: u32,
    hold_until: u64,
    ticks: u64,
    /// The tick of the last step down.
    last_down: u64,
}

impl Controller {
    pub(crate) fn new(target: f64, floor: usize, ceiling: usize) -> Self {
        Controller {
            target,
            floor,
            ceiling: ceiling.max(floor),
            limit: ceiling.max(floor),
            probe: DOWN_STEP,
            backoff: MIN_BACKOFF,
            hold_until: 0,
            ticks: 0,
            last_down: 0,
        }
    }

    /// The next limit, from the stall over the last tick and the share of
    /// it that a rise of [`UP_STEP`] would save (`Stall`), the stall over
    /// the last second (percent; `None`: the program was idle), the tree's
    /// usage and what it was a second ago.
    pub(crate) fn step(&mut self, tick: Option<Stall>, second: Option<f64>, usage: usize, before: usize) -> usize {
        let growing = usage as f64 > before as f64 * (1.0 + DOWN_STEP);
        let tick = tick.unwrap_or(Stall { percent: 0.0, near: 1.0 });
        let second = second.unwrap_or(0.0);
        let half = self.target / 2.0;
        self.ticks += 1;
        let next = if tick.percent > self.target {
            let up =
                if tick.near < 0.5 { UP_STEP } else { (UP_GAIN * (tick.percent / self.target - 1.0)).min(UP_STEP) };
            // A rise within a second of a step down: the probe failed.
            if self.last_down > 0 && self.ticks - self.last_down <= u64::from(MIN_BACKOFF) {
                self.probe = (self.probe / 2.0).max(MIN_PROBE);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                self.hold_until = self.ticks + u64::from(self.backoff);
            } else {
                self.hold_until = self.ticks + u64::from(MIN_BACKOFF);
            }
            (self.limit.min(usage) as f64 * (1.0 + up)).max(self.limit as f64)
        } else if second < half && !growing && self.ticks >= self.hold_until {
            let down = self.probe * (1.0 - second / half);
            self.probe = (self.probe * 1.1).min(DOWN_STEP);
            self.backoff = (self.backoff - 1).max(MIN_BACKOFF);
            self.last_down = self.ticks;
            // From the usage, and never further under it: where reclaim
            // lags (a loaded machine), cut upon cut took the limit past
            // the usage by more than the throttle's slack
            // (`zmem_uffd::tree::CONTROLLED_OVERAGE_DIV`), and the
            // program waited on every fault.
            (usage as f64 * (1.0 - down)).min(self.limit as f64)
        } else if !growing {
            // Held: trimmed to the usage and a margin, which evicts nothing.
            (self.limit as f64).min(usage as f64 * (1.0 + HEADROOM))
        } else {
            self.limit as f64
        };
        self.limit = (next as usize).clamp(self.floor, self.ceiling);
        self.limit
    }
}

/// A tick's stall, percent of the CPU time run, and the share of it that a
/// limit [`UP_STEP`] larger would have saved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Stall {
    pub(crate) percent: f64,
    pub(crate) near: f64,
}

/// One tick of what the controller saw, for the report.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(crate) struct Point {
    pub(crate) secs: f64,
    pub(crate) limit: u64,
    pub(crate) usage: u64,
    pub(crate) pool: u64,
    /// The stall over the tick, percent; `None`: idle.
    pub(crate) stall: Option<f64>,
    /// The share of it a limit [`UP_STEP`] larger would have saved.
    pub(crate) near: Option<f64>,
}

/// The tree's counters a tick, summed over its processes: the stall, its
/// loads' part and the loads by refault distance.
type Counts = [u64; 2 + zmem_uffd::REFAULT_BUCKETS];
const STALL: usize = 0;
const LOAD_STALL: usize = 1;

/// Adds up the tree's counters over processes that come and go, as
/// `CpuMeter` does the threads' CPU time.
#[derive(Debug, Default)]
struct Counted {
    last: std::collections::HashMap<u32, Counts>,
    total: Counts,
}

impl Counted {
    fn sample(&mut self, members: &[zmem_uffd::tree::MemberStats]) -> Counts {
        let mut now = std::collections::HashMap::new();
        for m in members {
            let mut c: Counts = [0; 2 + zmem_uffd::REFAULT_BUCKETS];
            c[STALL] = m.stall_ns;
            c[LOAD_STALL] = m.load_stall_ns;
            c[2..].copy_from_slice(&m.refaults);
            let before = self.last.get(&m.pid).copied().unwrap_or_default();
            for i in 0..c.len() {
                self.total[i] += c[i].saturating_sub(before[i]);
            }
            now.insert(m.pid, c);
        }
        self.last = now;
        self.total
    }
}

/// What `zmem run` asked of the controller's thread.
pub(crate) struct Watch {
    /// `Some`: move the limit; `None`: only look (for `--report`).
    pub(crate) controller: Option<Controller>,
    pub(crate) report: Option<PathBuf>,
}

/// The stall between two samples, and the share of it that a limit
/// [`UP_STEP`] larger would have saved: all of it but the loads', and of
/// the loads' the share whose refault distances were within that step.
fn tick_stall(old: &Sample<Counts>, new: &Sample<Counts>) -> Option<Stall> {
    let d = |i: usize| new.extra[i].saturating_sub(old.extra[i]);
    let percent = new.stall_percent_since(old)?;
    let (stall, loads_stall) = (d(STALL), d(LOAD_STALL));
    let refaults: [u64; zmem_uffd::REFAULT_BUCKETS] = std::array::from_fn(|i| d(2 + i));
    let n: u64 = refaults.iter().sum();
    let saved = if n == 0 { 1.0 } else { zmem_uffd::refaults_within(&refaults, UP_STEP) / n as f64 };
    let near = stall.saturating_sub(loads_stall) as f64 + loads_stall as f64 * saved;
    Some(Stall { percent, near: if stall == 0 { 1.0 } else { near / stall as f64 } })
}

/// Looks at the tree every [`TICK`] until `done`, moving its limit if
/// there is a controller; returns what it saw.
pub(crate) fn watch(tree: &Tree, mut w: Watch, done: &AtomicBool) -> Vec<Point> {
    let t0 = Instant::now();
    let mut cpu = CpuMeter::default();
    let mut counted = Counted::default();
    let mut history: History<Counts> = History::new(DOWN_WINDOW * 2);
    let mut points = Vec::new();
    loop {
        // Unparked when the program is done.
        let until = Instant::now() + TICK;
        while !done.load(Ordering::Acquire) && Instant::now() < until {
            std::thread::park_timeout(until.saturating_duration_since(Instant::now()));
        }
        if done.load(Ordering::Acquire) {
            break;
        }
        let members = tree.members();
        let threads = members.iter().flat_map(|m| {
            let t = zmem_common::stall::program_threads_cpu_ns(Some(m.pid)).unwrap_or_default();
            t.into_iter().map(move |(tid, ns)| ((m.pid, tid), ns))
        });
        let cpu_ns = cpu.sample(threads);
        let c = counted.sample(&members);
        let now = Instant::now();
        history.push(Sample { at: now, stall_ns: c[STALL], cpu_ns, extra: c });
        // A tick a little late still counts as the last tick.
        let tick = history.window(TICK + TICK / 2).and_then(|(old, new)| tick_stall(old, new));
        let second = history.stall_percent(DOWN_WINDOW);
        let usage: u64 = members.iter().map(|m| m.usage).sum();
        let a_second_ago = points.iter().rev().find(|p: &&Point| now.duration_since(t0).as_secs_f64() - p.secs >= 1.0);
        if let Some(c) = w.controller.as_mut() {
            tree.set_limit(c.step(tick, second, usage as usize, a_second_ago.map_or(0, |p| p.usage) as usize));
        }
        points.push(Point {
            secs: now.duration_since(t0).as_secs_f64(),
            limit: tree.limit() as u64,
            usage,
            pool: members.iter().map(|m| m.pool).sum(),
            stall: tick.map(|t| t.percent),
            near: tick.map(|t| t.near),
        });
    }
    if let Some(path) = &w.report {
        if let Err(e) = report(&points, w.controller.as_ref().map(|c| c.target), path) {
            eprintln!("zmem run: --report {}: {e:#}", path.display());
        }
    }
    points
}

/// The SVG of `--report`: limit, usage, resident (usage less the pool) and
/// pool over time, and the stall below them, with the target. A FILE that
/// ends in `.json` gets the points themselves, one object a tick.
fn report(points: &[Point], target: Option<f64>, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    if path.extension().is_some_and(|e| e == "json") {
        let text = serde_json::to_string(&serde_json::json!({ "max_slowdown_percent": target, "points": points }))?;
        return std::fs::write(path, text).with_context(|| format!("write {}", path.display()));
    }
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("{e}");
    let end = points.last().map_or(1.0, |p| p.secs).max(1.0);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let top = points.iter().map(|p| mib(p.limit.max(p.usage))).fold(16.0, f64::max) * 1.1;
    let stall_top = points.iter().filter_map(|p| p.stall).fold(target.unwrap_or(5.0) * 2.0, f64::max).min(100.0);
    let root = SVGBackend::new(path, (900, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (upper, lower) = root.split_vertically(420);
    let title = match target {
        Some(t) => format!("zmem run --max-slowdown {t}%: memory"),
        None => "zmem run: memory".to_string(),
    };
    let mut c = ChartBuilder::on(&upper)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..top)
        .map_err(|e| err(&e))?;
    c.configure_mesh().y_desc("MiB").x_desc("seconds").draw().map_err(|e| err(&e))?;
    // A line: its name, its colour, its value at a point.
    type Series = (&'static str, RGBColor, fn(&Point) -> u64);
    let series: [Series; 4] = [
        ("limit", RGBColor(0, 0, 0), |p| p.limit),
        ("usage", RGBColor(66, 133, 244), |p| p.usage),
        ("resident", RGBColor(52, 168, 83), |p| p.usage.saturating_sub(p.pool)),
        ("pool", RGBColor(234, 67, 53), |p| p.pool),
    ];
    for (name, color, get) in series {
        c.draw_series(LineSeries::new(points.iter().map(|p| (p.secs, mib(get(p)))), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    c.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    let mut s = ChartBuilder::on(&lower)
        .caption("stall on the limit, % of the program's CPU time", ("sans-serif", 16))
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..stall_top)
        .map_err(|e| err(&e))?;
    s.configure_mesh().y_desc("%").x_desc("seconds").draw().map_err(|e| err(&e))?;
    let stall = points.iter().map(|p| (p.secs, p.stall.unwrap_or(0.0).min(stall_top)));
    s.draw_series(LineSeries::new(stall, RGBColor(234, 67, 53).stroke_width(2))).map_err(|e| err(&e))?;
    if let Some(t) = target {
        s.draw_series(LineSeries::new([(0.0, t), (end, t)], BLACK.stroke_width(1))).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e)).with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

/// The machine's memory (`MemTotal`): the ceiling of a controller given no
/// `--limit`.
pub(crate) fn machine_memory() -> Result<usize> {
    let t = std::fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
    let b = zmem_common::procfs::kb_field(&t, "MemTotal:").context("no MemTotal in /proc/meminfo")?;
    Ok(b as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    const M: usize = 1 << 20;

    fn ctl() -> Controller {
        Controller::new(5.0, 16 * M, 1024 * M)
    }

    /// A tick's stall, all of it near.
    fn near(percent: f64) -> Option<Stall> {
        Some(Stall { percent, near: 1.0 })
    }

    #[test]
    fn an_idle_or_unstalled_program_is_probed_down_from_its_usage() {
        let mut c = ctl();
        assert_eq!(c.limit, 1024 * M, "it starts at the ceiling");
        // No stall: a step under the usage at once, not under the ceiling.
        assert_eq!(c.step(near(0.0), Some(0.0), 200 * M, 200 * M), (200.0 * M as f64 * (1.0 - DOWN_STEP)) as usize);
        // Idle counts as no stall, and reclaim follows the limit down; the
        // floor holds.
        for _ in 0..200 {
            c.step(None, None, c.limit, c.limit);
        }
        assert_eq!(c.limit, 16 * M);
        // Usage that lags a cut (reclaim behind it) holds the limit, which
        // stays within the throttle's slack of it.
        c.limit = 100 * M;
        let cut = (102.0 * M as f64 * (1.0 - DOWN_STEP)) as usize;
        assert_eq!(c.step(near(0.0), Some(0.0), 102 * M, 102 * M), cut);
        assert_eq!(c.step(near(0.0), Some(0.0), 103 * M, 103 * M), cut);
        assert!(1.0 / (1.0 - DOWN_STEP) < 1.0 + 1.0 / zmem_uffd::tree::CONTROLLED_OVERAGE_DIV as f64);
    }

    #[test]
    fn a_stall_over_the_target_raises_the_limit_fast_and_the_dead_band_holds_it() {
        let mut c = ctl();
        c.limit = 100 * M;
        // Twice the target: 10% up; far over: at most half. Each rise
        // halves the probe.
        // Rises that follow a probe halve it and double the backoff.
        (c.ticks, c.last_down) = (5, 5);
        assert_eq!(c.step(near(10.0), Some(10.0), 100 * M, 100 * M), 110 * M);
        assert_eq!(c.step(near(500.0), Some(100.0), 110 * M, 110 * M), 165 * M);
        assert!((c.probe - DOWN_STEP / 4.0).abs() < 1e-12);
        assert_eq!(c.backoff, 4 * MIN_BACKOFF, "doubled twice");
        // Between half the target and the target: held, where the usage
        // takes it all.
        assert_eq!(c.step(near(4.0), Some(3.0), 165 * M, 165 * M), 165 * M);
        // A quiet tick after a bad second: held too.
        assert_eq!(c.step(near(0.0), Some(3.0), 165 * M, 165 * M), 165 * M);
        // Quiet over the second, but within the backoff after the second
        // rise (4 s): held.
        for _ in 0..37 {
            assert_eq!(c.step(near(0.0), Some(0.0), 165 * M, 165 * M), 165 * M);
        }
        // Then down, by less as the stall nears half.
        let l = c.step(near(1.0), Some(1.25), 165 * M, 165 * M);
        assert_eq!(l, (165.0 * M as f64 * (1.0 - DOWN_STEP / 4.0 * 0.5)) as usize);
        for _ in 0..40 {
            c.step(near(0.0), Some(0.0), 165 * M, 165 * M);
        }
        assert_eq!(c.probe, DOWN_STEP, "grown back");
        // Far refaults: half at once, whatever the overshoot.
        c.limit = 100 * M;
        assert_eq!(c.step(Some(Stall { percent: 6.0, near: 0.1 }), Some(6.0), 100 * M, 100 * M), 150 * M);
        // Not above what the usage needs.
        assert_eq!(c.step(Some(Stall { percent: 6.0, near: 0.1 }), Some(6.0), 20 * M, 20 * M), 150 * M);
        // Held with usage well under the limit: trimmed to the headroom.
        c.limit = 200 * M;
        c.hold_until = u64::MAX;
        assert_eq!(c.step(near(4.0), Some(3.0), 100 * M, 100 * M), (100.0 * M as f64 * (1.0 + HEADROOM)) as usize);
        // Growing fast: no probe down and no trim, though the stall is low.
        c.limit = 100 * M;
        c.hold_until = 0;
        assert_eq!(c.step(near(0.0), Some(0.0), 100 * M, 90 * M), 100 * M);
        assert_eq!(c.step(near(0.0), Some(0.0), 50 * M, 40 * M), 100 * M);
        assert!(c.step(near(0.0), Some(0.0), 100 * M, 98 * M) < 100 * M, "slowly: probed");
        // Never over the ceiling.
        c.limit = 1000 * M;
        assert_eq!(c.step(near(1000.0), None, 1000 * M, 1000 * M), 1024 * M);
    }

    /// A model program: a working set `ws` re-read at random; below it,
    /// the stall is the share it misses times a cost that makes a 1% miss
    /// rate a 20% stall. The limit must settle within a quarter of the
    /// working set, with the stall near or under the target, and follow a
    /// change of working set (a phase) within a few seconds.
    #[test]
    fn the_limit_settles_near_the_working_set_and_follows_a_phase_change() {
        let mut c = ctl();
        let stall = |limit: usize, ws: usize| (ws.saturating_sub(limit) as f64 / ws as f64) * 2000.0;
        for ws in [64 * M, 400 * M, 48 * M] {
            let (mut last, mut over) = (0.0, 0);
            for i in 0..120 {
                let s = stall(c.limit, ws);
                c.step(near(s), Some(s.max(last)), ws.min(c.limit), ws.min(c.limit));
                last = s;
                if i >= 40 && s > c.target {
                    over += 1;
                }
            }
            let l = c.limit as f64 / ws as f64;
            assert!((0.75..=1.25).contains(&l), "working set {} MiB: limit {} MiB", ws / M, c.limit / M);
            assert!(over <= 8, "working set {} MiB: {over} ticks of 80 over the target", ws / M);
        }
    }
}
