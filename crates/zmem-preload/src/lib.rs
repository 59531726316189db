//! zmem's LD_PRELOAD shim (`libzmem_preload.so`), and the C API of
//! `include/zmem.h`.
//!
//! `zmem run -- CMD` starts CMD with this library preloaded. It places the
//! program's anonymous memory under one in-process [`zmem_uffd::Pager`]:
//!
//! - `mmap(NULL, len, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0)`
//!   with `len >= ZMEM_THRESHOLD` (jemalloc, Python's arenas, most
//!   allocators' large chunks call mmap through the PLT);
//! - every other private anonymous writable mapping of the program, found
//!   by the pager's scan of the address space (adoption): glibc's brk heap
//!   and the chunks it maps with its own internal mmap, another allocator's
//!   chunks, a runtime's heap.
//!
//! The malloc family is interposed only to keep zmem's own allocations on
//! zmem's heap (`heap.rs`); the program's allocator, glibc's included,
//! stays its own (`next.rs`). With adoption off (`ZMEM_ADOPT=0`), requests
//! of `ZMEM_THRESHOLD` or more to glibc's malloc become regions, the only
//! way its large chunks are managed then.
//!
//! `munmap`, `mremap`, `madvise` and `free` of managed memory are handled
//! here; everything else goes to the kernel (raw syscalls) or glibc.
//!
//! # Reentrancy
//! A fault taken while serving a fault deadlocks, so zmem's own memory must
//! never be managed. A thread-local flag (`IN_ZMEM`) marks code that runs
//! inside the shim, and is set for good on every thread the pager starts
//! (`PagerConfig::thread_init`). While it is set, every entry point passes
//! straight through. zmem's own big mappings (regions, staging, the
//! mempool) are made with raw syscalls and never reach these symbols.
//!
//! # fork, exec and the process tree
//! A forked child inherits the regions whole: the prepare step of fork loads
//! every evicted folio back and freezes reclaim until the parent step
//! (`Pager::fork_prepare`). The child abandons the parent's pager (its
//! threads are not in the child; its userfaultfd and swap file are closed)
//! and starts one of its own under the same settings, which adopts the
//! inherited regions: they stay in the table as plain memory of the child's
//! (`Managed::region` is `None`), and the child's memory stays managed.
//! The forking thread holds the table, zmem's range records
//! (`owned::fork_lock`) and zmem's heap across fork, so that no lock is
//! left held in the child. vfork and posix_spawn run no atfork handlers and
//! need none. `exec` starts afresh: the environment carries `LD_PRELOAD`
//! and the settings, so the new program gets its own pager.
//!
//! Every process of a `zmem run` shares one limit: `ZMEM_TREE` names the
//! tree's accounting segment (`zmem_uffd::tree`), and each pager keeps its
//! usage within its share. A process starts its pager only once the tree's
//! memory is halfway to the limit (`waiting.rs`); until then it counts
//! itself in the tree and its stats thread looks.
//!
//! # Files
//! - The process's life cycle: `init.rs`, the shim's start; `fork.rs`:
//!   fork's three steps; `waiting.rs`: a pager that starts late; `modes.rs`:
//!   `unshare`, `setns`, seccomp and `chroot` (zmem out of the way, or
//!   started first); `ns.rs`: the `unshare` and `setns` interposers. These
//!   call each other by design: a mode switch stops and restarts the pager
//!   and the stats thread, and the stats thread drives the waiting state and
//!   the sandbox checks (`sandbox.rs`, `coredump.rs`, `creds.rs` too).
//! - `state.rs`: the running shim and the managed-mapping table, a leaf.
//! - `mmap.rs`, `malloc.rs`, `heap.rs`, `next.rs`: the interposed memory
//!   calls, zmem's own heap, the program's allocator.
//! - `threads.rs`, `tasks.rs`: the program's threads and their stacks.
//! - `uaccess.rs`: system-call buffers loaded first (user-mode-only
//!   userfaultfd), `stdio.rs` the C library's streams it reads; `creds.rs`, `sandbox.rs`, `exec.rs`, `fds.rs`: the calls
//!   that change credentials, sandboxes, programs and descriptors.
//! - `stats.rs`, `meminfo.rs`, `sysmem.rs`: the stats file and what the
//!   program is told of memory; `coredump.rs`: memory back before a dump.
//! - Leaves: `state.rs`, `guard.rs` (reentrancy, panics), `flags.rs`
//!   (per-thread flags), `errno.rs` (`errno`, raw system calls); `capi.rs`:
//!   `include/zmem.h`.
//!
//! # Partial munmap
//! Unmapping part of a managed mapping drops its pages (`MADV_DONTNEED`, so
//! the pager frees their entries) and makes the range `PROT_NONE`; the
//! address range is returned when the whole mapping is unmapped.
#![allow(clippy::missing_safety_doc)]

mod capi;
mod coredump;
mod creds;
mod errno;
mod exec;
mod fds;
mod flags;
mod fork;
mod guard;
mod heap;
mod init;
mod malloc;
mod meminfo;
mod mmap;
mod modes;
mod next;
mod ns;
mod sandbox;
mod state;
mod stats;
mod stdio;
mod sysmem;
mod tasks;
mod threads;
mod uaccess;
mod waiting;

pub use guard::mark_internal_thread;

#[global_allocator]
static HEAP: heap::ZmemHeap = heap::ZmemHeap;
