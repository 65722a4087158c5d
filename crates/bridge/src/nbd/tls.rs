//! TLS for NBD (the protocol's STARTTLS option): the server's policy (`serve --tls off|on|require`)
//! and its certificates, in the directory layout nbdkit and qemu use (`--tls-certificates DIR`):
//!
//! - `server-cert.pem`: the server's certificate, then any intermediates;
//! - `server-key.pem`: its private key (PKCS#8, PKCS#1 or SEC1 PEM, unencrypted);
//! - `ca-cert.pem`: the CA whose signature a client certificate must carry, read with
//!   `--tls-verify-peer` (as nbdkit's).
//!
//! Everything is read and checked once at start-up, so that a missing file, a key that does not
//! belong to the certificate or an expired certificate stops the server before it listens rather
//! than failing every client's handshake. TLS itself is rustls with the `ring` provider: TLS 1.3
//! and 1.2 with rustls's default (forward-secret, AEAD-only) suites.
//!
//! The handshake (`handshake.rs`) runs the TLS handshake after its STARTTLS reply and haggles the
//! rest of the options inside TLS; the transmission phase then goes through `crate::transport`'s TLS stream.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::RootCertStore;
use zeroize::{Zeroize, Zeroizing};

/// The certificate files in a `--tls-certificates` directory (nbdkit's and qemu's names).
pub const CA_CERT: &str = "ca-cert.pem";
/// Certificate revocation lists of the CA, read with `--tls-verify-peer` where present.
pub const CA_CRL: &str = "ca-crl.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
/// The client's certificate and key, where a client has them (libnbd's names).
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

/// A server certificate that expires within this many days gets a warning at start-up.
const EXPIRY_WARNING_DAYS: i64 = 30;

/// `serve --tls`: nbdkit's three settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// NBD_OPT_STARTTLS is answered NBD_REP_ERR_UNSUP.
    #[default]
    Off,
    /// Clients may upgrade to TLS or stay in plaintext.
    On,
    /// Clients must upgrade before anything else: until then every option but STARTTLS and ABORT
    /// is refused with NBD_REP_ERR_TLS_REQD, and NBD_OPT_EXPORT_NAME (which cannot be refused)
    /// closes the connection.
    Require,
}

/// The server's TLS set-up, checked and ready for handshakes.
#[derive(Clone)]
pub struct TlsPolicy {
    /// `On` or `Require` (a server without TLS has no policy).
    pub required: bool,
    pub(crate) config: Arc<rustls::ServerConfig>,
    /// Whether clients must present a certificate signed by `ca-cert.pem`.
    pub verify_peer: bool,
}

impl fmt::Debug for TlsPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsPolicy").field("required", &self.required).field("verify_peer", &self.verify_peer).finish_non_exhaustive()
    }
}

/// Why the certificates cannot be used; each names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls {0:?} has no policy to load (TLS is off)")]
    Off(TlsMode),
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}: {what}", path.display())]
    Pem { path: PathBuf, what: String },
    #[error("the private key {} does not belong to the certificate {} ({why})", key.display(), cert.display())]
    KeyMismatch { key: PathBuf, cert: PathBuf, why: String },
    #[error("{}: the server certificate expired on {} (now {}); renew it", path.display(), utc(*not_after), utc(*now))]
    Expired { path: PathBuf, not_after: i64, now: i64 },
    #[error("{}: {why}", path.display())]
    Invalid { path: PathBuf, why: String },
    #[error("TLS set-up failed: {0}")]
    Rustls(#[from] rustls::Error),
}

impl TlsPolicy {
    /// Reads and checks the certificates in `dir` for `mode` (not `Off`). With `verify_peer`,
    /// clients must present a certificate signed by `dir/ca-cert.pem`.
    pub fn load(mode: TlsMode, dir: &Path, verify_peer: bool) -> Result<Self, TlsError> {
        if mode == TlsMode::Off {
            return Err(TlsError::Off(mode));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cert_path = dir.join(SERVER_CERT);
        let key_path = dir.join(SERVER_KEY);
        let chain = read_certs(&cert_path)?;
        check_validity(&cert_path, &chain[0])?;
        let signing_key = read_key(&key_path)?;
        let certified = CertifiedKey::new(chain, signing_key);
        if let Err(e) = certified.keys_match() {
            return Err(TlsError::KeyMismatch { key: key_path, cert: cert_path, why: e.to_string() });
        }
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider)).with_safe_default_protocol_versions()?;
        let builder = if verify_peer {
            let ca_path = dir.join(CA_CERT);
            let mut roots = RootCertStore::empty();
            for cert in read_certs(&ca_path)? {
                roots.add(cert).map_err(|e| TlsError::Invalid { path: ca_path.clone(), why: format!("not a usable CA certificate: {e}") })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .with_crls(read_crls(&dir.join(CA_CRL))?)
                .build()
                .map_err(|e| match e {
                    rustls::server::VerifierBuilderError::InvalidCrl(why) => TlsError::Invalid { path: dir.join(CA_CRL), why: format!("unusable CRL: {why:?}") },
                    e => TlsError::Invalid { path: ca_path, why: e.to_string() },
                })?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(certified)));
        Ok(Self { required: mode == TlsMode::Require, config: Arc::new(config), verify_peer })
    }
}

/// The client certificate and key in a `tls-certificates` directory, for an upstream that
/// asks for one (nbdkit `--tls-verify-peer`): `None` where neither file is there; one without
/// the other, or a key that does not match, is an error.
pub(crate) fn client_identity(dir: &Path) -> Result<Option<Arc<SingleCertAndKey>>, TlsError> {
    let (cert_path, key_path) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
    match (cert_path.exists(), key_path.exists()) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (false, true) => return Err(TlsError::Read { path: cert_path, source: io::ErrorKind::NotFound.into() }),
        (true, false) => return Err(TlsError::Read { path: key_path, source: io::ErrorKind::NotFound.into() }),
    }
    let certified = CertifiedKey::new(read_certs(&cert_path)?, read_key(&key_path)?);
    if let Err(e) = certified.keys_match() {
        return Err(TlsError::KeyMismatch { key: key_path, cert: cert_path, why: e.to_string() });
    }
    Ok(Some(Arc::new(SingleCertAndKey::from(certified))))
}

/// The CRLs in `path` (PEM, one or more), or none where the file is not there: a certificate
/// they list is refused (qemu's and GnuTLS's `ca-crl.pem`; the server's for client
/// certificates, an `nbds://` upstream's for the upstream's certificate).
pub(crate) fn read_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = read_file(path)?;
    let crls = CertificateRevocationListDer::pem_slice_iter(&text).collect::<Result<Vec<_>, _>>().map_err(|e| pem_error(path, e))?;
    if crls.is_empty() {
        return Err(TlsError::Pem { path: path.to_path_buf(), what: "no X509 CRL in it".into() });
    }
    Ok(crls)
}

fn read_file(path: &Path) -> Result<Zeroizing<Vec<u8>>, TlsError> {
    std::fs::read(path).map(Zeroizing::new).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

fn pem_error(path: &Path, e: pem::Error) -> TlsError {
    TlsError::Pem { path: path.to_path_buf(), what: format!("not valid PEM ({e})") }
}

/// Every certificate in a PEM file, in order; none is an error.
pub(crate) fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let text = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&text).collect::<Result<Vec<_>, _>>().map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(TlsError::Pem { path: path.to_path_buf(), what: "no CERTIFICATE section".into() });
    }
    Ok(certs)
}

/// The private key, as a signing key. The PEM text and the DER key are wiped once the key is
/// loaded; the loaded key (inside `ring`) lives as long as the server.
fn read_key(path: &Path) -> Result<Arc<dyn rustls::sign::SigningKey>, TlsError> {
    warn_if_readable_by_others(path);
    let text = read_file(path)?;
    let mut der = match PrivateKeyDer::from_pem_slice(&text) {
        Ok(der) => der,
        Err(pem::Error::NoItemsFound) => {
            let what = if text.windows(9).any(|w| w == b"ENCRYPTED") {
                "the private key is encrypted; give it unencrypted (openssl pkey -in KEY -out server-key.pem)"
            } else {
                "no private key (PKCS#8 \"PRIVATE KEY\", PKCS#1 \"RSA PRIVATE KEY\" or SEC1 \"EC PRIVATE KEY\" PEM)"
            };
            return Err(TlsError::Pem { path: path.to_path_buf(), what: what.into() });
        }
        Err(e) => return Err(pem_error(path, e)),
    };
    let key = rustls::crypto::ring::sign::any_supported_type(&der);
    der.zeroize();
    key.map_err(|e| TlsError::Invalid { path: path.to_path_buf(), why: format!("unusable private key: {e}") })
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!("{} is readable by others (mode {mode:04o}); chmod 600 it", path.display());
        }
    }
}

/// An expired server certificate stops the start (every client would refuse it); one not valid
/// yet (a clock set wrong, on this machine or the CA's) or expiring within 30 days is a warning.
fn check_validity(path: &Path, cert: &CertificateDer<'_>) -> Result<(), TlsError> {
    let Some((not_before, not_after)) = validity(cert) else {
        return Err(TlsError::Invalid { path: path.to_path_buf(), why: "cannot read the certificate's validity period (not X.509 DER?)".into() });
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    if now > not_after {
        return Err(TlsError::Expired { path: path.to_path_buf(), not_after, now });
    }
    if now < not_before {
        tracing::warn!("{}: the server certificate is not valid before {}; clients will refuse it until then", path.display(), utc(not_before));
    } else if not_after - now < EXPIRY_WARNING_DAYS * 86_400 {
        tracing::warn!("{}: the server certificate expires on {}", path.display(), utc(not_after));
    }
    Ok(())
}

/// One DER element: (tag, contents, the rest after it).
fn der_element(d: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, d) = d.split_first()?;
    let (&first, mut d) = d.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || d.len() < n {
            return None;
        }
        let len = d[..n].iter().fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        d = &d[n..];
        len
    };
    (d.len() >= len).then(|| (tag, &d[..len], &d[len..]))
}

/// The certificate's notBefore and notAfter, in seconds since the Unix epoch. Certificate ::=
/// SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber, signature,
/// issuer, validity SEQUENCE { notBefore, notAfter }, ... }, ... } (RFC 5280 4.1).
fn validity(cert: &[u8]) -> Option<(i64, i64)> {
    let (0x30, cert, _) = der_element(cert)? else { return None };
    let (0x30, tbs, _) = der_element(cert)? else { return None };
    let (tag, _, mut rest) = der_element(tbs)?;
    if tag == 0xa0 {
        rest = der_element(rest)?.2; // the version was there: skip the serial number too
    }
    let rest = der_element(rest)?.2; // signature algorithm
    let rest = der_element(rest)?.2; // issuer
    let (0x30, validity, _) = der_element(rest)? else { return None };
    let (t1, before, rest) = der_element(validity)?;
    let (t2, after, _) = der_element(rest)?;
    Some((der_time(t1, before)?, der_time(t2, after)?))
}

/// UTCTime (YYMMDDHHMMSSZ, years 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ), as RFC 5280
/// requires them to be written.
fn der_time(tag: u8, s: &[u8]) -> Option<i64> {
    let digits = |b: &[u8]| -> Option<i64> {
        b.iter().try_fold(0i64, |acc, &c| c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0')))
    };
    let (year, rest) = match (tag, s.len()) {
        (0x17, 13) => {
            let yy = digits(&s[..2])?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &s[2..])
        }
        (0x18, 15) => (digits(&s[..4])?, &s[4..]),
        _ => return None,
    };
    if rest[10] != b'Z' {
        return None;
    }
    let field = |i: usize| digits(&rest[i..i + 2]);
    let (month, day, hour, min, sec) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3600 + min * 60 + sec)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A Unix time as `YYYY-MM-DD HH:MM:SS UTC`, for messages.
fn utc(t: i64) -> String {
    let (days, secs) = (t.div_euclid(86_400), t.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-1 certificate (no [0] version field) from `openssl ca -startdate 240229123456Z
    /// -enddate 20510101000000Z` (OpenSSL 3.0): a UTCTime start and a GeneralizedTime end, as
    /// RFC 5280 has them either side of 2050.
    const CERT_V1: &str = "-----BEGIN CERTIFICATE-----
MIIBAjCBqQIBATAKBggqhkjOPQQDAjANMQswCQYDVQQDDAJjYTAgFw0yNDAyMjkx
MjM0NTZaGA8yMDUxMDEwMTAwMDAwMFowDDEKMAgGA1UEAwwBdDBZMBMGByqGSM49
AgEGCCqGSM49AwEHA0IABGyRZdmk7rHY4sy/dt5zCOu7zf6Vw4Yu+fnQmuyF+F9h
l9UvjDTQ1gGOkrh16qOLqEfYQngypb+iOELXI9R/tJcwCgYIKoZIzj0EAwIDSAAw
RQIgGdtbrRwugj2eosHBfm+SxkKyjtFHdlRhSmBGIT5jb9wCIQDBhJchZjORFGe2
egLmCY7OfbvhxXaQTl2a7O1lk1UB0w==
-----END CERTIFICATE-----
";

    /// A version-3 certificate from `openssl req -x509 -days 3650` (OpenSSL 3.0).
    const CERT_V3: &str = "-----BEGIN CERTIFICATE-----
MIIBcDCCARWgAwIBAgIUWF0OlmODMwZmF1XBUGFReXd06zUwCgYIKoZIzj0EAwIw
DTELMAkGA1UEAwwCY2EwHhcNMjYxMTI1MTczNzA0WhcNMzYxMTIyMTczNzA0WjAN
MQswCQYDVQQDDAJjYTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABIR/i+LD15q+
Bb6al95Vx/Pqn2CBs1QBL8MuTUjaws3L/e1IZBrEbykH6r3Ic012U+m5eNtsioNB
lkL/wdY+9najUzBRMB0GA1UdDgQWBBScjzy1gS6SKHTo0OVXtCXV6+s6fjAfBgNV
HSMEGDAWgBScjzy1gS6SKHTo0OVXtCXV6+s6fjAPBgNVHRMBAf8EBTADAQH/MAoG
CCqGSM49BAMCA0kAMEYCIQC5f9TgMwkR7CKySvqYw9Lur5jStJcLf2iBh/nfq+UN
yQIhANTqVTTO0AZK7FhGj2LTmPs5L7HT8vhoZ4NnQFdN1Awf
-----END CERTIFICATE-----
";

    #[test]
    fn validity_of_real_certificates() {
        let der = CertificateDer::from_pem_slice(CERT_V1.as_bytes()).unwrap();
        let (nb, na) = validity(&der).unwrap();
        // `date -u -d '2024-02-29 12:34:56' +%s` and `date -u -d 2051-01-01 +%s`
        assert_eq!((nb, na), (1_709_210_096, 2_556_144_000));
        assert_eq!(utc(nb), "2024-02-29 12:34:56 UTC");
        assert_eq!(utc(na), "2051-01-01 00:00:00 UTC");
        let der = CertificateDer::from_pem_slice(CERT_V3.as_bytes()).unwrap();
        // `openssl x509 -noout -startdate -enddate` of it, through `date -u -d ... +%s`
        assert_eq!(validity(&der), Some((1_795_628_224, 2_110_988_224)));
    }

    #[test]
    fn malformed_times_and_ders() {
        assert_eq!(der_time(0x17, b"500101000000Z"), Some(days_from_civil(1950, 1, 1) * 86_400));
        assert_eq!(der_time(0x17, b"491231235959Z"), Some(days_from_civil(2050, 1, 1) * 86_400 - 1));
        assert_eq!(der_time(0x17, b"491231235959+"), None);
        assert_eq!(der_time(0x18, b"20241301000000Z"), None);
        assert_eq!(der_time(0x17, b"20240101000000Z"), None);
        assert_eq!(validity(&[]), None);
        assert_eq!(validity(&[0x30, 0x82, 0xff]), None);
        assert_eq!(validity(&[0x30, 0x03, 0x30, 0x01, 0x02]), None);
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
    }
}

#[cfg(test)]
mod load_tests {
    use super::*;
    use super::session_tests::{cert_dir, server_dir};

    #[test]
    fn good_directory_loads() {
        let dir = server_dir();
        let p = TlsPolicy::load(TlsMode::On, dir.path(), true).unwrap();
        assert!(!p.required && p.verify_peer);
        assert!(TlsPolicy::load(TlsMode::Require, dir.path(), false).unwrap().required);
        assert!(matches!(TlsPolicy::load(TlsMode::Off, dir.path(), false), Err(TlsError::Off(_))));
    }

    #[test]
    fn bad_directories_name_the_problem() {
        let err = |files: &[(&str, &str)], verify: bool| TlsPolicy::load(TlsMode::Require, cert_dir(files).path(), verify).unwrap_err();
        let cert = ("server-cert.pem", "server-cert.pem");
        let key = ("server-key.pem", "server-key.pem");
        let e = err(&[key], false);
        assert!(matches!(&e, TlsError::Read { path, .. } if path.ends_with(SERVER_CERT)), "{e}");
        let e = err(&[cert], false);
        assert!(matches!(&e, TlsError::Read { path, .. } if path.ends_with(SERVER_KEY)), "{e}");
        let e = err(&[cert, ("server-key.pem", "client-key.pem")], false);
        assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");
        let e = err(&[cert, ("server-key.pem", "server-cert.pem")], false);
        assert!(e.to_string().contains("no private key"), "{e}");
        let e = err(&[("server-cert.pem", "server-key.pem"), key], false);
        assert!(e.to_string().contains("no CERTIFICATE"), "{e}");
        let e = err(&[("server-cert.pem", "expired-cert.pem"), ("server-key.pem", "expired-key.pem")], false);
        assert!(matches!(e, TlsError::Expired { .. }), "{e}");
        assert!(e.to_string().contains("expired on 2021-01-01 00:00:00 UTC"), "{e}");
        let e = err(&[cert, key], true);
        assert!(matches!(&e, TlsError::Read { path, .. } if path.ends_with(CA_CERT)), "{e}");
    }
}

#[cfg(test)]
pub(crate) mod session_tests {

    //! The TLS handshake and the shared session against rustls's own client, over a socket pair:
    //! these run wherever the Rust tests do (under qemu for aarch64 too), the integration tests
    //! (tests/integration/test_tls.py) run libnbd, qemu and OpenSSL clients.

    use std::io::{IoSlice, Read, Write};
    use std::os::unix::net::UnixStream;
    use std::path::{Path, PathBuf};
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::Duration;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    use super::{TlsMode, TlsPolicy};
    use crate::nbd::handshake::{negotiate_tls_within, Outcome};
    use crate::nbd::*;
    use crate::transport::{Socket, Stream};

    pub(crate) fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tls").join(name)
    }

    /// A certificate directory in nbdkit's layout, from the fixtures: (dest name, fixture name).
    pub(crate) fn cert_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (dest, src) in files {
            std::fs::copy(fixture(src), dir.path().join(dest)).unwrap();
        }
        dir
    }

    pub(crate) fn server_dir() -> tempfile::TempDir {
        cert_dir(&[("ca-cert.pem", "ca-cert.pem"), ("server-cert.pem", "server-cert.pem"), ("server-key.pem", "server-key.pem")])
    }

    pub(crate) fn client_config(with_cert: bool) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(fixture("ca-cert.pem")).unwrap()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = if with_cert {
            let cert = CertificateDer::from_pem_file(fixture("client-cert.pem")).unwrap();
            let key = PrivateKeyDer::from_pem_file(fixture("client-key.pem")).unwrap();
            builder.with_client_auth_cert(vec![cert], key).unwrap()
        } else {
            builder.with_no_client_auth()
        };
        Arc::new(config)
    }

    pub(crate) fn option(option: u32, data: &[u8]) -> Vec<u8> {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    /// One option reply: (option, type, data).
    pub(crate) fn opt_reply(r: &mut impl Read) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        r.read_exact(&mut h).unwrap();
        assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), OPTION_REPLY_MAGIC);
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        r.read_exact(&mut data).unwrap();
        (u32::from_be_bytes(h[8..12].try_into().unwrap()), u32::from_be_bytes(h[12..16].try_into().unwrap()), data)
    }

    /// The client's greeting and flags, then STARTTLS and its ACK: the socket is ready for TLS.
    pub(crate) fn plaintext_until_starttls(c: &mut UnixStream) {
        let mut greeting = [0u8; 18];
        c.read_exact(&mut greeting).unwrap();
        c.write_all(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes()).unwrap();
        c.write_all(&option(OPT_STARTTLS, &[])).unwrap();
        assert_eq!(opt_reply(c), (OPT_STARTTLS, REP_ACK, vec![]));
    }

    /// Messages of mixed sizes (up to 1 MiB) go up through TLS; the server's reader hands each
    /// to one of four writer threads, which echo them while the reader goes on reading, so the
    /// reader receives and the writers seal and send on one session at the same time.
    #[test]
    fn handshake_then_reader_and_writers_share_the_session() {
        let dir = server_dir();
        let policy = TlsPolicy::load(TlsMode::Require, dir.path(), true).unwrap();
        let (server, mut client) = UnixStream::pair().unwrap();
        let sizes: Vec<usize> = (0..120).map(|i| [1, 16, 4096, 16 * 1024 + 7, 65536, 1 << 20][i % 6]).collect();
        let total: usize = sizes.iter().sum();
        let server = std::thread::spawn(move || {
            let mut stream = Socket::Unix(server);
            let (outcome, session) = negotiate_tls_within(&mut stream, &crate::nbd::handshake::tests::export(), Duration::from_secs(30), Some(&policy)).unwrap();
            assert!(matches!(outcome, Outcome::Transmission(_)), "{outcome:?}");
            let stream = Arc::new(Stream::tls_server(stream, session.expect("a TLS session")));
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            let rx = Arc::new(Mutex::new(rx));
            let turn = Arc::new(Mutex::new(()));
            let writers: Vec<_> = (0..4)
                .map(|_| {
                    let (stream, rx, turn) = (Arc::clone(&stream), Arc::clone(&rx), Arc::clone(&turn));
                    std::thread::spawn(move || loop {
                        let Ok(msg) = rx.lock().unwrap().recv() else { return };
                        let _turn = turn.lock().unwrap(); // whole messages, as the front end's writers take turns
                        let (head, body) = msg.split_at(8);
                        stream.write_all_more(&mut [IoSlice::new(head), IoSlice::new(body)], false).unwrap();
                    })
                })
                .collect();
            let mut got = 0;
            loop {
                let mut head = [0u8; 8];
                (&*stream).read_exact(&mut head).unwrap();
                let len = u32::from_be_bytes(head[..4].try_into().unwrap()) as usize;
                if len == 0 {
                    break;
                }
                let mut msg = head.to_vec();
                msg.resize(8 + len, 0);
                (&*stream).read_exact(&mut msg[8..]).unwrap();
                got += len;
                tx.send(msg).unwrap();
            }
            drop(tx);
            writers.into_iter().for_each(|w| w.join().unwrap());
            got
        });

        plaintext_until_starttls(&mut client);
        let conn = rustls::ClientConnection::new(client_config(true), "localhost".try_into().unwrap()).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, client);
        let mut go = 0u32.to_be_bytes().to_vec();
        go.extend_from_slice(&0u16.to_be_bytes());
        tls.write_all(&option(OPT_GO, &go)).unwrap();
        while opt_reply(&mut tls).1 != REP_ACK {}
        let body = |id: usize, len: usize| -> Vec<u8> { (0..len).map(|i| (i * 31 + id * 7) as u8).collect() };
        for (id, &len) in sizes.iter().enumerate() {
            tls.write_all(&(len as u32).to_be_bytes()).unwrap();
            tls.write_all(&(id as u32).to_be_bytes()).unwrap();
            tls.write_all(&body(id, len)).unwrap();
        }
        tls.write_all(&[0u8; 8]).unwrap();
        let mut seen = vec![false; sizes.len()];
        for _ in 0..sizes.len() {
            let mut head = [0u8; 8];
            tls.read_exact(&mut head).unwrap();
            let len = u32::from_be_bytes(head[..4].try_into().unwrap()) as usize;
            let id = u32::from_be_bytes(head[4..].try_into().unwrap()) as usize;
            assert_eq!(len, sizes[id]);
            let mut data = vec![0u8; len];
            tls.read_exact(&mut data).unwrap();
            assert!(data == body(id, len), "message {id} came back changed");
            assert!(!std::mem::replace(&mut seen[id], true), "message {id} twice");
        }
        assert_eq!(server.join().unwrap(), total);
    }

    /// Under --tls=require, options before STARTTLS are refused; EXPORT_NAME closes; a client
    /// without a certificate fails the TLS handshake when peers are verified.
    #[test]
    fn require_refuses_plaintext_and_unauthenticated_clients() {
        let dir = server_dir();
        let policy = Arc::new(TlsPolicy::load(TlsMode::Require, dir.path(), true).unwrap());
        let serve = |sock: UnixStream| {
            let policy = Arc::clone(&policy);
            std::thread::spawn(move || {
                let mut stream = Socket::Unix(sock);
                negotiate_tls_within(&mut stream, &crate::nbd::handshake::tests::export(), Duration::from_secs(30), Some(&policy)).map(|(o, s)| (o, s.is_some()))
            })
        };
        let (server, mut c) = UnixStream::pair().unwrap();
        let done = serve(server);
        let mut greeting = [0u8; 18];
        c.read_exact(&mut greeting).unwrap();
        c.write_all(&CLIENT_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
        for opt in [OPT_LIST, OPT_INFO, OPT_GO, 99] {
            c.write_all(&option(opt, &[])).unwrap();
            assert_eq!(opt_reply(&mut c).1, REP_ERR_TLS_REQD, "option {opt}");
        }
        c.write_all(&option(OPT_EXPORT_NAME, &[])).unwrap();
        assert_eq!(done.join().unwrap().unwrap(), (Outcome::Closed, false));
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "no export data before TLS");

        let (server, mut c) = UnixStream::pair().unwrap();
        let done = serve(server);
        plaintext_until_starttls(&mut c);
        let conn = rustls::ClientConnection::new(client_config(false), "localhost".try_into().unwrap()).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, c);
        let _ = tls.write_all(&option(OPT_LIST, &[])).and_then(|()| tls.flush());
        let mut buf = [0u8; 1];
        assert!(!matches!(tls.read(&mut buf), Ok(1)), "no option reply without a client certificate");
        assert_eq!(done.join().unwrap().unwrap(), (Outcome::Closed, false));
    }
}
