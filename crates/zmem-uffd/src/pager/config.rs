//! The pager's settings and errors.

use std::time::Duration;

use thiserror::Error;
use zmem_common::{defaults, ConfigError};
use zmem_tier::{TierConfig, TierError};

use crate::sys::{Features, Uffd, UffdError};
use zmem_common::PAGE_SIZE;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PagerError {
    #[error("invalid pager configuration: {0}")]
    Config(#[from] zmem_common::ConfigError),
    /// A pager thread could not be started.
    #[error("spawn a pager thread: {0}")]
    Spawn(std::io::Error),
    #[error(transparent)]
    Uffd(#[from] UffdError),
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error("mmap: {0}")]
    Map(rustix::io::Errno),
    #[error("the process tree's accounting: {0}")]
    Tree(#[from] crate::tree::TreeError),
    /// A forked child could not take its memory over from its parent.
    #[error("fork hand-over: {0}")]
    Handover(String),
    /// The pager's threads have not all started: nothing is registered
    /// until they have (see `Pager::adopt`).
    #[error("the pager's threads are still starting")]
    Starting,
}

/// Settings of a pager.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Bytes of resident memory plus pool plus metadata the regions may use.
    pub limit: usize,
    /// Reclaim starts above this percent of the limit…
    pub high_watermark_percent: u32,
    /// …and stops below this one.
    pub low_watermark_percent: u32,
    /// The eviction unit: 4 KiB to 2 MiB, a power of two.
    pub folio_size: usize,
    /// Folios per reclaim pass (1..=32); small folios make a pass of at
    /// least `RECLAIM_BATCH_BYTES` (see [`PagerConfig::batch_folios`]).
    pub reclaim_batch: usize,
    /// The longest a fault waits for reclaim when usage is over the limit.
    pub direct_reclaim_wait: Duration,
    /// Threads reading faults from the userfaultfd (1..=16).
    pub handler_threads: usize,
    /// How long a handler busy-polls for the next fault before it blocks in
    /// poll(2). Zero blocks at once: on a 2-vCPU guest a spinning handler
    /// takes a CPU from the program (see `zmem bench fault --spin-us`).
    pub handler_spin: Duration,
    /// How long a handler busy-polls after serving its last fault when that
    /// fault came back to back with the one before (see `pager/spin.rs`):
    /// the program barely runs between its faults, as when it pages a
    /// working set larger than its limit, and blocking would cost two
    /// cross-CPU wake-ups a fault. Zero: never.
    pub handler_spin_hot: Duration,
    /// CPUs the handler threads are pinned to, round-robin; empty: no pinning.
    pub handler_cpus: Vec<usize>,
    /// Where `handler_cpus` is empty: a handler pins itself to the CPU of
    /// the thread that takes most of its faults, and lets go when no thread
    /// does (see `pager/follow.rs`).
    pub handler_follow: bool,
    /// While following: where the scheduler keeps moving the thread
    /// followed off the handler's CPU, hold it there while its faults are
    /// served (its affinity narrowed for that moment; see
    /// `pager/follow.rs`).
    pub handler_hold: bool,
    /// Refresh CLOCK's referenced bits from write tracking (UFFD WP_ASYNC
    /// and PAGEMAP_SCAN) when the kernel offers it. Without it a folio is
    /// referenced only when it is faulted in.
    pub track_writes: bool,
    /// A forked child inherits the regions (whole: see
    /// [`Pager::fork_prepare`](crate::Pager::fork_prepare), which the caller
    /// must run before every fork). Off: regions are `MADV_DONTFORK`, and
    /// a child that touches one gets SIGSEGV.
    pub keep_on_fork: bool,
    /// With `keep_on_fork`: ask for `UFFD_FEATURE_EVENT_FORK`, so that a
    /// fork loads nothing back; the child's evicted pages stay in the tier
    /// and its pager takes them over (`pager/handover.rs`). Needs one
    /// handler thread, which must not wait for a lock the forking thread
    /// holds across fork (the shim gives it a heap of its own with
    /// `handler_init`; without one, `fork_prepare` lets the handler finish
    /// with the forking thread's faults first, but another thread's fault
    /// during the fork may still make it allocate from the C heap and
    /// hang the fork). Off: every evicted folio is loaded back before a
    /// fork.
    pub fork_event: bool,
    /// Run on the handler thread after `thread_init`.
    pub handler_init: Option<fn()>,
    /// Run first on every thread the pager starts (the LD_PRELOAD shim marks
    /// its internal threads with it, so their allocations stay unmanaged).
    pub thread_init: Option<fn()>,
    /// Adopt the program's mappings by scanning the address space (see
    /// `adopt.rs`); `None`: only what [`Pager::map`](crate::Pager::map)
    /// hands out and [`Pager::adopt`](crate::Pager::adopt) is given.
    pub adopt: Option<AdoptConfig>,
    /// Share one limit with a process tree through the segment at this path
    /// (`crate::tree`): the tree's limit replaces `limit`, and this pager
    /// keeps its usage within its share.
    pub tree: Option<std::path::PathBuf>,
    /// How to open the userfaultfd: `Auto` takes the best this process is
    /// allowed; `UserModeOnly` is what a user without privileges gets on a
    /// default kernel (for tests of it).
    pub open_mode: crate::sys::OpenMode,
    pub tier: TierConfig,
    /// Recompress the pool's idle entries with this (stronger) codec in the
    /// background, as zram's `recompress type=idle` does: while usage is
    /// under the high watermark, reclaim takes a slice of the pool each
    /// second; an entry moves when it was not loaded or stored again since
    /// the slice before, and only if its object shrinks by an eighth.
    /// Loads from the stronger codec's pool are slower (zstd:1 ~3x lz4's
    /// time: `zmem bench tier`). `None`: off.
    pub recompress: Option<zmem_tier::CodecSpec>,
    /// Let the pool's share of the limit move between these percents (min,
    /// max), starting at `tier.max_pool_percent`: towards the pool while
    /// loads from the swap file outnumber refaults, towards resident pages
    /// while refaults do (`balance.rs`). `None`: the share stays fixed.
    /// Ignored when `tier.max_pool_bytes` fixes the pool's limit. Off by
    /// default here; on under `zmem run` with a swap file, unless a share
    /// is named (ARCHITECTURE.md, "The pool's share of the limit").
    pub pool_balance: Option<(u32, u32)>,
    /// A stronger codec for new stores while the swap file serves many of
    /// the loads, and back to `tier.compressor` once it serves few
    /// (`pager/codec.rs`). `None`: the codec stays.
    pub strong_codec: Option<zmem_tier::CodecSpec>,
    /// The most bytes a sequential fault loads ahead (the window doubles
    /// up to this, rounded down to folios); 0 turns read-ahead off.
    pub read_ahead: usize,
    /// A fault on an evicted folio that continues no read-ahead stream
    /// loads only this many bytes of it, the aligned block around the
    /// faulting page, as a random access wants (the kernel's swap-in is a
    /// page at a time, plus what its read-ahead finds useful). The rest of
    /// the folio stays in the tier until touched. A fault that continues a
    /// stream loads the whole folio. 0, or the folio size or more (or
    /// folios over 64 pages): whole folios always.
    pub fault_around: usize,
    /// Fault injection for tests: reclaim sleeps this long between looking
    /// up a folio's holes and moving its pages, widening the window an
    /// UNMAP must never slip through (`move_span`). Zero in real use.
    #[doc(hidden)]
    pub inject_move_delay: Duration,
    /// Fault injection for tests: adoption sleeps this long after
    /// registering a range, before it reads which pages are present (a
    /// scan: after registering all it adopts, before each range's pages).
    #[doc(hidden)]
    pub inject_adopt_delay: Duration,
    /// Fault injection for tests: a load sleeps this long between reading
    /// a folio from the tier and COPYing it, widening the window a
    /// REMOVE must never slip through (`copy_folio`).
    #[doc(hidden)]
    pub inject_copy_delay: Duration,
    /// Fault injection for tests: reclaim sleeps this long after its MOVEs
    /// and before it stores the pass, its folios Evicting and `events` not
    /// held, so that events (an mremap's REMAP, a REMOVE) find them so.
    #[doc(hidden)]
    pub inject_store_delay: Duration,
}

/// Which of the program's mappings a scan adopts, and how often it looks.
#[derive(Debug, Clone)]
pub struct AdoptConfig {
    /// Mappings smaller than this are left alone, unless they extend a
    /// mapping already adopted (a heap that grew).
    pub threshold: usize,
    /// Adopt the program's thread stacks too (zmem's own never).
    pub stacks: bool,
    /// Time between scans; reclaim also scans before it evicts, at most
    /// every `interval / 8`.
    pub interval: Duration,
}

impl PagerConfig {
    /// Folios per reclaim pass: `reclaim_batch`, or as many as make
    /// `RECLAIM_BATCH_BYTES` when folios are small. Adjacent victims move
    /// out in one `UFFDIO_MOVE` (one TLB shootdown), so the per-call costs
    /// of a pass do not grow as folios shrink.
    pub fn batch_folios(&self) -> usize {
        Self::batch_folios_for(self.folio_size, self.reclaim_batch)
    }

    /// [`PagerConfig::batch_folios`] of a config with these fields.
    pub fn batch_folios_for(folio_size: usize, reclaim_batch: usize) -> usize {
        reclaim_batch.max(defaults::RECLAIM_BATCH_BYTES / folio_size.max(1))
    }

    /// The userfaultfd features a pager under this config asks for, and
    /// whether it tracks writes and has `UFFDIO_POISON`.
    ///
    /// # Errors
    /// What asking the kernel for its features fails with.
    pub(super) fn uffd_features(&self) -> Result<(Features, bool, bool), PagerError> {
        let mut want = Features::MOVE | Features::EVENT_REMOVE | Features::EVENT_UNMAP | Features::EVENT_REMAP;
        let offered = Uffd::offered(self.open_mode)?;
        let tracking = self.track_writes && offered.contains(Features::WP_ASYNC);
        if tracking {
            want = want | Features::WP_ASYNC;
        }
        if self.fork_event {
            want = want | Features::EVENT_FORK;
        }
        if offered.contains(Features::THREAD_ID) {
            want = want | Features::THREAD_ID; // for `follow.rs`
        }
        let poison = offered.contains(Features::POISON);
        if poison {
            want = want | Features::POISON;
        }
        Ok((want, tracking, poison))
    }

    /// Refuses a config no pager can run under.
    ///
    /// # Errors
    /// [`PagerError::Config`], naming the field.
    pub fn validate(&self) -> Result<(), PagerError> {
        let fs = self.folio_size;
        if !fs.is_power_of_two() || !(PAGE_SIZE..=2 << 20).contains(&fs) {
            return Err(ConfigError::out_of_range("folio_size", fs, "4 KiB..=2 MiB, a power of two").into());
        }
        if !(1..=32).contains(&self.reclaim_batch) {
            return Err(ConfigError::out_of_range("reclaim_batch", self.reclaim_batch, "1..=32").into());
        }
        if self.low_watermark_percent >= self.high_watermark_percent || self.high_watermark_percent > 100 {
            return Err(ConfigError::invalid("watermarks", "they must satisfy low < high <= 100").into());
        }
        if self.limit < 4 * fs * self.batch_folios() {
            return Err(ConfigError::invalid(
                "limit",
                format!("{} is below four reclaim batches ({} bytes)", self.limit, 4 * fs * self.batch_folios()),
            )
            .into());
        }
        if !(1..=16).contains(&self.handler_threads) {
            return Err(ConfigError::out_of_range("handler_threads", self.handler_threads, "1..=16").into());
        }
        if self.fork_event && (!self.keep_on_fork || self.handler_threads != 1) {
            return Err(ConfigError::invalid("fork_event", "it needs keep_on_fork and one handler thread").into());
        }
        Ok(())
    }

    /// The smallest share of a tree's limit a process gets: four reclaim
    /// batches.
    pub fn share_floor(&self) -> usize {
        Self::share_floor_for(self.folio_size, self.reclaim_batch)
    }

    /// [`PagerConfig::share_floor`] of a config with these fields (no
    /// config need be built: the tier's defaults read `/proc/meminfo`).
    pub fn share_floor_for(folio_size: usize, reclaim_batch: usize) -> usize {
        4 * folio_size * Self::batch_folios_for(folio_size, reclaim_batch)
    }

    /// Pages a fault that continues no stream loads (see `fault_around`);
    /// `None`: whole folios.
    pub fn fault_around_pages(&self) -> Option<usize> {
        let ppf = self.folio_size / zmem_common::PAGE_SIZE;
        let n = (self.fault_around / zmem_common::PAGE_SIZE).max(1).next_power_of_two();
        (self.fault_around > 0 && n < ppf && ppf <= 64).then_some(n)
    }

    /// The most folios a sequential fault loads ahead.
    pub fn read_ahead_folios(&self) -> usize {
        self.read_ahead / self.folio_size.max(1)
    }

    /// The newest folios of the once list that reclaim leaves alone: the
    /// window a walk loaded ahead and the folio it is reading, for two
    /// walks per handler (a copy from one buffer to another).
    pub(super) fn keep_once_folios(&self) -> usize {
        2 * (self.read_ahead_folios() + 1) * self.handler_threads.max(1)
    }

    /// A pager under `limit` bytes, with the defaults of
    /// `zmem_common::defaults`. Its tier's pool may take `MAX_POOL_PERCENT`
    /// of the limit, and writes back to a swap file in the temporary
    /// directory beyond that: real heap pages compress 2-3x, so a working
    /// set of several times the limit does not fit without writeback.
    pub fn with_limit(limit: usize) -> PagerConfig {
        PagerConfig {
            limit,
            high_watermark_percent: defaults::HIGH_WATERMARK_PERCENT,
            low_watermark_percent: defaults::LOW_WATERMARK_PERCENT,
            folio_size: defaults::FOLIO_SIZE,
            reclaim_batch: defaults::RECLAIM_BATCH,
            direct_reclaim_wait: Duration::from_millis(20),
            handler_threads: 1,
            handler_spin: Duration::ZERO,
            handler_spin_hot: Duration::from_micros(100),
            handler_cpus: Vec::new(),
            handler_follow: true,
            handler_hold: true,
            track_writes: true,
            keep_on_fork: false,
            fork_event: false,
            handler_init: None,
            thread_init: None,
            adopt: None,
            tree: None,
            open_mode: crate::sys::OpenMode::Auto,
            tier: TierConfig { memory_budget: limit, ..TierConfig::default() },
            recompress: None,
            pool_balance: None,
            strong_codec: None,
            read_ahead: defaults::READ_AHEAD_BYTES,
            fault_around: defaults::FAULT_AROUND_BYTES,
            inject_move_delay: Duration::ZERO,
            inject_copy_delay: Duration::ZERO,
            inject_store_delay: Duration::ZERO,
            inject_adopt_delay: Duration::ZERO,
        }
    }
}
