//! The bridge's own requests and what they come to, whatever protocol brought them: a front end
//! turns its protocol's requests into [`Request`]s (after checking them against its rules) and
//! an [`Outcome`] back into its protocol's reply.

use std::io;

use super::budget::Permit;
use crate::mapping::{Extent, ReadData, SealedRead};
use crate::metrics::{self, OpKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
    /// Make the range read back as zeros.
    WriteZeroes,
    /// Deallocate the range (advisory).
    Trim,
    /// Make every write answered so far durable.
    Flush,
    /// A read-ahead hint: answered at once.
    Cache,
    /// Which parts of the range are allocated.
    BlockStatus,
}

impl Op {
    /// Its kind, as the metrics count it.
    pub(crate) fn kind(self) -> OpKind {
        match self {
            Op::Read => OpKind::Read,
            Op::Write => OpKind::Write,
            Op::WriteZeroes => OpKind::Zero,
            Op::Trim => OpKind::Trim,
            Op::Flush => OpKind::Flush,
            Op::Cache => OpKind::Cache,
            Op::BlockStatus => OpKind::BlockStatus,
        }
    }

    /// Whether the request changes data, or must come after every request that does (FLUSH).
    pub(crate) fn orders(self) -> bool {
        matches!(self, Op::Write | Op::WriteZeroes | Op::Trim | Op::Flush)
    }
}

/// One request, checked by its front end: its range lies within the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) op: Op,
    /// The front end's name for the request (NBD's cookie), handed back with its outcome.
    pub(crate) handle: u64,
    pub(crate) offset: u64,
    pub(crate) len: u32,
    /// Durable before it is answered.
    pub(crate) fua: bool,
    /// A BLOCK_STATUS that wants one extent only.
    pub(crate) req_one: bool,
}

impl Request {
    /// The bytes the request holds while in flight: a WRITE's payload or a READ's data.
    pub(crate) fn bytes(&self) -> u64 {
        match self.op {
            Op::Read | Op::Write => u64::from(self.len),
            _ => 0,
        }
    }
}

/// What a request that succeeded hands back.
pub(crate) enum Body {
    Empty,
    /// A READ's plaintext.
    Data(ReadData),
    /// A READ's ciphertext, decrypted piece by piece as the reply is sent
    /// ([`crate::mapping::Mapping::open_into`]).
    Sealed(SealedRead),
    /// A BLOCK_STATUS's runs.
    Extents(Vec<Extent>),
}

/// How a request ended, with what it holds of the budget until its reply is sent or dropped.
pub(crate) struct Outcome {
    pub(crate) request: Request,
    pub(crate) result: io::Result<Body>,
    /// None for a request its front end refused before admitting it.
    pub(crate) permit: Option<Permit>,
}

impl Outcome {
    /// The outcome of an admitted request: every one is made here, and counted here, once.
    pub(crate) fn done(request: Request, result: io::Result<Body>, permit: Permit) -> Self {
        let bytes = match request.op {
            Op::Read | Op::Write | Op::Trim | Op::WriteZeroes => u64::from(request.len),
            Op::Flush | Op::Cache | Op::BlockStatus => 0,
        };
        metrics::global().completed(request.op.kind(), bytes, permit.admitted.elapsed(), result.as_ref().map(|_| ()));
        Self { request, result, permit: Some(permit) }
    }
}
