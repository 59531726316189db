//! The reclaim thread: wakes on a kick or every 10 ms, runs the timed
//! chores, scans for mappings to adopt, and evicts (`evict.rs`) from the
//! high watermark down to the low one, or backs off and turns the limit
//! soft when nothing can go.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zmem_common::{unpoison, LockExt};

use super::balance::Balance;
use super::lru::{SHARED_RESCAN, UNEVICTABLE_RESCAN};
use super::staging::Staging;
use super::stats::inc;
use super::{Inner, Pass};
use crate::pagemap::WriteTracker;
use crate::sys::UffdError;
use zmem_common::PAGE_SIZE;

/// How often idle reclaim recompresses, and at most how many pages each
/// time: ~2,000 pages a second is ~30 ms of zstd:1 on this machine (the
/// tier bench recompresses at ~260 MB/s), 3% of a CPU. Faster, while the
/// limit is soft (every 50 ms), held 1.45x the pages in a full pool for
/// Python under `--no-writeback`, but ran it 35% slower at the same peak
/// RSS: not kept.
const RECOMPRESS_INTERVAL: Duration = Duration::from_millis(1000);
const RECOMPRESS_PAGES: usize = 2048;

/// How often reclaim sweeps the tree for members that are gone.
const TREE_SWEEP: Duration = Duration::from_secs(1);

/// How long a round waits for a kick; before the first scan for mappings
/// to adopt, for the handlers to run (`Inner::threads_running`).
const ROUND_WAIT: Duration = Duration::from_millis(10);
const FIRST_SCAN_POLL: Duration = Duration::from_millis(1);

/// The reclaim thread's state: what each of its steps last did, for when
/// it is due again.
struct Reclaimer {
    staging: Staging,
    /// `None` without write tracking: reclaim sees faults only.
    tracker: Option<WriteTracker>,
    /// Backing off after a reclaim that could evict nothing: until
    /// `retry_at`, doubling from 50 ms to 2 s.
    backoff: Duration,
    retry_at: Instant,
    /// Stuck with the lists empty (the rest pinned, locked, or pool): the
    /// program's next loads put folios there, and reclaim goes for them at
    /// once, not after the backoff (the limit stays a limit for what can be
    /// evicted).
    stuck_on_empty_lists: bool,
    /// The soft limit was warned of (once a process).
    warned: bool,
    rescan_at: Instant,
    shared_at: Instant,
    scanned_at: Option<Instant>,
    scanned_rss: usize,
    /// `/proc/thread-self/statm`, kept open, with adoption on.
    statm: Option<zmem_common::host::fds::KeptFd>,
    recompress: Option<zmem_tier::CodecSpec>,
    recompressed_at: Instant,
    chores: Chores,
}

/// The state of [`Inner::timed_chores`].
struct Chores {
    swept_at: Instant,
    balance: Balance,
    codec: super::codec::CodecBalance,
}

impl Inner {
    /// The reclaim thread. Each round, in this order:
    ///
    /// | step | when | what |
    /// |---|---|---|
    /// | `rescans` | a fork's shared folios every `SHARED_RESCAN` (or when asked); unevictable ones every `UNEVICTABLE_RESCAN` | back on the lists to be looked at again |
    /// | wait | a kick, or 10 ms (1 ms before the first scan) | |
    /// | `timed_chores` | each on its own timer | the tree's sweep, the pool's share, the codec |
    /// | `scan_if_due` | with adoption: its interval, an eighth of it over the high watermark, or 2 ms after RSS grew by a sixteenth of the limit | adopt the mappings the program made itself |
    /// | `reclaim` | over the high watermark, unless backing off | evict to the low watermark, or turn the limit soft |
    /// | `recompress_if_idle` | under the high watermark or soft, every `RECOMPRESS_INTERVAL` | the pool's cold entries to the stronger codec |
    ///
    /// The reclaim gate is held from the scan to the recompression: a fork
    /// or an adoption that takes it waits for the round to end.
    pub(super) fn reclaim_main(self: Arc<Self>, staging: Staging) {
        let now = Instant::now();
        let mut r = Reclaimer {
            staging,
            tracker: if self.tracking {
                WriteTracker::open().map_err(|e| log::warn!("no write tracking ({e}); reclaim sees faults only")).ok()
            } else {
                None
            },
            backoff: Duration::ZERO,
            retry_at: now,
            stuck_on_empty_lists: false,
            warned: false,
            rescan_at: now + UNEVICTABLE_RESCAN,
            shared_at: now,
            scanned_at: None,
            scanned_rss: 0,
            statm: self.cfg.adopt.as_ref().and_then(|_| {
                use rustix::fs::{Mode, OFlags};
                zmem_common::host::fds::open_kept(zmem_common::host::fds::Wait::Yes, rustix::io::Errno::AGAIN, || {
                    rustix::fs::open("/proc/thread-self/statm", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
                })
                .ok()
            }),
            recompress: self.cfg.recompress,
            recompressed_at: now,
            chores: Chores { swept_at: now, balance: Balance::new(), codec: super::codec::CodecBalance::new() },
        };
        loop {
            self.rescans(&mut r);
            // Before it waits (`zmem_common::host::tls`).
            zmem_common::host::tls::keep_resident();
            {
                // Until the first scan, what the program fills in the
                // mappings it made before the start (a late start's) is
                // not managed: it waits for the handlers only.
                let wait = if r.scanned_at.is_none() && self.adopts() { FIRST_SCAN_POLL } else { ROUND_WAIT };
                let mut k = self.acct.kick.0.lock_ok();
                if !*k {
                    k = unpoison(self.acct.kick.1.wait_timeout(k, wait)).0;
                }
                *k = false;
            }
            if self.stop.load(Ordering::Acquire) {
                // Unregister before the munmap: an UNMAP event would wait
                // for a handler that may already be gone.
                r.staging.unregister(&self.uffd);
                return;
            }
            self.refresh_limit();
            self.timed_chores(&mut r.chores);
            if self.usage() <= self.limit() {
                self.acct.soft.store(false, Ordering::Relaxed);
            }
            let gate = self.fork.reclaim_gate.lock_ok();
            self.scan_if_due(&mut r);
            let due = Instant::now() >= r.retry_at || (r.stuck_on_empty_lists && self.evictable_listed());
            if self.usage() > self.high() && due && !self.is_frozen() {
                self.reclaim(&mut r);
            }
            self.recompress_if_idle(&mut r);
            drop(gate);
            self.acct.reclaim_rounds.fetch_add(1, Ordering::Release);
            self.wake_reclaim_waiters();
        }
    }

    fn is_frozen(&self) -> bool {
        self.fork.frozen.load(Ordering::Acquire)
    }

    /// Folios set aside go back on the lists when their time comes: those a
    /// fork left shared (`Lru::shared`), and the unevictable ones.
    fn rescans(&self, r: &mut Reclaimer) {
        if self.fork.forked.load(Ordering::Relaxed)
            && (r.shared_at.elapsed() >= SHARED_RESCAN || self.lists.rescan_shared_now.load(Ordering::Acquire))
        {
            r.shared_at = Instant::now();
            self.rescan_shared(&r.staging);
            self.lists.rescan_shared_now.store(false, Ordering::Release);
            self.wake_reclaim_waiters();
        }
        if Instant::now() >= r.rescan_at {
            r.rescan_at = Instant::now() + UNEVICTABLE_RESCAN;
            let mut lru = self.lists.lru.lock_ok();
            let back = std::mem::take(&mut lru.unevictable);
            lru.inactive.extend(back);
        }
    }

    /// With adoption on: a scan for mappings to adopt on the timer, before
    /// evicting (at most 8 times as often), and when the process's RSS has
    /// grown by a sixteenth of the limit since the last scan (a program
    /// filling memory it mapped itself, faster than the timer).
    ///
    /// After a scan (or at once, without adoption), what this process
    /// published as mapped before its pager started stops counting in the
    /// tree (`Tree::join`): the pager's own count holds that memory now.
    fn scan_if_due(&self, r: &mut Reclaimer) {
        let Some(cfg) = self.cfg.adopt.as_ref().filter(|_| self.adopts()) else {
            self.forget_waiting_usage();
            return;
        };
        // Not before the handlers run (see `Pager::adopt`).
        if !self.threads_running() {
            return;
        }
        let since = r.scanned_at.map_or(Duration::MAX, |t| t.elapsed());
        let over = self.usage() > self.high();
        let rss = r.statm.as_ref().and_then(resident_bytes);
        let grew = rss.is_some_and(|b| b > r.scanned_rss + (self.limit() / 16).max(2 << 20));
        if !self.is_frozen()
            && (since >= cfg.interval
                || (over && since >= cfg.interval / 8)
                || (grew && since >= Duration::from_millis(2)))
        {
            if let Err(e) = self.scan_mappings(cfg) {
                log::warn!("a scan for mappings to adopt failed: {e}");
            }
            r.scanned_at = Some(Instant::now());
            r.scanned_rss = rss.unwrap_or(0);
            self.forget_waiting_usage();
        }
    }

    /// Whether the reclaim thread scans for mappings to adopt.
    fn adopts(&self) -> bool {
        self.cfg.adopt.is_some() && self.adopting.load(Ordering::Relaxed)
    }

    /// See [`scan_if_due`](Self::scan_if_due): one store, after each scan.
    fn forget_waiting_usage(&self) {
        if let Some(m) = &self.acct.member {
            m.publish_mapped(0);
        }
    }

    /// Evicts batches until usage is under the low watermark, or until a
    /// pass evicts nothing: then the limit turns soft (`stuck`).
    fn reclaim(&self, r: &mut Reclaimer) {
        r.stuck_on_empty_lists = false;
        while self.usage() > self.low() && !self.is_frozen() {
            // A pool over its limit (a tree member's share shrank:
            // `refresh_limit`) is written back first; no store may come to
            // do it if nothing is left to evict.
            let pool_before = self.tier.pool_total_size();
            self.tier.shrink_to_limit();
            let shrank = self.tier.pool_total_size() < pool_before;
            let pass = self.evict_batch(&mut r.staging, r.tracker.as_mut());
            if let Some(m) = &self.acct.member {
                m.add_evicted(pass.evicted as u64);
            }
            self.refresh_limit();
            // A program that loads as fast as reclaim stores keeps this
            // loop going for seconds.
            self.timed_chores(&mut r.chores);
            self.wake_reclaim_waiters();
            if shrank || pass.evicted + pass.parked + pass.rescued > 0 || (pass.unevictable > 0 && pass.rejected == 0) {
                // Progress, or unevictable folios set aside: go on.
                r.backoff = Duration::ZERO;
                self.acct.soft.store(false, Ordering::Relaxed);
                continue;
            }
            self.stuck(r, &pass);
            break;
        }
        // Done for now: the stale copies in staging go.
        let freed = r.staging.release(&self.uffd);
        self.staging_freed(freed);
    }

    /// A pass evicted nothing. The free pages the tier keeps for reuse go
    /// back to the OS: stuck, the process should hold no more than it
    /// must. If the pool is full and writeback is off or failing, or what
    /// is left is unevictable, the limit turns soft, as memory.high does,
    /// and reclaim backs off rather than spin.
    fn stuck(&self, r: &mut Reclaimer, pass: &Pass) {
        self.tier.release_free_pages();
        if self.usage() <= self.limit() && pass.rejected + pass.unevictable == 0 {
            return;
        }
        r.backoff = (r.backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(2));
        r.retry_at = Instant::now() + r.backoff;
        // (Whatever is listed now came after the pass looked: a fault
        // since.)
        r.stuck_on_empty_lists = pass.isolated == 0;
        if self.acct.soft.swap(true, Ordering::Relaxed) {
            return;
        }
        inc(&self.counters.limit_soft_events);
        // A tree member squeezed to the smallest share (the others hold the
        // rest of the limit: a forked worker beside its parent) is no news,
        // nor one with at most half of the tree's limit a floor's worth over
        // its share. Python's `multiprocessing` workers (a few MiB of pool
        // and metadata, nothing to evict, beside a parent holding the rest)
        // got shares of 2-4 MiB under 32M and 150M, just above the floor,
        // and warned. A lone process, or one holding most of the tree's
        // limit, still warns: that is the user's limit missed. Nor where a
        // controller moves the limit (`zmem run --max-slowdown`): it probes
        // down to what cannot be evicted, an idle program's to its floor,
        // and is not the user's.
        let floor = self.limit_controlled()
            || self.acct.member.as_ref().is_some_and(|m| {
                let floor = self.share_floor();
                self.limit() <= floor || (self.limit() <= m.tree().limit() / 2 && self.usage() <= self.limit() + floor)
            });
        if r.warned {
            return;
        }
        r.warned = !floor;
        // Once per tree: its other processes would say the same
        // (`ZMEM_LOG=info` shows them).
        let first =
            !floor && self.acct.member.as_ref().is_none_or(|m| m.tree().first_warning(crate::tree::Warning::SoftLimit));
        let level = if first { log::Level::Warn } else { log::Level::Info };
        log::log!(
            level,
            "usage {} MiB cannot get down to its reclaim target of {} MiB (limit {} MiB): nothing more can be \
             evicted ({}); the limit is soft until reclaim succeeds again",
            self.usage() >> 20,
            self.low() >> 20,
            self.limit() >> 20,
            self.stuck_reason(pass)
        );
    }

    /// Idle, or stuck with the pool full (the limit soft: what
    /// recompression frees lets reclaim go on): the pool's cold entries to
    /// the stronger compressor, a slice at a time
    /// (`PagerConfig::recompress`).
    fn recompress_if_idle(&self, r: &mut Reclaimer) {
        let Some(spec) = r.recompress else { return };
        let idle = self.usage() <= self.high() || self.acct.soft.load(Ordering::Relaxed);
        if !idle || r.recompressed_at.elapsed() < RECOMPRESS_INTERVAL || self.is_frozen() {
            return;
        }
        r.recompressed_at = Instant::now();
        match self.tier.recompress(spec, RECOMPRESS_PAGES, true) {
            // The objects left behind free zspages once packed.
            Ok(x) if x.moved > 0 => {
                self.tier.compact();
            }
            Ok(_) => {}
            Err(e) => {
                log::warn!("recompression with {spec} failed ({e}); it stops");
                r.recompress = None;
            }
        }
    }

    /// The chores on a timer of their own, each a no-op until it is due:
    /// the tree's sweep for members that are gone (every second), the
    /// pool's share (`balance.rs`) and the codec of new stores
    /// (`codec.rs`). Reclaim runs them at each wake-up and after each pass
    /// of a reclaim that goes on: node's random reads under 200M loaded
    /// ~40k pages a second for ten seconds in one reclaim, and the share
    /// and codec of its start (14%, zstd:1) held throughout, though the
    /// swap file then served under 1% of the loads; 18.8 s against the
    /// 13.8 s of a run that happened to reach the floor and lz4 first.
    fn timed_chores(&self, c: &mut Chores) {
        if let Some(m) = &self.acct.member {
            if c.swept_at.elapsed() >= TREE_SWEEP {
                c.swept_at = Instant::now();
                m.tree().sweep();
            }
        }
        self.balance_pool(&mut c.balance);
        self.balance_codec(&mut c.codec);
    }

    /// Whether a folio waits on the active, inactive or once list (not set
    /// aside as unevictable or shared).
    fn evictable_listed(&self) -> bool {
        let lru = self.lists.lru.lock_ok();
        !(lru.active.is_empty() && lru.inactive.is_empty() && lru.once.is_empty())
    }

    /// Counts a free of the staging area; on an error (registering it
    /// again failed) reclaim stops. Returns whether reclaim may go on.
    pub(super) fn staging_freed(&self, freed: Result<bool, UffdError>) -> bool {
        match freed {
            Ok(f) => {
                if f {
                    inc(&self.counters.staging_frees);
                }
                true
            }
            Err(e) => {
                log::error!("re-registering the staging area failed ({e}); reclaim stops");
                self.stop.store(true, Ordering::Release);
                false
            }
        }
    }

    /// Why a pass that evicted nothing could not, for the warning.
    fn stuck_reason(&self, pass: &Pass) -> String {
        let why = if pass.rejected > 0 {
            if self.tier.config().writeback {
                "the pool is full and writeback fails"
            } else {
                "the pool is full and writeback is off"
            }
        } else if pass.unevictable > 0 || !self.lists.lru.lock_ok().unevictable.is_empty() {
            "what is left is locked or pinned"
        } else {
            "nothing is on the reclaim lists: the rest is the pool, metadata, or pages shared with another process"
        };
        match &self.acct.member {
            Some(m) => format!("{why}; the limit is this process's share of the tree's {} MiB", m.tree().limit() >> 20),
            None => why.to_string(),
        }
    }
}

/// The process's resident bytes, from `/proc/self/statm` (its second
/// field, in pages): one `pread`, no allocation.
fn resident_bytes(statm: &zmem_common::host::fds::KeptFd) -> Option<usize> {
    let mut buf = [0u8; 128];
    let n = rustix::io::pread(statm, &mut buf, 0).ok()?;
    let pages = zmem_common::procfs::statm_field(std::str::from_utf8(&buf[..n]).ok()?, 1)?;
    Some(pages * PAGE_SIZE)
}
