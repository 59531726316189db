//! What another codec would make of the pool: a sample of the current
//! pool's entries, expanded and compressed again, and sized. The
//! pager's codec choice weighs it (`zmem_uffd`'s `pager/codec.rs`).

use std::sync::atomic::Ordering;

use zmem_common::PAGE_SIZE;
use zmem_compress::{BatchCompressor, CodecSpec, Sequential};

use crate::stats::inc;
use crate::{Stored, Tier, TierError};

/// Sizes of a sample of pool entries under the current codec and under
/// another.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CodecSample {
    /// Entries sampled.
    pub pages: usize,
    /// Their objects' bytes now, and with the other codec.
    pub bytes_now: usize,
    pub bytes_other: usize,
}

impl Tier {
    /// Samples up to `nr` compressed entries of the current pool, from the
    /// shard after the one the last call ended in, under `other`. Takes
    /// each shard's lock only to copy objects out. An empty sample (no
    /// compressed entries) has `pages` 0.
    ///
    /// # Errors
    /// Making `other`'s compressor.
    pub fn sample_codec(&self, other: CodecSpec, nr: usize) -> Result<CodecSample, TierError> {
        let pool = self.current();
        let shards = crate::tree::SHARDS;
        let first = self.sample_cursor.load(Ordering::Relaxed);
        let mut objs: Vec<Vec<u8>> = Vec::with_capacity(nr.min(256));
        let mut next = first;
        for s in (first..first + shards).map(|s| s % shards) {
            next = s + 1;
            if objs.len() >= nr {
                break;
            }
            let shard = self.tree.lock_shard(s);
            for key in shard.keys() {
                if objs.len() >= nr {
                    break;
                }
                let Some(e) = shard.get(key) else { continue };
                let Stored::Pool { handle, len } = e.stored else { continue };
                if e.pool != pool.id || len as usize >= PAGE_SIZE {
                    continue;
                }
                let mut obj = vec![0u8; len as usize];
                if pool.zs.map(handle, |o| obj.copy_from_slice(&o[..len as usize])).is_ok() {
                    objs.push(obj);
                }
            }
        }
        self.sample_cursor.store(next % shards, Ordering::Relaxed);
        let mut out = CodecSample::default();
        if objs.is_empty() {
            return Ok(out);
        }
        let them = Sequential::new(other.factory(), 1)?;
        let mut page = vec![0u8; PAGE_SIZE];
        let mut obj2 = vec![0u8; PAGE_SIZE];
        for obj in &objs {
            if Self::expand(&pool, 0, obj, &mut page).is_err() {
                inc(&self.counters.decompress_fail, 1);
                continue;
            }
            let mut res = [Ok(0)];
            them.compress_batch(&[&page], &mut [&mut obj2[..]], &mut res)?;
            out.pages += 1;
            out.bytes_now += obj.len();
            out.bytes_other += res[0].as_ref().map_or(PAGE_SIZE, |&n| n);
        }
        Ok(out)
    }
}
