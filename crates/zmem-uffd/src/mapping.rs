//! An anonymous private mapping: what regions and staging areas are made of.
//!
//! Its bytes are changed behind Rust's back by the kernel (UFFDIO_COPY,
//! MOVE, DONTNEED) and by other threads, so they are never lent out as
//! `&[u8]`: only as atomics ([`Mapping::words`]), or as raw addresses for
//! the ioctls.

use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use zmem_common::PAGE_SIZE;

#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is an address range; all access to its bytes goes through
// atomics or the kernel, both of which are fine from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: &Mapping only gives out atomics and addresses.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (rounded up to pages) of anonymous private memory.
    ///
    /// # Errors
    /// mmap's error.
    pub fn new(len: usize) -> rustix::io::Result<Mapping> {
        let len = len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        // Recorded as zmem's before a scan of the address space can see it.
        let _recording = zmem_common::host::owned::spawn_lock();
        // SAFETY: a fresh anonymous mapping at an address the kernel picks
        // aliases nothing.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
            )
        }?;
        zmem_common::host::owned::add(p as u64, len, zmem_common::host::owned::Kind::Zmem);
        Ok(Mapping { ptr: NonNull::new(p.cast()).ok_or(rustix::io::Errno::NOMEM)?, len })
    }

    /// Maps the first `len` bytes of the file `fd`, shared and read-only.
    ///
    /// # Errors
    /// mmap's error.
    pub fn file_read_only(fd: &std::os::fd::OwnedFd, len: usize) -> rustix::io::Result<Mapping> {
        let len = len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let _recording = zmem_common::host::owned::spawn_lock();
        // SAFETY: a fresh mapping at an address the kernel picks aliases
        // nothing; the file's bytes are only read through it.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        zmem_common::host::owned::add(p as u64, len, zmem_common::host::owned::Kind::Zmem);
        Ok(Mapping { ptr: NonNull::new(p.cast()).ok_or(rustix::io::Errno::NOMEM)?, len })
    }

    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapping as 64-bit atomic words. A touch of a missing page in a
    /// registered range blocks until a handler resolves it.
    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: 1. ptr is page-aligned (so 8-aligned) and valid for len
        // bytes for the life of self; 2. AtomicU64 has u64's layout and
        // permits concurrent writes by other threads and the kernel; 3. no
        // &mut to this memory is ever created.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<AtomicU64>(), self.len / 8) }
    }

    /// Makes the mapping executable too (read, write and execute).
    ///
    /// # Errors
    /// mprotect's error (EACCES where a security policy forbids memory
    /// both writable and executable).
    pub fn make_executable(&self) -> rustix::io::Result<()> {
        use rustix::mm::MprotectFlags as P;
        // SAFETY: the range is our own mapping; nothing of ours executes it,
        // and its bytes stay readable and writable.
        unsafe { rustix::mm::mprotect(self.ptr.as_ptr().cast(), self.len, P::READ | P::WRITE | P::EXEC) }
    }

    /// `MADV_DONTFORK`: a forked child does not inherit the mapping.
    ///
    /// # Errors
    /// madvise's error.
    pub fn dont_fork(&self) -> rustix::io::Result<()> {
        // SAFETY: the range is our own mapping; DONTFORK changes only what a
        // child inherits, not the memory.
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().cast(), self.len, rustix::mm::Advice::LinuxDontFork) }
    }

    /// `madvise(MADV_DONTNEED)` over `[off, off + len)` of the mapping.
    ///
    /// # Errors
    /// madvise's error.
    pub fn dontneed(&self, off: usize, len: usize) -> rustix::io::Result<()> {
        assert!(off + len <= self.len, "range inside the mapping");
        // SAFETY: the range lies inside our mapping, and its bytes are only
        // ever reached through atomics or the kernel, for which dropping
        // them (reading zeros or faulting next) is an ordinary change.
        let start = (self.ptr.as_ptr() as usize + off) as *mut std::ffi::c_void;
        // SAFETY: see above.
        unsafe { rustix::mm::madvise(start, len, rustix::mm::Advice::LinuxDontNeed) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are this mapping's own, and no reference into it
        // outlives self (words() borrows self).
        let r = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        debug_assert!(r.is_ok(), "munmap of a zmem mapping failed: {r:?}");
        zmem_common::host::owned::remove(self.addr());
    }
}
