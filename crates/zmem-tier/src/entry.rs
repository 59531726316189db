//! `Entry`: what the tier keeps for one stored page (`struct zswap_entry`).

use zmem_swapfile::Slot;
use zmem_zsmalloc::Handle;

/// Where an entry's page is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Every 8-byte word of the page equals this value (zero pages too); no
    /// pool memory is used.
    SameFilled(u64),
    /// A compressed object of `len` bytes in the entry's pool, or the raw
    /// page when `len == PAGE_SIZE` (an incompressible page, kept only when
    /// writeback is possible).
    Pool { handle: Handle, len: u32 },
    /// Written back: `len` bytes at `off` in a slot of the swap file, the
    /// object as it was in the pool (compressed writeback). A raw page when
    /// `len == PAGE_SIZE`; otherwise compressed by the entry's pool's
    /// compressor, so the entry keeps its pool reference.
    Swap { slot: Slot, off: u16, len: u16 },
}

/// One stored page.
///
/// - `id`: unique per store. Writeback and LRU items name an entry by
///   `(key, id)`, and re-check the id after re-taking the tree lock, so an
///   entry that was invalidated, loaded or stored again meanwhile is never
///   mistaken for the one they picked.
/// - `pool`: the id of the pool whose compressor and zs pool hold the object
///   (meaningful where [`Entry::holds_pool`]).
/// - `referenced`: set on store and on a non-exclusive load; the shrinker
///   clears it and gives the entry a second trip round the LRU.
/// - `cached`: the page is mapped again, and this pool entry was kept as
///   its clean copy ([`Tier::retain_clean`](crate::Tier::retain_clean)), as
///   the kernel's swap cache keeps a page's slot. If the page is still the
///   same when it is evicted again, the store keeps the entry and compresses
///   nothing; the shrinker frees a cached entry instead of writing it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub id: u32,
    pub pool: u32,
    pub stored: Stored,
    pub referenced: bool,
    pub cached: bool,
}

impl Entry {
    pub fn in_pool(&self) -> bool {
        matches!(self.stored, Stored::Pool { .. })
    }

    /// Whether the entry needs its pool: for the object, or for the
    /// compressor that made its written-back object.
    pub fn holds_pool(&self) -> bool {
        match self.stored {
            Stored::Pool { .. } => true,
            Stored::Swap { len, .. } => usize::from(len) < zmem_common::PAGE_SIZE,
            Stored::SameFilled(_) => false,
        }
    }
}
