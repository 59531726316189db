//! mmap, munmap, mremap and madvise: anonymous private RW mappings of
//! `ZMEM_THRESHOLD` or more are managed; the rest go to the kernel.

use std::ffi::{c_int, c_void};
use zmem_common::RwLockExt;

use crate::errno::set_errno;
use crate::guard::guarded;
use crate::init::managed_alloc;
use crate::state::{current, lookup, managed_free, wants, REGIONS};
use zmem_common::PAGE_SIZE;

pub(crate) fn raw_mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the mmap syscall with the caller's arguments; what it maps is
    // the caller's business, as it would be with glibc's mmap.
    let r = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) };
    r as *mut c_void
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    let anon_private = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let plain = flags & !libc::MAP_NORESERVE == anon_private;
    // Never the shim's start: this mmap may come from inside an allocator's
    // own start-up (jemalloc's, from its first malloc), whose lock the
    // shim's start would wait on. The shim starts from its constructor.
    let started = current().is_some();
    if started && addr.is_null() && plain && prot == libc::PROT_READ | libc::PROT_WRITE && fd == -1 && wants(len) {
        if let Some(p) = managed_alloc(len) {
            return p;
        }
    }

    if flags & libc::MAP_LOCKED != 0 {
        // Recorded before a scan can see it.
        let _recording = guarded(zmem_common::host::owned::spawn_lock);
        let p = raw_mmap(addr, len, prot, flags, fd, off);
        if p != libc::MAP_FAILED {
            crate::state::locked(p as usize, len);
        }
        return p;
    }
    let p = raw_mmap(addr, len, prot, flags, fd, off);
    if !started
        && p != libc::MAP_FAILED
        && plain
        && prot & libc::PROT_WRITE != 0
        && fd == -1
        && len >= zmem_settings::Settings::DEFAULT_THRESHOLD
        && crate::waiting::saw_mapping(len, false)
    {
        // The pager started for this mapping (a process that waited):
        // managed from its first byte, as one mapped under a pager is.
        if let Some(s) = current() {
            guarded(|| s.pager.adopt(p as u64, len).map_err(|e| log::debug!("a mapping at {p:?} not adopted: {e}")));
        }
    }
    p
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the same function under its LFS name.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    let a = addr as usize;
    if let Some((start, cap, _)) = lookup(a) {
        let end = (a + len).min(start + cap);
        if a == start && end == start + cap {
            managed_free(start);
            return 0;
        }
        // Part of it: drop the pages (the pager frees their entries) and
        // fence the range; the addresses return with the whole mapping.
        let (pa, plen) =
            (a & !(PAGE_SIZE - 1), end.saturating_sub(a & !(PAGE_SIZE - 1)).div_ceil(PAGE_SIZE) * PAGE_SIZE);
        // SAFETY: [pa, pa + plen) lies in our managed mapping, which the
        // program gave up: dropping and fencing it is what munmap promises.
        unsafe {
            libc::syscall(libc::SYS_madvise, pa, plen, libc::MADV_DONTNEED);
        }
        // SAFETY: as above.
        unsafe {
            libc::syscall(libc::SYS_mprotect, pa, plen, libc::PROT_NONE);
        }
        let whole = guarded(|| {
            REGIONS.write_ok().get_mut(&start).is_some_and(|m| {
                m.unmapped += plen;
                m.unmapped >= cap
            })
        })
        .unwrap_or(false);
        if whole {
            managed_free(start);
        }
        return 0;
    }
    // SAFETY: not ours: the kernel's munmap with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int }
}

/// `mremap`, which C declares variadic (`new_address` is read only with
/// MREMAP_FIXED). On x86-64 a variadic callee reads its arguments from the
/// same registers as a fixed one, so the fifth is declared outright.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    let a = old as usize;
    if let Some((start, cap, len)) = lookup(a) {
        if a != start || flags & libc::MREMAP_FIXED != 0 {
            set_errno(libc::EINVAL);
            return libc::MAP_FAILED;
        }
        if new_len <= cap {
            guarded(|| {
                if let Some(m) = REGIONS.write_ok().get_mut(&start) {
                    m.len = new_len;
                }
            });
            return old;
        }
        if flags & libc::MREMAP_MAYMOVE == 0 {
            set_errno(libc::ENOMEM);
            return libc::MAP_FAILED;
        }
        // A forked child manages nothing new: a plain mapping then.
        let q = managed_alloc(new_len).unwrap_or_else(|| {
            let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
            raw_mmap(std::ptr::null_mut(), new_len, libc::PROT_READ | libc::PROT_WRITE, anon, -1, 0)
        });
        if q == libc::MAP_FAILED {
            set_errno(libc::ENOMEM);
            return libc::MAP_FAILED;
        }
        // SAFETY: both are managed mappings, distinct, with len and new_len
        // bytes.
        unsafe { std::ptr::copy_nonoverlapping(old.cast::<u8>(), q.cast::<u8>(), len.min(old_len).min(new_len)) };
        managed_free(start);
        return q;
    }
    // An adopted mapping's evicted pages cannot follow a move that splits
    // its region: load them first.
    if let Some(s) = current() {
        if !crate::guard::in_zmem() {
            guarded(|| s.pager.prepare_remap(old as u64, old_len));
        }
    }
    // SAFETY: not ours: the kernel's mremap with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) as *mut c_void }
}

#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int {
    // MADV_FREE raises no event: on managed memory it becomes DONTNEED, so
    // the pager drops the range's entries (and the pages read as zeros, as
    // MADV_FREE allows).
    let advice =
        if advice == libc::MADV_FREE && lookup(addr as usize).is_some() { libc::MADV_DONTNEED } else { advice };
    // SAFETY: the kernel's madvise with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) as c_int }
}

/// `mprotect`: a range made readable and writable (a runtime committing
/// part of a `PROT_NONE` reservation: V8's heap, 256 KiB at a time) is
/// adopted at once (`Pager::adopt_committed`), before the program fills
/// it, rather than by the next scan. In a process that waits to start its
/// pager, the commit counts as memory about to be filled, as a large
/// `mmap` does (`waiting::saw_mapping`): one that reaches the start point
/// waits for the start, and is adopted. Counted only at the next look,
/// commits filled at memset speed went ~15 MiB past the point before the
/// look and ~12 MiB more during the start, and tests/data/commit.c under
/// `--limit 32M` peaked at 33-53 MiB (the tree's slack is 40).
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int {
    // SAFETY: the kernel's mprotect with the caller's arguments.
    let r = unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) } as c_int;
    if r != 0 || prot != libc::PROT_READ | libc::PROT_WRITE {
        return r;
    }
    let started = current().is_some();
    if !started && len >= zmem_settings::Settings::DEFAULT_THRESHOLD && !crate::waiting::saw_mapping(len, false) {
        return r;
    }
    if wants(len) {
        if let Some(s) = current().filter(|s| s.settings.adopt) {
            guarded(|| s.pager.adopt_committed(addr as u64, len));
        }
    }
    r
}

/// `mlock`: locked memory is never managed (the kernel never reclaims it
/// either), so the range is recorded before any scan can adopt it. Memory
/// already managed stays so (its pages, faulted in by the lock, cannot be
/// moved out and sit on the unevictable list).
#[no_mangle]
pub unsafe extern "C" fn mlock(addr: *const c_void, len: usize) -> c_int {
    // SAFETY: the kernel's mlock with the caller's arguments.
    let r = unsafe { libc::syscall(libc::SYS_mlock, addr, len) } as c_int;
    if r == 0 {
        crate::state::locked(addr as usize, len);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn mlock2(addr: *const c_void, len: usize, flags: libc::c_uint) -> c_int {
    // SAFETY: the kernel's mlock2 with the caller's arguments.
    let r = unsafe { libc::syscall(libc::SYS_mlock2, addr, len, flags) } as c_int;
    if r == 0 {
        crate::state::locked(addr as usize, len);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn munlock(addr: *const c_void, len: usize) -> c_int {
    // SAFETY: the kernel's munlock with the caller's arguments.
    let r = unsafe { libc::syscall(libc::SYS_munlock, addr, len) } as c_int;
    if r == 0 {
        crate::state::unlocked(addr as usize);
    }
    r
}

/// `mlockall`: with `MCL_FUTURE` everything the program maps from now on
/// is locked, so nothing new is managed (no region, no adoption).
#[no_mangle]
pub unsafe extern "C" fn mlockall(flags: c_int) -> c_int {
    // SAFETY: the kernel's mlockall with the caller's argument.
    let r = unsafe { libc::syscall(libc::SYS_mlockall, flags) } as c_int;
    if r == 0 {
        crate::state::locked_all(flags);
    }
    r
}
