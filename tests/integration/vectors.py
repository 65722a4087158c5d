"""Loaders for the public XTS vectors in the repository's tests/vectors (see its README.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple


class XtsVector(NamedTuple):
    name: str
    key: bytes
    tweak: bytes  # as given (may be shorter than 16 bytes: zero-pad on the right)
    pt: bytes
    ct: bytes


def botan_xts(path: Path) -> list[XtsVector]:
    """AES sections of botan's xts.vec ([AES-128/XTS], [AES-256/XTS])."""
    out: list[XtsVector] = []
    section = None
    cur: dict[str, str] = {}
    comment = ""
    n = 0

    def flush():
        nonlocal cur, n
        if cur and section and section.startswith("AES-"):
            n += 1
            out.append(
                XtsVector(
                    f"botan {section} #{n} {comment}".strip(),
                    bytes.fromhex(cur["Key"]),
                    bytes.fromhex(cur["Nonce"]),
                    bytes.fromhex(cur["In"]),
                    bytes.fromhex(cur["Out"]),
                )
            )
        cur = {}

    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            flush()
            section = line[1:-1]
            continue
        if not line:
            flush()
            continue
        if line.startswith("#"):
            comment = line.lstrip("# ")
            continue
        k, _, v = line.partition("=")
        cur[k.strip()] = v.strip()
    flush()
    return out


def wycheproof_xts(path: Path) -> list[XtsVector]:
    d = json.loads(path.read_text())
    out = []
    for g in d["testGroups"]:
        for t in g["tests"]:
            if t["result"] != "valid":
                continue
            out.append(
                XtsVector(
                    f"wycheproof tc{t['tcId']} ({g['keySize']}-bit key, {t['comment']})",
                    bytes.fromhex(t["key"]),
                    bytes.fromhex(t["iv"]),
                    bytes.fromhex(t["msg"]),
                    bytes.fromhex(t["ct"]),
                )
            )
    return out


def all_xts(vectors_dir: Path) -> list[XtsVector]:
    d = vectors_dir / "xts"
    return botan_xts(d / "botan_xts.vec") + wycheproof_xts(d / "wycheproof_aes_xts_test.json")
