//! The server-wide pool of I/O threads. Its jobs are turns on a connection's read side: the
//! thread that takes one reads that connection's requests until a slow one comes, hands the read
//! side on (a new job) and runs the request itself, then comes back for more work. This is the
//! leader/follower scheme (as nbdkit's threads per connection), with the followers shared by
//! every connection instead of 32 of them waiting per connection: idle connections hold no pool
//! threads besides the one reading each, and a busy one gets as many as its queue depth needs.
//!
//! Threads start on demand (a job that finds none idle) and exit after a while without work.
//! A thread reading a socket may wait there as long as the client is idle, so readers do not
//! count against the limit: at most `max_threads` pool threads are idle or running requests.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::throttle::{unreported_note, RateLimitedWarn, WARN_PERIOD};

/// A turn on a connection's read side. It holds the [`Reading`] mark while it reads and drops it
/// before it runs a request.
pub(crate) type Job = Box<dyn FnOnce(Reading) + Send + 'static>;

pub(crate) struct Pool {
    max_threads: usize,
    idle_exit: Duration,
    state: Mutex<State>,
    work: Condvar,
    /// Pool threads reading a socket now.
    readers: AtomicUsize,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Pool threads alive.
    threads: usize,
    /// Threads waiting for work...
    sleepers: usize,
    /// ...of which this many have been woken for a job and not yet taken it.
    wakeups: usize,
    started: u64,
}

/// Marks a pool thread as reading a socket (not counted against the limit) until dropped.
pub(crate) struct Reading(Option<Arc<Pool>>);

impl Reading {
    /// For a thread outside the pool (a connection's first reader).
    pub(crate) fn outside() -> Self {
        Reading(None)
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        if let Some(pool) = self.0.take() {
            pool.readers.fetch_sub(1, SeqCst);
        }
    }
}

impl Pool {
    pub(crate) fn new(max_threads: usize, idle_exit: Duration) -> Arc<Self> {
        Arc::new(Self {
            max_threads: max_threads.max(1),
            idle_exit,
            state: Mutex::default(),
            work: Condvar::new(),
            readers: AtomicUsize::new(0),
        })
    }

    /// Pool threads that are not reading: idle or running a request.
    fn working(&self, s: &State) -> usize {
        s.threads.saturating_sub(self.readers.load(SeqCst))
    }

    /// Hands `job` to an idle thread, a new one, or (at the limit) the queue, which running
    /// threads take from when done. `Err(job)` when no pool thread could ever run it (none is
    /// working and none can be started): the caller keeps the work.
    pub(crate) fn submit(self: &Arc<Self>, job: Job) -> Result<(), Job> {
        let mut s = self.lock();
        if s.sleepers > s.wakeups {
            s.queue.push_back(job);
            s.wakeups += 1;
            drop(s);
            self.work.notify_one();
            return Ok(());
        }
        if self.working(&s) >= self.max_threads {
            s.queue.push_back(job);
            return Ok(());
        }
        s.threads += 1;
        s.started += 1;
        let n = s.started;
        drop(s);
        // The job waits in a slot the new thread empties, so that it survives a failed start.
        let slot = Arc::new(Mutex::new(Some(job)));
        let (pool, first) = (Arc::clone(self), Arc::clone(&slot));
        let spawned = std::thread::Builder::new().name(format!("io-{n}")).spawn(move || {
            let job = first.lock().unwrap_or_else(|e| e.into_inner()).take();
            pool.worker(job);
        });
        // Under a pids or memory limit every request may fail to start one: see `throttle`.
        static START_FAILURES: RateLimitedWarn = RateLimitedWarn::new(WARN_PERIOD);
        let e = match spawned {
            Ok(_) => {
                if let Some(n) = START_FAILURES.succeeded() {
                    tracing::info!("I/O threads start again; {n} more had failed to start since the last warning");
                }
                return Ok(());
            }
            Err(e) => e,
        };
        let job = slot.lock().unwrap_or_else(|e| e.into_inner()).take().expect("a thread that never started left its job");
        let mut s = self.lock();
        s.threads -= 1;
        let working = self.working(&s);
        if let Some(n) = START_FAILURES.failed() {
            tracing::warn!("cannot start an I/O thread ({e}); {working} other I/O threads at work{}", unreported_note(n));
        }
        if working == 0 {
            return Err(job);
        }
        s.queue.push_back(job);
        Ok(())
    }

    /// Makes the calling thread a pool thread (until it idles out), unless the pool is full.
    pub(crate) fn join(self: &Arc<Self>) {
        let mut s = self.lock();
        if self.working(&s) >= self.max_threads {
            return;
        }
        s.threads += 1;
        drop(s);
        self.worker(None);
    }

    /// Pool threads alive now.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.lock().threads
    }

    fn worker(self: &Arc<Self>, first: Option<Job>) {
        if let Some(job) = first {
            self.run(job);
        }
        let mut s = self.lock();
        loop {
            if let Some(job) = s.queue.pop_front() {
                drop(s);
                self.run(job);
                s = self.lock();
                continue;
            }
            s.sleepers += 1;
            let (guard, wait) = self.work.wait_timeout(s, self.idle_exit).unwrap_or_else(|e| e.into_inner());
            s = guard;
            s.sleepers -= 1;
            s.wakeups = s.wakeups.saturating_sub(1);
            if wait.timed_out() && s.queue.is_empty() {
                s.threads -= 1;
                return;
            }
        }
    }

    /// Runs one job; a panic (a bug) is logged and costs that job, not the thread.
    fn run(self: &Arc<Self>, job: Job) {
        self.readers.fetch_add(1, SeqCst);
        let reading = Reading(Some(Arc::clone(self)));
        if catch_unwind(AssertUnwindSafe(move || job(reading))).is_err() {
            tracing::error!("an I/O job panicked; its connection may be left without a reply");
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::time::Instant;

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn threads_start_on_demand_run_in_parallel_and_exit_when_idle() {
        let pool = Pool::new(8, Duration::from_millis(100));
        assert_eq!(pool.threads(), 0, "no threads before work");
        // Four jobs that can only finish together: they need four threads at once.
        let barrier = Arc::new(Barrier::new(5));
        for _ in 0..4 {
            let b = Arc::clone(&barrier);
            assert!(pool.submit(Box::new(move |_| { b.wait(); })).is_ok());
        }
        barrier.wait();
        assert!(pool.threads() >= 4);
        wait_for("idle threads to exit", || pool.threads() == 0);
    }

    #[test]
    fn the_limit_counts_working_threads_not_readers() {
        let pool = Pool::new(2, Duration::from_secs(5));
        let release = Arc::new(Barrier::new(5));
        let running = Arc::new(AtomicUsize::new(0));
        // Four jobs that stay "reading" (like a reader on an idle socket) until released: the
        // limit of 2 does not stop them, since readers do not count.
        for i in 0..4 {
            let (b, r) = (release.clone(), running.clone());
            assert!(pool.submit(Box::new(move |_reading| {
                r.fetch_add(1, SeqCst);
                b.wait();
            }))
            .is_ok());
            wait_for("the reader to start", || running.load(SeqCst) == i + 1);
        }
        assert_eq!(pool.readers.load(SeqCst), 4);
        release.wait();
        wait_for("readers to finish", || pool.readers.load(SeqCst) == 0);
    }

    #[test]
    fn no_thread_is_started_beyond_the_limit_of_working_ones() {
        use std::sync::atomic::AtomicBool;
        let pool = Pool::new(2, Duration::from_secs(5));
        let (working, done, release) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let job = || -> Job {
            let (w, d, r) = (working.clone(), done.clone(), release.clone());
            Box::new(move |reading| {
                drop(reading); // done reading: now it runs a request
                w.fetch_add(1, SeqCst);
                while !r.load(SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                d.fetch_add(1, SeqCst);
            })
        };
        for i in 0..2 {
            assert!(pool.submit(job()).is_ok());
            wait_for("the job to work", || working.load(SeqCst) == i + 1);
        }
        assert!(pool.submit(job()).is_ok(), "queued at the limit");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!((working.load(SeqCst), pool.threads()), (2, 2), "the third waits in the queue");
        release.store(true, SeqCst);
        wait_for("every job", || done.load(SeqCst) == 3);
        assert_eq!(pool.threads(), 2);
    }

    #[test]
    fn a_joined_thread_runs_jobs() {
        let pool = Pool::new(4, Duration::from_millis(200));
        let p = Arc::clone(&pool);
        let joined = std::thread::spawn(move || p.join());
        wait_for("the thread to join and wait for work", || pool.lock().sleepers == 1);
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        assert!(pool.submit(Box::new(move |_| { d.fetch_add(1, SeqCst); })).is_ok());
        wait_for("the job", || done.load(SeqCst) == 1);
        assert_eq!(pool.threads(), 1, "the joined thread took it; none was started");
        joined.join().unwrap();
        assert_eq!(pool.threads(), 0, "it left after idling");
    }

    #[test]
    fn a_panicking_job_costs_only_itself() {
        let pool = Pool::new(1, Duration::from_secs(5));
        let done = Arc::new(AtomicUsize::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        let s = started.clone();
        assert!(pool.submit(Box::new(move |_| {
            s.fetch_add(1, SeqCst);
            panic!("test panic in a job")
        }))
        .is_ok());
        // The panic dropped the job's reading mark; the thread lives on, idle. (Waiting for the
        // mark alone could pass before the job even started, under emulation, and the next
        // submit would then find the thread busy and start a second one.)
        wait_for("the panicked job's reading mark to go", || started.load(SeqCst) == 1 && pool.readers.load(SeqCst) == 0);
        assert_eq!(pool.threads(), 1);
        let d = done.clone();
        assert!(pool.submit(Box::new(move |_| { d.fetch_add(1, SeqCst); })).is_ok());
        wait_for("the second job", || done.load(SeqCst) == 1);
        assert_eq!(pool.threads(), 1, "the same thread ran it");
    }
}
