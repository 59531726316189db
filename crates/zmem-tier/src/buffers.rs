//! Byte buffers the codec paths reuse, kept by the tier rather than in
//! thread-locals.
//!
//! A Rust thread-local that owns memory registers its destructor on its
//! first use in each thread, through glibc's `__cxa_thread_atexit_impl`,
//! which takes the dynamic loader's lock. The pager's threads must never
//! wait for a lock the program may hold while it faults. Python importing
//! a module (`dlopen`, the loader's lock held) faulted on a folio that
//! reclaim was evicting, and reclaim waited for the loader's lock to
//! register its first buffer: both waited for good (`zmem run`'s
//! `each_pool_follows_its_share_of_the_tree_limit` hung in CI under load,
//! and in 1 of 2 runs of its program beside a `make -j2`). A handler's
//! first load during a `dlopen` could hang the same way.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use zmem_common::LockExt;

/// Buffers kept for reuse at most: one per thread that uses them at once
/// (handlers, reclaim, recompression), with room to spare.
const KEEP: usize = 8;

/// A stack of buffers, each as long as the longest use it has had.
#[derive(Debug, Default)]
pub(crate) struct Buffers {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Buffers {
    /// A buffer of at least `len` bytes (longer if it served a longer use
    /// before; its bytes are whatever that use left). It goes back when
    /// dropped.
    pub(crate) fn take(&self, len: usize) -> Buffer<'_> {
        let mut v = self.free.lock_ok().pop().unwrap_or_default();
        if v.len() < len {
            v.resize(len, 0);
        }
        Buffer { v, home: self }
    }
}

/// A buffer taken from [`Buffers`].
pub(crate) struct Buffer<'a> {
    v: Vec<u8>,
    home: &'a Buffers,
}

impl Deref for Buffer<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v
    }
}

impl DerefMut for Buffer<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.v
    }
}

impl Drop for Buffer<'_> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        let mut free = self.home.free.lock_ok();
        if free.len() < KEEP {
            free.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_long_enough_and_comes_back_for_the_next_use() {
        let b = Buffers::default();
        let mut x = b.take(100);
        assert!(x.len() >= 100);
        x[99] = 7;
        let y = b.take(10);
        assert_eq!(y.len(), 10, "a second use at once gets a buffer of its own");
        drop((x, y));
        let z = b.take(50);
        assert!(z.len() >= 50);
        assert_eq!(b.free.lock_ok().len(), 1, "one of the two is out again");
    }
}
