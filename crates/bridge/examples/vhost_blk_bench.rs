//! A load generator for `cryptbridge serve --vhost-user-blk` (bench/vhost.py): libblkio's
//! `virtio-blk-vhost-user` driver in user space, as `vhost_blk_client` uses it, keeping a fixed
//! number of requests in flight the way fio does against the NBD front end.
//!
//! ```text
//! vhost_blk_bench SOCKET [--bs BYTES] [--iodepth N] [--rw read|write|randread|randwrite|randrw]
//!                        [--rwmixread PCT] [--runtime S] [--ramp S] [--size BYTES] [--queues N]
//!                        [--seed N] [--poll]
//! ```
//! Sizes take a K/M/G suffix (powers of two). Prints one JSON line: ops, bytes, seconds, iops,
//! mbps (10^6 B/s, reads and writes together), the split by direction and completion latency
//! percentiles, all over the measured time only (after the ramp).
//!
//! With more than one queue, each queue gets its own thread and an equal share of the depth, as a
//! guest with one vCPU per queue would drive them.
//!
//! `--poll` uses libblkio's poll queues: the thread spins on the used ring instead of sleeping on
//! the queue's completion eventfd, and the driver asks the device for no used-buffer
//! notifications, as a guest's polled virtio-blk queues (Linux `virtio_blk.poll_queues`) do. The
//! default waits on the eventfd, so every batch of completions costs the device an eventfd
//! write that wakes the client.

use std::mem::MaybeUninit;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

#[derive(Clone, Copy, PartialEq)]
enum Pattern {
    Read,
    Write,
    RandRead,
    RandWrite,
    RandRw,
}

#[derive(Clone)]
struct Opts {
    socket: String,
    bs: usize,
    iodepth: usize,
    rw: Pattern,
    rwmixread: u32,
    runtime: f64,
    ramp: f64,
    size: Option<u64>,
    queues: usize,
    seed: u64,
    poll: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.trim_end_matches("IB").trim_end_matches('B');
    let (num, mult) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    num.parse::<u64>().map(|n| n * mult).map_err(|e| format!("{s}: {e}"))
}

fn parse_args() -> Result<Opts, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut o = Opts {
        socket: String::new(),
        bs: 4096,
        iodepth: 32,
        rw: Pattern::RandRead,
        rwmixread: 50,
        runtime: 5.0,
        ramp: 1.0,
        size: None,
        queues: 1,
        seed: 0x9e37_79b9_7f4a_7c15,
        poll: false,
    };
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{a}: missing value"));
        let float = |s: String| s.parse::<f64>().map_err(|e| format!("{s}: {e}"));
        match a.as_str() {
            "--bs" => o.bs = parse_size(&val()?)? as usize,
            "--iodepth" => o.iodepth = parse_size(&val()?)? as usize,
            "--rw" => {
                o.rw = match val()?.as_str() {
                    "read" => Pattern::Read,
                    "write" => Pattern::Write,
                    "randread" => Pattern::RandRead,
                    "randwrite" => Pattern::RandWrite,
                    "randrw" => Pattern::RandRw,
                    other => return Err(format!("--rw {other}: read|write|randread|randwrite|randrw")),
                }
            }
            "--rwmixread" => o.rwmixread = parse_size(&val()?)?.min(100) as u32,
            "--runtime" => o.runtime = float(val()?)?,
            "--ramp" => o.ramp = float(val()?)?,
            "--size" => o.size = Some(parse_size(&val()?)?),
            "--queues" => o.queues = parse_size(&val()?)?.max(1) as usize,
            "--seed" => o.seed = parse_size(&val()?)?,
            "--poll" => o.poll = true,
            s if s.starts_with("--") => return Err(format!("unknown option {s}")),
            s if o.socket.is_empty() => o.socket = s.to_string(),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if o.socket.is_empty() {
        return Err("missing SOCKET".into());
    }
    if o.bs == 0 || o.iodepth == 0 {
        return Err("--bs and --iodepth must be positive".into());
    }
    Ok(o)
}

/// What one queue's thread measured after the ramp.
#[derive(Default)]
struct Tally {
    ops: u64,
    read_bytes: u64,
    write_bytes: u64,
    errors: u64,
    first_error: Option<i32>,
    lat_ns: Vec<u64>,
}

/// xorshift64*: cheap, and the offsets only have to be spread, not unpredictable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Drives one queue: `depth` requests, each on its own `bs` slice of the mapped region starting at
/// `base`, resubmitted as soon as it completes, until the ramp and the runtime have passed.
fn drive(q: &mut Blkioq, o: &Opts, base: usize, depth: usize, blocks: u64, seq_start: u64, seed: u64) -> Tally {
    let mut rng = Rng(seed | 1);
    let mut seq = seq_start;
    let mut started = vec![Instant::now(); depth];
    let mut is_read = vec![true; depth];
    let mut submit = |q: &mut Blkioq, slot: usize, started: &mut [Instant], is_read: &mut [bool]| {
        let block = match o.rw {
            Pattern::Read | Pattern::Write => {
                let b = seq;
                seq = (seq + 1) % blocks;
                b
            }
            _ => rng.next() % blocks,
        };
        let read = match o.rw {
            Pattern::Read | Pattern::RandRead => true,
            Pattern::Write | Pattern::RandWrite => false,
            Pattern::RandRw => (rng.next() % 100) < u64::from(o.rwmixread),
        };
        let addr = base + slot * o.bs;
        let offset = block * o.bs as u64;
        started[slot] = Instant::now();
        is_read[slot] = read;
        if read {
            q.read(offset, addr as *mut u8, o.bs, slot, ReqFlags::empty());
        } else {
            q.write(offset, addr as *const u8, o.bs, slot, ReqFlags::empty());
        }
    };
    let t0 = Instant::now();
    let ramp_end = t0 + Duration::from_secs_f64(o.ramp);
    let end = ramp_end + Duration::from_secs_f64(o.runtime);
    for slot in 0..depth {
        submit(q, slot, &mut started, &mut is_read);
    }
    let mut tally = Tally::default();
    let mut measuring = o.ramp <= 0.0;
    let mut in_flight = depth;
    let mut done: Vec<MaybeUninit<Completion>> = (0..depth).map(|_| MaybeUninit::uninit()).collect();
    while in_flight > 0 {
        let n = match q.do_io(&mut done, 1, None, None) {
            Ok(n) => n,
            Err(e) => {
                tally.errors += 1;
                tally.first_error.get_or_insert(e.errno().raw_os_error());
                break;
            }
        };
        let now = Instant::now();
        if !measuring && now >= ramp_end {
            measuring = true;
        }
        let stopping = now >= end;
        for c in &done[..n] {
            // SAFETY: do_io initialised the first n completions.
            let c = unsafe { c.assume_init_ref() };
            let slot = c.user_data;
            in_flight -= 1;
            if c.ret != 0 {
                tally.errors += 1;
                tally.first_error.get_or_insert(-c.ret);
            } else if measuring {
                tally.ops += 1;
                if is_read[slot] {
                    tally.read_bytes += o.bs as u64;
                } else {
                    tally.write_bytes += o.bs as u64;
                }
                tally.lat_ns.push(now.duration_since(started[slot]).as_nanos() as u64);
            }
            if !stopping && c.ret == 0 {
                submit(q, slot, &mut started, &mut is_read);
                in_flight += 1;
            }
        }
    }
    tally
}

fn run(o: &Opts) -> Result<String, String> {
    fn err(what: &'static str) -> impl Fn(blkio::Error) -> String {
        move |e| format!("{what}: {e} (errno {})", e.errno().raw_os_error())
    }
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(err("new"))?;
    b.set_str("path", &o.socket).map_err(err("path"))?;
    b.connect().map_err(err("connect"))?;
    let (interrupt_queues, poll_queues) = if o.poll { (0, o.queues) } else { (o.queues, 0) };
    b.set_i32("num-queues", interrupt_queues as i32).map_err(err("num-queues"))?;
    b.set_i32("num-poll-queues", poll_queues as i32).map_err(err("num-poll-queues"))?;
    let started = b.start().map_err(err("start"))?;
    let started_queues = if o.poll { started.poll_queues } else { started.queues };
    let capacity = b.get_u64("capacity").map_err(err("capacity"))?;
    let size = o.size.unwrap_or(capacity).min(capacity);
    let blocks = size / o.bs as u64;
    if blocks == 0 {
        return Err(format!("--size {size} holds no block of {} bytes", o.bs));
    }
    let nq = started_queues.len().min(o.queues).max(1);
    let depth_of = |q: usize| o.iodepth / nq + usize::from(q < o.iodepth % nq);
    // Every request gets its own slice of one region shared with the bridge: a virtio driver
    // may only hand the device memory the device has been told about.
    let align = b.get_u64("mem-region-alignment").map_err(err("mem-region-alignment"))? as usize;
    let len = (o.iodepth * o.bs).div_ceil(align).max(1) * align;
    let region = b.alloc_mem_region(len).map_err(err("alloc_mem_region"))?;
    b.map_mem_region(&region).map_err(err("map_mem_region"))?;
    {
        // SAFETY: alloc_mem_region mapped `len` bytes read-write at `addr`; they live as long as
        // `b`, which outlives this slice, and no request is in flight yet.
        let buf = unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, region.len) };
        let mut rng = Rng(o.seed | 1);
        for chunk in buf.chunks_mut(8) {
            let r = rng.next().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
    }
    let t0 = Instant::now();
    let mut queues = started_queues;
    queues.truncate(nq);
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        let mut first_slot = 0;
        for (i, q) in queues.iter_mut().enumerate() {
            let d = depth_of(i);
            let base = region.addr + first_slot * o.bs;
            first_slot += d;
            // Sequential streams start apart so that queues do not read the same blocks.
            let seq_start = (blocks / nq as u64) * i as u64;
            let seed = o.seed.wrapping_add(i as u64 * 0x1000_0001);
            handles.push(s.spawn(move || if d == 0 { Tally::default() } else { drive(q, o, base, d, blocks, seq_start, seed) }));
        }
        handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut total = Tally::default();
    for t in tallies {
        total.ops += t.ops;
        total.read_bytes += t.read_bytes;
        total.write_bytes += t.write_bytes;
        total.errors += t.errors;
        total.first_error = total.first_error.or(t.first_error);
        total.lat_ns.extend(t.lat_ns);
    }
    total.lat_ns.sort_unstable();
    let pct = |p: f64| -> f64 {
        if total.lat_ns.is_empty() {
            return 0.0;
        }
        let i = ((total.lat_ns.len() as f64 * p).ceil() as usize).clamp(1, total.lat_ns.len()) - 1;
        total.lat_ns[i] as f64 / 1e3
    };
    let mean = if total.lat_ns.is_empty() { 0.0 } else { total.lat_ns.iter().sum::<u64>() as f64 / total.lat_ns.len() as f64 / 1e3 };
    // The measured span is the runtime as asked, as fio reports it; the wall time (ramp and the
    // last requests' drain included) is printed beside it.
    let secs = o.runtime.max(1e-9);
    let bytes = total.read_bytes + total.write_bytes;
    let rw = match o.rw {
        Pattern::Read => "read",
        Pattern::Write => "write",
        Pattern::RandRead => "randread",
        Pattern::RandWrite => "randwrite",
        Pattern::RandRw => "randrw",
    };
    Ok(format!(
        concat!(
            "{{\"ok\":{},\"rw\":\"{}\",\"bs\":{},\"iodepth\":{},\"queues\":{},\"poll\":{},\"size\":{},",
            "\"ops\":{},\"bytes\":{},\"read_bytes\":{},\"write_bytes\":{},\"seconds\":{:.3},\"wall_s\":{:.3},",
            "\"iops\":{:.1},\"mbps\":{:.2},\"read_mbps\":{:.2},\"write_mbps\":{:.2},",
            "\"lat_us\":{{\"mean\":{:.1},\"p50\":{:.1},\"p99\":{:.1},\"p99.9\":{:.1}}},",
            "\"errors\":{},\"first_errno\":{}}}"
        ),
        total.errors == 0 && total.ops > 0,
        rw,
        o.bs,
        o.iodepth,
        nq,
        o.poll,
        size,
        total.ops,
        bytes,
        total.read_bytes,
        total.write_bytes,
        secs,
        wall,
        total.ops as f64 / secs,
        bytes as f64 / secs / 1e6,
        total.read_bytes as f64 / secs / 1e6,
        total.write_bytes as f64 / secs / 1e6,
        mean,
        pct(0.50),
        pct(0.99),
        pct(0.999),
        total.errors,
        total.first_error.map_or("null".to_string(), |e| e.to_string()),
    ))
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("vhost_blk_bench: {e}");
            eprintln!(
                "usage: vhost_blk_bench SOCKET [--bs B] [--iodepth N] [--rw read|write|randread|randwrite|randrw] \
                 [--rwmixread PCT] [--runtime S] [--ramp S] [--size B] [--queues N] [--seed N] [--poll]"
            );
            return ExitCode::from(2);
        }
    };
    match run(&o) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vhost_blk_bench: {e}");
            ExitCode::from(1)
        }
    }
}
