//! `cryptbridge serve`: the bridge itself.

use std::net::TcpListener;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cryptbridge_bridge::backing::{IoEngine, RemoteOptions, DEFAULT_RECONNECT_DELAY};
use cryptbridge_bridge::metrics::ExportInfo;
use cryptbridge_bridge::nbd::uri::{self, NbdUri};
use cryptbridge_bridge::{raise_open_file_limit, Backing, BackingOptions, Listener, Mapping, Server, ServerConfig, TlsMode, TlsPolicy};
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, CpuLevel, SectorCipher};
use cryptbridge_engine::{Backend, CpuBackend, Engine, RtlSimBackend, SectorLayout};

use crate::{keyfile, names, size, usage};

mod activation;
mod luks;
mod metrics;
mod reencrypt;
mod unix_socket;
mod vhost;

/// `--type`: how the backing store holds the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VolumeType {
    /// dm-crypt plain: the key file is the key, the whole backing store is data.
    Plain,
    /// LUKS1 or LUKS2 (cryptsetup, qemu): the header gives cipher, key size, sector size and
    /// data offset; a passphrase opens a keyslot.
    Luks,
}

/// `--tls`: nbdkit's settings.
/// `--io-engine`: how a file or block device back end submits its reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IoEngineArg {
    /// pread/pwrite on the thread that runs the request.
    Threads,
    /// io_uring; where the kernel refuses it, the thread path with a warning.
    Uring,
    /// io_uring where the kernel allows it, else the thread path (one log line says why).
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsArg {
    /// No TLS: NBD_OPT_STARTTLS is refused.
    Off,
    /// Clients may upgrade to TLS with NBD_OPT_STARTTLS, or stay in plaintext.
    On,
    /// Clients must upgrade to TLS before anything else is answered.
    Require,
}

#[derive(clap::Args)]
#[command(after_help = "On-disk bytes equal those of `cryptsetup open --type plain --cipher aes-xts-plain64 \
--key-size 512 --key-file KEYFILE` for the same key and sector size.\n\
When ready, prints `ready <NBD URI>` on stdout.")]
pub struct Args {
    /// Backing file or block device (a file is created sparse at --size, mode 0600, when
    /// missing; it is removed again if the server then fails to start); or an upstream NBD
    /// export, nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH (nbds:// with
    /// ?tls-certificates=DIR holding ca-cert.pem for TLS), which then holds only ciphertext (see
    /// docs/network.md).
    #[arg(long, value_name = "PATH|URI")]
    backing: PathBuf,
    /// With an NBD URI as --backing: connections to the upstream (default 4, or the number of
    /// CPUs if fewer, when it advertises multi-conn, else 1; more than 1 needs multi-conn).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=64))]
    backing_connections: Option<u64>,
    /// With an NBD URI as --backing: serve every client connection through those shared
    /// connections, instead of giving each client connection an upstream connection of its own
    /// (the default where the upstream advertises multi-conn and takes no TLS; see
    /// docs/network.md).
    #[arg(long)]
    backing_shared: bool,
    /// With an NBD URI as --backing: seconds requests may wait on an upstream that sends nothing
    /// (nor answers a liveness probe) before they fail with EIO.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    backing_timeout: u64,
    /// With an NBD URI as --backing: seconds during which requests lost with an upstream
    /// connection (closed, reset, a broken reply) are resent over new connections before they
    /// fail with EIO; 0 fails them at once (qemu's reconnect-delay).
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_RECONNECT_DELAY.as_secs(), value_parser = clap::value_parser!(u64).range(0..=3600))]
    backing_reconnect_delay: u64,
    /// Size of a new backing file: bytes, or a number with K/M/G/T (binary units).
    #[arg(long, value_parser = size::parse_size)]
    size: Option<u64>,
    /// Raw key file (Key1 || Key2), as written by `cryptbridge keygen`; at most 64 bytes are read
    /// (a pipe such as <(cmd) or /dev/stdin works).
    #[arg(long, required_unless_present_any = ["passthrough", "volume_type"])]
    key_file: Option<PathBuf>,
    /// Key size in bits; by default taken from the key file's length.
    #[arg(long)]
    key_size: Option<usize>,
    /// Volume cipher: aes-xts-plain64 (dm-crypt name), capi:xts(aes)-plain64 or xts(aes); or a
    /// wide-block scheme by Linux name: hctr2(aes), adiantum(xchacha12,aes),
    /// adiantum(xchacha20,aes), eme2(aes), fast-horner(aes), fast-brw(aes), aez, and xcb(aes)
    /// (LEGACY: published plaintext-recovery attacks). See docs/tes.md.
    #[arg(long, default_value = "aes-xts-plain64", value_parser = names::parse_volume_cipher)]
    cipher: String,
    /// Encryption sector size in bytes.
    #[arg(long, default_value_t = 512, value_parser = parse_sector_size)]
    sector_size: usize,
    /// Count IVs in sectors of --sector-size instead of 512-byte units (dm-crypt's option).
    #[arg(long)]
    iv_large_sectors: bool,
    /// Store plaintext: the same bridge without encryption, the baseline for measurements.
    #[arg(long, conflicts_with_all = ["key_file", "key_size", "iv_large_sectors"])]
    passthrough: bool,
    /// TCP address to listen on. Under socket activation (LISTEN_PID/LISTEN_FDS, as systemd and
    /// `nbdinfo -- [ cryptbridge serve ... ]` pass a socket) the inherited socket is served and
    /// this is ignored.
    #[arg(long, default_value = DEFAULT_LISTEN, conflicts_with = "unix")]
    listen: String,
    /// Listen on a Unix socket instead of TCP (ignored under socket activation). The socket is
    /// created mode 0600, whatever the umask: whoever can connect reads and writes the plaintext.
    #[arg(long)]
    unix: Option<PathBuf>,
    /// With --unix: give the socket to this group (a name or a number) and make it 0660, so that
    /// members of the group may connect too.
    #[arg(long, value_name = "GROUP", requires = "unix")]
    group: Option<String>,
    /// Answer `GET /metrics` (Prometheus text format) on HOST:PORT, or on a Unix socket at this
    /// path (one with a `/`; created 0600): requests, bytes, latency and errors per kind,
    /// connections, remote back-end reconnects (docs/cli.md, "Metrics").
    #[arg(long, value_name = "HOST:PORT|PATH")]
    metrics: Option<String>,
    /// Serve the volume as a vhost-user-blk device on this Unix socket instead of NBD, for qemu,
    /// cloud-hypervisor or libblkio (see docs/vhost-user.md). The socket is created mode 0600,
    /// whatever the umask; one front end at a time, and after it leaves the next may connect.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["listen", "unix", "group", "tls"])]
    vhost_user_blk: Option<PathBuf>,
    /// With --vhost-user-blk: virtqueues, each served by a worker thread of its own.
    // u8: at most MAX_VHOST_USER_QUEUES (64).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "vhost_user_blk",
          value_parser = clap::value_parser!(u8).range(1..=cryptbridge_bridge::MAX_VHOST_USER_QUEUES as i64))]
    queues: u8,
    /// Export name (clients asking for the empty name get it too).
    #[arg(long, default_value = "cryptbridge")]
    export_name: String,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Pass TRIM to the backing store. Off by default: discards show which sectors are in use.
    #[arg(long)]
    allow_discards: bool,
    /// Open the backing store with O_DIRECT, bypassing the page cache.
    #[arg(long)]
    direct: bool,
    /// How reads and writes reach a file or block device: `threads` (pread/pwrite on the thread
    /// that runs the request), `uring` (io_uring; a FUA write and its fdatasync go in one
    /// submission) or `auto` (io_uring where the kernel allows it). Where io_uring is refused
    /// (old kernel, kernel.io_uring_disabled, seccomp) the server uses threads and says so.
    /// Default threads: io_uring did not lower CPU per byte (docs/bench/2026-11-28-io-uring.md).
    #[arg(long, value_enum, default_value = "threads")]
    io_engine: IoEngineArg,
    /// Crypto threads for large requests (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// The most requests of one connection running at once (its queue depth served in
    /// parallel), on I/O threads that every connection shares.
    #[arg(long, default_value_t = 32)]
    io_workers: usize,
    /// Most I/O threads idle or running requests, shared by every connection (threads waiting on
    /// a client's socket do not count): started when a request finds none idle, ended after 5 s
    /// without work.
    #[arg(long, default_value_t = cryptbridge_bridge::server::DEFAULT_MAX_IO_THREADS)]
    max_io_threads: usize,
    /// Most connections open at once (handshaking or transmitting); further ones are closed at
    /// once, with a log line. Default: what the open-file limit allows (idle connections hold no
    /// thread, only their socket): the limit, raised to its hard limit at start, less 64 for the
    /// server's own files, halved when each client has its own upstream connection (a remote
    /// backing without --backing-shared).
    #[arg(long)]
    max_connections: Option<usize>,
    /// Close a connection that has no request in flight and has received nothing for this
    /// many seconds. 0 (the default, as nbdkit's): never.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
    idle_timeout: u64,
    /// Request bytes one connection may have in flight (WRITE payloads being written, READ data
    /// whose reply is not sent yet); at the limit its requests are not read until replies drain.
    /// Bytes, or a number with K/M/G. One request always runs, even if larger. Default 64M
    /// (under a memory cgroup limit, at most the default --max-inflight-bytes).
    #[arg(long, value_parser = size::parse_size)]
    max_inflight_bytes_per_connection: Option<u64>,
    /// The same limit over all connections together. Default 512M, or under a memory cgroup
    /// limit a quarter of that limit if less: memory use is this budget plus a fixed part
    /// (docs/cli.md).
    #[arg(long, value_parser = size::parse_size)]
    max_inflight_bytes: Option<u64>,
    /// After answering a small page-cache request, poll the socket this long (nanoseconds) for
    /// the next request before sleeping, like qemu's iothread `poll-max-ns`: waking an idle
    /// vCPU costs tens of microseconds, more than serving a small request, so polling cuts
    /// queue-depth-1 latency on VMs at the cost of CPU time. 0 disables polling.
    #[arg(long, default_value_t = 32_768)]
    poll_max_ns: u64,
    /// Seconds a client has for the whole handshake, from connecting to the start of
    /// transmission (one deadline, however the client paces its bytes; as qemu-nbd's
    /// --handshake-limit). A client still negotiating then is disconnected.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    handshake_limit: u64,
    /// Seconds a send to a client may block because the client does not read its replies
    /// (its socket buffer full) before that client is disconnected. The sending thread may be
    /// one other clients wait on (with a remote backing, an upstream connection's reply
    /// reader), so a client that stops reading must not hold it. 0: no limit.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=86400))]
    send_timeout: u64,
    /// `plain` (dm-crypt plain mode: --key-file is the raw key) or `luks` (a LUKS1/LUKS2 volume
    /// made by cryptsetup or qemu-img: its header gives the cipher, key size, sector size and data
    /// offset, and the export is its data segment; --key-file is then a passphrase file read whole
    /// as cryptsetup does, `-` for standard input, or without it the passphrase is asked for on
    /// the terminal). See docs/luks.md. Default `plain`; a backing that starts with a LUKS header
    /// is refused unless `--type plain` is given explicitly (serving it as plain would expose the
    /// header as data, and the first write there would destroy the volume's keyslots).
    #[arg(long = "type", value_enum)]
    volume_type: Option<VolumeType>,
    /// With --type luks: the volume's detached LUKS header (as `cryptsetup --header`).
    #[arg(long)]
    header: Option<PathBuf>,
    /// With --type luks: try only this keyslot (by default every keyslot, as cryptsetup).
    #[arg(long)]
    key_slot: Option<u32>,
    /// With --type luks on a volume whose LUKS2 reencryption is in progress (started by
    /// `cryptsetup reencrypt --init-only`, or stopped by either tool): advance it in the
    /// background while serving, clients first, with cryptsetup's commit points; SIGINT/SIGTERM
    /// stop it at one, a restart resumes. Recovers a hotzone a crash left first.
    #[arg(long)]
    reencrypt: bool,
    /// With --reencrypt: the most bytes per second it rewrites on average (e.g. 100M; default:
    /// no cap, only the back-off while clients make requests).
    #[arg(long, value_parser = crate::size::parse_size, value_name = "BYTES")]
    reencrypt_rate: Option<u64>,
    /// TLS on the wire (NBD_OPT_STARTTLS), as nbdkit's --tls: `off`; `on`, clients may upgrade to
    /// TLS or stay in plaintext; `require`, a client must upgrade before any other option is
    /// answered. Needs --tls-certificates. The ready line's URI is then nbds://. See
    /// docs/network.md.
    #[arg(long, value_enum, default_value = "off")]
    tls: TlsArg,
    /// Directory of the server's certificates, as nbdkit's and qemu's: server-cert.pem (with
    /// any intermediates), server-key.pem (unencrypted) and, for --tls-verify-peer, ca-cert.pem
    /// (and ca-crl.pem, optional).
    /// Read and checked at start-up.
    #[arg(long, value_name = "DIR", required_if_eq_any = [("tls", "on"), ("tls", "require")])]
    tls_certificates: Option<PathBuf>,
    /// With --tls: clients must present a certificate signed by ca-cert.pem (nbdkit's option)
    /// and not revoked by ca-crl.pem, where that file is there.
    #[arg(long)]
    tls_verify_peer: bool,
    /// Crypto back end: `cpu`, or `rtl-sim` (the Verilated XTS-AES-256 hardware core from rtl/,
    /// run as a co-process; needs a 512-bit aes-xts-plain64 key and `make -C rtl sim`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "rtl-sim"])]
    engine: String,
}

const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

impl Args {
    fn volume_type(&self) -> VolumeType {
        self.volume_type.unwrap_or(VolumeType::Plain)
    }
}


/// `--backing` as an NBD URI, with the options that go with one checked; `None` for a path.
fn remote_backing(args: &Args) -> Result<Option<NbdUri>> {
    let spec = args.backing.to_str().filter(|s| uri::is_nbd_uri(s));
    let Some(spec) = spec else {
        if args.backing_connections.is_some() {
            usage("--backing-connections needs an NBD URI as --backing".into());
        }
        if args.backing_shared {
            usage("--backing-shared needs an NBD URI as --backing".into());
        }
        return Ok(None);
    };
    let uri = uri::parse(spec).unwrap_or_else(|e| usage(format!("--backing: {e}")));
    if args.direct {
        usage("--direct applies to a file or device, not to an NBD export as --backing".into());
    }
    if args.io_engine == IoEngineArg::Uring {
        usage("--io-engine uring applies to a file or device, not to an NBD export as --backing".into());
    }
    if args.volume_type() == VolumeType::Luks && args.header.is_none() {
        usage("--type luks with an NBD export as --backing needs the header in a local file (--header FILE)".into());
    }
    Ok(Some(uri))
}

/// The in-flight byte limits (per connection, server-wide): the options where given, else the
/// defaults, made smaller under a memory cgroup limit so that the budget and the server's fixed
/// part fit it with room to spare (the budget at most a quarter of the limit; docs/cli.md,
/// "Memory").
fn inflight_limits(args: &Args, cgroup_limit: Option<u64>) -> (u64, u64) {
    use cryptbridge_bridge::server::{DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_MAX_INFLIGHT_BYTES_PER_CONNECTION};
    let total = args.max_inflight_bytes.unwrap_or_else(|| match cgroup_limit {
        Some(limit) if limit / 4 < DEFAULT_MAX_INFLIGHT_BYTES => {
            let sized = (limit / 4 / MIB * MIB).max(MIN_SIZED_BUDGET);
            tracing::info!(
                "memory cgroup limit {} MiB: in-flight budget {} MiB (a quarter of it; --max-inflight-bytes overrides)",
                limit / MIB,
                sized / MIB
            );
            sized
        }
        _ => DEFAULT_MAX_INFLIGHT_BYTES,
    });
    let per_connection = args.max_inflight_bytes_per_connection.unwrap_or(if args.max_inflight_bytes.is_none() {
        DEFAULT_MAX_INFLIGHT_BYTES_PER_CONNECTION.min(total)
    } else {
        DEFAULT_MAX_INFLIGHT_BYTES_PER_CONNECTION
    });
    (per_connection, total)
}

const MIB: u64 = 1 << 20;
/// The least budget sized from a cgroup limit: below it, requests would wait for one another
/// more than memory is saved (one request always runs anyway).
const MIN_SIZED_BUDGET: u64 = 8 * MIB;

/// The memory limit of this process's cgroup: the smallest set on its path to the root, in the
/// v2 hierarchy (`memory.max`) or the v1 memory controller's (`memory.limit_in_bytes`). `None`
/// without a limit or where none can be read.
fn cgroup_memory_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut least: Option<u64> = None;
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else { continue };
        let (root, file) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut dir = Path::new(root).join(path.trim_start_matches('/'));
        loop {
            if let Some(limit) = std::fs::read_to_string(dir.join(file)).ok().and_then(|s| s.trim().parse::<u64>().ok()) {
                // v1 writes "no limit" as a huge number (v2 as "max", which does not parse).
                if limit < 1 << 60 {
                    least = Some(least.map_or(limit, |l| l.min(limit)));
                }
            }
            if dir == Path::new(root) || !dir.pop() {
                break;
            }
        }
    }
    least
}

fn parse_sector_size(s: &str) -> Result<usize, String> {
    match s {
        "512" => Ok(512),
        "4096" => Ok(4096),
        _ => Err(format!("sector size must be 512 or 4096, got {s}")),
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    // First, while this process has one thread: the inherited socket and its variables.
    let activated = activation::take_listener()?;
    if args.io_workers == 0 || args.threads == Some(0) || args.max_io_threads == 0 || args.max_connections == Some(0) {
        usage("--io-workers, --threads, --max-io-threads and --max-connections must be at least 1".into());
    }
    if args.max_inflight_bytes_per_connection == Some(0) || args.max_inflight_bytes == Some(0) {
        usage("--max-inflight-bytes-per-connection and --max-inflight-bytes must be more than 0".into());
    }
    let (max_inflight_bytes_per_connection, max_inflight_bytes) = inflight_limits(&args, cgroup_memory_limit());
    if args.tls == TlsArg::Off && (args.tls_certificates.is_some() || args.tls_verify_peer) {
        usage("--tls-certificates and --tls-verify-peer need --tls on or --tls require".into());
    }
    // Certificates are checked before anything is opened, prompted for or listened on.
    let tls = match (args.tls, &args.tls_certificates) {
        (TlsArg::Off, _) | (_, None) => None,
        (mode, Some(dir)) => {
            let mode = if mode == TlsArg::Require { TlsMode::Require } else { TlsMode::On };
            Some(TlsPolicy::load(mode, dir, args.tls_verify_peer).context("--tls-certificates")?)
        }
    };
    let remote = remote_backing(&args)?;
    if args.reencrypt && (args.read_only || args.volume_type() != VolumeType::Luks) {
        usage("--reencrypt needs --type luks and a writable volume".into());
    }
    if args.reencrypt_rate.is_some() && !args.reencrypt {
        usage("--reencrypt-rate needs --reencrypt".into());
    }
    // --type luks: the header decides cipher, key, sector size and data area (cmd_serve/luks.rs).
    let mut luks = luks::open(&args)?;
    let sector_size = luks.as_ref().map_or(args.sector_size, luks::Volume::sector_size);
    let layout = luks.as_ref().map_or_else(|| SectorLayout::new(args.sector_size, args.iv_large_sectors), luks::Volume::layout);
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut rtl: Option<Arc<RtlSimBackend>> = None;
    let mut key_bits = 0;
    let engine = if args.passthrough {
        if args.engine != "cpu" {
            bail!("--passthrough stores plaintext; --engine {} has nothing to do", args.engine);
        }
        Engine::passthrough(layout)
    } else {
        let (cipher_name, key, key_source) = match luks.as_mut() {
            Some(v) => (v.crypto_api(), v.take_key(), v.key_source()),
            None => {
                let cipher_name = names::volume_cipher(&args.cipher)?;
                let key_path = args.key_file.as_ref().expect("luks::open requires --key-file for --type plain without --passthrough");
                (cipher_name, keyfile::read_key(key_path, args.key_size)?, format!("key file {}", key_path.display()))
            }
        };
        key_bits = key.len() * 8;
        let cipher: Arc<dyn SectorCipher> = Arc::from(
            new_cipher(cipher_name, &key, KeyPolicy::Volume)
                .with_context(|| format!("{key_source} cannot be used"))?,
        );
        let backend: Arc<dyn Backend> = match args.engine.as_str() {
            "rtl-sim" => {
                if cipher_name != "xts(aes)" {
                    bail!("--engine rtl-sim implements aes-xts-plain64 only, not {}", args.cipher);
                }
                let program = RtlSimBackend::locate().ok_or_else(|| {
                    anyhow::anyhow!("RTL simulator not found: build it with `make -C rtl sim` or set {}", cryptbridge_engine::RTL_SIM_ENV)
                })?;
                let sim = Arc::new(RtlSimBackend::spawn(&program, &key)?);
                tracing::info!("engine: RTL simulation of the XTS core ({})", program.display());
                rtl = Some(Arc::clone(&sim));
                sim
            }
            _ => Arc::new(CpuBackend::new(cipher, threads)?),
        };
        Engine::new(backend, layout)
    };
    let backing_opts = BackingOptions { size: args.size, read_only: args.read_only, direct: args.direct, sector_size };
    let backing = match &remote {
        Some(uri) => {
            let opts = RemoteOptions {
                connections: args.backing_connections.map(|n| n as usize),
                own_connections: !args.backing_shared,
                reply_timeout: std::time::Duration::from_secs(args.backing_timeout),
                reconnect_delay: std::time::Duration::from_secs(args.backing_reconnect_delay),
                ..RemoteOptions::default()
            };
            Backing::connect(uri, &backing_opts, &opts)?
        }
        None => {
            let engine = match args.io_engine {
                IoEngineArg::Threads => IoEngine::Threads,
                IoEngineArg::Uring => IoEngine::Uring,
                IoEngineArg::Auto => IoEngine::Auto,
            };
            Backing::open_with(&args.backing, &backing_opts, engine)?
        }
    };
    // A read-only upstream makes a read-only export; TRIM only where the upstream takes it.
    let read_only = args.read_only || backing.upstream().is_some_and(|e| e.read_only());
    let mut allow_discards = args.allow_discards;
    if allow_discards && backing.upstream().is_some_and(|e| !e.can_trim()) {
        tracing::warn!("the upstream does not take TRIM: --allow-discards has no effect");
        allow_discards = false;
    }
    // From here on, a start that fails removes the files it created (backing, socket).
    let mut created = CreatedFiles { backing: backing.created().then(|| args.backing.clone()), socket: None, metrics: None };
    if luks.is_none() && args.volume_type.is_none() && !backing.created() {
        refuse_luks_as_plain(&backing, &args.backing)?;
    }
    let (mapping, steps) = luks::window(luks.as_mut(), backing, engine, &args.backing)?;
    let mode = if args.passthrough { "passthrough (plaintext)".to_string() } else { format!("{} {key_bits}-bit", luks.as_ref().map_or_else(|| args.cipher.clone(), luks::Volume::label)) };
    // One descriptor per connection (two with its own upstream connection): the soft limit
    // (often 1024) would refuse connections long before threads or memory run out.
    let per_connection = if remote.is_some() && !args.backing_shared { 2 } else { 1 };
    let max_connections = match (raise_open_file_limit(), args.max_connections) {
        (Ok(limit), Some(max)) => {
            if limit < max as u64 * per_connection + cryptbridge_bridge::server::RESERVED_FDS {
                tracing::warn!("open-file limit {limit} is below --max-connections {max} plus the server's own files; accept may fail first");
            }
            max
        }
        (Ok(limit), None) => cryptbridge_bridge::default_max_connections(limit, per_connection),
        (Err(e), max) => {
            tracing::warn!("cannot read or raise the open-file limit: {e}");
            max.unwrap_or(cryptbridge_bridge::server::DEFAULT_MAX_CONNECTIONS)
        }
    };
    tracing::debug!("at most {max_connections} connections");
    if let Some(addr) = &args.metrics {
        let info = ExportInfo {
            export: args.export_name.clone(),
            cipher: if args.passthrough { "none".into() } else { luks.as_ref().map_or_else(|| args.cipher.clone(), luks::Volume::label) },
            cpu_level: CpuLevel::active().map_or("unknown", CpuLevel::name).into(),
            backing: if remote.is_some() { "nbd" } else if std::fs::metadata(&args.backing).is_ok_and(|m| m.file_type().is_block_device()) { "block" } else { "file" }.into(),
        };
        created.metrics = metrics::start(addr, info)?;
    }
    let server = Server::new(
        Arc::clone(&mapping),
        ServerConfig {
            read_only,
            allow_discards,
            io_workers: args.io_workers,
            poll_max: std::time::Duration::from_nanos(args.poll_max_ns),
            handshake_limit: std::time::Duration::from_secs(args.handshake_limit),
            send_timeout: (args.send_timeout > 0).then(|| std::time::Duration::from_secs(args.send_timeout)),
            max_connections,
            idle_timeout: (args.idle_timeout > 0).then(|| std::time::Duration::from_secs(args.idle_timeout)),
            max_io_threads: args.max_io_threads,
            max_inflight_bytes_per_connection,
            max_inflight_bytes,
            tls: tls.clone(),
            ..ServerConfig::new(args.export_name.clone(), format!("cryptbridge {mode}"))
        },
    );
    // The steps start once the export is ready to serve, stop before the process exits.
    let reencryption = steps.map(|s| reencrypt::Job::spawn(s, args.reencrypt_rate)).transpose().context("cannot start the reencryption")?;
    if let Some(path) = &args.vhost_user_blk {
        if activated.is_some() {
            tracing::info!("socket activation: the inherited socket is not served with --vhost-user-blk");
        }
        return vhost::serve(&args, path, &server, mapping, rtl, reencryption, created, &format!("{mode}{}", if read_only { ", read-only" } else { "" }));
    }
    let socket_activated = activated.is_some();
    let (listener, uri) = match activated {
        Some(inherited) => {
            if args.unix.is_some() || args.listen != DEFAULT_LISTEN {
                tracing::info!("socket activation: serving the inherited socket; --listen/--unix ignored");
            }
            inherited
        }
        None => {
            let bound = bind(&args)?;
            created.socket = args.unix.clone();
            bound
        }
    };
    // nbds:// (nbds+unix://): the URI scheme of NBD over TLS.
    let uri = if tls.is_some() { uri.replacen("nbd", "nbds", 1) } else { uri };
    // Only a socket this run created is removed on exit; an inherited one belongs to its giver.
    let sockets = [created.socket.clone(), created.metrics.clone()].into_iter().flatten().collect();
    install_signal_handler(Arc::clone(&mapping), sockets, rtl.clone(), reencryption)?;
    if let Some(sim) = rtl {
        report_simulation_speed(sim);
    }
    let tls_note = match &tls {
        None => "",
        Some(t) if t.verify_peer => if t.required { ", TLS required, client certificates verified" } else { ", TLS offered, client certificates verified" },
        Some(t) => if t.required { ", TLS required" } else { ", TLS offered" },
    };
    tracing::info!(
        "serving {} ({} bytes, {}-byte sectors, {}{}{}{tls_note}) as {uri}",
        args.backing.display(),
        mapping.size(),
        sector_size,
        mode,
        if args.direct { ", O_DIRECT" } else { "" },
        if read_only { ", read-only" } else { "" },
    );
    if socket_activated {
        // The client or service manager holds the socket already; stdout may be the client's
        // own (`nbdinfo --json -- [ ... ]` prints its JSON there), so no ready line.
        tracing::info!("ready {uri} (socket activation)");
    } else {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "ready {uri}").and_then(|()| out.flush()).context("cannot print the ready line on stdout")?;
    }
    // Started: the backing file stays whatever happens next. The socket is removed when the
    // server stops (by the signal handler, or here should the accept loop fail).
    created.backing = None;
    server.run(listener)?;
    Ok(ExitCode::SUCCESS)
}

/// A plain volume (`--type` not given) on a backing that starts with a LUKS header is almost
/// certainly a mistake that loses the volume: the header's first sector is the export's first, a
/// partition table or filesystem written there overwrites it. cryptsetup asks before it opens a
/// LUKS device as plain; a server has nobody to ask, so it refuses and names both ways on.
fn refuse_luks_as_plain(backing: &cryptbridge_bridge::Backing, path: &Path) -> Result<()> {
    // One aligned sector, so that an O_DIRECT backing can read it too.
    const SECTOR: usize = crate::aligned::Aligned::ALIGN;
    let mut buf = crate::aligned::Aligned::new(SECTOR);
    let first = buf.bytes();
    let len = (backing.size() as usize).min(SECTOR) / 512 * 512;
    if let Err(e) = backing.read_at(&mut first[..len], 0) {
        // The check guards against a mistake; a store whose first sector cannot be read now can
        // still serve the rest, and each request reports its own errors.
        tracing::warn!("cannot read the start of {} to look for a LUKS header: {e}", path.display());
        return Ok(());
    }
    if first.len() >= 8 && first[..6] == cryptbridge_volume::LUKS_MAGIC {
        let version = u16::from_be_bytes([first[6], first[7]]);
        bail!(
            "{} starts with a LUKS{version} header: serving it as a plain dm-crypt volume would expose the header \
             as data, and the first write there would destroy the volume's keyslots. Serve the volume with \
             --type luks (a passphrase opens it); give --type plain explicitly to use the whole device as plain \
             dm-crypt anyway",
            path.display()
        );
    }
    Ok(())
}

/// Files this start created, removed when it is dropped: on a failed start, an early return drops
/// it with both still set.
struct CreatedFiles {
    backing: Option<PathBuf>,
    socket: Option<PathBuf>,
    /// The --metrics Unix socket.
    metrics: Option<PathBuf>,
}

impl Drop for CreatedFiles {
    fn drop(&mut self) {
        for path in [self.backing.take(), self.socket.take(), self.metrics.take()].into_iter().flatten() {
            remove_created(&path);
        }
    }
}

fn remove_created(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!("removed {}, which this run created", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("cannot remove {}, which this run created: {e}", path.display()),
    }
}

fn bind(args: &Args) -> Result<(Listener, String)> {
    if let Some(path) = &args.unix {
        let group = args.group.as_deref().map(unix_socket::parse_group).transpose()?;
        let l = unix_socket::bind(path, group)?;
        if let Some(gid) = group {
            tracing::info!("{}: mode 0660, group {}", path.display(), unix_socket::group_name(gid));
        }
        let abs = std::fs::canonicalize(path)?;
        return Ok((Listener::Unix(l), format!("nbd+unix:///?socket={}", abs.display())));
    }
    let l = TcpListener::bind(&args.listen).with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = l.local_addr()?;
    Ok((Listener::Tcp(l), format!("nbd://{addr}")))
}

/// Logs how fast the simulated hardware runs, every 10 s while it is busy.
fn report_simulation_speed(sim: Arc<RtlSimBackend>) {
    std::thread::spawn(move || {
        let mut last = sim.stats();
        loop {
            std::thread::sleep(std::time::Duration::from_secs(10));
            let now = sim.stats();
            if now.bytes != last.bytes {
                log_sim_stats(&now);
                last = now;
            }
        }
    });
}

fn log_sim_stats(s: &cryptbridge_engine::SimStats) {
    tracing::info!(
        "rtl-sim: {} bytes in {} requests, {} cycles ({:.2} blocks/cycle); simulation speed {:.3e} cycles/s, {:.3} MB/s",
        s.bytes,
        s.requests,
        s.cycles,
        s.blocks_per_cycle(),
        s.cycles_per_sec(),
        s.mb_per_sec()
    );
}

/// SIGINT/SIGTERM: stop a reencryption at a commit point, make answered writes durable, remove
/// our socket, then exit cleanly.
fn install_signal_handler(mapping: Arc<Mapping>, sockets: Vec<PathBuf>, rtl: Option<Arc<RtlSimBackend>>, reencryption: Option<Arc<reencrypt::Job>>) -> Result<()> {
    ctrlc::set_handler(move || {
        if let Some(job) = &reencryption {
            job.stop();
        }
        if let Some(sim) = &rtl {
            log_sim_stats(&sim.stats());
        }
        for path in &sockets {
            let _ = std::fs::remove_file(path); // nothing to do if it is already gone
        }
        let code = match mapping.flush() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("cryptbridge: flush on shutdown failed: {e}");
                1
            }
        };
        tracing::info!("stopping");
        std::process::exit(code);
    })
    .context("cannot install signal handler")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: Args,
    }

    fn limits(options: &[&str], cgroup: Option<u64>) -> (u64, u64) {
        let argv = ["serve", "--backing", "b.img", "--passthrough"].iter().chain(options);
        inflight_limits(&Serve::parse_from(argv).args, cgroup)
    }

    #[test]
    fn default_limits_fit_the_memory_cgroup_and_options_win() {
        assert_eq!(limits(&[], None), (64 * MIB, 512 * MIB));
        assert_eq!(limits(&[], Some(4 << 30)), (64 * MIB, 512 * MIB), "a limit with room: the defaults");
        assert_eq!(limits(&[], Some(256 * MIB)), (64 * MIB, 64 * MIB));
        assert_eq!(limits(&[], Some(128 * MIB)), (32 * MIB, 32 * MIB));
        assert_eq!(limits(&[], Some(20 * MIB)), (8 * MIB, 8 * MIB), "never below MIN_SIZED_BUDGET");
        assert_eq!(limits(&["--max-inflight-bytes", "1G"], Some(256 * MIB)), (64 * MIB, 1 << 30));
        assert_eq!(limits(&["--max-inflight-bytes-per-connection", "128M"], Some(256 * MIB)), (128 * MIB, 64 * MIB));
    }
}
