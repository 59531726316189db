//! Zspages and a size class's state: slots, free stacks and fullness
//! groups (see `pool.rs` for the design and the lock order).

use crate::handle::MAX_ZSPAGES_PER_CLASS;
use crate::mempool::Page;
use zmem_common::PAGE_SIZE;

pub(crate) const FULL: usize = 10;
pub(crate) const NGROUPS: usize = FULL + 1;

#[derive(Debug, Clone, Copy)]
pub(crate) struct ObjMeta {
    /// Handle index of the object in this slot.
    pub(crate) handle: u32,
    /// Its size; 0 when the slot is free.
    pub(crate) size: u16,
}

#[derive(Debug)]
pub(crate) struct ZsPage {
    pub(crate) pages: Vec<Page>,
    pub(crate) objs: Vec<ObjMeta>,
    pub(crate) free: Vec<u16>,
    pub(crate) inuse: usize,
    pub(crate) group: usize,
    /// Position in `groups[group]`.
    pub(crate) pos: usize,
}

impl ZsPage {
    /// Copies slot `obj` (`len` bytes at `obj * size`) into `out`.
    pub(crate) fn read(&self, size: usize, obj: usize, out: &mut [u8]) {
        let off = obj * size;
        let (p, o) = (off / PAGE_SIZE, off % PAGE_SIZE);
        let first = out.len().min(PAGE_SIZE - o);
        out[..first].copy_from_slice(&self.pages[p].as_slice()[o..o + first]);
        if first < out.len() {
            let rest = out.len() - first;
            out[first..].copy_from_slice(&self.pages[p + 1].as_slice()[..rest]);
        }
    }

    pub(crate) fn write(&mut self, size: usize, obj: usize, data: &[u8]) {
        let off = obj * size;
        let (p, o) = (off / PAGE_SIZE, off % PAGE_SIZE);
        let first = data.len().min(PAGE_SIZE - o);
        self.pages[p].as_mut_slice()[o..o + first].copy_from_slice(&data[..first]);
        if first < data.len() {
            self.pages[p + 1].as_mut_slice()[..data.len() - first].copy_from_slice(&data[first..]);
        }
    }

    /// The object's bytes in place, when it does not straddle a page.
    pub(crate) fn contiguous(&self, size: usize, obj: usize, len: usize) -> Option<&[u8]> {
        let off = obj * size;
        let (p, o) = (off / PAGE_SIZE, off % PAGE_SIZE);
        (o + len <= PAGE_SIZE).then(|| &self.pages[p].as_slice()[o..o + len])
    }

    pub(crate) fn contiguous_mut(&mut self, size: usize, obj: usize, len: usize) -> Option<&mut [u8]> {
        let off = obj * size;
        let (p, o) = (off / PAGE_SIZE, off % PAGE_SIZE);
        (o + len <= PAGE_SIZE).then(|| &mut self.pages[p].as_mut_slice()[o..o + len])
    }
}

#[derive(Debug, Default)]
pub(crate) struct ClassInner {
    pub(crate) zspages: Vec<Option<ZsPage>>,
    pub(crate) free_ids: Vec<u32>,
    pub(crate) groups: [Vec<u32>; NGROUPS],
    /// Freed handle indices, reused by this class's next mallocs.
    pub(crate) free_handles: Vec<u32>,
    pub(crate) inuse: usize,
    pub(crate) nr_zspages: usize,
    pub(crate) bytes_stored: usize,
}

impl ClassInner {
    pub(crate) fn zspage(&self, id: u32) -> &ZsPage {
        self.zspages[id as usize].as_ref().expect("zspage id in use")
    }

    pub(crate) fn zspage_mut(&mut self, id: u32) -> &mut ZsPage {
        self.zspages[id as usize].as_mut().expect("zspage id in use")
    }

    pub(crate) fn group_of(inuse: usize, objs: usize) -> usize {
        if inuse >= objs {
            FULL
        } else {
            1 + inuse * (FULL - 1) / objs
        }
    }

    pub(crate) fn unlink(&mut self, id: u32) {
        let (g, pos) = {
            let z = self.zspage(id);
            (z.group, z.pos)
        };
        self.groups[g].swap_remove(pos);
        if let Some(&moved) = self.groups[g].get(pos) {
            self.zspage_mut(moved).pos = pos;
        }
    }

    pub(crate) fn link(&mut self, id: u32, objs: usize) {
        let g = Self::group_of(self.zspage(id).inuse, objs);
        let pos = self.groups[g].len();
        self.groups[g].push(id);
        let z = self.zspage_mut(id);
        z.group = g;
        z.pos = pos;
    }

    /// Re-files a zspage after its use count changed.
    pub(crate) fn refile(&mut self, id: u32, objs: usize) {
        if Self::group_of(self.zspage(id).inuse, objs) != self.zspage(id).group {
            self.unlink(id);
            self.link(id, objs);
        }
    }

    /// The fullest zspage with a free slot.
    pub(crate) fn fullest_with_room(&self) -> Option<u32> {
        (1..FULL).rev().find_map(|g| self.groups[g].last().copied())
    }

    /// The emptiest zspage.
    pub(crate) fn emptiest(&self) -> Option<u32> {
        (1..=FULL).find_map(|g| self.groups[g].last().copied())
    }

    pub(crate) fn insert(&mut self, z: ZsPage, objs: usize) -> Option<u32> {
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.zspages[id as usize] = Some(z);
                id
            }
            None => {
                let id = self.zspages.len() as u32;
                if id >= MAX_ZSPAGES_PER_CLASS {
                    return None;
                }
                self.zspages.push(Some(z));
                id
            }
        };
        self.nr_zspages += 1;
        self.link(id, objs);
        Some(id)
    }

    /// Removes an empty zspage, returning its pages.
    pub(crate) fn remove(&mut self, id: u32) -> Vec<Page> {
        self.unlink(id);
        let z = self.zspages[id as usize].take().expect("zspage id in use");
        debug_assert_eq!(z.inuse, 0);
        self.free_ids.push(id);
        self.nr_zspages -= 1;
        z.pages
    }
}
