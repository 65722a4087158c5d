//! Byte-range locks over the export, so that a read-modify-write of a partial sector cannot
//! interleave with another write to the same sector and lose its bytes, and so that writes to
//! overlapping sectors reach the backing store in the order they were received.
//!
//! A range is first reserved ([`RangeLocks::reserve`], which never blocks: a connection's
//! reading thread reserves each write as it reads it) and is held once no earlier reservation
//! overlaps it. Reservations are granted in the order they were made, so a later write never
//! overtakes an earlier one to the same sectors, even when the earlier one waits on an I/O
//! thread and the later one would be free to go.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

#[derive(Default)]
pub(crate) struct RangeLocks {
    state: Mutex<State>,
    released: Condvar,
}

#[derive(Default)]
struct State {
    /// `(id, start, end)` in the order reserved.
    entries: Vec<(u64, u64, u64)>,
    next_id: u64,
    /// Threads blocked in [`RangeGuard::wait`]. A release wakes them only when there are some:
    /// the condition variable's wake is a system call even with no one to wake, and most
    /// ranges are released with no one waiting (one per write on an upstream export).
    waiters: usize,
}

impl State {
    /// Whether reservation `id` holds its range: no earlier one overlaps it.
    fn granted(&self, id: u64) -> bool {
        let Some(i) = self.entries.iter().position(|e| e.0 == id) else {
            return false;
        };
        let (_, start, end) = self.entries[i];
        self.entries[..i]
            .iter()
            .all(|&(_, s, e)| !(s < end && start < e))
    }
}

/// A reservation of `[start, end)`, holding it once granted, until dropped.
pub(crate) struct RangeGuard {
    locks: Arc<RangeLocks>,
    id: u64,
}

impl RangeLocks {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `[start, end)` behind every reservation made before; does not wait.
    pub(crate) fn reserve(self: &Arc<Self>, start: u64, end: u64) -> RangeGuard {
        let mut st = self.state();
        let id = st.next_id;
        st.next_id += 1;
        st.entries.push((id, start, end));
        RangeGuard {
            locks: Arc::clone(self),
            id,
        }
    }

    /// Blocks until no earlier reservation overlaps `[start, end)`, then holds it.
    pub(crate) fn lock(self: &Arc<Self>, start: u64, end: u64) -> RangeGuard {
        let g = self.reserve(start, end);
        g.wait();
        g
    }
}

impl RangeGuard {
    /// Whether the range is held now (no earlier overlapping reservation is left).
    pub(crate) fn is_held(&self) -> bool {
        self.locks.state().granted(self.id)
    }

    /// Blocks until the range is held.
    pub(crate) fn wait(&self) {
        let mut st = self.locks.state();
        if st.granted(self.id) {
            return;
        }
        st.waiters += 1;
        while !st.granted(self.id) {
            st = self
                .locks
                .released
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        st.waiters -= 1;
    }
}

impl Drop for RangeGuard {
    fn drop(&mut self) {
        let mut st = self.locks.state();
        if let Some(i) = st.entries.iter().position(|e| e.0 == self.id) {
            st.entries.remove(i); // keeps the order of the others
        }
        let wake = st.waiters > 0;
        drop(st);
        if wake {
            self.locks.released.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
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
        assert!(
            !entered.load(Ordering::SeqCst),
            "overlapping lock must wait"
        );
        drop(g);
        t.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
    }

    /// A later reservation never overtakes an earlier overlapping one, even when the range it
    /// wants is free of held ones.
    #[test]
    fn reservations_are_granted_in_order() {
        let locks = Arc::new(RangeLocks::default());
        let first = locks.reserve(0, 10);
        let second = locks.reserve(0, 10);
        let third = locks.reserve(5, 20);
        let apart = locks.reserve(20, 30);
        assert!(first.is_held() && apart.is_held());
        assert!(!second.is_held() && !third.is_held());
        drop(first);
        assert!(second.is_held());
        assert!(
            !third.is_held(),
            "overlaps the earlier `second`, which holds now"
        );
        drop(second);
        assert!(third.is_held());
        // A barrier over everything waits for all before it and holds back all after it.
        let all = locks.reserve(0, u64::MAX);
        let after = locks.reserve(40, 50);
        assert!(!all.is_held() && !after.is_held());
        drop(third);
        drop(apart);
        assert!(all.is_held() && !after.is_held());
        drop(all);
        assert!(after.is_held());
    }
}
