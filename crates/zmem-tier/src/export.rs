//! Export and import: an entry's page as bytes, taken to another tier
//! without decompressing where both use the same compressor. A forked child
//! takes its parent's evicted pages this way (`zmem_uffd`'s fork hand-over):
//! the object is copied, never expanded and compressed again.

use std::sync::Arc;

use zmem_zsmalloc::PAGE_SIZE;

use crate::stats::inc;
use crate::tree::BLOCK;
use crate::{Entry, Pool, Stored, Tier, TierError};

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
