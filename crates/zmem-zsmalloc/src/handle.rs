//! Handles: opaque, generation-checked names for objects.
//!
//! A handle is `(generation << 32) | index`. The index names a slot of the
//! handle table; the slot holds the object's current location and the
//! generation it was allocated with. Compaction moves an object by rewriting
//! its slot (under the class lock), so a handle stays valid across
//! `compact()`. Freeing bumps the slot's generation, so a stale handle or a
//! second free is detected instead of touching another object.
//!
//! The table is a three-level array of atomics that only grows: its
//! directories and chunks are installed once and never moved, so a slot
//! can be read without a lock. Only the top directory is made up front (3
//! KiB): a flat directory for all 2^28 handles took 384 KiB, written at
//! creation, in every process under `zmem run` (a forking server's every
//! backend) whether it ever stored a page or not.
//! Readers load the slot, take the class lock it names, and load it again
//! (the class of a live object never changes; see `tests/loom.rs`).

use std::sync::OnceLock;

use crate::sync::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
const CHUNK_BITS: u32 = 14;
#[cfg(not(loom))]
const MID_BITS: u32 = 7;
#[cfg(not(loom))]
const TOP: usize = 1 << 7;
// Loom tracks every atomic: keep the modelled table tiny.
#[cfg(loom)]
const CHUNK_BITS: u32 = 1;
#[cfg(loom)]
const MID_BITS: u32 = 1;
#[cfg(loom)]
const TOP: usize = 1;
const CHUNK: usize = 1 << CHUNK_BITS;
const MID: usize = 1 << MID_BITS;
/// The most handles a pool can have live: 2^28.
pub const MAX_HANDLES: usize = CHUNK * MID * TOP;

/// An opaque reference to an object of a [`crate::ZsPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle(u64);

impl Handle {
    pub fn new(index: u32, gen: u32) -> Handle {
        Handle((u64::from(gen) << 32) | u64::from(index))
    }
    pub fn index(self) -> u32 {
        self.0 as u32
    }
    pub fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
    /// The raw value, for storing in an entry.
    pub fn to_raw(self) -> u64 {
        self.0
    }
    /// Rebuilds a handle from [`to_raw`](Self::to_raw). A forged value is
    /// caught as a stale handle, never used to reach another object.
    pub fn from_raw(raw: u64) -> Handle {
        Handle(raw)
    }
}

/// Where an object lives: size class, zspage and object index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(hidden)]
pub struct Location {
    pub class: u8,
    pub zspage: u32,
    pub obj: u16,
}

/// A slot's packed state: bit 63 allocated, bits 62..40 generation (23 bits),
/// bits 39..32 class, bits 31..12 zspage (20 bits), bits 11..0 object.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot(u64);

pub const GEN_MASK: u32 = (1 << 23) - 1;
pub const MAX_ZSPAGES_PER_CLASS: u32 = 1 << 20;
pub const MAX_OBJS_PER_ZSPAGE: usize = 1 << 12;

impl Slot {
    pub fn live(gen: u32, loc: Location) -> Slot {
        debug_assert!(loc.zspage < MAX_ZSPAGES_PER_CLASS && (loc.obj as usize) < MAX_OBJS_PER_ZSPAGE);
        Slot(
            1 << 63
                | u64::from(gen & GEN_MASK) << 40
                | u64::from(loc.class) << 32
                | u64::from(loc.zspage) << 12
                | u64::from(loc.obj),
        )
    }
    pub fn dead(gen: u32) -> Slot {
        Slot(u64::from(gen & GEN_MASK) << 40)
    }
    pub fn is_live(self) -> bool {
        self.0 >> 63 == 1
    }
    pub fn gen(self) -> u32 {
        (self.0 >> 40) as u32 & GEN_MASK
    }
    pub fn location(self) -> Location {
        Location {
            class: (self.0 >> 32) as u8,
            zspage: ((self.0 >> 12) as u32) & (MAX_ZSPAGES_PER_CLASS - 1),
            obj: (self.0 & 0xfff) as u16,
        }
    }
}

/// What a handle's slot says about it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Live(Location),
    /// Freed since: its generation moved one past the handle's.
    Freed,
    /// Never issued, or reused since.
    Stale,
}

#[doc(hidden)]
pub struct HandleTable {
    /// `MID` chunks per directory, `CHUNK` slots per chunk.
    top: Box<[OnceLock<Directory>]>,
    next: AtomicU32,
}

type Chunk = Box<[AtomicU64]>;
type Directory = Box<[OnceLock<Chunk>]>;

impl std::fmt::Debug for HandleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleTable").field("issued", &self.next.load(Ordering::Relaxed)).finish()
    }
}

impl Default for HandleTable {
    fn default() -> Self {
        Self::new()
    }
}

impl HandleTable {
    pub fn new() -> Self {
        HandleTable { top: (0..TOP).map(|_| OnceLock::new()).collect(), next: AtomicU32::new(0) }
    }

    fn slot_ref(&self, index: u32) -> Option<&AtomicU64> {
        let i = index as usize;
        let c = i >> CHUNK_BITS;
        let chunk = self.top.get(c >> MID_BITS)?.get()?.get(c & (MID - 1))?.get()?;
        chunk.get(i & (CHUNK - 1))
    }

    /// A never-used index (callers recycle freed ones themselves).
    pub fn fresh_index(&self) -> Option<u32> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        if i as usize >= MAX_HANDLES {
            self.next.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let c = i as usize >> CHUNK_BITS;
        self.top[c >> MID_BITS].get_or_init(|| (0..MID).map(|_| OnceLock::new()).collect())[c & (MID - 1)]
            .get_or_init(|| (0..CHUNK).map(|_| AtomicU64::new(0)).collect());
        Some(i)
    }

    pub fn load(&self, index: u32) -> Option<Slot> {
        self.slot_ref(index).map(|a| Slot(a.load(Ordering::Acquire)))
    }

    /// Stores a slot. Callers hold the lock of the class the slot names.
    pub fn store(&self, index: u32, slot: Slot) {
        if let Some(a) = self.slot_ref(index) {
            a.store(slot.0, Ordering::Release);
        }
    }

    pub fn lookup(&self, h: Handle) -> Lookup {
        match self.load(h.index()) {
            Some(s) if s.is_live() && s.gen() == h.gen() => Lookup::Live(s.location()),
            Some(s) if !s.is_live() && s.gen() == (h.gen() + 1) & GEN_MASK => Lookup::Freed,
            _ => Lookup::Stale,
        }
    }

    /// Memory the table itself takes.
    pub fn bytes(&self) -> usize {
        let dirs: Vec<&Directory> = self.top.iter().filter_map(OnceLock::get).collect();
        let chunks = dirs.iter().flat_map(|d| d.iter()).filter(|c| c.get().is_some()).count();
        chunks * CHUNK * std::mem::size_of::<AtomicU64>()
            + dirs.len() * MID * std::mem::size_of::<OnceLock<Chunk>>()
            + TOP * std::mem::size_of::<OnceLock<Directory>>()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A table costs next to nothing until handles are issued, then a
    /// directory and a chunk at a time; every index up to the last issued
    /// has its slot, and none past the end exists.
    #[test]
    fn the_table_grows_a_directory_and_a_chunk_at_a_time() {
        let t = HandleTable::new();
        let empty = t.bytes();
        assert!(empty <= 4 << 10, "an empty table takes {empty} B");
        assert_eq!(t.fresh_index(), Some(0));
        assert_eq!(t.bytes(), empty + MID * std::mem::size_of::<OnceLock<Chunk>>() + CHUNK * 8);
        t.store(0, Slot(7));
        assert_eq!(t.load(0), Some(Slot(7)));
        assert_eq!(t.load(1), Some(Slot(0)), "slots of an installed chunk read as never used");
        assert_eq!(t.load(CHUNK as u32), None, "a chunk not installed has no slots");
        // The next chunk, in the same directory, then one past it.
        t.next.store((CHUNK * MID) as u32 - 1, Ordering::Relaxed);
        let last_of_dir = t.fresh_index().unwrap();
        let first_of_next = t.fresh_index().unwrap();
        assert_eq!((last_of_dir as usize + 1, first_of_next as usize), (CHUNK * MID, CHUNK * MID));
        t.store(first_of_next, Slot(9));
        assert_eq!(t.load(first_of_next), Some(Slot(9)));
        assert_eq!(t.load(last_of_dir), Some(Slot(0)));
        t.next.store(MAX_HANDLES as u32, Ordering::Relaxed);
        assert_eq!(t.fresh_index(), None);
        assert_eq!(t.load(u32::MAX), None);
    }
}
