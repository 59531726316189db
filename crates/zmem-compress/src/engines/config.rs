//! The device's settings.

use std::thread;
use std::time::Duration;

use crate::Error;
use zmem_common::ConfigError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WqMode {
    /// All of a batch goes to the engine of the submitting core (IAA's
    /// per-CPU work-queue mapping): parallelism comes from many submitters.
    PerCpu,
    /// Descriptors are spread round-robin over all engines, so one batch
    /// runs on all of them at once.
    Global,
}

impl std::str::FromStr for WqMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "per-cpu" | "percpu" => Ok(WqMode::PerCpu),
            "global" => Ok(WqMode::Global),
            _ => {
                Err(ConfigError::invalid("wq_mode", format!("unknown mode {s:?}; valid modes are: per-cpu, global"))
                    .into())
            }
        }
    }
}

impl std::fmt::Display for WqMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WqMode::PerCpu => "per-cpu",
            WqMode::Global => "global",
        })
    }
}

/// Settings of the device.
#[derive(Debug, Clone)]
pub struct EnginesConfig {
    /// Number of engines; default: the number of cores.
    pub engines: usize,
    /// Descriptors each engine's work queue holds.
    pub wq_depth: usize,
    pub wq_mode: WqMode,
    /// The longest wait for a free descriptor before the software path runs
    /// the item.
    pub submit_timeout: Duration,
    /// How long `wait` waits for engines before running the remaining items
    /// itself.
    pub completion_timeout: Duration,
    /// Decompress every compressed output and compare it with its input.
    pub verify_compress: bool,
    /// The most items one call takes (1..=32).
    pub batch_size: usize,
    /// Pin engine k to core k mod ncores.
    pub pin: bool,
    /// While waiting, the waiter runs items that no engine has started yet
    /// (it is a CPU too). Off, it only spins and sleeps, as a thread waiting
    /// on a hardware device would.
    pub help_on_wait: bool,
    /// How long an idle engine polls its queue before sleeping. A cross-core
    /// wake-up costs 20-65 µs on this class of VM, more than a batch takes.
    pub idle_spin: Duration,
    /// The synchronous calls run on the calling thread, with the device's
    /// software contexts; only [`submit`](crate::BatchCompressor::submit)ted
    /// batches go to the engines. For a caller that has many batches to
    /// submit at once (a reclaim pass) and small ones to wait on (a
    /// fault's load): `zmem usemem --workers 1` read back at 1,017–1,054
    /// MB/s this way, against 602–785 MB/s with loads on the engines.
    pub sync_on_caller: bool,
    /// When engines ran fewer than this percent of the recent items (the
    /// submitters' own runs did the rest: the other cores are busy), the
    /// device tells callers it does not run beside them
    /// ([`runs_beside`](crate::BatchCompressor::runs_beside)), so that
    /// they compress on their own thread without copying into owned
    /// batches; one call in 32 still offers the engines work, to notice
    /// when cores free up. 0: always beside.
    pub min_offload_percent: u32,
}

impl Default for EnginesConfig {
    fn default() -> Self {
        EnginesConfig {
            engines: thread::available_parallelism().map_or(1, |n| n.get()),
            wq_depth: 64,
            wq_mode: WqMode::Global,
            submit_timeout: Duration::from_micros(100),
            completion_timeout: Duration::from_millis(50),
            verify_compress: false,
            batch_size: crate::batch::DEFAULT_BATCH_SIZE,
            pin: true,
            help_on_wait: true,
            idle_spin: Duration::from_micros(50),
            sync_on_caller: false,
            min_offload_percent: 0,
        }
    }
}
