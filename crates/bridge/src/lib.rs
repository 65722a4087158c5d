//! The bridge: an NBD server in front of a backing store, with every sector encrypted on its way
//! down and decrypted on its way up.
//!
//! Data flows one way: socket -> [`nbd`] decode -> [`pipeline`] (locks, read-modify-write) ->
//! engine -> [`backing`]; reads run in reverse. The NBD module knows nothing about crypto and the
//! pipeline nothing about the wire.

mod aligned;
pub mod backing;
pub mod nbd;
pub mod pipeline;
mod range_lock;
pub mod server;

pub use aligned::PooledBuf;
pub use backing::{Backing, BackingOptions};
pub use pipeline::Pipeline;
pub use server::{Listener, Server, ServerConfig, MAX_REQUEST};
