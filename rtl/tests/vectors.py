"""Readers for the public test vectors kept in the repository (tests/vectors, see its README).

Only public vectors are read here; nothing is derived from the RTL. Byte strings are returned as
bytes; writers turn them into $readmemh words with byte 0 in the least significant bits, which is
the byte-lane convention of the RTL.
"""
import json
import os

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def vectors_dir():
    d = os.environ.get("CRYPTBRIDGE_VECTORS", os.path.join(REPO, "tests", "vectors"))
    d = os.path.abspath(d)
    if not os.path.isdir(os.path.join(d, "aes")) or not os.path.isdir(os.path.join(d, "xts")):
        raise SystemExit(f"test vectors not found in {d} (expected the repository's tests/vectors)")
    return d


def _rsp(path):
    """NIST CAVP .rsp: yields (direction, dict) per record."""
    sect = None
    cur = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("["):
                sect = line.strip("[]")
                continue
            if not line or line.startswith("#"):
                if cur:
                    yield sect, cur
                    cur = {}
                continue
            k, v = [x.strip() for x in line.split("=", 1)]
            cur[k] = v
    if cur:
        yield sect, cur


def aes256_ecb():
    """AES-256 single-block vectors: list of (name, decrypt, key, input, expected)."""
    d = vectors_dir()
    out = []
    kat = os.path.join(d, "aes", "nist_cavp_kat")
    for fn in sorted(os.listdir(kat)):
        if not (fn.startswith("ECB") and fn.endswith("256.rsp")):
            continue
        for sect, r in _rsp(os.path.join(kat, fn)):
            key = bytes.fromhex(r["KEY"])
            pt = bytes.fromhex(r["PLAINTEXT"])
            ct = bytes.fromhex(r["CIPHERTEXT"])
            name = f"{fn}:{sect}:{r['COUNT']}"
            if sect == "ENCRYPT":
                out.append((name, 0, key, pt, ct))
            elif sect == "DECRYPT":
                out.append((name, 1, key, ct, pt))
            else:
                raise ValueError(f"{fn}: unknown section {sect}")
    with open(os.path.join(d, "aes", "sp800_38a_ecb_cbc_ctr.json")) as f:
        j = json.load(f)
    for n, v in enumerate(j["vectors"]):
        if v["mode"] != "ECB" or v["key_bits"] != 256:
            continue
        key = bytes.fromhex(v["key"])
        pt = bytes.fromhex(v["plaintext"])
        ct = bytes.fromhex(v["ciphertext"])
        dec = 1 if v["direction"] == "decryption" else 0
        for b in range(0, len(pt), 16):
            src, dst = (ct, pt) if dec else (pt, ct)
            out.append((f"sp800-38a:{n}:{b // 16}", dec, key, src[b:b + 16], dst[b:b + 16]))
    return out


def xts256():
    """XTS-AES-256 vectors usable by a sector core (length a multiple of 16 bytes).

    Returns (list of (name, key64, tweak16, pt, ct), number skipped because they need ciphertext
    stealing, which a sector-granular core does not implement)."""
    d = vectors_dir()
    out = []
    skipped = 0
    sect = None
    cur = {}
    with open(os.path.join(d, "xts", "botan_xts.vec")) as f:
        for line in f:
            line = line.strip()
            if line.startswith("["):
                sect = line
                continue
            if line.startswith("#") and "VECTOR" in line:
                cur["name"] = line.lstrip("# ").strip()
                continue
            if not line or line.startswith("#"):
                continue
            k, v = [x.strip() for x in line.split("=", 1)]
            cur[k] = v
            if k == "Out":
                if sect == "[AES-256/XTS]":
                    key = bytes.fromhex(cur["Key"])
                    tw = bytes.fromhex(cur["Nonce"]).ljust(16, b"\0")
                    pt = bytes.fromhex(cur["In"])
                    ct = bytes.fromhex(cur["Out"])
                    assert len(key) == 64
                    if len(pt) % 16:
                        skipped += 1
                    else:
                        out.append((f"botan:{cur.get('name', 'len' + str(len(pt)))}", key, tw, pt, ct))
                cur = {}
    with open(os.path.join(d, "xts", "wycheproof_aes_xts_test.json")) as f:
        j = json.load(f)
    for g in j["testGroups"]:
        if g["keySize"] != 512:
            continue
        for t in g["tests"]:
            if t["result"] != "valid":
                continue
            pt = bytes.fromhex(t["msg"])
            if len(pt) % 16:
                skipped += 1
                continue
            out.append((f"wycheproof:{t['tcId']}", bytes.fromhex(t["key"]),
                        bytes.fromhex(t["iv"]).ljust(16, b"\0"), pt, bytes.fromhex(t["ct"])))
    return out, skipped


def le_hex(b):
    """bytes -> hex of the little-endian integer (byte 0 least significant), for $readmemh."""
    return b[::-1].hex()
