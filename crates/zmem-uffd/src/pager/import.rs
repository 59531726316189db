//! The child's side of a fork hand-over (`handover.rs`): the parent's
//! snapshot is read, its regions adopted, and the entries of the pages
//! this process does not have imported, before the pager's threads start.

use std::sync::atomic::Ordering;
use std::time::Instant;

use zmem_tier::Exported;

use super::handover::{io_err, Snapshot, MAGIC, VERSION};
use super::{Inner, PagerError};
use zmem_common::PAGE_SIZE;

/// A snapshot's page records: address, kind, bytes.
type Records<'a> = Vec<(u64, u8, &'a [u8])>;

/// A snapshot record's entry: kind 0 a same-filled word, 1 an object; `None`
/// for kind 2, a page the parent could not read (the child poisons it).
///
/// # Errors
/// Another kind, or a same-filled word that is not 8 bytes: a malformed
/// snapshot.
fn record(kind: u8, bytes: &[u8]) -> Result<Option<Exported>, PagerError> {
    match kind {
        0 => bytes
            .try_into()
            .map(|w| Some(Exported::SameFilled(u64::from_ne_bytes(w))))
            .map_err(|_| PagerError::Handover("the parent's snapshot is malformed".into())),
        1 => Ok(Some(Exported::Object(bytes.to_vec()))),
        2 => Ok(None),
        _ => Err(PagerError::Handover("the parent's snapshot is malformed".into())),
    }
}

impl Inner {
    /// In a forked child's new pager, before its threads start: adopts the
    /// regions of the snapshot and imports the entries of the pages this
    /// process does not have.
    pub(super) fn import_fork(&self, snap: &Snapshot) -> Result<(), PagerError> {
        let t = Instant::now();
        let (spans, recs) = self.parse_snapshot(snap.bytes())?;
        let mut imported = 0u64;
        let mut lost = 0u64;
        for (a, e) in spans {
            let lo = recs.partition_point(|r| r.0 < a);
            let hi = recs.partition_point(|r| r.0 < e);
            let mine = &recs[lo..hi];
            let pages = ((e - a) / PAGE_SIZE as u64) as usize;
            let mut has = vec![false; pages];
            for r in mine {
                has[((r.0 - a) / PAGE_SIZE as u64) as usize] = true;
            }
            let (st, take_mask) = match self.adopt_with_entries(a, (e - a) as usize, &has) {
                Ok(Some(x)) => x,
                // Less than a folio (a span cut short by a hole), or taken:
                // nothing here is managed, and its pages go in whole.
                Ok(None) => {
                    lost += self.put_in_place(mine)?;
                    continue;
                }
                Err(err) => {
                    // Its pages cannot be managed: they are put in place.
                    log::warn!("a forked child could not adopt {a:#x}..{e:#x} ({err}): its pages go in whole");
                    lost += self.put_in_place(mine)?;
                    continue;
                }
            };
            // The pages the region does not take go in whole: those past
            // its last whole folio (a span ends where a hole of the
            // parent's region starts, mid-folio: the child's region stops
            // at the folio before, and the rest is an unmanaged tail), and
            // those this process has already (the parent served them
            // before the hand-over; the COPY then finds them present and
            // leaves them). Skipped, the tail's pages read as zeros: glibc
            // found its heap corrupt in the child.
            let mut whole = Vec::new();
            for r in mine {
                let p = ((r.0 - a) / PAGE_SIZE as u64) as usize;
                if !take_mask.get(p).copied().unwrap_or(false) {
                    whole.push(*r);
                    continue;
                }
                let Some(exp) = record(r.1, r.2)? else {
                    // The parent could not read it: never zeros.
                    let _ = self.uffd.poison(r.0, PAGE_SIZE as u64);
                    lost += 1;
                    continue;
                };
                if let Err(err) = self.tier.import(st.key(p), &exp) {
                    // Never zeros in its place: touching it is a SIGBUS.
                    log::error!("a forked child's page at {:#x} could not be imported: {err}", r.0);
                    let _ = self.uffd.poison(r.0, PAGE_SIZE as u64);
                    lost += 1;
                } else {
                    imported += 1;
                }
            }
            lost += self.put_in_place(&whole)?;
        }
        self.counters.fork_imported_pages.fetch_add(imported, Ordering::Relaxed);
        log::debug!("a forked child imported {imported} pages in {:?}", t.elapsed());
        if lost > 0 {
            log::error!("{lost} pages of a forked child could not be managed");
        }
        Ok(())
    }

    /// The parent's snapshot: its compressor (this pager takes it), the
    /// spans of its regions, and its records of pages, by address (the
    /// parent wrote them region by region).
    fn parse_snapshot<'a>(&self, b: &'a [u8]) -> Result<(Vec<(u64, u64)>, Records<'a>), PagerError> {
        let bad = || PagerError::Handover("the parent's snapshot is malformed".into());
        let at = std::cell::Cell::new(0usize);
        let take = |n: usize| -> Result<&[u8], PagerError> {
            let s = b.get(at.get()..at.get() + n).ok_or_else(bad)?;
            at.set(at.get() + n);
            Ok(s)
        };
        let u64_of = |s: &[u8]| u64::from_ne_bytes(s.try_into().expect("8 bytes"));
        if u64_of(take(8)?) != MAGIC || u32::from_ne_bytes(take(4)?.try_into().expect("4")) != VERSION {
            return Err(bad());
        }
        let clen = u32::from_ne_bytes(take(4)?.try_into().expect("4")) as usize;
        let codec = std::str::from_utf8(take(clen)?).map_err(|_| bad())?.to_string();
        if self.tier.compressor() != codec {
            let spec = codec.parse().map_err(|e| io_err("the parent's compressor", e))?;
            self.tier.set_compressor(spec)?;
        }
        let n = u64_of(take(8)?) as usize;
        let mut spans = Vec::with_capacity(n.min(1 << 20));
        for _ in 0..n {
            let a = u64_of(take(8)?);
            let e = u64_of(take(8)?);
            spans.push((a, e));
        }
        // The records, by address (the parent wrote them region by region).
        let mut recs: Records<'a> = Vec::new();
        while at.get() < b.len() {
            let a = u64_of(take(8)?);
            let kind = take(1)?[0];
            let len = u16::from_ne_bytes(take(2)?.try_into().expect("2")) as usize;
            recs.push((a, kind, take(len)?));
        }
        recs.sort_unstable_by_key(|r| r.0);
        Ok((spans, recs))
    }

    /// Pages of the snapshot that no region takes: expanded by the tier
    /// (nothing is stored) and copied in place; a page this process
    /// has already (the parent served it) is left as it is. Returns how
    /// many failed.
    fn put_in_place(&self, recs: &[(u64, u8, &[u8])]) -> Result<u64, PagerError> {
        let mut page = vec![0u8; PAGE_SIZE];
        let mut failed = 0;
        for &(a, kind, bytes) in recs {
            let ok = record(kind, bytes)?.is_some_and(|exp| self.tier.expand_exported(&exp, &mut page).is_ok());
            // SAFETY: a page of ours registered with our userfaultfd (the
            // parent's registration, inherited), which no Rust reference
            // covers; if it is present the kernel writes nothing (EEXIST,
            // which `copy` counts as done).
            if !ok || unsafe { self.uffd.copy(a, page.as_ptr(), PAGE_SIZE as u64, false) }.is_err() {
                let _ = self.uffd.poison(a, PAGE_SIZE as u64);
                failed += 1;
            }
        }
        Ok(failed)
    }
}
