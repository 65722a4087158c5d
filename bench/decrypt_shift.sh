#!/bin/bash
# Decryption with the header moving out (issue 28): `cryptsetup reencrypt --decrypt --header NEW
# --force-offline-reencrypt` against `cryptbridge luks reencrypt --decrypt --header NEW`, on fresh
# copies of one LUKS2 volume (1 GiB of data, 4096-byte sectors, random bytes as its ciphertext),
# the whole run timed (init, unlock, steps, finish), tools alternating in order, 3 repeats.
# Usage: bench/decrypt_shift.sh [WORKDIR]   (CRYPTBRIDGE_BIN: the binary; default target/release)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${CRYPTBRIDGE_BIN:-$repo/target/release/cryptbridge}
work=${1:-$repo/bench/out/work/decrypt-shift}
mkdir -p "$work" && cd "$work"
command -v cryptsetup >/dev/null || { echo "SKIPPED: cryptsetup not installed"; exit 0; }
[ -x "$bin" ] || { echo "no $bin: run cargo build --release --locked"; exit 1; }
printf 'bench passphrase' > key
if [ ! -f template.img ]; then
  head -c $(( (1024 + 16) << 20 )) /dev/urandom > template.img
  cryptsetup luksFormat --type luks2 -q --key-file key --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --sector-size 4096 template.img
fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in 1 2 3; do
  if [ $((r % 2)) -eq 1 ]; then order="cryptsetup cryptbridge"; else order="cryptbridge cryptsetup"; fi
  for tool in $order; do
    rm -f v.img v.hdr; cp template.img v.img; sync v.img
    t0=$(date +%s.%N)
    if [ "$tool" = cryptsetup ]; then
      cryptsetup reencrypt --decrypt --header v.hdr --force-offline-reencrypt -q --key-file key v.img
    else
      "$bin" luks reencrypt --decrypt --header v.hdr --key-file key v.img 2>/dev/null
    fi
    t1=$(date +%s.%N)
    python3 -c "import sys; t=float(sys.argv[2])-float(sys.argv[1]); print(f'repeat $r $tool {(1<<30)/t/1e6:.0f} MB/s ({t:.2f} s)')" "$t0" "$t1"
  done
done
rm -f v.img v.hdr
