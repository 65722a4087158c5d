//! Byte-range locks over the export, so that a read-modify-write of a partial sector cannot
//! interleave with another write to the same sector and lose its bytes.

use std::sync::{Condvar, Mutex};

#[derive(Default)]
pub(crate) struct RangeLocks {
    held: Mutex<Vec<(u64, u64)>>,
    released: Condvar,
}

/// Holds `[start, end)` until dropped.
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    range: (u64, u64),
}

impl RangeLocks {
    /// Blocks until no held range overlaps `[start, end)`, then holds it.
    pub(crate) fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let mut held = self.held.lock().expect("range lock");
        while held.iter().any(|&(s, e)| s < end && start < e) {
            held = self.released.wait(held).expect("range lock");
        }
        held.push((start, end));
        RangeGuard { locks: self, range: (start, end) }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock().expect("range lock");
        if let Some(i) = held.iter().position(|&r| r == self.range) {
            held.swap_remove(i);
        }
        drop(held);
        self.locks.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn overlapping_ranges_wait_disjoint_ones_do_not() {
        let locks = Arc::new(RangeLocks::default());
        let g = locks.lock(0, 4096);
        let _disjoint = locks.lock(4096, 8192);
        let entered = Arc::new(AtomicBool::new(false));
        let t = {
            let (locks, entered) = (locks.clone(), entered.clone());
            std::thread::spawn(move || {
                let _g = locks.lock(100, 200);
                entered.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!entered.load(Ordering::SeqCst), "overlapping lock must wait");
        drop(g);
        t.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
    }
}
