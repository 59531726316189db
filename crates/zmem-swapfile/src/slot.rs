//! The slot allocator: which 4 KiB slots of the file are free.
//!
//! Slots are handed out by next-fit from a cursor, so that a batch of
//! writebacks gets neighbouring slots and becomes a few large sequential
//! writes (the kernel's swap clusters do the same for swap devices). The file
//! grows one cluster at a time, up to `max_slots`.

/// A slot number: the page at byte offset `slot * PAGE_SIZE` of the file.
pub type Slot = u32;

/// Slots per cluster: the file grows by this much (1 MiB).
pub const CLUSTER: u32 = 256;

#[derive(Debug)]
pub struct SlotMap {
    /// One bit per slot of the file's current size; set = in use.
    used: Vec<u64>,
    nr_slots: u32,
    max_slots: u32,
    cursor: u32,
    inuse: u32,
}

impl SlotMap {
    pub fn new(max_slots: u32) -> SlotMap {
        SlotMap { used: Vec::new(), nr_slots: 0, max_slots, cursor: 0, inuse: 0 }
    }

    pub fn inuse(&self) -> u32 {
        self.inuse
    }

    pub fn nr_slots(&self) -> u32 {
        self.nr_slots
    }

    fn is_used(&self, s: Slot) -> bool {
        self.used[(s / 64) as usize] >> (s % 64) & 1 == 1
    }

    fn set(&mut self, s: Slot, v: bool) {
        let w = &mut self.used[(s / 64) as usize];
        if v {
            *w |= 1 << (s % 64);
        } else {
            *w &= !(1 << (s % 64));
        }
    }

    /// Up to `n` slots, neighbouring where possible; fewer when the file is
    /// at `max_slots` and full.
    pub fn alloc(&mut self, n: usize) -> Vec<Slot> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.inuse == self.nr_slots {
                if self.nr_slots >= self.max_slots {
                    break;
                }
                // Grow by a cluster and continue at its start.
                let grow = CLUSTER.min(self.max_slots - self.nr_slots);
                self.cursor = self.nr_slots;
                self.nr_slots += grow;
                self.used.resize(self.nr_slots.div_ceil(64) as usize, 0);
            }
            // Next fit from the cursor.
            let mut s = self.cursor % self.nr_slots;
            while self.is_used(s) {
                s = (s + 1) % self.nr_slots;
            }
            self.set(s, true);
            self.inuse += 1;
            self.cursor = s + 1;
            out.push(s);
        }
        out
    }

    /// Returns `s` to the free set; `false` if it was not in use.
    pub fn free(&mut self, s: Slot) -> bool {
        if s >= self.nr_slots || !self.is_used(s) {
            return false;
        }
        self.set(s, false);
        self.inuse -= 1;
        true
    }

    pub fn in_use(&self, s: Slot) -> bool {
        s < self.nr_slots && self.is_used(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_contiguous_and_space_is_reused() {
        let mut m = SlotMap::new(1024);
        let a = m.alloc(32);
        assert!(a.windows(2).all(|w| w[1] == w[0] + 1));
        for &s in &a[..16] {
            assert!(m.free(s));
        }
        assert!(!m.free(a[0]), "double free is refused");
        let b = m.alloc(16);
        assert!(b.windows(2).all(|w| w[1] == w[0] + 1), "next fit continues past the cursor");
        assert_eq!(m.inuse(), 32);
        let all = m.alloc(2000);
        assert_eq!(all.len(), 1024 - 32, "capped at max_slots");
        assert!(m.alloc(1).is_empty());
    }
}
