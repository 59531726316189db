//! Living inside a host process: the rules that let zmem's threads, mappings
//! and descriptors share a process with a program that does not know they
//! are there.
//!
//! Under `zmem run` the pager runs inside the program's own process (that is
//! what userfaultfd needs: the faults are the program's). The program may
//! close every descriptor it did not open, block or take any signal, fork at
//! any moment, allocate from its own `malloc`, and let a library constructor
//! hold the dynamic loader's lock while it faults. Each module here keeps
//! one invariant that such a program cannot break:
//!
//! - [`fds`]: **zmem's descriptors survive the program's closes.** Every
//!   descriptor a pager keeps (its userfaultfd, swap file, `/proc` readers)
//!   is listed in a lock-free table the shim's `close` family steps over;
//!   zmem opens and closes only inside a *section* that no close of the
//!   program's can interleave with, and never takes numbers 0–2.
//! - [`owned`]: **zmem never manages its own memory.** Every range zmem
//!   maps (regions, staging, pool arenas, its heap) and every thread stack
//!   is recorded before anyone can see it, so the mapping scan never adopts
//!   memory a zmem thread would then fault on and wait for itself.
//!   [`owned::fork_lock`] holds these records still across a fork.
//! - [`thread`]: **zmem's threads take none of the program's signals** and
//!   are known without `/proc` (they list themselves), so a program can be
//!   told apart from zmem's threads after a `chroot`.
//! - [`tls`]: **zmem's threads never fault on their own TLS vector.** glibc
//!   allocates it from the program's `malloc`, which may be the program's
//!   own allocator in memory zmem adopts, so its pages are pinned resident.
//!
//! Inside a descriptor section only descriptors are made, kept, closed and
//! forgotten: no lock is taken and the program's memory is not touched, so
//! the program's `close`, which waits for sections, never waits on a fault.

#[allow(unsafe_code)]
pub mod fds;
pub mod owned;
#[allow(unsafe_code)]
pub mod thread;
#[allow(unsafe_code)]
pub mod tls;
