//! Transmission-phase requests: what the export accepts, decided before any I/O, and how local
//! I/O errors map to the NBD error set. The server only acts on the [`Verdict`].

use std::io;

use super::transmission::Request;
use super::*;

/// Largest READ or WRITE accepted, advertised as the maximum block size.
pub const MAX_REQUEST: u32 = 32 << 20;
/// An over-sized WRITE's payload is read and dropped up to this size; beyond it the connection is
/// closed, since draining would let a client make the server read unbounded data.
pub const MAX_DRAIN: u32 = 64 << 20;

/// What requests are checked against: the export and the server's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Export size in bytes.
    pub size: u64,
    pub read_only: bool,
    pub allow_discards: bool,
    /// What this connection negotiated (DF needs structured replies, BLOCK_STATUS a context).
    pub negotiated: Negotiated,
}

/// What to do with a request that has just been decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Valid: read its payload (a WRITE's `length` bytes) and run it.
    Run,
    /// NBD_CMD_DISC: answer what is in flight, then close. No reply.
    Disconnect,
    /// Answer `errno` without any I/O, after reading and dropping `drain` payload bytes so that
    /// the next request header is found where the client put it.
    Reject { errno: u32, drain: u32 },
    /// A WRITE whose payload is too large to drain: the stream cannot be followed; close.
    Close(&'static str),
}

/// Decides what happens to `r` (proto.md, "Request types" and "Error values").
pub fn check(r: &Request, rules: &Rules) -> Verdict {
    if r.command == CMD_DISC {
        return Verdict::Disconnect;
    }
    match validate(r, rules) {
        Ok(()) => Verdict::Run,
        Err(_) if payload_len(r) > MAX_DRAIN => Verdict::Close("over-sized write payload; closing the connection"),
        Err(errno) => Verdict::Reject { errno, drain: payload_len(r) },
    }
}

/// Bytes of payload that follow the header on the wire: a WRITE's data, nothing otherwise.
pub fn payload_len(r: &Request) -> u32 {
    if r.command == CMD_WRITE {
        r.length
    } else {
        0
    }
}

/// Checks a request against the export before any I/O; the error is the NBD errno.
pub fn validate(r: &Request, rules: &Rules) -> Result<(), u32> {
    let end = r.offset.checked_add(u64::from(r.length));
    let in_range = end.is_some_and(|e| e <= rules.size);
    // FUA is valid on every command once SEND_FUA is advertised (proto.md: the server MUST
    // accept it, even by ignoring it); older qemu sets it on FLUSH.
    let allowed_flags = match r.command {
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_READ if rules.negotiated.structured => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        _ => CMD_FLAG_FUA,
    };
    if r.flags & !allowed_flags != 0 {
        return Err(EINVAL);
    }
    let writes = matches!(r.command, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM);
    if writes && rules.read_only {
        return Err(EPERM);
    }
    match r.command {
        CMD_READ | CMD_WRITE if r.length > MAX_REQUEST => Err(EINVAL),
        // Before `base:allocation` was negotiated the command does not exist for this client.
        CMD_BLOCK_STATUS if !rules.negotiated.base_allocation => Err(EINVAL),
        CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_CACHE | CMD_BLOCK_STATUS if r.length == 0 => Err(EINVAL),
        CMD_WRITE | CMD_WRITE_ZEROES if !in_range => Err(ENOSPC),
        CMD_READ | CMD_TRIM | CMD_CACHE | CMD_BLOCK_STATUS if !in_range => Err(EINVAL),
        CMD_TRIM if !rules.allow_discards => Err(EINVAL),
        // proto.md: a FLUSH's offset and length MUST be zero; a client that sets them expects
        // a ranged flush this server would not do (nbdkit answers EINVAL too).
        CMD_FLUSH if r.offset != 0 || r.length != 0 => Err(EINVAL),
        CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_CACHE | CMD_FLUSH | CMD_BLOCK_STATUS => Ok(()),
        _ => Err(EINVAL),
    }
}

/// Maps a local I/O error to the NBD error set.
pub fn errno_of(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES) => EPERM,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => ENOSPC,
        Some(libc::EINVAL) => EINVAL,
        Some(libc::ENOMEM) => ENOMEM,
        Some(libc::EOPNOTSUPP) => ENOTSUP,
        _ => EIO,
    }
}

/// The I/O error for an errno an upstream NBD server answered with: the same number, so that
/// [`errno_of`] hands the bridge's client what the upstream said. The wire values are Linux's;
/// ENOTSUP is EOPNOTSUPP there. A value outside the protocol's set is EIO (proto.md: a client
/// SHOULD treat an unexpected value as EIO).
pub fn io_error_of(errno: u32) -> io::Error {
    let os = match errno {
        EPERM => libc::EPERM,
        ENOMEM => libc::ENOMEM,
        EINVAL => libc::EINVAL,
        ENOSPC => libc::ENOSPC,
        EOVERFLOW => libc::EOVERFLOW,
        ENOTSUP => libc::EOPNOTSUPP,
        ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EIO,
    };
    io::Error::from_raw_os_error(os)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 1 << 30;
    const RW: Rules = Rules { size: SIZE, read_only: false, allow_discards: false, negotiated: Negotiated { structured: false, base_allocation: false } };
    const SR: Rules = Rules { negotiated: Negotiated { structured: true, base_allocation: true }, ..RW };

    #[test]
    fn block_status_and_df_need_their_negotiation() {
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 4096, 0), &RW), Err(EINVAL), "block status before negotiation");
        let structured_only = Rules { negotiated: Negotiated { structured: true, base_allocation: false }, ..RW };
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 4096, 0), &structured_only), Err(EINVAL), "no context selected");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 4096, 0), &SR), Ok(()));
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, u32::MAX, CMD_FLAG_REQ_ONE), &SR), Err(EINVAL), "past the end");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, SIZE - 4096, 4096, CMD_FLAG_REQ_ONE), &SR), Ok(()));
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 0, 0), &SR), Err(EINVAL), "zero length");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 512, CMD_FLAG_DF), &SR), Err(EINVAL), "DF is for READ");
        assert_eq!(validate(&req(CMD_READ, 0, 512, CMD_FLAG_DF), &RW), Err(EINVAL), "DF without structured replies");
        assert_eq!(validate(&req(CMD_READ, 0, 512, CMD_FLAG_DF), &SR), Ok(()));
        assert_eq!(validate(&req(CMD_READ, 0, 512, CMD_FLAG_REQ_ONE), &SR), Err(EINVAL), "REQ_ONE is for BLOCK_STATUS");
        let ro = Rules { read_only: true, ..SR };
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 512, 0), &ro), Ok(()), "block status reads nothing");
    }

    fn req(command: u16, offset: u64, length: u32, flags: u16) -> Request {
        Request { flags, command, handle: 9, offset, length }
    }

    #[test]
    fn valid_requests_run() {
        for command in [CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES, CMD_CACHE] {
            assert_eq!(check(&req(command, 0, 4096, 0), &RW), Verdict::Run, "command {command}");
            assert_eq!(check(&req(command, SIZE - 512, 512, CMD_FLAG_FUA), &RW), Verdict::Run, "command {command} at the end");
        }
        assert_eq!(check(&req(CMD_READ, 0, MAX_REQUEST, 0), &RW), Verdict::Run, "exactly the maximum");
        assert_eq!(check(&req(CMD_FLUSH, 0, 0, 0), &RW), Verdict::Run);
        assert_eq!(check(&req(CMD_FLUSH, 0, 0, CMD_FLAG_FUA), &RW), Verdict::Run, "FUA on FLUSH (older qemu)");
        assert_eq!(check(&req(CMD_WRITE_ZEROES, 0, 512, CMD_FLAG_NO_HOLE), &RW), Verdict::Run);
        let discards = Rules { allow_discards: true, ..RW };
        assert_eq!(check(&req(CMD_TRIM, 512, 1024, 0), &discards), Verdict::Run);
    }

    #[test]
    fn out_of_range_reads_are_einval_writes_enospc() {
        let discards = Rules { allow_discards: true, ..RW };
        for (command, errno) in [(CMD_READ, EINVAL), (CMD_CACHE, EINVAL), (CMD_TRIM, EINVAL), (CMD_WRITE_ZEROES, ENOSPC)] {
            assert_eq!(validate(&req(command, SIZE - 512, 1024, 0), &discards), Err(errno), "command {command} past the end");
            assert_eq!(validate(&req(command, SIZE, 512, 0), &discards), Err(errno), "command {command} at the end");
            // offset + length overflows u64: out of range, not a wrap to a small offset
            assert_eq!(validate(&req(command, u64::MAX - 511, 1024, 0), &discards), Err(errno), "command {command} overflow");
        }
        assert_eq!(validate(&req(CMD_WRITE, SIZE - 512, 1024, 0), &RW), Err(ENOSPC));
    }

    #[test]
    fn lengths_flags_and_policy() {
        for command in [CMD_READ, CMD_WRITE] {
            assert_eq!(validate(&req(command, 0, MAX_REQUEST + 1, 0), &RW), Err(EINVAL), "over-long {command}");
        }
        for command in [CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES, CMD_CACHE] {
            assert_eq!(validate(&req(command, 0, 0, 0), &RW), Err(EINVAL), "zero-length {command}");
        }
        assert_eq!(validate(&req(CMD_READ, 0, 512, 1 << 12), &RW), Err(EINVAL), "unknown flag");
        assert_eq!(validate(&req(CMD_READ, 0, 512, CMD_FLAG_NO_HOLE), &RW), Err(EINVAL), "NO_HOLE is for WRITE_ZEROES only");
        assert_eq!(validate(&req(42, 0, 512, 0), &RW), Err(EINVAL), "unknown command");
        assert_eq!(validate(&req(CMD_TRIM, 0, 4096, 0), &RW), Err(EINVAL), "trim without --allow-discards");
        let ro = Rules { read_only: true, ..RW };
        for command in [CMD_WRITE, CMD_WRITE_ZEROES, CMD_TRIM] {
            assert_eq!(validate(&req(command, 0, 512, 0), &ro), Err(EPERM), "command {command} on a read-only export");
        }
        assert_eq!(validate(&req(CMD_READ, 0, 512, 0), &ro), Ok(()));
        assert_eq!(validate(&req(CMD_FLUSH, 0, 0, 0), &ro), Ok(()));
    }

    #[test]
    fn flush_with_an_offset_or_length_is_einval() {
        assert_eq!(validate(&req(CMD_FLUSH, 0, 4096, 0), &RW), Err(EINVAL), "length");
        assert_eq!(validate(&req(CMD_FLUSH, 512, 0, 0), &RW), Err(EINVAL), "offset");
        assert_eq!(validate(&req(CMD_FLUSH, 512, 512, CMD_FLAG_FUA), &RW), Err(EINVAL), "both");
        assert_eq!(check(&req(CMD_FLUSH, 0, 4096, 0), &RW), Verdict::Reject { errno: EINVAL, drain: 0 }, "nothing to drain");
        assert_eq!(validate(&req(CMD_FLUSH, 0, 0, 0), &RW), Ok(()));
    }

    #[test]
    fn rejected_writes_drain_their_payload_up_to_a_limit() {
        assert_eq!(
            check(&req(CMD_WRITE, 0, MAX_REQUEST + 4096, 0), &RW),
            Verdict::Reject { errno: EINVAL, drain: MAX_REQUEST + 4096 }
        );
        assert_eq!(check(&req(CMD_WRITE, SIZE, 512, 0), &RW), Verdict::Reject { errno: ENOSPC, drain: 512 });
        assert!(matches!(check(&req(CMD_WRITE, 0, MAX_DRAIN + 1, 0), &RW), Verdict::Close(_)));
        assert!(matches!(check(&req(CMD_WRITE, 0, u32::MAX, 0), &RW), Verdict::Close(_)));
        // Only WRITE carries a payload: a rejected READ of any length drains nothing.
        assert_eq!(check(&req(CMD_READ, 0, u32::MAX, 0), &RW), Verdict::Reject { errno: EINVAL, drain: 0 });
        assert_eq!(check(&req(CMD_WRITE_ZEROES, 0, u32::MAX, 0), &RW), Verdict::Reject { errno: ENOSPC, drain: 0 });
        assert_eq!(check(&req(CMD_DISC, 0, 0, 0), &RW), Verdict::Disconnect);
        assert_eq!(check(&req(CMD_DISC, 0, 123, 0xff), &RW), Verdict::Disconnect, "DISC is honoured whatever it carries");
        assert_eq!(payload_len(&req(CMD_WRITE, 0, 77, 0)), 77);
        assert_eq!(payload_len(&req(CMD_READ, 0, 77, 0)), 0);
    }

    #[test]
    fn errno_mapping() {
        let os = io::Error::from_raw_os_error;
        for (e, want) in [
            (libc::EPERM, EPERM),
            (libc::EROFS, EPERM),
            (libc::EACCES, EPERM),
            (libc::ENOSPC, ENOSPC),
            (libc::EDQUOT, ENOSPC),
            (libc::EFBIG, ENOSPC),
            (libc::EINVAL, EINVAL),
            (libc::ENOMEM, ENOMEM),
            (libc::EOPNOTSUPP, ENOTSUP),
            (libc::EIO, EIO),
            (libc::ENXIO, EIO),
            (libc::EBADF, EIO),
        ] {
            assert_eq!(errno_of(&os(e)), want, "os error {e}");
        }
        assert_eq!(errno_of(&io::Error::other("engine failure")), EIO, "errors without an errno are EIO");
        // An upstream's errno comes back out as the same errno.
        for e in [EPERM, EIO, ENOMEM, EINVAL, ENOSPC, ENOTSUP] {
            assert_eq!(errno_of(&io_error_of(e)), e, "upstream errno {e}");
        }
        assert_eq!(io_error_of(ESHUTDOWN).raw_os_error(), Some(libc::ESHUTDOWN));
        assert_eq!(io_error_of(12345).raw_os_error(), Some(libc::EIO), "unknown upstream errno");
        // The wire values are Linux's, fixed by the protocol.
        assert_eq!((EPERM, EIO, ENOMEM, EINVAL, ENOSPC, ENOTSUP), (1, 5, 12, 22, 28, 95));
    }
}
