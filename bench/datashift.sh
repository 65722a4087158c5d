#!/bin/bash
# Reencryption with the data moving (issue 28), cryptsetup against cryptbridge on fresh copies of
# one image, the whole run timed (init, unlock, steps, finish), tools alternating in order, 3 repeats:
#   encrypt: an unencrypted image of 1 GiB + 32 MiB made a LUKS2 volume in place
#            (`reencrypt --encrypt --reduce-device-size 32M`, resilience datashift);
#   decrypt: a LUKS2 volume (1 GiB of data, 4096-byte sectors, random bytes as its ciphertext)
#            decrypted with its header moving out (`reencrypt --decrypt --header NEW`,
#            resilience datashift-checksum).
# Usage: bench/datashift.sh [encrypt|decrypt|both] [WORKDIR]   (CRYPTBRIDGE_BIN: the binary)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${CRYPTBRIDGE_BIN:-$repo/target/release/cryptbridge}
modes=${1:-both}
work=${2:-$repo/bench/out/work/datashift}
mkdir -p "$work" && cd "$work"
command -v cryptsetup >/dev/null || { echo "SKIPPED: cryptsetup not installed"; exit 0; }
[ -x "$bin" ] || { echo "no $bin: run cargo build --release --locked"; exit 1; }
[ "$modes" = both ] && modes="encrypt decrypt"
printf 'bench passphrase' > key
kdf=(--pbkdf pbkdf2 --pbkdf-force-iterations 1000)
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), load: $(cut -d' ' -f1-3 /proc/loadavg)"
for mode in $modes; do
  if [ "$mode" = encrypt ] && [ ! -f plain.img ]; then
    head -c $(( (1024 + 32) << 20 )) /dev/urandom > plain.img
  fi
  if [ "$mode" = decrypt ] && [ ! -f luks.img ]; then
    head -c $(( (1024 + 16) << 20 )) /dev/urandom > luks.img
    cryptsetup luksFormat --type luks2 -q --key-file key "${kdf[@]}" --sector-size 4096 luks.img
  fi
  for r in 1 2 3; do
    if [ $((r % 2)) -eq 1 ]; then order="cryptsetup cryptbridge"; else order="cryptbridge cryptsetup"; fi
    for tool in $order; do
      rm -f v.img v.hdr
      if [ "$mode" = encrypt ]; then cp plain.img v.img; else cp luks.img v.img; fi
      sync v.img
      t0=$(date +%s.%N)
      case "$mode/$tool" in
        encrypt/cryptsetup) cryptsetup reencrypt --encrypt --type luks2 --reduce-device-size 32M --force-offline-reencrypt -q --key-file key "${kdf[@]}" v.img ;;
        encrypt/cryptbridge) "$bin" luks reencrypt --encrypt --reduce-device-size 32M --batch-mode --key-file key "${kdf[@]}" v.img 2>/dev/null ;;
        decrypt/cryptsetup) cryptsetup reencrypt --decrypt --header v.hdr --force-offline-reencrypt -q --key-file key v.img ;;
        decrypt/cryptbridge) "$bin" luks reencrypt --decrypt --header v.hdr --key-file key v.img 2>/dev/null ;;
      esac
      t1=$(date +%s.%N)
      python3 -c "import sys; t=float(sys.argv[2])-float(sys.argv[1]); print(f'$mode repeat $r $tool {(1<<30)/t/1e6:.0f} MB/s ({t:.2f} s)')" "$t0" "$t1"
    done
  done
done
rm -f v.img v.hdr
