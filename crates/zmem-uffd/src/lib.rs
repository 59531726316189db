//! zmem's userfaultfd layer, written by hand over rustix and linux-raw-sys.
//!
//! The `userfaultfd` crate needs libclang and its headers predate
//! `UFFDIO_MOVE`, `UFFDIO_POISON` and `WP_ASYNC`, so [`sys`] speaks the uapi
//! directly: the API handshake and feature probe, registration in MISSING
//! and WP modes, `UFFDIO_{COPY, ZEROPAGE, WRITEPROTECT, MOVE, WAKE}`, and
//! reading events (page faults, fork, remap, remove, unmap).
//!
//! The pager (regions under a memory limit, fault handling, reclaim) is
//! built on this layer; see ARCHITECTURE.md.

pub mod mapping;
pub mod pagemap;
pub mod pager;
pub mod sys;
pub mod tree;
pub mod vmas;

pub use mapping::Mapping;
pub use pagemap::{PageMap, WriteTracker};
pub use pager::{
    refaults_within, stall_at_limit, unhold_current_thread, AdoptConfig, Pager, PagerConfig, PagerError, PagerStats,
    Region, REFAULT_BUCKETS,
};
pub use sys::{Event, Features, OpenMode, RegisterMode, Uffd, UffdError};
