//! The bridge: an NBD server in front of a backing store, with every sector encrypted on its way
//! down and decrypted on its way up.
//!
//! Data flows one way: socket -> [`nbd`] decode -> [`pipeline`] (locks, read-modify-write) ->
//! engine -> [`backing`]; reads run in reverse. The NBD module knows nothing about crypto and the
//! pipeline nothing about the wire.
//!
//! Below the protocol, `transport` owns the sockets of both ends (the server's clients and the
//! client's connections to an upstream export): the socket type (TCP or Unix), connect and
//! accept, TCP tuning, timeouts and the handshake deadline, and TLS over a plain socket. It
//! imports nothing from `nbd` or the pipeline.

mod aligned;
pub mod backing;
mod budget;
mod connection;
pub mod nbd;
pub mod pipeline;
mod pool;
mod range_lock;
pub mod server;
mod throttle;
mod transport;

pub use aligned::PooledBuf;
pub use backing::{Backing, BackingOptions};
pub use pipeline::Pipeline;
pub use nbd::tls::{TlsError, TlsMode, TlsPolicy};
pub use server::{raise_open_file_limit, Server, ServerConfig, MAX_REQUEST};
pub use transport::Listener;
