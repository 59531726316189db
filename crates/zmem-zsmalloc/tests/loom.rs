//! Loom models of the handle protocol, on the crate's own `HandleTable`:
//! a reader looks a handle up without a lock, takes the class lock (here a
//! mutex over two object cells), and looks again.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p zmem-zsmalloc --test loom --release`.
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use zmem_zsmalloc::handle::{Handle, HandleTable, Location, Lookup, Slot};

fn loc(obj: u16) -> Location {
    Location { class: 3, zspage: 0, obj }
}

/// The reader's side of `ZsPool::map`: lookup, lock, lookup, read.
fn read(table: &HandleTable, cells: &Mutex<[u8; 2]>, h: Handle) -> Option<u8> {
    let Lookup::Live(_) = table.lookup(h) else { return None };
    let g = cells.lock().unwrap();
    match table.lookup(h) {
        Lookup::Live(l) => Some(g[l.obj as usize]),
        _ => None,
    }
}

/// One model: a live object `b'A'` in cell 0, a reader of its handle on one
/// thread, and `writer` on the other (taking the class lock, here the cells'
/// mutex, for each of its steps). `check` judges what the reader saw.
fn model_reader_against(writer: fn(&HandleTable, &Mutex<[u8; 2]>, u32), check: fn(Option<u8>)) {
    loom::model(move || {
        let table = Arc::new(HandleTable::new());
        let cells = Arc::new(Mutex::new([b'A', 0u8]));
        let i = table.fresh_index().unwrap();
        table.store(i, Slot::live(0, loc(0)));
        let h = Handle::new(i, 0);
        let reader = {
            let (table, cells) = (Arc::clone(&table), Arc::clone(&cells));
            thread::spawn(move || read(&table, &cells, h))
        };
        writer(&table, &cells, i);
        check(reader.join().unwrap());
    });
}

/// free + malloc reusing the slot, in two lock holds: the reader sees its
/// object or an error, never the new object.
#[test]
fn reader_never_sees_a_reused_slot() {
    model_reader_against(
        |table, cells, i| {
            {
                let mut g = cells.lock().unwrap();
                g[0] = 0;
                table.store(i, Slot::dead(1));
            }
            let mut g = cells.lock().unwrap();
            g[1] = b'B';
            table.store(i, Slot::live(1, loc(1)));
        },
        |seen| assert!(seen.is_none() || seen == Some(b'A'), "reader saw {seen:?}"),
    );
}

/// Compaction moves the object: the reader always finds it, at either place.
#[test]
fn reader_follows_a_compaction_move() {
    model_reader_against(
        |table, cells, i| {
            let mut g = cells.lock().unwrap();
            g[1] = g[0];
            g[0] = 0xff;
            table.store(i, Slot::live(0, loc(1)));
        },
        |seen| assert_eq!(seen, Some(b'A')),
    );
}
