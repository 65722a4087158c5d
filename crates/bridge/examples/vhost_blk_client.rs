//! A vhost-user-blk client for the tests (`tests/integration/test_vhost_user.py`): libblkio's
//! `virtio-blk-vhost-user` driver, in user space, against `cryptbridge serve --vhost-user-blk`.
//! It shares its memory with the bridge as a hypervisor would, with no VM.
//!
//! ```text
//! vhost_blk_client SOCKET [--queues N] [--read-only] OP...
//!   info                          capacity, block size, queues, max segments
//!   write OFFSET FILE             FILE's bytes at OFFSET
//!   read OFFSET LEN FILE          LEN bytes at OFFSET into FILE
//!   flush | discard OFFSET LEN | zero OFFSET LEN
//!   spread COUNT SIZE SEED        COUNT writes of SIZE bytes (distinct blocks, pattern from
//!                                 SEED) spread over every queue at once, then read back on other
//!                                 queues and compared
//!   abandon COUNT SIZE            submits COUNT writes and exits without waiting for them
//! ```
//! Each op prints one line: `ok ...`, or `error ERRNO MESSAGE` (the client goes on).

use std::fs;
use std::mem::MaybeUninit;
use std::process::ExitCode;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

struct Client {
    /// Kept alive: the queues and the region belong to it.
    _blkio: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
}

impl Client {
    fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is `len` bytes mapped read-write by alloc_mem_region, lives as long
        // as the Blkio that owns it (kept in self), and the device only touches it while a
        // request that names it is in flight, which never outlives the call that submitted it.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Waits for `n` completions on queue `q`; the first failure's errno, if any.
    fn wait(&mut self, q: usize, n: usize) -> Result<(), String> {
        let mut done: Vec<MaybeUninit<Completion>> = (0..n.max(1)).map(|_| MaybeUninit::uninit()).collect();
        let mut got = 0;
        let mut first_error = None;
        while got < n {
            let k = self.queues[q].do_io(&mut done[..n - got], 1, None, None).map_err(|e| format!("{} {e}", e.errno().raw_os_error()))?;
            for c in &done[..k] {
                // SAFETY: do_io initialised the first k completions.
                let c = unsafe { c.assume_init_ref() };
                if c.ret != 0 && first_error.is_none() {
                    first_error = Some(format!("{} request failed", -c.ret));
                }
            }
            got += k;
        }
        first_error.map_or(Ok(()), Err)
    }

    fn run(&mut self, op: &str, args: &mut std::slice::Iter<'_, String>) -> Result<String, String> {
        let mut arg = || args.next().cloned().ok_or_else(|| format!("22 {op}: missing argument"));
        let num = |s: String| s.parse::<u64>().map_err(|e| format!("22 {s}: {e}"));
        match op {
            "info" => Ok(String::new()),
            "write" => {
                let (offset, path) = (num(arg()?)?, arg()?);
                let data = fs::read(&path).map_err(|e| format!("2 {path}: {e}"))?;
                self.buf()[..data.len()].copy_from_slice(&data);
                let addr = self.region.addr as *const u8;
                self.queues[0].write(offset, addr, data.len(), 0, ReqFlags::empty());
                self.wait(0, 1).map(|()| format!("{}", data.len()))
            }
            "read" => {
                let (offset, len, path) = (num(arg()?)?, num(arg()?)? as usize, arg()?);
                let addr = self.region.addr as *mut u8;
                self.queues[0].read(offset, addr, len, 0, ReqFlags::empty());
                self.wait(0, 1)?;
                fs::write(&path, &self.buf()[..len]).map_err(|e| format!("5 {path}: {e}"))?;
                Ok(format!("{len}"))
            }
            "flush" => {
                self.queues[0].flush(0, ReqFlags::empty());
                self.wait(0, 1).map(|()| String::new())
            }
            "discard" | "zero" => {
                let (offset, len) = (num(arg()?)?, num(arg()?)?);
                if op == "discard" {
                    self.queues[0].discard(offset, len, 0, ReqFlags::empty());
                } else {
                    self.queues[0].write_zeroes(offset, len, 0, ReqFlags::empty());
                }
                self.wait(0, 1).map(|()| String::new())
            }
            "spread" => {
                let (count, size, seed) = (num(arg()?)? as usize, num(arg()?)? as usize, num(arg()?)?);
                let nq = self.queues.len();
                if 2 * count * size > self.region.len {
                    return Err("22 spread: larger than the buffer".into());
                }
                let pattern = |i: usize, j: usize| (seed as usize).wrapping_mul(31).wrapping_add(i * 7 + j / 512) as u8;
                for i in 0..count {
                    let b = &mut self.buf()[i * size..(i + 1) * size];
                    for (j, x) in b.iter_mut().enumerate() {
                        *x = pattern(i, j);
                    }
                }
                // Every write goes out before any completes is waited for: all queues at once.
                let base = self.region.addr;
                let mut per_queue = vec![0; nq];
                for i in 0..count {
                    let q = i % nq;
                    self.queues[q].write((i * size) as u64, (base + i * size) as *const u8, size, i, ReqFlags::empty());
                    per_queue[q] += 1;
                }
                for (q, n) in per_queue.iter().enumerate() {
                    self.wait(q, *n)?;
                }
                // Read back on another queue than the one that wrote.
                let back = base + count * size;
                for i in 0..count {
                    let q = (i + 1) % nq;
                    self.queues[q].read((i * size) as u64, (back + i * size) as *mut u8, size, i, ReqFlags::empty());
                }
                for (q, n) in per_queue.iter().enumerate() {
                    self.wait((q + 1) % nq, *n)?;
                }
                let (written, read) = self.buf().split_at(count * size);
                match (0..count * size).find(|&k| written[k] != read[k]) {
                    None => Ok(format!("{count} {nq}")),
                    Some(k) => Err(format!("5 spread: byte {k} read back differs")),
                }
            }
            "abandon" => {
                let (count, size) = (num(arg()?)? as usize, num(arg()?)? as usize);
                for i in 0..count {
                    let q = i % self.queues.len();
                    self.buf()[i * size..(i + 1) * size].fill(0xab);
                    let addr = (self.region.addr + i * size) as *const u8;
                    self.queues[q].write((i * size) as u64, addr, size, i, ReqFlags::empty());
                }
                // Submitted (libblkio sends on submission); leave without waiting for them.
                for q in &mut self.queues {
                    let _ = q.do_io(&mut [], 0, None, None);
                }
                println!("ok abandon");
                std::process::exit(0);
            }
            _ => Err(format!("22 unknown op {op}")),
        }
    }
}

fn connect(socket: &str, queues: i32, read_only: bool) -> Result<Client, String> {
    fn err(what: &'static str) -> impl Fn(blkio::Error) -> String {
        move |e| format!("{} {what}: {e}", e.errno().raw_os_error())
    }
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(err("new"))?;
    b.set_str("path", socket).map_err(err("path"))?;
    if read_only {
        b.set_bool("read-only", true).map_err(err("read-only"))?;
    }
    b.connect().map_err(err("connect"))?;
    b.set_i32("num-queues", queues).map_err(err("num-queues"))?;
    let started = b.start().map_err(err("start"))?;
    let align = b.get_u64("mem-region-alignment").map_err(err("mem-region-alignment"))? as usize;
    let len = (8usize << 20).div_ceil(align) * align;
    let region = b.alloc_mem_region(len).map_err(err("alloc_mem_region"))?;
    b.map_mem_region(&region).map_err(err("map_mem_region"))?;
    Ok(Client { _blkio: b, queues: started.queues, region })
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some((socket, rest)) = argv.split_first() else {
        eprintln!("usage: vhost_blk_client SOCKET [--queues N] [--read-only] OP...");
        return ExitCode::from(2);
    };
    let mut args = rest.iter();
    let (mut queues, mut read_only) = (1, false);
    let mut ops = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--queues" => queues = args.next().and_then(|n| n.parse().ok()).unwrap_or(1),
            "--read-only" => read_only = true,
            _ => ops.push(a.clone()),
        }
    }
    let mut client = match connect(socket, queues, read_only) {
        Ok(c) => c,
        Err(e) => {
            println!("error {e}");
            return ExitCode::from(1);
        }
    };
    let mut ops = ops.iter();
    while let Some(op) = ops.next() {
        let line = match op.as_str() {
            "info" => {
                let get = |n: &str| client._blkio.get_u64(n).map(|v| v.to_string()).unwrap_or_else(|e| format!("?{e}"));
                let geti = |n: &str| client._blkio.get_i32(n).map(|v| v.to_string()).unwrap_or_else(|e| format!("?{e}"));
                format!(
                    "ok capacity={} request-alignment={} max-segments={} num-queues={} read-only={}",
                    get("capacity"),
                    geti("request-alignment"),
                    geti("max-segments"),
                    geti("num-queues"),
                    client._blkio.get_bool("read-only").map(|v| v.to_string()).unwrap_or_default(),
                )
            }
            _ => match client.run(op, &mut ops) {
                Ok(s) if s.is_empty() => format!("ok {op}"),
                Ok(s) => format!("ok {op} {s}"),
                Err(e) => format!("error {e}"),
            },
        };
        println!("{line}");
    }
    ExitCode::SUCCESS
}
