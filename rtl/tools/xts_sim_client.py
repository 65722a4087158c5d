#!/usr/bin/env python3
"""Minimal client of the xts_sim co-process framing (docs/rtl.md, "Co-process protocol").

As a library: XtsSim(path).set_keys(key64); .encrypt(data, sector_size, first_tweak, step) ...
As a tool:    xts_sim_client.py [--mib N] [--sector-size 4096]  -> encrypts N MiB of random
              sectors and prints simulated cycles, cycles/s and MB/s of the simulation.
"""
import argparse
import os
import struct
import subprocess
import time

MAGIC = 0x31535458
OP_PING, OP_SET_KEYS, OP_ENCRYPT, OP_DECRYPT, OP_BYPASS, OP_STATS, OP_CLEAR_KEYS, OP_QUIT = range(8)
HDR = struct.Struct("<IBBHIIQQQ")      # 40 bytes

DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "xts_sim")


class XtsSimError(Exception):
    pass


class XtsSim:
    def __init__(self, exe=DEFAULT):
        self.p = subprocess.Popen([exe, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.last = None        # (cycles, total_cycles, wall_ns) of the last reply

    def call(self, op, payload=b"", sector_size=0, first_tweak=0, step=0, tweak_hi=0):
        self.p.stdin.write(HDR.pack(MAGIC, op, 0, 0, sector_size, len(payload), first_tweak, step, tweak_hi))
        self.p.stdin.write(payload)
        self.p.stdin.flush()
        h = self.p.stdout.read(HDR.size)
        if len(h) != HDR.size:
            raise XtsSimError("co-process closed the pipe")
        magic, rop, status, _, ss, n, cycles, total, wall = HDR.unpack(h)
        body = self.p.stdout.read(n)
        if magic != MAGIC or rop != op or len(body) != n:
            raise XtsSimError("bad reply framing")
        self.last = (cycles, total, wall)
        if status:
            raise XtsSimError(body.decode(errors="replace"))
        return body

    def set_keys(self, key64):
        return self.call(OP_SET_KEYS, key64)

    def encrypt(self, data, sector_size, first_tweak, step=1):
        return self.call(OP_ENCRYPT, data, sector_size, first_tweak, step)

    def decrypt(self, data, sector_size, first_tweak, step=1):
        return self.call(OP_DECRYPT, data, sector_size, first_tweak, step)

    def bypass(self, data, sector_size):
        return self.call(OP_BYPASS, data, sector_size)

    def stats(self):
        regs = struct.unpack("<10I", self.call(OP_STATS))
        names = ["id", "ctrl", "cmd", "status", "sectors", "blocks", "stall_in", "stall_out", "len_errs", "config"]
        return dict(zip(names, regs))

    def close(self):
        try:
            self.call(OP_QUIT)
        except XtsSimError:
            pass
        self.p.stdin.close()
        self.p.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", default=DEFAULT)
    ap.add_argument("--mib", type=float, default=4)
    ap.add_argument("--sector-size", type=int, default=4096)
    a = ap.parse_args()
    s = XtsSim(a.exe)
    s.set_keys(os.urandom(64))
    n = int(a.mib * (1 << 20)) // a.sector_size * a.sector_size
    data = os.urandom(n)
    t = time.time()
    s.encrypt(data, a.sector_size, 0, a.sector_size // 512)
    dt = time.time() - t
    cycles, _, wall_ns = s.last
    st = s.stats()
    s.close()
    print(f"{n} bytes, {n // a.sector_size} sectors of {a.sector_size}: {cycles} simulated cycles "
          f"({n / 16 / cycles:.4f} blocks/cycle)")
    print(f"simulation: {cycles / (wall_ns / 1e9):.0f} cycles/s, {n / (wall_ns / 1e9) / 1e6:.2f} MB/s "
          f"(round trip incl. pipes {n / dt / 1e6:.2f} MB/s)")
    print(f"core counters: sectors {st['sectors']}, blocks {st['blocks']}, stall_in {st['stall_in']}, "
          f"stall_out {st['stall_out']}")


if __name__ == "__main__":
    main()
