//! When an idle handler busy-polls instead of blocking: for
//! `PagerConfig::handler_spin` after every event (off by default), and for
//! `PagerConfig::handler_spin_hot` after faults that come back to back.
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

/// The handler's choice between busy-polling and blocking in poll(2).
#[derive(Debug)]
pub(super) struct Spin {
    /// `PagerConfig::handler_spin`: after every event, this long.
    fixed: Duration,
    /// `PagerConfig::handler_spin_hot`: after going idle, this long, when
    /// the fault before came back to back.
    window: Duration,
    last_event: Instant,
    idle_since: Instant,
    hot: bool,
}

impl Spin {
    /// A zero `fixed` and a zero `window` never spin.
    pub(super) fn new(fixed: Duration, window: Duration, now: Instant) -> Spin {
        Spin { fixed, window, last_event: now, idle_since: now, hot: false }
    }

    /// Events were read at `now`; `fault_while_idle`: a fault among them
    /// ended an idle spell.
    pub(super) fn events_arrived(&mut self, now: Instant, fault_while_idle: bool) {
        self.last_event = now;
        if fault_while_idle {
            self.hot =
                !self.window.is_zero() && now.saturating_duration_since(self.idle_since) < self.window * HOT_GAP_SPINS;
        }
    }

    /// The handler served the last fault it had at `now`.
    pub(super) fn went_idle(&mut self, now: Instant) {
        self.idle_since = now;
    }

    /// Whether the idle handler busy-polls at `now`.
    pub(super) fn spinning(&self, now: Instant) -> bool {
        let since = |t: Instant| now.saturating_duration_since(t);
        (!self.fixed.is_zero() && since(self.last_event) < self.fixed)
            || (self.hot && since(self.idle_since) < self.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn faults_back_to_back_keep_the_handler_spinning_for_one_window() {
        let t0 = Instant::now();
        let mut s = Spin::new(Duration::ZERO, 100 * US, t0);
        assert!(!s.spinning(t0), "not before a fault has come back to back");
        s.events_arrived(t0 + 200 * US, true);
        s.went_idle(t0 + 250 * US);
        assert!(s.spinning(t0 + 260 * US));
        assert!(s.spinning(t0 + 349 * US));
        assert!(!s.spinning(t0 + 350 * US), "the window ends");
    }

    #[test]
    fn a_fault_after_a_long_gap_stops_the_spinning() {
        let t0 = Instant::now();
        let mut s = Spin::new(Duration::ZERO, 100 * US, t0);
        s.events_arrived(t0 + 10 * US, true);
        s.went_idle(t0 + 50 * US);
        assert!(s.spinning(t0 + 60 * US));
        // The program ran 2 ms before faulting again: it computes, so the
        // handler blocks next time.
        s.events_arrived(t0 + 2050 * US, true);
        s.went_idle(t0 + 2100 * US);
        assert!(!s.spinning(t0 + 2110 * US));
        // Just past three windows is not back to back either.
        s.events_arrived(t0 + 2401 * US, true);
        s.went_idle(t0 + 2450 * US);
        assert!(!s.spinning(t0 + 2460 * US));
    }

    #[test]
    fn a_fixed_spin_follows_every_event() {
        let t0 = Instant::now();
        let mut s = Spin::new(50 * US, Duration::ZERO, t0);
        s.events_arrived(t0 + 1000 * US, false);
        assert!(s.spinning(t0 + 1049 * US));
        assert!(!s.spinning(t0 + 1050 * US));
    }

    #[test]
    fn a_zero_window_never_spins() {
        let t0 = Instant::now();
        let mut s = Spin::new(Duration::ZERO, Duration::ZERO, t0);
        s.events_arrived(t0, true);
        s.went_idle(t0);
        assert!(!s.spinning(t0));
    }
}
