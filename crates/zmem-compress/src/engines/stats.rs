//! Per-engine counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one engine. The software-path counters are charged to the
/// engine the item was meant for.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) compress_calls: AtomicU64,
    pub(super) decompress_calls: AtomicU64,
    pub(super) completion_timeouts: AtomicU64,
    pub(super) sw_fallback_calls: AtomicU64,
    pub(super) poor_outputs: AtomicU64,
    pub(super) verify_failures: AtomicU64,
    pub(super) helped_calls: AtomicU64,
    pub(super) caller_calls: AtomicU64,
}

/// A snapshot of one engine's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    pub compress_calls: u64,
    pub decompress_calls: u64,
    pub completion_timeouts: u64,
    pub sw_fallback_calls: u64,
    pub poor_outputs: u64,
    pub verify_failures: u64,
    /// Items of this engine's queue that the waiting thread ran itself.
    pub helped_calls: u64,
    /// Items of synchronous calls run on the calling thread
    /// (`sync_on_caller`), all charged to engine 0.
    pub caller_calls: u64,
}

impl EngineStats {
    /// Field-wise sum, for a device-wide total.
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a EngineStats>) -> EngineStats {
        all.into_iter().fold(EngineStats::default(), |a, s| EngineStats {
            compress_calls: a.compress_calls + s.compress_calls,
            decompress_calls: a.decompress_calls + s.decompress_calls,
            completion_timeouts: a.completion_timeouts + s.completion_timeouts,
            sw_fallback_calls: a.sw_fallback_calls + s.sw_fallback_calls,
            poor_outputs: a.poor_outputs + s.poor_outputs,
            verify_failures: a.verify_failures + s.verify_failures,
            helped_calls: a.helped_calls + s.helped_calls,
            caller_calls: a.caller_calls + s.caller_calls,
        })
    }
}

impl Counters {
    pub(super) fn snapshot(&self) -> EngineStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        EngineStats {
            compress_calls: r(&self.compress_calls),
            decompress_calls: r(&self.decompress_calls),
            completion_timeouts: r(&self.completion_timeouts),
            sw_fallback_calls: r(&self.sw_fallback_calls),
            poor_outputs: r(&self.poor_outputs),
            verify_failures: r(&self.verify_failures),
            helped_calls: r(&self.helped_calls),
            caller_calls: r(&self.caller_calls),
        }
    }
}
