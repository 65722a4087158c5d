//! The metrics endpoint: `GET /metrics` over HTTP/1.x on TCP or a Unix socket, answered with the
//! Prometheus text format, one connection at a time on one thread.
//!
//! Written by hand because it answers one request on one path: a scraper sends a request line
//! and a few headers and reads one response; no keep-alive, no body, no routing. Each connection
//! has a deadline for its request and for its response, so a client that connects and sends
//! nothing holds the endpoint for at most `DEADLINE`, and never the server's other threads.

use std::io::{self, Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How long one connection may take to send its request, and to take the response.
const DEADLINE: Duration = Duration::from_secs(5);
/// The longest request head read; longer ones are answered 431.
const MAX_HEAD: usize = 8 * 1024;
/// After a response: how long, and how much, of a client's unread input is taken before closing.
const LINGER: Duration = Duration::from_millis(500);
const MAX_LINGER_BYTES: usize = 1 << 20;

pub enum Endpoint {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// Answers scrapes on `endpoint` from a thread of its own, for the life of the process.
pub fn start(endpoint: Endpoint) -> io::Result<()> {
    std::thread::Builder::new().name("cb-metrics".into()).spawn(move || loop {
        let accepted = match &endpoint {
            Endpoint::Tcp(l) => l.accept().map(|(s, _)| Box::new(s) as Box<dyn Conn>),
            Endpoint::Unix(l) => l.accept().map(|(s, _)| Box::new(s) as Box<dyn Conn>),
        };
        match accepted {
            Ok(mut conn) => {
                if let Err(e) = answer(&mut *conn) {
                    tracing::debug!("metrics endpoint: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("metrics endpoint: accept failed: {e}");
                // Out of descriptors, say: do not spin.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    })?;
    Ok(())
}

trait Conn: Read + Write {
    fn set_timeouts(&self, t: Duration) -> io::Result<()>;
    fn shutdown_write(&self) -> io::Result<()>;
}

impl Conn for std::net::TcpStream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }

    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Conn for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }

    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

fn answer(conn: &mut dyn Conn) -> io::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() > MAX_HEAD {
            return respond(conn, "431 Request Header Fields Too Large", "text/plain", b"request head too long\n");
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no whole request within the deadline"));
        }
        conn.set_timeouts(left)?;
        let n = conn.read(&mut buf)?;
        if n == 0 {
            return Ok(()); // gone before asking
        }
        head.extend_from_slice(&buf[..n]);
    }
    conn.set_timeouts(DEADLINE)?;
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(conn, "200 OK", CONTENT_TYPE, super::global().render().as_bytes()),
        ("GET", _) => respond(conn, "404 Not Found", "text/plain", b"only /metrics is served here\n"),
        _ => respond(conn, "405 Method Not Allowed", "text/plain", b"only GET is answered\n"),
    }
}

fn respond(conn: &mut dyn Conn, status: &str, content_type: &str, body: &[u8]) -> io::Result<()> {
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)?;
    conn.flush()?;
    // A close with unread input resets the connection, and the client may lose the response
    // with it (a request answered before it was read whole): end the response, then take what
    // is left of the request, briefly, before closing.
    conn.shutdown_write()?;
    conn.set_timeouts(LINGER)?;
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < MAX_LINGER_BYTES {
        match conn.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
    Ok(())
}
