//! Size classes: which zspage shape stores an object of a given size.
//!
//! As in mm/zsmalloc.c: classes run from [`MIN_ALLOC_SIZE`] to `PAGE_SIZE`
//! in steps of [`CLASS_DELTA`]; each class picks the zspage length (1 to
//! `chain_size` pages) that wastes the least; consecutive classes whose
//! zspages hold the same number of objects on the same number of pages are
//! merged into the largest of them; and a class whose zspage is one page
//! with one object is "huge": every object at or above the smallest huge
//! size takes a whole page.

use zmem_common::PAGE_SIZE;

pub const MIN_ALLOC_SIZE: usize = 32;
pub const CLASS_DELTA: usize = 16;
/// Number of raw size slots: 32, 48, …, 4096.
pub const NR_SIZES: usize = (PAGE_SIZE - MIN_ALLOC_SIZE) / CLASS_DELTA + 1;
/// The kernel's default CONFIG_ZSMALLOC_CHAIN_SIZE.
pub const DEFAULT_CHAIN_SIZE: usize = 8;
pub const MAX_CHAIN_SIZE: usize = 16;

/// The shape of one size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassShape {
    /// Object slot size in bytes.
    pub size: usize,
    pub pages_per_zspage: usize,
    pub objs_per_zspage: usize,
}

impl ClassShape {
    pub fn is_huge(&self) -> bool {
        self.pages_per_zspage == 1 && self.objs_per_zspage == 1
    }
}

/// The best zspage length for `size`: the one that leaves the least of its
/// pages unused (ties go to fewer pages).
pub fn shape_for(size: usize, chain_size: usize) -> ClassShape {
    let mut best = ClassShape { size, pages_per_zspage: 1, objs_per_zspage: PAGE_SIZE / size };
    let mut best_used = 0.0;
    for k in 1..=chain_size {
        let objs = k * PAGE_SIZE / size;
        let used = (objs * size) as f64 / (k * PAGE_SIZE) as f64;
        if used > best_used + 1e-12 {
            best_used = used;
            best = ClassShape { size, pages_per_zspage: k, objs_per_zspage: objs };
        }
    }
    best
}

/// The class table: distinct shapes and the map from size slot to class.
#[derive(Debug, Clone)]
pub struct ClassTable {
    pub classes: Vec<ClassShape>,
    /// Size slot (`(size - 32 + 15) / 16`) to class index.
    pub slot_to_class: Vec<u8>,
    /// Objects at least this big go to the huge class (one per page).
    pub huge_threshold: usize,
}

impl ClassTable {
    pub fn new(chain_size: usize, merge: bool) -> ClassTable {
        // Build from the largest size down, merging into the class above when
        // the shape (objects, pages) is the same, as zsmalloc does.
        let mut classes: Vec<ClassShape> = Vec::new();
        let mut slot_to_class_rev = Vec::with_capacity(NR_SIZES);
        for slot in (0..NR_SIZES).rev() {
            let size = MIN_ALLOC_SIZE + slot * CLASS_DELTA;
            let shape = shape_for(size, chain_size);
            let prev = classes.last().copied();
            let mergeable = prev.is_some_and(|p| {
                (merge || p.is_huge() && shape.is_huge())
                    && p.pages_per_zspage == shape.pages_per_zspage
                    && p.objs_per_zspage == shape.objs_per_zspage
            });
            if !mergeable {
                classes.push(shape);
            }
            slot_to_class_rev.push(classes.len() - 1);
        }
        // Re-index so that class 0 is the smallest.
        let n = classes.len();
        classes.reverse();
        let slot_to_class: Vec<u8> = slot_to_class_rev.iter().rev().map(|&c| (n - 1 - c) as u8).collect();
        let huge_threshold = (0..NR_SIZES)
            .find(|&s| classes[slot_to_class[s] as usize].is_huge())
            .map_or(PAGE_SIZE, |s| MIN_ALLOC_SIZE + s * CLASS_DELTA - CLASS_DELTA + 1);
        assert!(n <= 255, "class index fits a byte");
        ClassTable { classes, slot_to_class, huge_threshold }
    }

    /// The class of an object of `size` bytes (1..=PAGE_SIZE).
    pub fn class_of(&self, size: usize) -> usize {
        let slot = size.saturating_sub(MIN_ALLOC_SIZE).div_ceil(CLASS_DELTA);
        self.slot_to_class[slot] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn kernel_like_table() {
        let t = ClassTable::new(DEFAULT_CHAIN_SIZE, true);
        assert!(t.classes.len() < NR_SIZES, "some classes merge");
        assert_eq!(t.classes.last().unwrap().size, PAGE_SIZE);
        assert!(t.classes.last().unwrap().is_huge());
        assert!(t.huge_threshold > 3000 && t.huge_threshold <= PAGE_SIZE, "{}", t.huge_threshold);
    }

    proptest! {
        #[test]
        fn every_size_fits_its_class(size in 1usize..=PAGE_SIZE, chain in 1usize..=MAX_CHAIN_SIZE, merge: bool) {
            let t = ClassTable::new(chain, merge);
            let c = t.classes[t.class_of(size)];
            prop_assert!(c.size >= size);
            prop_assert!(c.objs_per_zspage >= 1);
            prop_assert!(c.objs_per_zspage * c.size <= c.pages_per_zspage * PAGE_SIZE);
            prop_assert!(c.pages_per_zspage <= chain);
            // No class is more than one delta too big unless merged.
            if !merge && !c.is_huge() {
                prop_assert!(c.size - size.max(MIN_ALLOC_SIZE) < CLASS_DELTA);
            }
            if size >= t.huge_threshold {
                prop_assert!(c.is_huge());
            }
        }
    }
}
