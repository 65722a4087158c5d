//! Front ends: each turns one protocol's requests into the core's [`crate::core::request::Request`]s
//! (decode, check against its rules, map errors) and the core's outcomes back into its
//! protocol's replies. A front end implements [`crate::core::Client`] for its connections and
//! calls [`crate::core::Core::intake`] for every request it reads; it owns its sockets and its
//! reply writer, nothing else.
//!
//! NBD ([`nbd`], with the wire protocol in [`crate::nbd`]) and vhost-user-blk ([`vhost_user`],
//! on rust-vmm's vhost-user-backend).

pub(crate) mod nbd;
pub(crate) mod vhost_user;
