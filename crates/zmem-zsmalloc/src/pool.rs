//! `ZsPool`: the compressed-object allocator.
//!
//! # Lock order
//! 1. a size class's mutex (`SizeClass::inner`): every read, write, malloc,
//!    free and compaction step of that class;
//! 2. the mempool's mutex, taken inside (1) only by nothing: zspage pages are
//!    allocated before taking the class lock and returned after dropping it.
//!
//! No two class locks are ever held together; the handle table is lock-free
//! (atomics) and its slots are written only under the lock of the class they
//! name.
//!
//! # Objects and zspages
//! A zspage is 1..`chain_size` pages from the mempool, not contiguous, cut
//! into `objs_per_zspage` slots of the class size. An object may straddle two
//! pages; [`ZsPool::map`] then hands the closure a copy in a stack buffer
//! (the kernel's per-CPU mapping buffer), [`ZsPool::map_mut`] copies back.
//! Per zspage, the pool keeps each slot's handle index and object size (6
//! bytes) and a stack of free slots (2 bytes): 8 bytes of metadata per slot,
//! counted by [`ZsPool::metadata_bytes`].
//!
//! Zspages sit in fullness groups (by tenths of their slots in use). malloc
//! takes the fullest zspage with room, so that objects pack densely and the
//! emptiest zspages drain; an emptied zspage goes back to the mempool at
//! once. `compact()` moves objects from the emptiest zspages into the
//! fullest, rewriting the handle table, until no more zspage can be emptied.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, MutexGuard};
use zmem_common::LockExt;

use thiserror::Error;

use crate::handle::{Handle, HandleTable, Location, Lookup, Slot, MAX_OBJS_PER_ZSPAGE};
use crate::mempool::{Mempool, Page};
use crate::size_class::{ClassShape, ClassTable, DEFAULT_CHAIN_SIZE, MAX_CHAIN_SIZE};
use crate::strict_assert;
use crate::zspage::{ClassInner, ObjMeta, ZsPage};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use zmem_common::PAGE_SIZE;

/// Errors of the pool. A bad handle is always an error, never silently
/// another object.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ZsError {
    #[error("object size {size} is not in 1..={PAGE_SIZE}")]
    InvalidSize { size: usize },
    #[error("handle {handle:#x} is stale: it was never issued by this pool or its object was freed and reused")]
    StaleHandle { handle: u64 },
    #[error("handle {handle:#x} was already freed")]
    DoubleFree { handle: u64 },
    #[error("could not allocate a {pages}-page zspage: the mempool is exhausted")]
    AllocFailed { pages: usize },
    #[error("out of handles or zspage ids")]
    TooManyObjects,
    #[error("object is {size} bytes but {len} bytes were given")]
    SizeMismatch { size: usize, len: usize },
    #[error("invalid pool configuration: {0}")]
    Config(#[from] zmem_common::ConfigError),
}

/// Settings of a pool.
#[derive(Debug, Clone, Copy)]
pub struct ZsPoolConfig {
    /// Most pages per zspage (CONFIG_ZSMALLOC_CHAIN_SIZE).
    pub chain_size: usize,
    /// Merge consecutive classes of the same shape, as zsmalloc does.
    pub merge_classes: bool,
}

impl Default for ZsPoolConfig {
    fn default() -> Self {
        ZsPoolConfig { chain_size: DEFAULT_CHAIN_SIZE, merge_classes: true }
    }
}

/// One row of the debugfs `classes` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassStats {
    pub class: usize,
    pub size: usize,
    pub objs_per_zspage: usize,
    pub pages_per_zspage: usize,
    /// Objects in use.
    pub inuse: usize,
    /// Object slots in all zspages.
    pub obj_allocated: usize,
    pub zspages: usize,
    pub pages_used: usize,
    /// Bytes the live objects asked for.
    pub bytes_stored: usize,
}

#[derive(Debug)]
struct SizeClass {
    shape: ClassShape,
    inner: Mutex<ClassInner>,
}

/// A zsmalloc-style pool of compressed objects.
#[derive(Debug)]
pub struct ZsPool {
    table: ClassTable,
    classes: Vec<SizeClass>,
    handles: HandleTable,
    mempool: Arc<Mempool>,
    /// Pages held by zspages (pool_total_size / PAGE_SIZE).
    pages: AtomicUsize,
    /// The same count, summed with other pools of a group (the tier's
    /// pools), updated only when a zspage comes or goes.
    group_pages: Arc<AtomicUsize>,
    /// Fault injection: this many of the next mallocs fail as if the
    /// mempool were exhausted.
    inject_fail: std::sync::atomic::AtomicU32,
}

impl ZsPool {
    /// Fault injection (`zmem bench soak`, tests): the next `n` mallocs fail
    /// with [`ZsError::AllocFailed`], as under memory pressure.
    #[doc(hidden)]
    pub fn inject_alloc_failures(&self, n: u32) {
        self.inject_fail.store(n, Ordering::Relaxed);
    }

    /// # Errors
    /// [`ZsError::Config`] for a chain size outside 1..=16.
    pub fn new(cfg: ZsPoolConfig, mempool: Arc<Mempool>) -> Result<ZsPool, ZsError> {
        Self::new_in_group(cfg, mempool, Arc::new(AtomicUsize::new(0)))
    }

    /// A pool whose zspage pages are also counted in `group_pages`, so that
    /// the total of several pools is one load ([`group_total_size`]).
    ///
    /// # Errors
    /// As [`ZsPool::new`].
    ///
    /// [`group_total_size`]: Self::group_total_size
    pub fn new_in_group(
        cfg: ZsPoolConfig,
        mempool: Arc<Mempool>,
        group_pages: Arc<AtomicUsize>,
    ) -> Result<ZsPool, ZsError> {
        if !(1..=MAX_CHAIN_SIZE).contains(&cfg.chain_size) {
            return Err(zmem_common::ConfigError::out_of_range("chain_size", cfg.chain_size, "1..=16").into());
        }
        let table = ClassTable::new(cfg.chain_size, cfg.merge_classes);
        let classes = table
            .classes
            .iter()
            .map(|&shape| {
                assert!(shape.objs_per_zspage <= MAX_OBJS_PER_ZSPAGE);
                SizeClass { shape, inner: Mutex::new(ClassInner::default()) }
            })
            .collect();
        Ok(ZsPool {
            table,
            classes,
            handles: HandleTable::new(),
            mempool,
            pages: AtomicUsize::new(0),
            group_pages,
            inject_fail: std::sync::atomic::AtomicU32::new(0),
        })
    }

    pub fn mempool(&self) -> &Arc<Mempool> {
        &self.mempool
    }

    /// Objects of at least this many bytes take a whole page.
    pub fn huge_threshold(&self) -> usize {
        self.table.huge_threshold
    }

    fn lock(&self, class: usize) -> MutexGuard<'_, ClassInner> {
        self.classes[class].inner.lock_ok()
    }

    /// Allocates an object of `size` bytes (1..=PAGE_SIZE).
    ///
    /// # Errors
    /// [`ZsError::InvalidSize`]; [`ZsError::AllocFailed`] when the mempool
    /// cannot supply a new zspage (nothing is allocated then);
    /// [`ZsError::TooManyObjects`].
    pub fn malloc(&self, size: usize) -> Result<Handle, ZsError> {
        if size == 0 || size > PAGE_SIZE {
            strict_assert!(false, "zs malloc of {size} bytes");
            return Err(ZsError::InvalidSize { size });
        }
        if self.inject_fail.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            return Err(ZsError::AllocFailed { pages: 0 });
        }
        let ci = self.table.class_of(size);
        let shape = self.classes[ci].shape;
        let mut g = self.lock(ci);
        let id = match g.fullest_with_room() {
            Some(id) => id,
            None => {
                // Allocate the zspage's pages without the class lock (the
                // mempool may wait for frees, which need this lock).
                drop(g);
                let bulk = self.mempool.alloc_pages_bulk_array(shape.pages_per_zspage);
                if !bulk.is_complete() {
                    self.mempool.free_pages(bulk.pages);
                    return Err(ZsError::AllocFailed { pages: shape.pages_per_zspage });
                }
                g = self.lock(ci);
                let z = ZsPage {
                    pages: bulk.pages,
                    objs: vec![ObjMeta { handle: 0, size: 0 }; shape.objs_per_zspage],
                    free: (0..shape.objs_per_zspage as u16).rev().collect(),
                    inuse: 0,
                    group: 0,
                    pos: 0,
                };
                let Some(id) = g.insert(z, shape.objs_per_zspage) else {
                    return Err(ZsError::TooManyObjects);
                };
                self.pages.fetch_add(shape.pages_per_zspage, Ordering::Relaxed);
                self.group_pages.fetch_add(shape.pages_per_zspage, Ordering::Relaxed);
                // Another thread may have made room meanwhile; the new
                // zspage is used either way (as zs_malloc does).
                id
            }
        };
        let (index, gen) = match g.free_handles.pop() {
            Some(i) => (i, self.handles.load(i).map_or(0, Slot::gen)),
            None => match self.handles.fresh_index() {
                Some(i) => (i, 0),
                None => return Err(ZsError::TooManyObjects),
            },
        };
        let z = g.zspage_mut(id);
        let obj = z.free.pop().expect("a zspage with room has a free slot");
        z.objs[obj as usize] = ObjMeta { handle: index, size: size as u16 };
        z.inuse += 1;
        g.refile(id, shape.objs_per_zspage);
        g.inuse += 1;
        g.bytes_stored += size;
        self.handles.store(index, Slot::live(gen, Location { class: ci as u8, zspage: id, obj }));
        Ok(Handle::new(index, gen))
    }

    /// Allocates an object holding `data`.
    ///
    /// # Errors
    /// As [`malloc`](Self::malloc).
    pub fn malloc_copy(&self, data: &[u8]) -> Result<Handle, ZsError> {
        let h = self.malloc(data.len())?;
        self.write(h, data).expect("a fresh handle is live and of this size");
        Ok(h)
    }

    /// Takes the lock of `h`'s class and returns it with `h`'s current
    /// location (re-read under the lock: compaction may have moved it).
    fn locate(&self, h: Handle) -> Result<(MutexGuard<'_, ClassInner>, Location), ZsError> {
        let first = match self.handles.lookup(h) {
            Lookup::Live(loc) => loc,
            Lookup::Freed => return Err(ZsError::DoubleFree { handle: h.to_raw() }),
            Lookup::Stale => return Err(ZsError::StaleHandle { handle: h.to_raw() }),
        };
        let g = self.lock(first.class as usize);
        match self.handles.lookup(h) {
            Lookup::Live(loc) if loc.class == first.class => Ok((g, loc)),
            Lookup::Freed => Err(ZsError::DoubleFree { handle: h.to_raw() }),
            _ => Err(ZsError::StaleHandle { handle: h.to_raw() }),
        }
    }

    fn checked<T>(r: Result<T, ZsError>) -> Result<T, ZsError> {
        if let Err(e @ (ZsError::DoubleFree { .. } | ZsError::StaleHandle { .. })) = &r {
            strict_assert!(false, "{e}");
        }
        r
    }

    /// Frees `h`'s object.
    ///
    /// # Errors
    /// [`ZsError::DoubleFree`] or [`ZsError::StaleHandle`] (a panic in debug
    /// builds); nothing is freed then.
    pub fn free(&self, h: Handle) -> Result<(), ZsError> {
        Self::checked(self.free_inner(h))
    }

    fn free_inner(&self, h: Handle) -> Result<(), ZsError> {
        let (mut g, loc) = self.locate(h)?;
        let shape = self.classes[loc.class as usize].shape;
        let z = g.zspage_mut(loc.zspage);
        let size = z.objs[loc.obj as usize].size as usize;
        z.objs[loc.obj as usize].size = 0;
        z.free.push(loc.obj);
        z.inuse -= 1;
        let empty = z.inuse == 0;
        g.inuse -= 1;
        g.bytes_stored -= size;
        self.handles.store(h.index(), Slot::dead(h.gen() + 1));
        g.free_handles.push(h.index());
        let freed = if empty {
            Some(g.remove(loc.zspage))
        } else {
            g.refile(loc.zspage, shape.objs_per_zspage);
            None
        };
        drop(g);
        if let Some(pages) = freed {
            self.pages.fetch_sub(pages.len(), Ordering::Relaxed);
            self.group_pages.fetch_sub(pages.len(), Ordering::Relaxed);
            self.mempool.free_pages(pages);
        }
        Ok(())
    }

    /// The size `h`'s object was allocated with.
    ///
    /// # Errors
    /// [`ZsError::StaleHandle`] or [`ZsError::DoubleFree`].
    pub fn obj_size(&self, h: Handle) -> Result<usize, ZsError> {
        let (g, loc) = self.locate(h)?;
        Ok(g.zspage(loc.zspage).objs[loc.obj as usize].size as usize)
    }

    /// Runs `f` over `h`'s object bytes (exactly its size), under its class
    /// lock. `f` MUST NOT call back into this pool.
    ///
    /// # Errors
    /// [`ZsError::StaleHandle`] or [`ZsError::DoubleFree`]; `f` is not run.
    pub fn map<R>(&self, h: Handle, f: impl FnOnce(&[u8]) -> R) -> Result<R, ZsError> {
        let (g, loc) = Self::checked(self.locate(h))?;
        let shape = self.classes[loc.class as usize].shape;
        let z = g.zspage(loc.zspage);
        let len = z.objs[loc.obj as usize].size as usize;
        if let Some(s) = z.contiguous(shape.size, loc.obj as usize, len) {
            return Ok(f(s));
        }
        let mut buf = [0u8; PAGE_SIZE];
        z.read(shape.size, loc.obj as usize, &mut buf[..len]);
        Ok(f(&buf[..len]))
    }

    /// Runs `f` over `h`'s object bytes for writing, as [`map`](Self::map).
    ///
    /// # Errors
    /// As [`map`](Self::map).
    pub fn map_mut<R>(&self, h: Handle, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, ZsError> {
        let (mut g, loc) = Self::checked(self.locate(h))?;
        let shape = self.classes[loc.class as usize].shape;
        let z = g.zspage_mut(loc.zspage);
        let len = z.objs[loc.obj as usize].size as usize;
        if let Some(s) = z.contiguous_mut(shape.size, loc.obj as usize, len) {
            return Ok(f(s));
        }
        let mut buf = [0u8; PAGE_SIZE];
        z.read(shape.size, loc.obj as usize, &mut buf[..len]);
        let r = f(&mut buf[..len]);
        z.write(shape.size, loc.obj as usize, &buf[..len]);
        Ok(r)
    }

    /// Copies `data` into `h`'s object; `data` must be exactly its size.
    ///
    /// # Errors
    /// As [`map`](Self::map), or [`ZsError::SizeMismatch`] (nothing written).
    pub fn write(&self, h: Handle, data: &[u8]) -> Result<(), ZsError> {
        let (mut g, loc) = Self::checked(self.locate(h))?;
        let shape = self.classes[loc.class as usize].shape;
        let z = g.zspage_mut(loc.zspage);
        let size = z.objs[loc.obj as usize].size as usize;
        if data.len() != size {
            return Err(ZsError::SizeMismatch { size, len: data.len() });
        }
        z.write(shape.size, loc.obj as usize, data);
        Ok(())
    }

    /// Bytes held by zspages: the kernel's `pool_total_size`.
    pub fn pool_total_size(&self) -> usize {
        self.pages.load(Ordering::Relaxed) * PAGE_SIZE
    }

    /// Bytes held by zspages of every pool in this pool's group.
    pub fn group_total_size(&self) -> usize {
        self.group_pages.load(Ordering::Relaxed) * PAGE_SIZE
    }

    /// Bytes of the pool's own bookkeeping (handle table, per-slot metadata,
    /// class structures), on top of [`pool_total_size`](Self::pool_total_size).
    pub fn metadata_bytes(&self) -> usize {
        let mut b = self.handles.bytes() + std::mem::size_of::<ZsPool>();
        for c in &self.classes {
            let g = c.inner.lock_ok();
            b += std::mem::size_of::<SizeClass>()
                + g.zspages.capacity() * std::mem::size_of::<Option<ZsPage>>()
                + (g.free_ids.capacity() + g.free_handles.capacity()) * 4
                + g.groups.iter().map(|v| v.capacity() * 4).sum::<usize>();
            for z in g.zspages.iter().flatten() {
                b += z.objs.capacity() * std::mem::size_of::<ObjMeta>()
                    + z.free.capacity() * 2
                    + z.pages.capacity() * std::mem::size_of::<Page>();
            }
        }
        b
    }

    /// Per-class statistics, like zsmalloc's debugfs `classes` file (only
    /// classes that hold something).
    pub fn class_stats(&self) -> Vec<ClassStats> {
        self.classes
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let g = c.inner.lock_ok();
                (g.nr_zspages > 0).then(|| ClassStats {
                    class: i,
                    size: c.shape.size,
                    objs_per_zspage: c.shape.objs_per_zspage,
                    pages_per_zspage: c.shape.pages_per_zspage,
                    inuse: g.inuse,
                    obj_allocated: g.nr_zspages * c.shape.objs_per_zspage,
                    zspages: g.nr_zspages,
                    pages_used: g.nr_zspages * c.shape.pages_per_zspage,
                    bytes_stored: g.bytes_stored,
                })
            })
            .collect()
    }

    /// Live objects and the bytes they asked for.
    pub fn objects(&self) -> (usize, usize) {
        self.class_stats().iter().fold((0, 0), |(n, b), c| (n + c.inuse, b + c.bytes_stored))
    }

    /// Moves objects out of sparse zspages into dense ones and returns the
    /// emptied zspages' pages to the mempool. Handles stay valid. Returns the
    /// number of pages freed.
    pub fn compact(&self) -> usize {
        (0..self.classes.len()).map(|c| self.compact_class(c)).sum()
    }

    fn compact_class(&self, ci: usize) -> usize {
        let shape = self.classes[ci].shape;
        let objs = shape.objs_per_zspage;
        let mut freed = 0;
        let mut buf = [0u8; PAGE_SIZE];
        loop {
            let mut g = self.lock(ci);
            // Only worth it while the free slots could empty a whole zspage.
            let slots = g.nr_zspages * objs;
            if slots - g.inuse < objs || g.nr_zspages < 2 {
                return freed;
            }
            let Some(src) = g.emptiest() else { return freed };
            g.unlink(src);
            let dst = g.fullest_with_room();
            let Some(dst) = dst.filter(|&d| d != src) else {
                g.link(src, objs);
                return freed;
            };
            // Move objects from src to dst until one is empty or full.
            for obj in 0..objs {
                if g.zspage(src).inuse == 0 || g.zspage(dst).free.is_empty() {
                    break;
                }
                let meta = g.zspage(src).objs[obj];
                if meta.size == 0 {
                    continue;
                }
                let len = meta.size as usize;
                g.zspage(src).read(shape.size, obj, &mut buf[..len]);
                let d = g.zspage_mut(dst);
                let to = d.free.pop().expect("dst has room");
                d.write(shape.size, to as usize, &buf[..len]);
                d.objs[to as usize] = meta;
                d.inuse += 1;
                let s = g.zspage_mut(src);
                s.objs[obj].size = 0;
                s.free.push(obj as u16);
                s.inuse -= 1;
                let gen = self.handles.load(meta.handle).map_or(0, Slot::gen);
                self.handles.store(meta.handle, Slot::live(gen, Location { class: ci as u8, zspage: dst, obj: to }));
            }
            g.refile(dst, objs);
            let pages = if g.zspage(src).inuse == 0 {
                // `remove` unlinks; link first so that it finds the zspage.
                g.link(src, objs);
                Some(g.remove(src))
            } else {
                g.link(src, objs);
                None
            };
            drop(g);
            if let Some(pages) = pages {
                freed += pages.len();
                self.pages.fetch_sub(pages.len(), Ordering::Relaxed);
                self.group_pages.fetch_sub(pages.len(), Ordering::Relaxed);
                self.mempool.free_pages(pages);
            }
        }
    }
}
