//! NBD URIs as libnbd, qemu and nbdkit write them (the NBD project's doc/uri.md):
//!
//! - `nbd://HOST[:PORT][/EXPORT]` (TCP, port 10809 by default; an IPv6 host in brackets)
//! - `nbd+unix:///EXPORT?socket=PATH` (a Unix socket)
//! - `nbds://` and `nbds+unix://`: the same over TLS.
//!
//! The export name is the path after the first `/`, percent-decoded; an empty one asks for the
//! server's default export. With TLS, libnbd's `tls-certificates=DIR` names the directory
//! holding `ca-cert.pem` (the CA the server's certificate must chain to) and `tls-hostname=NAME`
//! the name it must carry (default: the URI's host; `localhost` over a Unix socket).

use std::fmt;
use std::path::PathBuf;

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub address: Address,
    pub export: String,
    /// `nbds`: TLS is required.
    pub tls: bool,
    /// `tls-certificates=DIR`: where `ca-cert.pem` is.
    pub tls_certificates: Option<PathBuf>,
    /// `tls-hostname=NAME`: the name the server's certificate must carry.
    pub tls_hostname: Option<String>,
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = if self.tls { "s" } else { "" };
        let export = encode(&self.export);
        let mut query = Vec::new();
        if let Address::Unix(path) = &self.address {
            query.push(format!("socket={}", path.display()));
        }
        if let Some(dir) = &self.tls_certificates {
            query.push(format!("tls-certificates={}", dir.display()));
        }
        if let Some(name) = &self.tls_hostname {
            query.push(format!("tls-hostname={}", encode(name)));
        }
        let query = if query.is_empty() { String::new() } else { format!("?{}", query.join("&")) };
        match &self.address {
            Address::Tcp { host, port } if host.contains(':') => write!(f, "nbd{s}://[{host}]:{port}/{export}{query}"),
            Address::Tcp { host, port } => write!(f, "nbd{s}://{host}:{port}/{export}{query}"),
            Address::Unix(_) => write!(f, "nbd{s}+unix:///{export}{query}"),
        }
    }
}

/// Whether `s` is written as an NBD URI (rather than a file name): it starts with one of the
/// schemes above. A file really named so can still be given as `./nbd:...`.
pub fn is_nbd_uri(s: &str) -> bool {
    let scheme = s.split_once("://").map_or("", |(scheme, _)| scheme);
    matches!(scheme.to_ascii_lowercase().as_str(), "nbd" | "nbds" | "nbd+unix" | "nbds+unix" | "nbd+vsock" | "nbds+vsock")
}

/// Parses an NBD URI; the error says what is wrong with it.
pub fn parse(s: &str) -> Result<NbdUri, String> {
    let (scheme, rest) = s.split_once("://").ok_or_else(|| format!("{s:?} is not an NBD URI (nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH)"))?;
    let scheme = scheme.to_ascii_lowercase();
    let (tls, unix) = match scheme.as_str() {
        "nbd" => (false, false),
        "nbds" => (true, false),
        "nbd+unix" => (false, true),
        "nbds+unix" => (true, true),
        "nbd+vsock" | "nbds+vsock" => return Err(format!("{scheme}:// (AF_VSOCK) is not supported")),
        _ => return Err(format!("unknown URI scheme {scheme:?} (nbd, nbds, nbd+unix or nbds+unix)")),
    };
    if rest.contains('#') {
        return Err(format!("{s:?}: an NBD URI has no fragment"));
    }
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match before_query.find('/') {
        Some(i) => (&before_query[..i], &before_query[i + 1..]),
        None => (before_query, ""),
    };
    let export = decode(path).ok_or_else(|| format!("{s:?}: bad percent-encoding in the export name"))?;
    let mut socket = None;
    let (mut tls_certificates, mut tls_hostname) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = decode(value).ok_or_else(|| format!("{s:?}: bad percent-encoding in {key}="))?;
        match key {
            "socket" if unix => socket = Some(PathBuf::from(value)),
            "socket" => return Err(format!("{s:?}: socket= belongs to nbd+unix:// URIs")),
            "tls-certificates" if tls => tls_certificates = Some(PathBuf::from(value)),
            "tls-hostname" if tls => tls_hostname = Some(value),
            "tls-certificates" | "tls-hostname" => return Err(format!("{s:?}: {key}= belongs to nbds:// URIs")),
            _ => return Err(format!("{s:?}: query parameter {key:?} is not supported")),
        }
    }
    if authority.contains('@') {
        return Err(format!("{s:?}: user names in NBD URIs are not supported"));
    }
    let address = if unix {
        if !authority.is_empty() {
            return Err(format!("{s:?}: an nbd+unix URI has no host (nbd+unix:///EXPORT?socket=PATH)"));
        }
        let path = socket.ok_or_else(|| format!("{s:?}: nbd+unix needs ?socket=PATH"))?;
        if path.as_os_str().is_empty() {
            return Err(format!("{s:?}: empty socket path"));
        }
        Address::Unix(path)
    } else {
        let (host, port) = split_host_port(authority).map_err(|e| format!("{s:?}: {e}"))?;
        Address::Tcp { host, port }
    };
    Ok(NbdUri { address, export, tls, tls_certificates, tls_hostname })
}

fn split_host_port(authority: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or("unclosed [ in the host")?;
        match after {
            "" => (host, None),
            p => (host, Some(p.strip_prefix(':').ok_or("junk after ]")?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("no host (nbd://HOST[:PORT][/EXPORT])".into());
    }
    let port = match port {
        None | Some("") => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| format!("bad port {p:?}"))?,
    };
    Ok((host.to_string(), port))
}

/// Percent-decoding; `None` for a bad escape or bytes that are not UTF-8.
fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> NbdUri {
        NbdUri { address: Address::Tcp { host: host.into(), port }, export: export.into(), tls: false, tls_certificates: None, tls_hostname: None }
    }

    #[test]
    fn libnbd_forms() {
        assert_eq!(parse("nbd://example.com").unwrap(), tcp("example.com", 10809, ""));
        assert_eq!(parse("nbd://example.com/").unwrap(), tcp("example.com", 10809, ""));
        assert_eq!(parse("nbd://127.0.0.1:10900/disk").unwrap(), tcp("127.0.0.1", 10900, "disk"));
        assert_eq!(parse("nbd://[::1]:1234/a/b").unwrap(), tcp("::1", 1234, "a/b"));
        assert_eq!(parse("nbd://[::1]").unwrap(), tcp("::1", 10809, ""));
        assert_eq!(parse("NBD://h/my%20vol").unwrap(), tcp("h", 10809, "my vol"));
        let u = parse("nbd+unix:///vol?socket=/run/nbd.sock").unwrap();
        assert_eq!(u, NbdUri { address: Address::Unix("/run/nbd.sock".into()), export: "vol".into(), tls: false, tls_certificates: None, tls_hostname: None });
        let t = parse("nbds://h/x?tls-certificates=/etc/pki/nbd&tls-hostname=store").unwrap();
        assert_eq!((t.tls_certificates.as_deref(), t.tls_hostname.as_deref()), (Some(std::path::Path::new("/etc/pki/nbd")), Some("store")));
        assert_eq!(parse(&t.to_string()).unwrap(), t);
        assert_eq!(parse("nbd+unix://?socket=/s").unwrap().export, "");
        assert!(parse("nbds://h/x").unwrap().tls);
        assert!(parse("nbds+unix:///?socket=/s").unwrap().tls);
        for s in ["nbd://h:10809/x", "nbd+unix:///x?socket=/tmp/s", "nbd://[::1]:5/y"] {
            assert_eq!(parse(&parse(s).unwrap().to_string()).unwrap(), parse(s).unwrap(), "{s}");
        }
    }

    #[test]
    fn malformed_uris_are_refused() {
        for s in [
            "nbd://",
            "nbd://:10809/x",
            "nbd://h:0/x",
            "nbd://h:99999/x",
            "nbd://h:port/x",
            "nbd://[::1/x",
            "nbd://u@h/x",
            "nbd://h/x?socket=/s",
            "nbd://h/x?foo=1",
            "nbd://h/x?tls-certificates=/d",
            "nbd://h/%zz",
            "nbd://h/x#frag",
            "nbd+unix:///x",
            "nbd+unix://h/x?socket=/s",
            "nbd+unix:///x?socket=",
            "nbd+vsock://1:2",
            "http://h/x",
            "/tmp/file",
        ] {
            assert!(parse(s).is_err(), "{s} accepted");
        }
    }

    #[test]
    fn uri_or_file_name() {
        assert!(is_nbd_uri("nbd://h"));
        assert!(is_nbd_uri("nbd+unix:///x?socket=/s"));
        assert!(is_nbd_uri("NBDS://h"));
        assert!(!is_nbd_uri("/dev/sdb"));
        assert!(!is_nbd_uri("./nbd://x"));
        assert!(!is_nbd_uri("disk.img"));
    }
}
