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
//! rest of the options inside TLS; the transmission phase then goes through `crate::tls_stream`.

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
    use crate::tls_stream::tests::{cert_dir, server_dir};

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
