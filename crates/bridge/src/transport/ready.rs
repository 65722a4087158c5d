//! The server-wide readiness waiter: one thread that waits, in one epoll set, on the sockets of
//! every parked connection (an idle client's, whose reader found nothing to read for a while),
//! so an idle connection holds no thread. When a parked socket becomes readable (a request, the
//! client hanging up, an error) or its deadline passes, the waiter takes it out of the set and
//! calls what the connection left to resume it; that hands the work to a pool thread at once.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Why a parked connection is resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woken {
    /// Its socket has something to read (or has hung up, or failed): a read will not wait.
    Ready,
    /// Its deadline passed with nothing received.
    Idle,
}

/// What a parked connection does when woken; called on the waiter's thread, so it must only
/// hand work on (or re-park), never wait.
pub(crate) type Resume = Box<dyn FnOnce(Woken) + Send + 'static>;

pub(crate) struct Waiter {
    epoll: OwnedFd,
    /// An eventfd in the set: rung when a parked deadline comes before the one the waiter sleeps
    /// toward, so that the new deadline is kept.
    bell: OwnedFd,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next: u64,
    parked: HashMap<u64, Entry>,
    /// Entries with a deadline (the scan for the nearest is skipped without any).
    timed: usize,
    /// The deadline the waiter sleeps toward now (`None`: none, it sleeps until an event).
    sleeping_until: Option<Instant>,
}

struct Entry {
    fd: RawFd,
    deadline: Option<Instant>,
    /// Holds what owns `fd` (the connection), so the descriptor stays open while registered.
    resume: Resume,
}

/// The bell's token; parked entries count from 1.
const BELL: u64 = 0;
/// Events taken from one epoll_wait.
const EVENTS: usize = 256;

impl Waiter {
    /// The waiter with its thread started.
    pub(crate) fn start() -> io::Result<Arc<Self>> {
        // SAFETY: epoll_create1 takes only flags; a non-negative result is a new descriptor that
        // nothing else owns.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `ep` was just created and is owned by nothing else.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        // SAFETY: eventfd takes an initial value and flags; as above for its descriptor.
        let ev = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if ev < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `ev` was just created and is owned by nothing else.
        let bell = unsafe { OwnedFd::from_raw_fd(ev) };
        let mut event = libc::epoll_event { events: libc::EPOLLIN as u32, u64: BELL };
        // SAFETY: both descriptors are open (owned above); `event` is a live local read by the call.
        if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, bell.as_raw_fd(), &mut event) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let waiter = Arc::new(Self { epoll, bell, state: Mutex::default() });
        let w = Arc::clone(&waiter);
        std::thread::Builder::new().name("cb-idle".into()).spawn(move || w.run())?;
        Ok(waiter)
    }

    /// Parks `fd` until it is readable or `deadline` passes, then calls `resume` (once) on the
    /// waiter's thread. `Err(resume)` when the socket cannot be watched: the caller reads it
    /// itself. A socket readable already is resumed at once (epoll is level-triggered, so data
    /// that came in before the registration is reported by it): no wake-up is lost between the
    /// caller's last look at the socket and the registration.
    pub(crate) fn park(&self, fd: RawFd, deadline: Option<Instant>, resume: Resume) -> Result<(), Resume> {
        let mut s = self.lock();
        s.next += 1;
        let token = s.next;
        // One-shot: a woken entry stays quiet until it is taken out, even if the waiter is slow
        // to get to it.
        let events = libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT;
        let mut event = libc::epoll_event { events: events as u32, u64: token };
        // The entry goes in under the lock before the waiter can see the token (it looks entries
        // up under the same lock).
        // SAFETY: the epoll descriptor is owned by self; `fd` is open, owned by what `resume`
        // holds; `event` is a live local read by the call.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) } != 0 {
            tracing::debug!("cannot watch a socket for readiness: {}", io::Error::last_os_error());
            return Err(resume);
        }
        s.parked.insert(token, Entry { fd, deadline, resume });
        let ring = match deadline {
            Some(d) => {
                s.timed += 1;
                s.sleeping_until.is_none_or(|u| d < u)
            }
            None => false,
        };
        drop(s);
        if ring {
            self.ring();
        }
        Ok(())
    }

    /// Sockets parked now.
    #[cfg(test)]
    pub(crate) fn parked(&self) -> usize {
        self.lock().parked.len()
    }

    fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local to the eventfd owned by self. A full counter
        // (EAGAIN) already wakes the waiter, so a failure needs nothing more.
        unsafe { libc::write(self.bell.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    fn run(&self) {
        // SAFETY: epoll_event is plain data; all zeroes is a valid value.
        let mut events: Vec<libc::epoll_event> = vec![unsafe { std::mem::zeroed() }; EVENTS];
        let mut woken: Vec<(Resume, Woken)> = Vec::new();
        loop {
            let timeout = {
                let mut s = self.lock();
                let nearest = if s.timed == 0 { None } else { s.parked.values().filter_map(|e| e.deadline).min() };
                s.sleeping_until = nearest;
                nearest.map_or(-1, millis_until)
            };
            // SAFETY: `events` is a live buffer of EVENTS entries the kernel writes into; the
            // epoll descriptor is owned by self.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), EVENTS as libc::c_int, timeout) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!("waiting for idle connections failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
            {
                let mut s = self.lock();
                for event in &events[..n as usize] {
                    let token = event.u64;
                    if token == BELL {
                        let mut count = [0u8; 8];
                        // SAFETY: reads 8 bytes into a live local from the non-blocking eventfd
                        // owned by self (resetting it).
                        unsafe { libc::read(self.bell.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
                    } else if let Some(entry) = self.take(&mut s, token) {
                        woken.push((entry.resume, Woken::Ready));
                    }
                }
                if s.timed > 0 {
                    let now = Instant::now();
                    let due: Vec<u64> = s.parked.iter().filter(|(_, e)| e.deadline.is_some_and(|d| d <= now)).map(|(t, _)| *t).collect();
                    for token in due {
                        if let Some(entry) = self.take(&mut s, token) {
                            woken.push((entry.resume, Woken::Idle));
                        }
                    }
                }
            }
            // Outside the lock: a resume may park again.
            for (resume, why) in woken.drain(..) {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || resume(why))).is_err() {
                    tracing::error!("resuming a parked connection panicked; it is closed");
                }
            }
        }
    }

    /// Takes an entry out of the set (before its descriptor may close, with what `resume` holds).
    fn take(&self, s: &mut State, token: u64) -> Option<Entry> {
        let entry = s.parked.remove(&token)?;
        if entry.deadline.is_some() {
            s.timed -= 1;
        }
        // SAFETY: `entry.fd` is still open (its owner is held by `entry.resume`); the epoll
        // descriptor is owned by self. The event argument may be null for EPOLL_CTL_DEL.
        unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_DEL, entry.fd, std::ptr::null_mut()) };
        Some(entry)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Milliseconds from now to `d`, rounded up (so the waiter does not wake just before it).
fn millis_until(d: Instant) -> libc::c_int {
    let left = d.saturating_duration_since(Instant::now());
    let ms = left.as_nanos().div_ceil(1_000_000);
    ms.min(i32::MAX as u128) as libc::c_int
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    fn parked(w: &Waiter, sock: &Arc<UnixStream>, deadline: Option<Instant>) -> mpsc::Receiver<Woken> {
        let (tx, rx) = mpsc::channel();
        let held = Arc::clone(sock);
        let resume: Resume = Box::new(move |why| {
            drop(held);
            let _ = tx.send(why);
        });
        assert!(w.park(sock.as_raw_fd(), deadline, resume).is_ok());
        rx
    }

    #[test]
    fn a_parked_socket_is_resumed_when_data_comes() {
        let w = Waiter::start().unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        let a = Arc::new(a);
        let rx = parked(&w, &a, None);
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "nothing to read yet");
        b.write_all(b"x").unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Woken::Ready);
        assert_eq!(w.parked(), 0);
    }

    #[test]
    fn data_already_there_resumes_at_once() {
        let w = Waiter::start().unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"x").unwrap();
        let rx = parked(&w, &Arc::new(a), None);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Woken::Ready);
    }

    #[test]
    fn a_hang_up_resumes() {
        let w = Waiter::start().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let rx = parked(&w, &Arc::new(a), None);
        drop(b);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Woken::Ready);
    }

    #[test]
    fn deadlines_pass_in_order_even_when_parked_later() {
        let w = Waiter::start().unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        let far = parked(&w, &Arc::new(a), Some(Instant::now() + Duration::from_secs(30)));
        let start = Instant::now();
        let near = parked(&w, &Arc::new(c), Some(Instant::now() + Duration::from_millis(100)));
        assert_eq!(near.recv_timeout(Duration::from_secs(5)).unwrap(), Woken::Idle);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(100) && took < Duration::from_secs(5), "{took:?}");
        assert!(far.try_recv().is_err());
        assert_eq!(w.parked(), 1);
    }
}
