//! The codec of new stores: the fast one, or a stronger one while the
//! swap file serves many of the random loads.
//!
//! While the pool holds what is evicted, the fastest codec wins: every
//! store and load pays for it, and a smaller pool only moves pages between
//! resident and compressed. Once the swap file serves many loads, a page
//! the pool could not hold costs a read from the disk (~60 µs with
//! `O_DIRECT`), its writeback before that, and the fault's wait, against a
//! few microseconds more of codec work per page; a stronger codec fits
//! more pages in the same pool. Measured here (one run each, 144 MB of
//! lines, `sort -S 400M --parallel=2` under `zmem run --limit 100M`): lz4
//! 323-355 s, zstd:1 174-181 s, zstd:1 holding 3.8 pages a pool page where
//! lz4 held 2.0. But where the disk's loads are a walk reading back what
//! was written long ago (`scripts/strings.py 10000000` under 300M, all of
//! its read-back from the disk), a larger pool saves few of them, and
//! zstd:1 took 16.1-17.0 s against lz4's 11.1-11.4 s.
//!
//! So, every `INTERVAL`, the reclaim thread switches new stores to the
//! strong codec when at least `STRONG_PERCENT` of the last interval's
//! loads came from the swap file, fewer than `WALK_PERCENT` were a walk's
//! (loaded by faults that continue a sequential stream, or ahead of them),
//! and a sample of the pool (`Tier::sample_codec`) shrinks to
//! `TIGHTER_PERCENT` or less of its bytes under it. `QUIET_INTERVALS`
//! intervals in a row under `FAST_PERCENT` switch back. Entries keep the
//! codec they were stored with (`Tier::set_compressor`), so a switch costs
//! no work.

use std::time::{Duration, Instant};

use super::stats::inc;
use super::Inner;
use zmem_common::PAGE_SIZE;

/// How often the counters are looked at.
const INTERVAL: Duration = Duration::from_secs(1);
/// Loads from the swap file, percent of all loads, that switch to the
/// strong codec…
const STRONG_PERCENT: u64 = 10;
/// …unless this many percent of the loads were a walk's…
const WALK_PERCENT: u64 = 25;
/// …or the strong codec packs a sample of the pool into more than this
/// percent of its bytes.
const TIGHTER_PERCENT: usize = 80;
/// Pool entries sampled (~1 ms of codec work with zstd:1).
const SAMPLE_PAGES: usize = 64;
/// Under this percent, `QUIET_INTERVALS` times in a row, the fast codec is
/// back.
const FAST_PERCENT: u64 = 2;
const QUIET_INTERVALS: u32 = 5;
/// Fewer loads from the swap file than this in an interval never switch.
const MIN_SWAP_LOADS: u64 = 256;

/// One interval's loads: all, from the swap file, and a walk's (pages).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Traffic {
    pub(super) loads: u64,
    pub(super) swap_loads: u64,
    pub(super) walk_loads: u64,
}

/// What an interval's loads ask of the codec in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Weigh the strong codec (sample the pool).
    TryStrong,
    Fast,
    Stay,
}

/// The reclaim thread's state: the counters at the last look.
#[derive(Debug)]
pub(super) struct CodecBalance {
    at: Instant,
    /// (`zswpin`, `pswpin`, walk pages) then.
    last: (u64, u64, u64),
    strong: bool,
    quiet: u32,
}

impl CodecBalance {
    pub(super) fn new() -> CodecBalance {
        CodecBalance { at: Instant::now(), last: (0, 0, 0), strong: false, quiet: 0 }
    }

    /// One interval's verdict.
    pub(super) fn judge(&mut self, t: Traffic) -> Verdict {
        if !self.strong {
            let busy = t.swap_loads >= MIN_SWAP_LOADS && t.swap_loads * 100 >= t.loads * STRONG_PERCENT;
            let walking = t.walk_loads * 100 >= t.loads * WALK_PERCENT;
            return if busy && !walking { Verdict::TryStrong } else { Verdict::Stay };
        }
        if t.swap_loads * 100 < t.loads * FAST_PERCENT || t.loads == 0 {
            self.quiet += 1;
        } else {
            self.quiet = 0;
        }
        if self.quiet >= QUIET_INTERVALS {
            return Verdict::Fast;
        }
        Verdict::Stay
    }

    /// The codec in use is now the strong one (or not).
    fn switched(&mut self, strong: bool) {
        self.strong = strong;
        self.quiet = 0;
    }
}

/// Whether a sample of `now` pool bytes, `other` under the strong codec,
/// is worth the strong codec's time.
pub(super) fn tighter(now: usize, other: usize) -> bool {
    now > 0 && other * 100 <= now * TIGHTER_PERCENT
}

impl Inner {
    /// Called by the reclaim thread on every wake-up: once an interval,
    /// switches the codec of new stores if the loads ask for it.
    pub(super) fn balance_codec(&self, b: &mut CodecBalance) {
        let Some(strong) = self.cfg.strong_codec else { return };
        if b.at.elapsed() < INTERVAL {
            return;
        }
        b.at = Instant::now();
        let s = self.tier.stats();
        let c = &self.counters;
        let ppf = (self.cfg.folio_size / PAGE_SIZE) as u64;
        let r = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let now = (s.zswpin, s.pswpin, (r(&c.walk_load_faults) + r(&c.readahead_folios)) * ppf);
        let t = Traffic {
            loads: now.0.saturating_sub(b.last.0),
            swap_loads: now.1.saturating_sub(b.last.1),
            walk_loads: now.2.saturating_sub(b.last.2),
        };
        b.last = now;
        let spec = match b.judge(t) {
            Verdict::Stay => return,
            Verdict::Fast => self.cfg.tier.compressor,
            Verdict::TryStrong => match self.tier.sample_codec(strong, SAMPLE_PAGES) {
                Ok(x) if tighter(x.bytes_now, x.bytes_other) => strong,
                Ok(_) => return,
                Err(e) => {
                    log::warn!("sampling the pool under {strong} failed ({e})");
                    return;
                }
            },
        };
        match self.tier.set_compressor(spec) {
            Ok(()) => {
                b.switched(spec == strong);
                inc(&self.counters.codec_switches);
                log::info!(
                    "new stores use {spec}: {} of {} loads came from the swap file in the last second ({} a walk's)",
                    t.swap_loads,
                    t.loads,
                    t.walk_loads
                );
            }
            Err(e) => log::warn!("switching new stores to {spec} failed ({e}); the codec stays"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(loads: u64, swap_loads: u64, walk_loads: u64) -> Traffic {
        Traffic { loads, swap_loads, walk_loads }
    }

    #[test]
    fn random_loads_from_the_swap_file_try_the_strong_codec_and_a_walks_do_not() {
        let mut b = CodecBalance::new();
        assert_eq!(b.judge(t(100_000, 0, 0)), Verdict::Stay);
        assert_eq!(b.judge(t(100_000, 9_000, 0)), Verdict::Stay, "9% is not enough");
        assert_eq!(b.judge(t(1_000, 200, 0)), Verdict::Stay, "too few to judge by");
        // GNU sort under 100M: 19k of 34k loads from the disk, at random.
        assert_eq!(b.judge(t(34_000, 19_000, 400)), Verdict::TryStrong);
        // Python reading back what it wrote, from the disk.
        assert_eq!(b.judge(t(109_000, 107_000, 100_000)), Verdict::Stay);
        assert_eq!(b.judge(t(100_000, 90_000, 25_000)), Verdict::Stay, "a quarter is a walk");
        assert_eq!(b.judge(t(100_000, 90_000, 24_000)), Verdict::TryStrong);
    }

    #[test]
    fn the_strong_codec_must_pack_a_fifth_tighter() {
        assert!(tighter(67_711, 35_420), "GNU sort's lines: lz4 against zstd:1");
        assert!(!tighter(100_000, 81_000));
        assert!(!tighter(0, 0), "an empty sample decides nothing");
    }

    #[test]
    fn the_fast_codec_comes_back_after_five_quiet_intervals_in_a_row() {
        let mut b = CodecBalance::new();
        b.switched(true);
        for _ in 0..4 {
            assert_eq!(b.judge(t(100_000, 1_000, 0)), Verdict::Stay);
        }
        // A busy interval starts the count again.
        assert_eq!(b.judge(t(100_000, 5_000, 0)), Verdict::Stay);
        for _ in 0..4 {
            assert_eq!(b.judge(t(100_000, 0, 0)), Verdict::Stay);
        }
        // An idle interval (no loads at all) is quiet too.
        assert_eq!(b.judge(t(0, 0, 0)), Verdict::Fast);
        b.switched(false);
        assert_eq!(b.judge(t(100_000, 20_000, 0)), Verdict::TryStrong);
    }
}
