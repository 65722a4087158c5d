"""Every shell example in the user documentation runs as printed, in order, from an empty directory.

For each document below, the fenced shell blocks (```sh, ```bash, ```shell, ```console) are run
one after the other in a fresh temporary directory, with `target/release/cryptbridge` first on
PATH (as `export PATH=$PWD/target/release:$PATH` puts it). Nothing in a block is rewritten.
Each block runs as a script of its own under `bash -euo pipefail`, so a failing line fails the
block; the failure message carries the block's text, where it starts in the document, and its
output. Later blocks still run, so the count of failed examples is complete.

A block may be preceded (on the line just before its fence) by one marker:

    <!-- doc-test: background -->
        A "second terminal" block: it starts servers that run until Ctrl-C. It is started in the
        background in a process group of its own; the walker waits until every `cryptbridge
        serve` in it has printed its `ready URI` line on stdout, then goes on with the next block.
        Background blocks are stopped (SIGTERM to the group, as Ctrl-C: answered writes are
        synced) when the document ends, or at a `stop-background` block. A background block
        that exits before it is stopped is a failure.
    <!-- doc-test: stop-background -->
        "Stop the server(s) with Ctrl-C first": every running background block is stopped before
        this block runs.
    <!-- doc-test: root -->
        Needs root and kernel features (loop devices, /dev/fuse, mount). Runs when this process
        is root and they work; otherwise skipped with the reason.
    <!-- doc-test: skip REASON -->
        Cannot run here (device-mapper, systemd, another host, the repository checkout, ...).
        Never run; the reason is printed.

Skipped blocks are reported (in the terminal summary, and as the skip reason of a document whose
blocks were all skipped); they never count as passes. Fixed TCP ports in the examples
(`127.0.0.1:10809`, ...) are checked first: a document whose port is taken is skipped with the
reason, not run against someone else's server. The summary at the end gives, per document and in
total, the blocks run, skipped (with reasons) and failed; the target is 0 failed.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from conftest import BIN, REPO, require_binary

DOCS = ["README.md", "docs/cli.md", "docs/network.md", "docs/luks.md", "docs/tes.md"]
# `make run`'s banner (RUN_BANNER in the Makefile): `make run` itself is started (with its data in
# the temporary directory, the binary as built), and the commands its banner prints are run.
BANNER = "Makefile:RUN_BANNER"

SHELL_LANGS = {"sh", "bash", "shell", "console"}
MARKER_RE = re.compile(r"^\s*<!--\s*doc-test:\s*(\S+)\s*(.*?)\s*-->\s*$")
FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
KINDS = {"background", "stop-background", "root", "skip"}

BLOCK_TIMEOUT = 180.0  # one foreground block
READY_TIMEOUT = 60.0  # a background block's servers (a LUKS unlock benchmarks Argon2 for seconds)
STOP_TIMEOUT = 20.0
OUTPUT_TAIL = 6000


@dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    kind: Optional[str] = None  # None: run in the foreground
    reason: str = ""
    seconds: float = 0.0  # how long it ran (a background block: until ready)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def script(self) -> str:
        if self.lang != "console":
            return self.text
        # ```console: commands are the lines after a `$ ` prompt; the rest is sample output.
        cmds = [ln[2:] for ln in self.text.splitlines() if ln.startswith("$ ")]
        return "\n".join(cmds) + "\n" if cmds else self.text


def parse_blocks(doc: str, text: str) -> list[Block]:
    """The fenced shell blocks of `text`, with their markers. A marker must sit on the line just
    before a shell block's fence; a marker anywhere else, or an unknown one, is an error (so a
    marker cannot silently stop applying after an edit)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    pending: Optional[tuple[int, str, str]] = None
    while i < len(lines):
        line = lines[i]
        m = MARKER_RE.match(line)
        if m:
            kind, reason = m.group(1), m.group(2)
            if kind not in KINDS:
                raise ValueError(f"{doc}:{i + 1}: unknown doc-test marker {kind!r} (known: {sorted(KINDS)})")
            if kind == "skip" and not reason:
                raise ValueError(f"{doc}:{i + 1}: `doc-test: skip` needs a reason")
            if kind != "skip" and reason:
                raise ValueError(f"{doc}:{i + 1}: `doc-test: {kind}` takes no argument (got {reason!r})")
            pending = (i + 1, kind, reason)
            i += 1
            continue
        f = FENCE_RE.match(line)
        if f:
            indent, fence, lang = len(f.group(1)), f.group(2), f.group(3).lower()
            body = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence[0] * len(fence)):
                body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
                j += 1
            if j == len(lines):
                raise ValueError(f"{doc}:{i + 1}: unclosed code fence")
            if lang in SHELL_LANGS:
                b = Block(doc, i + 1, lang, "\n".join(body) + "\n")
                if pending is not None:
                    if pending[0] != i:
                        raise ValueError(f"{doc}:{pending[0]}: doc-test marker is not on the line just before a fence")
                    b.kind, b.reason = pending[1], pending[2]
                blocks.append(b)
            elif pending is not None:
                raise ValueError(f"{doc}:{pending[0]}: doc-test marker before a block that is not shell ({lang or 'no language'})")
            pending = None
            i = j + 1
            continue
        if pending is not None and line.strip():
            raise ValueError(f"{doc}:{pending[0]}: doc-test marker is not followed by a code fence")
        i += 1
    if pending is not None:
        raise ValueError(f"{doc}:{pending[0]}: doc-test marker at the end of the document")
    return blocks


# --- what the machine offers -------------------------------------------------------------------

def _have(tool: str) -> bool:
    return any(shutil.which(tool, path=p) for p in (os.environ.get("PATH", ""), "/usr/sbin:/sbin"))


_ROOT_REASON: Optional[list] = None


def root_skip_reason() -> Optional[str]:
    """None when root blocks can run here: root, /dev/fuse, a working loop device, the tools."""
    global _ROOT_REASON
    if _ROOT_REASON is not None:
        return _ROOT_REASON[0]
    reason = None
    if os.geteuid() != 0:
        reason = "needs root"
    elif not os.path.exists("/dev/fuse"):
        reason = "no /dev/fuse"
    else:
        for t in ("nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "mount", "umount"):
            if not _have(t):
                reason = f"{t} not installed"
                break
    if reason is None:
        with tempfile.NamedTemporaryFile(prefix="cb-loop-") as f:
            f.truncate(1 << 20)
            f.flush()
            p = subprocess.run(["losetup", "-f", "--show", f.name], capture_output=True, text=True, timeout=30)
            if p.returncode != 0:
                reason = f"loop devices do not work here: {p.stderr.strip()}"
            else:
                subprocess.run(["losetup", "-d", p.stdout.strip()], capture_output=True, timeout=30)
    _ROOT_REASON = [reason]
    return reason


PORT_RE = re.compile(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0):(\d{2,5})\b")


def fixed_ports(blocks: list[Block]) -> set[int]:
    """TCP ports the document's runnable examples use as printed; `serve` without --listen or
    --unix (and not under socket activation, `[ ... ]`) takes its default, 10809."""
    ports: set[int] = set()
    for b in blocks:
        if b.kind == "skip":
            continue
        ports |= {int(p) for p in PORT_RE.findall(b.text)}
        for cmd in re.findall(r"cryptbridge serve[^\n]*(?:\\\n[^\n]*)*", b.text):
            if "--listen" not in cmd and "--unix" not in cmd and "[ cryptbridge" not in b.text:
                ports.add(10809)
    return ports


def port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # SO_REUSEADDR as the server sets it (Rust's TcpListener): connections in TIME_WAIT from an
    # earlier run do not count, a listener (or a socket bound to the port) does.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


# --- running -----------------------------------------------------------------------------------

def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-OUTPUT_TAIL:].decode(errors="replace")


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. An exited one counts as gone although it is a
    zombie until reaped: a server whose block's shell died first is reaped by PID 1, which in
    some sandboxes takes a second or two."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command: state, ppid, pgrp.
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the block's process group (as Ctrl-C in its terminal), then SIGKILL."""
    _stop_groups([proc])


def _stop_groups(procs: list) -> None:
    """_stop_group for several blocks at once: SIGTERM to every group, then each is waited for
    (up to STOP_TIMEOUT from that SIGTERM, then SIGKILL), so that their shutdowns (a server's
    takes a second or two) overlap instead of adding up."""
    for proc in procs:
        _kill_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline and any(_group_alive(p.pid) for p in procs):
        for p in procs:
            p.poll()
        time.sleep(0.05)
    for proc in procs:
        if _group_alive(proc.pid):
            _kill_group(proc, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Running:
    block: Block
    proc: subprocess.Popen
    out: Path
    err: Path


@dataclass
class DocRun:
    doc: str
    workdir: Path
    env: dict
    ran: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # (block, reason)
    failed: list = field(default_factory=list)  # (block, message)
    background: list = field(default_factory=list)
    groups: list = field(default_factory=list)  # every foreground block's process, for cleanup
    n: int = 0

    def _script(self, b: Block) -> Path:
        self.n += 1
        # Outside the working directory, so the examples start from a really empty directory.
        p = self.workdir.parent / f"block{self.n:02d}.sh"
        p.write_text(b.script())
        return p

    def fail(self, b: Block, what: str, out: str) -> None:
        self.failed.append((b, f"{b.where} ({b.kind or 'foreground'} block) {what}\n"
                               f"--- block ---\n{b.text}--- output (stdout and stderr) ---\n{out}"))

    def run_foreground(self, b: Block) -> None:
        script = self._script(b)
        log = self.workdir.parent / f"block{self.n:02d}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=self.workdir, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.groups.append(proc)
        t0 = time.monotonic()
        try:
            rc = proc.wait(timeout=BLOCK_TIMEOUT)
            b.seconds = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            self.fail(b, f"did not finish within {BLOCK_TIMEOUT:.0f} s", _tail(log))
            return
        if rc != 0:
            self.fail(b, f"failed with exit status {rc}", _tail(log))
        else:
            self.ran.append(b)

    def start_background(self, b: Block) -> None:
        script = self._script(b)
        out = self.workdir.parent / f"block{self.n:02d}.stdout"
        err = self.workdir.parent / f"block{self.n:02d}.stderr"
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=self.workdir, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=o, stderr=e, start_new_session=True)
        r = Running(b, proc, out, err)
        t0 = time.monotonic()
        want = max(1, len(re.findall(r"\bcryptbridge serve\b", b.text)))
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            ready = [ln for ln in _tail(out).splitlines() if ln.startswith("ready ")]
            if len(ready) >= want:
                b.seconds = time.monotonic() - t0
                self.background.append(r)
                self.ran.append(b)
                return
            if proc.poll() is not None:
                _stop_group(proc)
                self.fail(b, f"exited with status {proc.returncode} before its {want} `ready` line(s)",
                          _tail(out) + _tail(err))
                return
            if time.monotonic() > deadline:
                _stop_group(proc)
                self.fail(b, f"printed {len(ready)} of {want} `ready` lines in {READY_TIMEOUT:.0f} s",
                          _tail(out) + _tail(err))
                return
            time.sleep(0.05)

    def make_run(self) -> list[Block]:
        """Starts `make run` in the background (data under the temporary directory; -o: the
        binary as built, not remade) and returns the blocks its banner prints."""
        data = self.workdir.parent / "data"
        b = Block(BANNER, 0, "sh", f"make -s -C {REPO} -o target/release/cryptbridge run DATA_DIR={data}\n",
                  kind="background")
        self.start_background(b)
        banner = _tail(self.workdir.parent / f"block{self.n:02d}.stdout")
        if self.failed:
            return []
        blocks = banner_blocks(banner)
        assert blocks and blocks[0].text.strip(), f"no commands found in make run's banner:\n{banner}"
        return blocks

    def stop_background(self) -> None:
        # Whether each exited early is read before any is stopped; then all are stopped at once.
        early_exits = [r.proc.poll() for r in self.background]
        _stop_groups([r.proc for r in self.background])
        for r, early in zip(self.background, early_exits):
            log = _tail(r.out) + _tail(r.err)
            if early is not None:
                self.fail(r.block, f"exited with status {early} while it should have been serving", log)
            elif "panicked" in log:
                self.fail(r.block, "panicked", log)
        self.background = []

    def cleanup(self) -> None:
        self.stop_background()
        for p in self.groups:
            if _group_alive(p.pid):
                _stop_group(p)


def banner_blocks(stdout: str) -> list[Block]:
    """The commands `make run` prints: the indented lines after "Use it from another terminal:"
    (one block) and after "As root" (a root block), up to the first line that is not indented."""
    blocks: list[Block] = []
    cur: Optional[Block] = None
    for n, line in enumerate(stdout.splitlines(), 1):
        if line.startswith("Use it from another terminal"):
            cur = Block(BANNER, n, "sh", "")
            blocks.append(cur)
        elif line.startswith("As root") and cur is not None:
            cur = Block(BANNER, n, "sh", "", kind="root")
            blocks.append(cur)
        elif line.startswith("  ") and cur is not None:
            cur.text += line[2:] + "\n"
        elif cur is not None:
            break
    return blocks


def _summary_line(r: DocRun) -> str:
    skipped = "; ".join(f"{b.where}: {reason}" for b, reason in r.skipped)
    return (f"{r.doc}: {len(r.ran)} block(s) ran, {len(r.skipped)} skipped"
            + (f" ({skipped})" if skipped else "") + f", {len(r.failed)} failed")


RESULTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or not RESULTS:
        return
    tr.write_line("")
    tr.write_sep("-", "doc examples")
    for line in RESULTS.values():
        tr.write_line(line if isinstance(line, str) else _summary_line(line))
    runs = [r for r in RESULTS.values() if isinstance(r, DocRun)]
    tr.write_line(f"doc examples: {sum(len(r.ran) for r in runs)} ran, "
                  f"{sum(len(r.skipped) for r in runs)} skipped, "
                  f"{sum(len(r.failed) for r in runs)} failed (target: 0 failed)")


def test_markers_parse():
    """Every document parses: markers known, each on the line just before a shell fence."""
    for doc in DOCS:
        blocks = parse_blocks(doc, (REPO / doc).read_text())
        assert any(b.kind != "skip" for b in blocks), f"{doc}: no runnable shell example at all"


@pytest.mark.parametrize("doc", DOCS + [BANNER])
def test_doc_examples(doc):
    require_binary()
    if doc == BANNER:
        # `make run` serves on 127.0.0.1:10809 (LISTEN); its banner is read once it is ready.
        blocks = [Block(BANNER, 0, "sh", "make run", kind="background")]
    else:
        blocks = parse_blocks(doc, (REPO / doc).read_text())
    busy = sorted(p for p in fixed_ports(blocks) | ({10809} if doc == BANNER else set()) if not port_free(p))
    if busy:
        RESULTS[doc] = f"{doc}: not run: port(s) {busy} on 127.0.0.1 in use (the examples use them as printed)"
        pytest.skip(f"{doc}: TCP port(s) {busy} in use; its examples listen on them as printed")

    top = Path(tempfile.mkdtemp(prefix="cb-doc-", dir="/tmp"))  # short: examples make Unix sockets
    workdir = top / "work"
    workdir.mkdir()
    env = dict(os.environ)
    env["PATH"] = f"{BIN.parent}:{env.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"
    env.pop("RUST_LOG", None)
    r = DocRun(doc, workdir, env)
    RESULTS[doc] = r
    t0 = time.monotonic()
    try:
        if doc == BANNER:
            blocks = r.make_run()
        root_reason = root_skip_reason() if any(b.kind == "root" for b in blocks) else None
        for b in blocks:
            if b.kind == "skip":
                r.skipped.append((b, b.reason))
                continue
            if b.kind == "root" and root_reason:
                r.skipped.append((b, f"root block: {root_reason}"))
                continue
            if b.kind == "stop-background":
                r.stop_background()
            if b.kind == "background":
                r.start_background(b)
            else:
                r.run_foreground(b)
    finally:
        r.cleanup()
    elapsed = time.monotonic() - t0
    print(_summary_line(r) + f" in {elapsed:.1f} s")
    for b in r.ran:
        print(f"  {b.where} {b.kind or 'foreground'}: {b.seconds:.1f} s")
    if r.failed:
        msgs = "\n\n".join(m for _, m in r.failed)
        pytest.fail(f"{len(r.failed)} example block(s) of {doc} failed (kept in {top}):\n\n{msgs}\n\n"
                    + _summary_line(r), pytrace=False)
    shutil.rmtree(top, ignore_errors=True)
    if not r.ran:
        pytest.skip(f"{doc}: every block skipped: " + "; ".join(f"{b.where}: {why}" for b, why in r.skipped))
