//! Limits on what is in flight: per connection ([`Flow`]: slow requests running, request bytes)
//! and server-wide ([`Budget`]: request bytes). A reader that finds its connection or the server
//! at a limit stops reading that socket until replies drain (back pressure), so memory stays
//! bounded whatever the clients send.
//!
//! The server-wide budget is shared fairly: a connection that already holds a large share (a
//! client that pipelines large READs and does not read the replies holds up to its per-connection
//! limit) cannot take the last part of the budget, [`RESERVE_DIVISOR`]'s share, which stays for
//! connections that hold little; and those do not queue behind the large holders. So however
//! many clients stop reading, one that reads its replies still gets its requests admitted.
//!
//! Counting uses atomics, and a mutex and condition variable only when someone waits: the quick
//! path (a 4 KiB page-cache read) takes and releases a permit per request.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::metrics;

/// The part of the server-wide budget (1 / this) that only connections holding little may take.
pub(crate) const RESERVE_DIVISOR: u64 = 8;
/// A connection holds little while its bytes in flight, with the request's, are at most this
/// part of the reserve (1 / this): several reading clients can be served from the reserve at
/// once.
const SMALL_DIVISOR: u64 = 4;

/// Server-wide limit on request bytes in flight. Waiters are served first come, first served
/// within their class (see [`Class`]), so a large request is not overtaken forever by small
/// ones of its class; the classes do not wait for each other.
pub(crate) struct Budget {
    limit: u64,
    /// What `Class::Large` may not take (`limit / RESERVE_DIVISOR`).
    reserve: u64,
    used: AtomicU64,
    waiters: [AtomicUsize; 2],
    queue: Mutex<[Tickets; 2]>,
    changed: Condvar,
}

/// Which part of the budget a request may take, by what its connection holds with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// The connection holds little: the whole budget.
    Small = 0,
    /// The budget less the reserve.
    Large = 1,
}

#[derive(Default)]
struct Tickets {
    next: u64,
    serving: u64,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit,
            reserve: limit / RESERVE_DIVISOR,
            used: AtomicU64::new(0),
            waiters: Default::default(),
            queue: Mutex::default(),
            changed: Condvar::new(),
        }
    }

    /// The class of a request of `n` bytes from a connection that holds `held` bytes.
    pub(crate) fn class(&self, held: u64, n: u64) -> Class {
        if held.saturating_add(n) <= self.reserve / SMALL_DIVISOR {
            Class::Small
        } else {
            Class::Large
        }
    }

    /// Takes `n` bytes if they fit now in what `class` may take (anything fits while nothing
    /// is in use, so one request larger than the limit still runs, alone).
    fn try_take(&self, n: u64, class: Class) -> bool {
        let cap = match class {
            Class::Small => self.limit,
            Class::Large => self.limit - self.reserve,
        };
        self.used.fetch_update(SeqCst, SeqCst, |used| (used == 0 || used + n <= cap).then_some(used + n)).is_ok()
    }

    /// Takes `n` bytes now, unless others of `class` wait (they are first).
    fn try_take_now(&self, n: u64, class: Class) -> bool {
        n == 0 || (self.waiters[class as usize].load(SeqCst) == 0 && self.try_take(n, class))
    }

    /// Takes `n` bytes, waiting for them; `before_wait` runs (without any lock held) once before
    /// the first wait.
    pub(crate) fn take(&self, n: u64, class: Class, before_wait: impl FnOnce()) {
        if self.try_take_now(n, class) {
            return;
        }
        before_wait();
        let c = class as usize;
        let mut q = self.lock();
        let ticket = q[c].next;
        q[c].next += 1;
        self.waiters[c].fetch_add(1, SeqCst);
        while !(q[c].serving == ticket && self.try_take(n, class)) {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        q[c].serving += 1;
        self.waiters[c].fetch_sub(1, SeqCst);
        drop(q);
        // The next ticket may fit too.
        self.changed.notify_all();
    }

    pub(crate) fn give(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.used.fetch_sub(n, SeqCst);
        if self.waiters.iter().any(|w| w.load(SeqCst) > 0) {
            // Taking the lock orders this with a waiter between its check and its wait.
            drop(self.lock());
            self.changed.notify_all();
        }
    }

    #[cfg(test)]
    pub(crate) fn used(&self) -> u64 {
        self.used.load(SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, [Tickets; 2]> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One connection's requests in flight. Only the connection's reader takes from it (and waits);
/// any thread gives back.
#[derive(Default)]
pub(crate) struct Flow {
    /// Slow requests (run apart from the read side) whose replies are not sent yet.
    tasks: AtomicUsize,
    /// Request bytes (WRITE payloads, READ data) whose replies are not sent yet.
    bytes: AtomicU64,
    waiting: AtomicBool,
    lock: Mutex<()>,
    changed: Condvar,
}

/// What one request holds until its reply is sent or dropped; released on drop.
pub(crate) struct Permit {
    flow: Arc<Flow>,
    global: Arc<Budget>,
    bytes: u64,
    task: bool,
    /// When the request was admitted (its latency runs from here).
    pub(crate) admitted: quanta::Instant,
}

impl Permit {
    fn new(flow: &Arc<Flow>, global: &Arc<Budget>, bytes: u64, task: bool) -> Self {
        metrics::global().admitted();
        Self { flow: Arc::clone(flow), global: Arc::clone(global), bytes, task, admitted: quanta::Instant::now() }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        metrics::global().released();
        self.global.give(self.bytes);
        let f = &self.flow;
        f.bytes.fetch_sub(self.bytes, SeqCst);
        if self.task {
            f.tasks.fetch_sub(1, SeqCst);
        }
        f.wake();
    }
}

/// The per-connection limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlowLimits {
    pub(crate) max_tasks: usize,
    pub(crate) max_bytes: u64,
}

impl Flow {
    /// Whether a request of `bytes` (run on the pool when `task`) fits now. Anything fits while
    /// the connection has no bytes in flight, so a request larger than the limit still runs.
    fn fits(&self, limits: FlowLimits, bytes: u64, task: bool) -> bool {
        let used = self.bytes.load(SeqCst);
        (!task || self.tasks.load(SeqCst) < limits.max_tasks) && (used == 0 || used + bytes <= limits.max_bytes)
    }

    /// Takes a permit for a request of `bytes`: first this connection's share, then the
    /// server's. While either is at its limit the caller waits; `before_wait` runs (once per
    /// wait, without locks) so the caller can send replies it holds back, and `stop` is checked
    /// before each wait on the connection: when it says so, no permit is taken (`None`).
    pub(crate) fn admit(
        self: &Arc<Self>,
        global: &Arc<Budget>,
        limits: FlowLimits,
        bytes: u64,
        task: bool,
        mut before_wait: impl FnMut(),
        stop: impl Fn() -> bool,
    ) -> Option<Permit> {
        if !self.fits(limits, bytes, task) {
            before_wait();
            let mut guard = self.lock();
            self.waiting.store(true, SeqCst);
            while !self.fits(limits, bytes, task) && !stop() {
                guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            self.waiting.store(false, SeqCst);
            drop(guard);
            if stop() {
                return None;
            }
        }
        // Only this connection's reader adds, so what fitted still fits.
        let class = global.class(self.bytes.fetch_add(bytes, SeqCst), bytes);
        if task {
            self.tasks.fetch_add(1, SeqCst);
        }
        // Counted here before the server-wide wait, so the connection's share is never exceeded
        // while this request waits for the server's.
        let permit = Permit::new(self, global, bytes, task);
        global.take(bytes, class, before_wait);
        Some(permit)
    }

    /// [`Flow::admit`] for a request that runs on the reading thread, without waiting: `None`
    /// when this connection or the server is at its limit now (the caller retries once replies
    /// have drained).
    pub(crate) fn try_admit(self: &Arc<Self>, global: &Arc<Budget>, limits: FlowLimits, bytes: u64) -> Option<Permit> {
        if !self.fits(limits, bytes, false) {
            return None;
        }
        if !global.try_take_now(bytes, global.class(self.bytes.load(SeqCst), bytes)) {
            return None;
        }
        self.bytes.fetch_add(bytes, SeqCst);
        Some(Permit::new(self, global, bytes, false))
    }

    /// Wakes the reader if it waits (after a release, or when the connection fails).
    pub(crate) fn wake(&self) {
        if self.waiting.load(SeqCst) {
            // Taking the lock orders this with the reader between its check and its wait.
            drop(self.lock());
            self.changed.notify_all();
        }
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    const LIMITS: FlowLimits = FlowLimits { max_tasks: 2, max_bytes: 100 };

    fn admit_now(flow: &Arc<Flow>, global: &Arc<Budget>, bytes: u64, task: bool) -> Option<Permit> {
        flow.admit(global, LIMITS, bytes, task, || panic!("must not wait"), || false)
    }

    #[test]
    fn permits_count_and_release() {
        let global = Arc::new(Budget::new(1000));
        let flow = Arc::new(Flow::default());
        let a = admit_now(&flow, &global, 60, true).unwrap();
        let b = admit_now(&flow, &global, 40, false).unwrap();
        assert_eq!((flow.bytes(), global.used()), (100, 100));
        assert!(!flow.fits(LIMITS, 1, false), "bytes at the limit");
        let c = admit_now(&flow, &global, 0, true).unwrap();
        assert!(!flow.fits(LIMITS, 0, true), "two tasks at most");
        assert!(flow.fits(LIMITS, 0, false), "quick requests are not tasks");
        drop((a, b, c));
        assert_eq!((flow.bytes(), global.used(), flow.tasks.load(SeqCst)), (0, 0, 0));
        // Anything fits alone, even over both limits.
        let big = admit_now(&flow, &global, 5000, false).unwrap();
        assert_eq!(global.used(), 5000);
        drop(big);
        assert_eq!((flow.bytes(), global.used()), (0, 0));
    }

    #[test]
    fn reader_waits_until_replies_drain() {
        let global = Arc::new(Budget::new(1000));
        let flow = Arc::new(Flow::default());
        let held = admit_now(&flow, &global, 80, false).unwrap();
        let waited = Arc::new(AtomicBool::new(false));
        let t = {
            let (flow, global, waited) = (flow.clone(), global.clone(), waited.clone());
            std::thread::spawn(move || {
                let p = flow.admit(&global, LIMITS, 80, false, || waited.store(true, SeqCst), || false).unwrap();
                drop(p);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(waited.load(SeqCst), "the reader was told before it waited");
        assert!(!t.is_finished(), "80 + 80 > 100: must wait");
        drop(held);
        t.join().unwrap();
        assert_eq!(flow.bytes(), 0);
    }

    #[test]
    fn a_stopped_connection_takes_no_permit() {
        let global = Arc::new(Budget::new(1000));
        let flow = Arc::new(Flow::default());
        let _held = admit_now(&flow, &global, 100, false).unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let t = s.spawn(|| flow.admit(&global, LIMITS, 10, false, || {}, || stop.load(SeqCst)).is_none());
            std::thread::sleep(Duration::from_millis(30));
            stop.store(true, SeqCst);
            flow.wake();
            assert!(t.join().unwrap());
        });
        assert_eq!(flow.bytes(), 100);
    }

    #[test]
    fn global_budget_is_shared_and_first_come_first_served() {
        let global = Arc::new(Budget::new(100));
        let (f1, f2, f3) = (Arc::new(Flow::default()), Arc::new(Flow::default()), Arc::new(Flow::default()));
        let big_limits = FlowLimits { max_tasks: 10, max_bytes: 1000 };
        let held = f1.admit(&global, big_limits, 90, false, || {}, || false).unwrap();
        let got = AtomicUsize::new(0);
        std::thread::scope(|s| {
            // A 50-byte request waits first; a 5-byte one, which would fit beside the 90, must
            // queue behind it.
            let big = s.spawn(|| {
                let p = f2.admit(&global, big_limits, 50, false, || {}, || false).unwrap();
                got.fetch_add(1, SeqCst);
                p
            });
            while global.waiters[Class::Large as usize].load(SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let small = s.spawn(|| {
                let p = f3.admit(&global, big_limits, 5, false, || {}, || false).unwrap();
                got.fetch_add(1, SeqCst);
                p
            });
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(got.load(SeqCst), 0, "both wait while 90 of 100 are used");
            assert_eq!(global.used(), 90);
            drop(held);
            let (p1, p2) = (big.join().unwrap(), small.join().unwrap());
            assert_eq!(global.used(), 55);
            drop((p1, p2));
        });
        assert_eq!(global.used(), 0);
    }

    #[test]
    fn connections_holding_little_are_served_from_the_reserve() {
        // Reserve 100 of 800; holding at most 25 with the request is small.
        let global = Arc::new(Budget::new(800));
        let limits = FlowLimits { max_tasks: 10, max_bytes: 1000 };
        let (hog, waiting, reader) = (Arc::new(Flow::default()), Arc::new(Flow::default()), Arc::new(Flow::default()));
        let _hog = hog.admit(&global, limits, 700, false, || {}, || false).unwrap();
        std::thread::scope(|s| {
            let t = s.spawn(|| waiting.admit(&global, limits, 50, false, || {}, || false).unwrap());
            while global.waiters[Class::Large as usize].load(SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Past a large waiter, into the reserve, without waiting.
            let small = admit_now(&reader, &global, 20, false).unwrap();
            assert_eq!(global.used(), 720);
            assert!(reader.try_admit(&global, limits, 5).is_some(), "20 + 5 is still small");
            assert!(reader.try_admit(&global, limits, 6).is_none(), "20 + 6 is large: behind the waiter");
            assert!(!t.is_finished(), "700 + 50 > 800 - 100: the large request waits");
            drop(small);
            drop(_hog);
            drop(t.join().unwrap());
        });
        assert_eq!(global.used(), 0);
    }
}
