//! The bridge: an NBD server in front of a backing store, with every sector encrypted on its way
//! down and decrypted on its way up.
//!
//! Three layers, one interface between each (docs/architecture.md, docs/bridge.md):
//! - [`frontend`]: a protocol's requests in, its replies out (NBD today, over [`nbd`]'s wire
//!   code). It implements `core::Client` and calls `Core::intake` for every request.
//! - [`core`]: every request through the same steps: admit (budget), order (range locks),
//!   plan (`core::plan`, the one decision of where it runs and where its crypto runs), run,
//!   reply; and back-end sessions (`core::session`).
//! - [`mapping`] (the volume mapping: export bytes -> whole sectors -> engine, at the volume's
//!   data offset) over [`backing`] (file, block device, remote NBD export).
//!
//! Below the protocol, `transport` owns the sockets of both ends (the server's clients and the
//! client's connections to an upstream export): the socket type (TCP or Unix), connect and
//! accept, TCP tuning, timeouts and the handshake deadline, and TLS over a plain socket. It
//! imports nothing from `nbd`, the core or the mapping.

mod aligned;
pub mod backing;
mod core;
mod frontend;
pub mod mapping;
pub mod metrics;
pub mod nbd;
mod range_lock;
pub mod server;
mod throttle;
mod transport;

pub use aligned::PooledBuf;
pub use backing::{Backing, BackingOptions};
pub use mapping::{BadRegions, BadWindow, Extent, Mapping, Region, StepCommit};
pub use nbd::tls::{TlsError, TlsMode, TlsPolicy};
pub use server::{default_max_connections, raise_open_file_limit, Server, ServerConfig, MAX_REQUEST};
pub use frontend::vhost_user::{serve_vhost_user_blk, VhostUserOptions, MAX_QUEUES as MAX_VHOST_USER_QUEUES};
pub use transport::Listener;
