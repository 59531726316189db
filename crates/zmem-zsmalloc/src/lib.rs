//! zmem's compressed-object pool: a user-space zsmalloc, fed by a mempool
//! with a bulk page allocator.
//!
//! - [`mempool`]: arenas of pages, a reserve, bulk allocation with a bounded
//!   wait, batched release to the OS. The only `unsafe` of the crate.
//! - [`size_class`]: the class table (sizes, zspage shapes, merging, huge).
//! - [`handle`]: opaque handles that survive compaction.
//! - [`pool`]: [`ZsPool`]: malloc, free, map, compact, statistics.
//! - `zspage`: zspages, their slots and free stacks, fullness groups.

pub mod assert;
pub mod handle;
pub mod mempool;
pub mod pool;
pub mod size_class;
mod sync;
mod zspage;

pub use handle::Handle;
pub use mempool::{BulkAlloc, Mempool, MempoolConfig, MempoolError, MempoolStats, Page};
pub use pool::{ClassStats, ZsError, ZsPool, ZsPoolConfig};
