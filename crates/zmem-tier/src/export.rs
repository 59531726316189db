//! Export and import: an entry's page as bytes, taken to another tier
//! without decompressing where both use the same compressor. A forked child
//! takes its parent's evicted pages this way (`zmem_uffd`'s fork hand-over):
//! the object is copied, never expanded and compressed again.

use std::sync::Arc;

use zmem_common::PAGE_SIZE;

use zmem_swapfile::Slot;

use crate::stats::inc;
use crate::tree::BLOCK;
use crate::{Cursor, Entry, Pool, Stored, Tier, TierError};

/// One entry's page, as [`Tier::export`] gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exported {
    /// Every 8-byte word of the page is this value.
    SameFilled(u64),
    /// The object compressed by the exporting tier's current compressor
    /// ([`Tier::compressor`]), or the raw page when it is `PAGE_SIZE`
    /// bytes long.
    Object(Vec<u8>),
}

/// A written-back object to read for an export: (page, entry id, slot,
/// offset, length, the pool of one compressed by an older compressor).
type SwapRead = (usize, u32, Slot, u16, u16, Option<Arc<Pool>>);

impl Tier {
    /// The page stored under `key`, as another tier with the same
    /// compressor can [`import`](Self::import) it; `None` if there is no
    /// entry. An object compressed by an older compressor (before a switch)
    /// is expanded to the raw page. The entry stays.
    ///
    /// # Errors
    /// A written-back object that cannot be read, or an old one that fails
    /// to expand (as [`load`](Self::load)).
    pub fn export(&self, key: u64) -> Result<Option<Exported>, TierError> {
        self.export_many(&[key]).pop().expect("one result per key")
    }

    /// [`export`](Self::export) of each of `keys`, with their written-back
    /// objects read together: one `preadv` per run of neighbouring slots,
    /// each slot once, rather than a read per page. An entry that changed
    /// while its object was read (invalidated, stored again) is exported
    /// again on its own.
    pub fn export_many(&self, keys: &[u64]) -> Vec<Result<Option<Exported>, TierError>> {
        let current = self.current().id;
        let mut out: Vec<Result<Option<Exported>, TierError>> = keys.iter().map(|_| Ok(None)).collect();
        let mut reads: Vec<SwapRead> = Vec::new();
        // Objects of older compressors, to expand: (page, object, pool).
        let mut old: Vec<(usize, Vec<u8>, Arc<Pool>)> = Vec::new();
        let mut cursor = Cursor::new(&self.tree);
        for (i, slot_out) in out.iter_mut().enumerate() {
            let k = keys[i];
            let shard = cursor.lock(k);
            let Some(e) = shard.get(k) else { continue };
            match e.stored {
                Stored::SameFilled(v) => *slot_out = Ok(Some(Exported::SameFilled(v))),
                Stored::Pool { handle, .. } => {
                    let pool = shard.pool(e.pool).expect("a pool entry's shard holds its pool");
                    match pool.zs.map(handle, <[u8]>::to_vec) {
                        Ok(obj) if obj.len() == PAGE_SIZE || e.pool == current => {
                            *slot_out = Ok(Some(Exported::Object(obj)));
                        }
                        Ok(obj) => old.push((i, obj, Arc::clone(pool))),
                        Err(err) => *slot_out = Err(err.into()),
                    }
                }
                Stored::Swap { slot, off, len } => {
                    let pool = if e.holds_pool() { shard.pool(e.pool).cloned() } else { None };
                    let pool = pool.filter(|p| p.id != current);
                    reads.push((i, e.id, slot, off, len, pool));
                }
            }
        }
        cursor.unlock();
        if !reads.is_empty() {
            let sf = self.swap.as_ref().expect("swap entries exist only with a swap file");
            let mut bufs: Vec<Vec<u8>> = reads.iter().map(|r| vec![0u8; usize::from(r.4)]).collect();
            let results = {
                let mut reqs: Vec<(Slot, u16, &mut [u8])> =
                    reads.iter().zip(bufs.iter_mut()).map(|(r, b)| (r.2, r.3, &mut b[..])).collect();
                sf.read_objs(&mut reqs)
            };
            for ((r, obj), res) in reads.into_iter().zip(bufs).zip(results) {
                let (i, id, slot, ..) = r;
                let k = keys[i];
                // The slot may have been freed and reused since the lock was
                // let go: the entry must be the one read.
                let same = self
                    .tree
                    .lock(k)
                    .get(k)
                    .is_some_and(|e| e.id == id && matches!(e.stored, Stored::Swap { slot: s, .. } if s == slot));
                if !same {
                    out[i] = self.export_one(k);
                    continue;
                }
                match (res, r.5) {
                    (Err(source), _) => out[i] = Err(TierError::Swap { key: k, source }),
                    (Ok(()), Some(pool)) if obj.len() < PAGE_SIZE => old.push((i, obj, pool)),
                    (Ok(()), _) => out[i] = Ok(Some(Exported::Object(obj))),
                }
            }
        }
        for (i, obj, pool) in old {
            let mut page = vec![0u8; PAGE_SIZE];
            out[i] = Self::expand(&pool, keys[i], &obj, &mut page).map(|()| Some(Exported::Object(page)));
        }
        out
    }

    /// One key's export, its object read under the shard lock.
    fn export_one(&self, key: u64) -> Result<Option<Exported>, TierError> {
        let current = self.current();
        let shard = self.tree.lock(key);
        let Some(e) = shard.get(key) else { return Ok(None) };
        let obj = match e.stored {
            Stored::SameFilled(v) => return Ok(Some(Exported::SameFilled(v))),
            Stored::Pool { handle, .. } => {
                let pool = shard.pool(e.pool).expect("a pool entry's shard holds its pool");
                pool.zs.map(handle, <[u8]>::to_vec)?
            }
            Stored::Swap { slot, off, len } => {
                let sf = self.swap.as_ref().expect("swap entries exist only with a swap file");
                let mut obj = vec![0u8; usize::from(len)];
                let r = sf.read_objs(&mut [(slot, off, &mut obj[..])]).pop().expect("one result per request");
                r.map_err(|source| TierError::Swap { key, source })?;
                obj
            }
        };
        if obj.len() == PAGE_SIZE || e.pool == current.id {
            return Ok(Some(Exported::Object(obj)));
        }
        let pool = shard.pool(e.pool).expect("a compressed entry's shard holds its pool");
        let mut page = vec![0u8; PAGE_SIZE];
        Self::expand(pool, key, &obj, &mut page)?;
        Ok(Some(Exported::Object(page)))
    }

    /// Expands `page`, exported by a tier whose current compressor is this
    /// one's, into `dst` (one page), without storing it.
    ///
    /// # Errors
    /// [`TierError::BadFolio`] for an object of no bytes or more than a
    /// page, or a `dst` that is not a page; a decompression error.
    pub fn expand_exported(&self, page: &Exported, dst: &mut [u8]) -> Result<(), TierError> {
        if dst.len() != PAGE_SIZE {
            return Err(TierError::BadFolio { len: dst.len() });
        }
        match page {
            Exported::SameFilled(v) => {
                crate::load::fill(dst, *v);
                Ok(())
            }
            Exported::Object(b) if b.is_empty() || b.len() > PAGE_SIZE => Err(TierError::BadFolio { len: b.len() }),
            Exported::Object(b) => Self::expand(&self.current(), u64::MAX, b, dst),
        }
    }

    /// Stores `page`, exported by a tier whose current compressor is this
    /// one's, under `key`, replacing any entry there. The object is copied
    /// into the current pool as it is; the pool's limit is not checked (the
    /// caller's reclaim writes back what is over it).
    ///
    /// # Errors
    /// [`TierError::BadFolio`] for an object of no bytes or more than a
    /// page; the pool's allocation error. Nothing is stored then.
    pub fn import(&self, key: u64, page: &Exported) -> Result<(), TierError> {
        let pool: Arc<Pool> = self.current();
        let stored = match page {
            Exported::SameFilled(v) => Stored::SameFilled(*v),
            Exported::Object(b) if b.is_empty() || b.len() > PAGE_SIZE => {
                return Err(TierError::BadFolio { len: b.len() });
            }
            Exported::Object(b) => Stored::Pool { handle: pool.zs.malloc_copy(b)?, len: b.len() as u32 },
        };
        let e = Entry { id: crate::store::next_ids(1), pool: pool.id, stored, referenced: false, cached: false };
        let c = &self.counters;
        let mut shard = self.tree.lock(key);
        // As a store: the gauges go up under the shard lock, before the
        // entry is seen.
        inc(&c.stored_pages, 1);
        match stored {
            Stored::SameFilled(_) => inc(&c.same_filled_pages, 1),
            Stored::Pool { len, .. } if len as usize == PAGE_SIZE => inc(&c.stored_incompressible_pages, 1),
            _ => {}
        }
        if e.in_pool() {
            self.ages.stored(e.id);
        }
        let old = shard.insert(key, e, &pool);
        let dropped = old.and_then(|o| self.release(&mut shard, o));
        drop(shard);
        drop(dropped);
        if matches!(stored, Stored::Pool { .. }) {
            self.lru.push([key / BLOCK as u64]);
        }
        Ok(())
    }
}
