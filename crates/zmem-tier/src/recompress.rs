//! Recompression: pool entries go from their compressor's pool to a
//! stronger compressor's (zstd, say), as zram's `recompress` does. The
//! object is expanded with the compressor that made it and compressed
//! again; it moves only where it shrinks by at least an eighth, which is
//! what frees pool memory once size classes round it up. Loads decompress
//! with the entry's pool's compressor, wherever the entry came from, and
//! writeback copies the new object as it is.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use zmem_common::PAGE_SIZE;
use zmem_compress::{CodecSpec, CompressError};
use zmem_zsmalloc::Handle;

use crate::stats::inc;
use crate::{Pool, Stored, Tier, TierError};

/// What one [`Tier::recompress`] call did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recompressed {
    /// Pool entries looked at.
    pub scanned: usize,
    /// Entries moved to the stronger compressor's pool.
    pub moved: usize,
    /// Object bytes the moved entries no longer take.
    pub saved_bytes: usize,
}

/// An entry picked under its shard's lock, its object copied out.
struct Picked {
    key: u64,
    id: u32,
    from: Arc<Pool>,
    handle: Handle,
    obj: Vec<u8>,
}

impl Tier {
    /// Recompresses up to `nr` pool entries with `spec`, from the shard
    /// after the one the last call ended in. With `idle`, only entries not
    /// referenced since the last look (zram's `type=idle` after `mark
    /// idle`): a referenced entry (stored or loaded since) has the mark
    /// cleared and waits for the next call that comes by, as the shrinker's
    /// second chance does. Cached clean copies are left alone (the shrinker
    /// frees them first), and so are entries already in a pool of `spec`'s
    /// compressor.
    ///
    /// # Errors
    /// Making `spec`'s compressor or its pool; the codec failing as a whole.
    /// Entries are moved one by one, each only if its new object is in the
    /// pool: an error leaves every entry loadable.
    pub fn recompress(&self, spec: CodecSpec, nr: usize, idle: bool) -> Result<Recompressed, TierError> {
        let to = self.recompress_pool(spec)?;
        let mut done = Recompressed::default();
        let shards = crate::tree::SHARDS;
        let first = self.recompress_cursor.load(Ordering::Relaxed);
        let bs = to.compressor.batch_size().max(1);
        let mut page = vec![0u8; bs * PAGE_SIZE];
        let mut out = vec![0u8; bs * PAGE_SIZE];
        for s in (first..first + shards).map(|s| s % shards) {
            if done.moved >= nr {
                self.recompress_cursor.store(s, Ordering::Relaxed);
                break;
            }
            // One shard at a time: every entry picked here is checked again
            // under the lock before it is moved.
            let mut picked = Vec::new();
            {
                let mut shard = self.tree.lock_shard(s);
                let keys: Vec<u64> = shard.keys().collect();
                for key in keys {
                    if picked.len() >= nr - done.moved {
                        break;
                    }
                    let Some(e) = shard.get(key) else { continue };
                    let Stored::Pool { handle, len } = e.stored else { continue };
                    if e.cached {
                        continue;
                    }
                    if idle && e.referenced {
                        if let Some(mut m) = shard.get_mut(key) {
                            m.referenced = false;
                        }
                        continue;
                    }
                    let Some(from) = shard.pool(e.pool) else { continue };
                    if from.name == to.name {
                        continue;
                    }
                    done.scanned += 1;
                    let mut obj = vec![0u8; len as usize];
                    if from.zs.map(handle, |o| obj.copy_from_slice(&o[..len as usize])).is_err() {
                        inc(&self.counters.decompress_fail, 1);
                        continue;
                    }
                    picked.push(Picked { key, id: e.id, from: Arc::clone(from), handle, obj });
                }
            }
            for chunk in picked.chunks(bs) {
                done = self.recompress_chunk(&to, chunk, &mut page, &mut out, done)?;
            }
        }
        Ok(done)
    }

    /// Expands `chunk`'s objects, compresses them with `to`'s compressor,
    /// and moves each entry whose object shrinks enough and is unchanged.
    fn recompress_chunk(
        &self,
        to: &Arc<Pool>,
        chunk: &[Picked],
        page: &mut [u8],
        out: &mut [u8],
        mut done: Recompressed,
    ) -> Result<Recompressed, TierError> {
        let n = chunk.len();
        let mut ok = vec![true; n];
        let mut pages: Vec<&mut [u8]> = page.chunks_exact_mut(PAGE_SIZE).take(n).collect();
        for (i, p) in chunk.iter().enumerate() {
            if Self::expand(&p.from, p.key, &p.obj, pages[i]).is_err() {
                inc(&self.counters.decompress_fail, 1);
                ok[i] = false;
            }
        }
        let srcs: Vec<&[u8]> = pages.iter().map(|p| &**p).collect();
        let mut dsts: Vec<&mut [u8]> = out.chunks_exact_mut(PAGE_SIZE).take(n).collect();
        let mut res: Vec<Result<usize, CompressError>> = vec![Ok(0); n];
        to.compressor.compress_batch(&srcs, &mut dsts, &mut res)?;
        for (i, p) in chunk.iter().enumerate() {
            let old = p.obj.len();
            let new = match res[i] {
                Ok(len) if ok[i] && len <= old - old / 8 => len,
                _ => continue,
            };
            let Ok(handle) = to.zs.malloc_copy(&dsts[i][..new]) else { break };
            let mut shard = self.tree.lock(p.key);
            let r = shard.recompress_commit(
                p.key,
                p.id,
                p.handle,
                (to.id, to),
                Stored::Pool { handle, len: new as u32 },
                |q, e| {
                    if let Stored::Pool { handle, .. } = e.stored {
                        let r = q.zs.free(handle);
                        debug_assert!(r.is_ok(), "{r:?}");
                    }
                },
            );
            if r.is_ok() && old == PAGE_SIZE {
                // Under the shard lock, as invalidate's: never below zero.
                crate::stats::dec(&self.counters.stored_incompressible_pages, 1);
            }
            drop(shard);
            match r {
                Ok(dropped) => {
                    drop(dropped);
                    done.moved += 1;
                    done.saved_bytes += old - new;
                    inc(&self.counters.recompressed_pages, 1);
                }
                // Loaded, invalidated, written back or stored again
                // meanwhile: the new object holds nothing anyone needs.
                Err(()) => {
                    let r = to.zs.free(handle);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            }
        }
        Ok(done)
    }

    /// The pool recompressed entries go to: `spec`'s, made on first use,
    /// when `spec` changes, and after the last entry of the one before
    /// went (it is freed then, as an old compressor's pool is).
    fn recompress_pool(&self, spec: CodecSpec) -> Result<Arc<Pool>, TierError> {
        let mut slot = self.recompress_to.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = slot.as_ref().filter(|(s, _)| *s == spec).and_then(|(_, w)| w.upgrade()) {
            return Ok(p);
        }
        let pool = self.new_pool(Self::make_compressor(&self.cfg, spec)?)?;
        *slot = Some((spec, Arc::downgrade(&pool)));
        Ok(pool)
    }
}
