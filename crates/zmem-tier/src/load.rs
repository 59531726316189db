//! Load, invalidate and lookup.

use zmem_compress::DecompressError;
use zmem_zsmalloc::PAGE_SIZE;

use crate::stats::inc;
use crate::{Entry, Pool, Stored, Tier, TierError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    Loaded,
    NotFound,
}

fn fill(dst: &mut [u8], v: u64) {
    let b = v.to_ne_bytes();
    for w in dst.chunks_exact_mut(8) {
        w.copy_from_slice(&b);
    }
}

impl Tier {
    /// Decompresses (or copies, for a raw page) a pool entry into `dst`.
    pub(crate) fn load_from_pool(pool: &Pool, key: u64, e: &Entry, dst: &mut [u8]) -> Result<(), TierError> {
        let Stored::Pool { handle, len } = e.stored else { unreachable!("a pool entry") };
        pool.zs
            .map(handle, |obj| {
                if len as usize == PAGE_SIZE {
                    dst.copy_from_slice(obj);
                    return Ok(());
                }
                let mut res = [Ok(0)];
                let mut d = [&mut *dst];
                pool.compressor.decompress_batch(&[obj], &mut d, &mut res)?;
                match res[0] {
                    Ok(n) if n == PAGE_SIZE => Ok(()),
                    Ok(got) => Err(TierError::Decompress {
                        key,
                        source: DecompressError::LengthMismatch { codec: "codec", got, want: PAGE_SIZE },
                    }),
                    Err(ref source) => Err(TierError::Decompress { key, source: source.clone() }),
                }
            })
            .map_err(TierError::Pool)?
    }

    /// Loads the page stored under `key` into `dst` (one page). An exclusive
    /// load (the default) frees the entry.
    ///
    /// # Errors
    /// [`TierError::Decompress`] or [`TierError::Swap`] (a corrupt slot, an
    /// I/O error): `decompress_fail` is counted, `dst` holds garbage and the
    /// entry stays, so nothing is lost. [`TierError::BadFolio`] for a `dst`
    /// that is not one page.
    pub fn load(&self, key: u64, dst: &mut [u8]) -> Result<LoadOutcome, TierError> {
        if dst.len() != PAGE_SIZE {
            return Err(TierError::BadFolio { len: dst.len() });
        }
        let mut shard = self.tree.lock(key);
        let Some(e) = shard.get(key).copied() else { return Ok(LoadOutcome::NotFound) };
        let r = match e.stored {
            Stored::SameFilled(v) => {
                fill(dst, v);
                Ok(())
            }
            Stored::Pool { .. } => {
                Self::load_from_pool(shard.pool(e.pool).expect("a pool entry's shard holds its pool"), key, &e, dst)
            }
            Stored::Swap { slot } => match &self.swap {
                Some(sf) => sf.read(slot, dst).map_err(|source| TierError::Swap { key, source }),
                None => unreachable!("swap entries exist only with a swap file"),
            },
        };
        if let Err(err) = r {
            inc(&self.counters.decompress_fail, 1);
            return Err(err);
        }
        inc(&self.counters.zswpin, 1);
        let dropped = if self.cfg.exclusive_loads {
            let e = shard.remove(key).expect("looked up under the same lock");
            self.release(&mut shard, e)
        } else {
            if let Some(e) = shard.get_mut(key) {
                e.referenced = true;
            }
            None
        };
        drop(shard);
        drop(dropped);
        Ok(LoadOutcome::Loaded)
    }

    /// Drops the entry under `key`, if any.
    pub fn invalidate(&self, key: u64) -> bool {
        let mut shard = self.tree.lock(key);
        let Some(e) = shard.remove(key) else { return false };
        let dropped = self.release(&mut shard, e);
        drop(shard);
        drop(dropped);
        true
    }

    /// Whether `key` has an entry, and where.
    pub fn lookup(&self, key: u64) -> Option<Stored> {
        self.tree.lock(key).get(key).map(|e| e.stored)
    }
}
