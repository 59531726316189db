//! Writeback: the coldest pool entries go to the swap file, as they are in
//! the pool (compressed writeback): objects are copied out, packed into
//! slots and written; no codec runs. They are decompressed when loaded.

use zmem_common::LockExt;
use zmem_common::PAGE_SIZE;
use zmem_zsmalloc::Handle;

use crate::stats::{dec, inc};
use crate::tree::BLOCK;
use crate::{Entry, Stored, Tier};

impl Tier {
    /// Writes back up to `nr` of the coldest pool entries now, whatever the
    /// pool's size (`memory.reclaim source=zswap`). Returns how many left
    /// the pool: written back, or freed for being cached clean copies.
    pub fn writeback(&self, nr: usize) -> usize {
        let mut scratch = self.shrink_lock.lock_ok();
        // Every entry may need two visits (the first clears `referenced`).
        let budget = 2 * self.lru.len() + nr;
        let (mut done, mut scanned) = (0, 0);
        while done < nr && scanned < budget {
            let pass = self.writeback_batch(&mut scratch, (nr - done).min(WRITEBACK_BATCH));
            if pass.failed || pass.scanned == 0 {
                break;
            }
            done += pass.written + pass.dropped;
            scanned += pass.scanned;
        }
        done
    }

    /// One batch of writeback from the cold end of the LRU. The caller holds
    /// `shrink_lock` and passes its scratch buffer.
    fn writeback_batch(&self, scratch: &mut Vec<u8>, max: usize) -> Pass {
        let mut pass = Pass::default();
        let Some(sf) = self.swap.as_ref().filter(|_| self.cfg.writeback) else { return pass };
        self.rebuild_lru_if_doubled();
        scratch.resize(max * PAGE_SIZE, 0);
        // (key, id, the object's handle), and where in `scratch` the
        // object was copied.
        let mut victims: Vec<(u64, u32, Handle)> = Vec::with_capacity(max);
        let mut objs: Vec<(usize, usize)> = Vec::with_capacity(max);
        let mut used = 0;
        // Blocks whose entries got a second chance: back at the hot end.
        let mut rotate = Vec::new();
        let mut dropped = Vec::new();
        let mut scanned = 0;
        while victims.len() < max && scanned < max * 8 {
            let Some(&b) = self.lru.pop_cold(1).first() else { break };
            scanned += 1;
            pass.scanned += 1;
            let first = b * BLOCK as u64;
            let mut shard = self.tree.lock(first);
            let (mut second, mut unfinished) = (false, false);
            for key in first..=first + (BLOCK - 1) as u64 {
                let Some(e) = shard.get(key) else { continue };
                if !e.in_pool() {
                    continue;
                }
                if e.referenced {
                    // Second chance, as shrink_memcg_cb gives. A clean copy
                    // gets one too: it was kept by a load just now, and a
                    // walk's pages are evicted again soon (the pager's once
                    // list), into this entry if it is still here.
                    if let Some(mut m) = shard.get_mut(key) {
                        m.referenced = false;
                    }
                    second = true;
                    continue;
                }
                if e.cached {
                    // A clean copy of a page that is mapped: free, not
                    // written (the page is stored again when evicted).
                    self.free_in(&mut shard, key, &mut dropped);
                    inc(&self.counters.cached_dropped, 1);
                    pass.dropped += 1;
                    continue;
                }
                if victims.len() == max {
                    unfinished = true;
                    continue;
                }
                let pool = shard.pool(e.pool).expect("a pool entry's shard holds its pool");
                let Stored::Pool { handle, len } = e.stored else { unreachable!("checked in_pool") };
                let len = len as usize;
                let copied = pool.zs.map(handle, |obj| {
                    scratch[used..used + len].copy_from_slice(&obj[..len]);
                });
                match copied {
                    Ok(()) => {
                        victims.push((key, e.id, handle));
                        objs.push((used, len));
                        used += len;
                    }
                    Err(_) => {
                        inc(&self.counters.decompress_fail, 1);
                        second = true;
                    }
                }
            }
            drop(shard);
            if unfinished {
                // The next pass goes on with this block.
                self.lru.push_cold(&[b]);
            } else if second {
                rotate.push(b);
            }
        }
        drop(dropped);
        self.lru.push(rotate);
        if victims.is_empty() {
            return pass;
        }
        let pieces: Vec<&[u8]> = objs.iter().map(|&(at, len)| &scratch[at..at + len]).collect();
        let slots = match sf.write_packed(&pieces) {
            Ok(s) => s,
            Err(_) => {
                // ENOSPC, EIO, no bounce pages: the entries stay in the pool.
                inc(&self.counters.reject_reclaim_fail, victims.len() as u64);
                let mut blocks: Vec<u64> = victims.iter().map(|&(k, ..)| k / BLOCK as u64).collect();
                blocks.dedup();
                self.lru.push_cold(&blocks);
                // Slots that cached entries keep are worth more to the
                // next writeback than the compressions they may save.
                self.drop_clean(0);
                pass.failed = true;
                return pass;
            }
        };
        let mut written = 0;
        for (((key, id, handle), (slot, off)), &(_, len)) in victims.into_iter().zip(slots).zip(&objs) {
            let mut shard = self.tree.lock(key);
            let (mut raw, mut cached) = (false, false);
            let to = Stored::Swap { slot, off, len: len as u16 };
            let r = shard.writeback_commit(key, id, handle, to, |p, e| {
                // Kept by a load since it was picked, it left `ages` then.
                cached = e.cached;
                if let Stored::Pool { handle, len } = e.stored {
                    raw = len as usize == PAGE_SIZE;
                    let r = p.zs.free(handle);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            });
            if r.is_ok() {
                // Under the shard lock, as invalidate's: never below zero.
                dec(&self.counters.stored_pages, 1);
                if !cached {
                    self.ages.removed(id);
                }
                inc(&self.counters.swap_pages, 1);
                if raw {
                    dec(&self.counters.stored_incompressible_pages, 1);
                }
            }
            drop(shard);
            match r {
                Ok(dropped) => {
                    drop(dropped);
                    written += 1;
                }
                // Loaded, invalidated, stored again or recompressed while
                // we wrote: the slot holds nothing anyone needs.
                Err(()) => {
                    let _ = sf.free(slot);
                }
            }
        }
        inc(&self.counters.written_back_pages, written as u64);
        pass.written = written;
        pass
    }
}

impl Tier {
    /// Drops the LRU's stale items once the list has doubled since its last
    /// rebuild, as writeback does before each batch. A store calls it: with
    /// the pool under its limit no writeback runs, and every store pushes
    /// an item while loads leave theirs behind. Redis paging 1.2M keys
    /// (`DEBUG DIGEST`) under 64M ended with 6.6 MB of items for ~4,500
    /// blocks, 6.6 of its 7.7 MB of metadata, all of it charged to the
    /// limit. Skipped while a shrinker runs (it rebuilds).
    pub(crate) fn trim_lru(&self) {
        if !self.lru.needs_rebuild() {
            return;
        }
        let Ok(_one_at_a_time) = self.shrink_lock.try_lock() else { return };
        self.rebuild_lru_if_doubled();
    }

    /// The rebuild itself; the caller holds `shrink_lock`.
    fn rebuild_lru_if_doubled(&self) {
        if self.lru.needs_rebuild() {
            self.lru.rebuild(|b| self.block_has(b, |e| e.in_pool()));
        }
    }

    /// Whether block `b` of the tree holds an entry for which `f` says yes.
    pub(crate) fn block_has(&self, b: u64, f: impl Fn(&Entry) -> bool) -> bool {
        let first = b * BLOCK as u64;
        let shard = self.tree.lock(first);
        (first..=first + (BLOCK - 1) as u64).any(|k| shard.get(k).is_some_and(|e| f(&e)))
    }
}

/// What one writeback pass did.
#[derive(Debug, Default, Clone, Copy)]
struct Pass {
    /// LRU items looked at (written, rotated, or stale).
    scanned: usize,
    written: usize,
    /// Cached entries freed rather than written.
    dropped: usize,
    /// The swap file refused the batch (ENOSPC, EIO): stop for now.
    failed: bool,
}

/// How many entries one writeback pass takes (one pwritev per run).
const WRITEBACK_BATCH: usize = 32;
