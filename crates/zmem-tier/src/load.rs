//! Load, invalidate and lookup.

use zmem_compress::DecompressError;
use zmem_zsmalloc::PAGE_SIZE;

use std::sync::Arc;

use crate::stats::inc;
use crate::tree::Shard;
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
        let dropped = self.loaded(&mut shard, key);
        drop(shard);
        drop(dropped);
        Ok(LoadOutcome::Loaded)
    }

    /// Loads `dst.len() / PAGE_SIZE` pages from keys `key`, `key + 1`, ...
    /// (a folio): as many [`load`](Self::load)s, except that the pages in
    /// the swap file are read together, one `preadv` per run of
    /// neighbouring slots, with no tree lock held during the I/O. `out[i]`
    /// is page `i`'s outcome; a page that fails keeps its entry, as `load`.
    ///
    /// Each swap read is checked after it returns: if the key no longer
    /// holds the same entry (invalidated, loaded, or stored again meanwhile,
    /// so its slot may have been reused), that page is loaded again with
    /// `load`.
    pub fn load_many(&self, key: u64, dst: &mut [u8]) -> Vec<Result<LoadOutcome, TierError>> {
        if dst.is_empty() || dst.len() % PAGE_SIZE != 0 {
            return vec![Err(TierError::BadFolio { len: dst.len() })];
        }
        let n = dst.len() / PAGE_SIZE;
        let mut out: Vec<Result<LoadOutcome, TierError>> = Vec::with_capacity(n);
        // (page, slot, entry id) of the pages to read from the swap file.
        let mut swapped = Vec::new();
        for (i, page) in dst.chunks_exact_mut(PAGE_SIZE).enumerate() {
            let k = key.wrapping_add(i as u64);
            let at_swap = self.tree.lock(k).get(k).and_then(|e| match e.stored {
                Stored::Swap { slot } => Some((slot, e.id)),
                _ => None,
            });
            match at_swap {
                Some((slot, id)) if self.swap.is_some() => {
                    swapped.push((i, slot, id));
                    out.push(Ok(LoadOutcome::Loaded));
                }
                _ => out.push(self.load(k, page)),
            }
        }
        if swapped.is_empty() {
            return out;
        }
        let sf = self.swap.as_ref().expect("checked above");
        let mut pages: Vec<Option<&mut [u8]>> = dst.chunks_exact_mut(PAGE_SIZE).map(Some).collect();
        let mut reqs: Vec<(zmem_swapfile::Slot, &mut [u8])> =
            swapped.iter().map(|&(i, slot, _)| (slot, pages[i].take().expect("each page once"))).collect();
        let results = sf.read_batch(&mut reqs);
        let mut again = Vec::new();
        for ((&(i, slot, id), r), (_, page)) in swapped.iter().zip(results).zip(reqs) {
            let k = key.wrapping_add(i as u64);
            let mut shard = self.tree.lock(k);
            let same = shard.get(k).is_some_and(|e| e.id == id && e.stored == (Stored::Swap { slot }));
            if !same {
                drop(shard);
                again.push((i, page));
                continue;
            }
            if let Err(source) = r {
                inc(&self.counters.decompress_fail, 1);
                out[i] = Err(TierError::Swap { key: k, source });
                continue;
            }
            let dropped = self.loaded(&mut shard, k);
            drop(shard);
            drop(dropped);
        }
        for (i, page) in again {
            out[i] = self.load(key.wrapping_add(i as u64), page);
        }
        out
    }

    /// A page of `key` was loaded (its shard locked by the caller): count
    /// it, then free the entry (exclusive loads) or mark it referenced.
    /// Returns a pool whose last entry this was, for the caller to drop
    /// after the shard lock.
    fn loaded(&self, shard: &mut Shard<Arc<Pool>>, key: u64) -> Option<Arc<Pool>> {
        inc(&self.counters.zswpin, 1);
        if self.cfg.exclusive_loads {
            let e = shard.remove(key).expect("looked up under the same lock");
            self.release(shard, e)
        } else {
            if let Some(e) = shard.get_mut(key) {
                e.referenced = true;
            }
            None
        }
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
