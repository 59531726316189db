//! When an idle handler busy-polls instead of blocking
//! (`PagerConfig::handler_spin_hot`).
//!
//! A blocked handler costs each fault two cross-CPU wake-ups: the fault
//! wakes the handler, and the COPY wakes the program (BUDGET.md: a fault
//! served by a blocking handler on the other vCPU is ~60 µs, ~20 µs while it
//! busy-polls). That is wasted when the program faults again at once, as it
//! does while it pages a working set larger than its limit: redis's `DEBUG
//! DIGEST` over 55 MB under 48M spent 25% of all CPU in those wake-ups and
//! 37% idle. Spinning always takes a CPU from the program on a 2-vCPU guest,
//! so the handler spins only after a fault that came back to back.

use std::time::{Duration, Instant};

/// A fault counts as back to back when it came within this many spin
/// windows of the handler going idle: a blocked handler's gap also holds the
/// two wake-ups, ~60 µs each on this class of VM.
const HOT_GAP_SPINS: u32 = 3;

#[derive(Debug)]
pub(super) struct HotSpin {
    window: Duration,
    idle_since: Instant,
    hot: bool,
}

impl HotSpin {
    /// Spins for `window` after going idle, while faults come back to back;
    /// a zero window never spins.
    pub(super) fn new(window: Duration, now: Instant) -> HotSpin {
        HotSpin { window, idle_since: now, hot: false }
    }

    /// The handler served the last fault it had at `now`.
    pub(super) fn went_idle(&mut self, now: Instant) {
        self.idle_since = now;
    }

    /// A fault arrived at `now` while the handler was idle.
    pub(super) fn fault_arrived(&mut self, now: Instant) {
        self.hot =
            !self.window.is_zero() && now.saturating_duration_since(self.idle_since) < self.window * HOT_GAP_SPINS;
    }

    /// Whether the idle handler busy-polls at `now`.
    pub(super) fn spinning(&self, now: Instant) -> bool {
        self.hot && now.saturating_duration_since(self.idle_since) < self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn faults_back_to_back_keep_the_handler_spinning_for_one_window() {
        let t0 = Instant::now();
        let mut s = HotSpin::new(100 * US, t0);
        assert!(!s.spinning(t0), "not before a fault has come back to back");
        s.fault_arrived(t0 + 200 * US);
        s.went_idle(t0 + 250 * US);
        assert!(s.spinning(t0 + 260 * US));
        assert!(s.spinning(t0 + 349 * US));
        assert!(!s.spinning(t0 + 350 * US), "the window ends");
    }

    #[test]
    fn a_fault_after_a_long_gap_stops_the_spinning() {
        let t0 = Instant::now();
        let mut s = HotSpin::new(100 * US, t0);
        s.fault_arrived(t0 + 10 * US);
        s.went_idle(t0 + 50 * US);
        assert!(s.spinning(t0 + 60 * US));
        // The program ran 2 ms before faulting again: it computes, so the
        // handler blocks next time.
        s.fault_arrived(t0 + 2050 * US);
        s.went_idle(t0 + 2100 * US);
        assert!(!s.spinning(t0 + 2110 * US));
        // Just past three windows is not back to back either.
        s.fault_arrived(t0 + 2401 * US);
        s.went_idle(t0 + 2450 * US);
        assert!(!s.spinning(t0 + 2460 * US));
    }

    #[test]
    fn a_zero_window_never_spins() {
        let t0 = Instant::now();
        let mut s = HotSpin::new(Duration::ZERO, t0);
        s.fault_arrived(t0);
        s.went_idle(t0);
        assert!(!s.spinning(t0));
    }
}
