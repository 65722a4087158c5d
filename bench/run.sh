#!/usr/bin/env bash
# cryptbridge benchmarks (benchmarks, not tests): cipher engine vs OpenSSL, then the NBD bridge
# vs nbdkit / qemu-nbd with fio. Installs what is missing, builds the release binary, runs both.
#
#   bench/run.sh                 full run (~15-20 min)
#   bench/run.sh --quick         smoke run (~3 min)
#   bench/run.sh --runtime 10 --repeats 5 --regimes cpu ...   (other options go to bench/bridge.py)
#
# Environment: PYTHON=/path/to/python (default: .venv/bin/python if present, else python3),
#              BENCH_SKIP_INSTALL=1 (never touch apt/pip), BENCH_SKIP_BUILD=1 (no cargo build).
# Results: bench/out/engine.json, bench/out/bridge.{json,md}, docs/bench/bench-bridge.png
#          (bench/out/bench-bridge.png for --quick), server logs in bench/out/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

QUICK=()
BRIDGE_ARGS=()
for a in "$@"; do
    case "$a" in
        --quick) QUICK=(--quick); BRIDGE_ARGS+=("$a") ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) BRIDGE_ARGS+=("$a") ;;
    esac
done

SUDO=()
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=(sudo); fi

# ---- system packages (only what is missing) ----
need_pkgs=()
command -v fio      >/dev/null 2>&1 || need_pkgs+=(fio)
command -v nbdinfo  >/dev/null 2>&1 || need_pkgs+=(libnbd-bin)
command -v nbdkit   >/dev/null 2>&1 || need_pkgs+=(nbdkit)
command -v qemu-nbd >/dev/null 2>&1 || need_pkgs+=(qemu-utils)
command -v qemu-img >/dev/null 2>&1 || need_pkgs+=(qemu-utils)
command -v openssl  >/dev/null 2>&1 || need_pkgs+=(openssl)
command -v fincore  >/dev/null 2>&1 || need_pkgs+=(util-linux)
if command -v nbdkit >/dev/null 2>&1 && \
   ! timeout 30 nbdkit --filter=luks null --dump-plugin >/dev/null 2>&1; then
    # Debian ships the luks filter in nbdkit itself; newer releases may split filters out.
    need_pkgs+=(nbdkit)
fi
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    if [ -n "${BENCH_SKIP_INSTALL:-}" ]; then
        echo "bench: missing packages: ${need_pkgs[*]} (BENCH_SKIP_INSTALL set)" >&2
        exit 1
    fi
    # dedupe
    mapfile -t need_pkgs < <(printf '%s\n' "${need_pkgs[@]}" | sort -u)
    echo "bench: installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # apt may be locked by another installer for a while: wait for the lock instead of failing.
    timeout 900 "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
    timeout 1800 "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${need_pkgs[@]}"
fi

# ---- python + matplotlib ----
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=$(command -v python3)
fi
# Resolve shims (pyenv) to the real interpreter so signals reach the benchmark itself.
PY=$("$PY" -c 'import sys; print(sys.executable)')
if ! "$PY" -c 'import matplotlib' >/dev/null 2>&1; then
    if [ -n "${BENCH_SKIP_INSTALL:-}" ]; then
        echo "bench: warning: matplotlib missing, no chart will be drawn" >&2
    else
        echo "bench: installing matplotlib for $PY"
        timeout 600 "$PY" -m pip install --quiet matplotlib \
        || timeout 600 "$PY" -m pip install --quiet --break-system-packages matplotlib \
        || { [ "$PY" = /usr/bin/python3 ] && timeout 900 "${SUDO[@]}" apt-get install -y -qq python3-matplotlib; } \
        || echo "bench: warning: could not install matplotlib, no chart will be drawn" >&2
    fi
fi

# ---- build ----
if [ -z "${BENCH_SKIP_BUILD:-}" ]; then
    cargo build --release
fi
BIN=$ROOT/target/release/cryptbridge
if [ ! -x "$BIN" ]; then
    echo "bench: $BIN not found after cargo build --release" >&2
    exit 1
fi

mkdir -p bench/out
status=0
echo
echo "=== (a) cipher engine: bench/engine.py ${QUICK[*]}"
"$PY" bench/engine.py --binary "$BIN" "${QUICK[@]}" || status=$?
echo
echo "=== (b) NBD bridge: bench/bridge.py ${BRIDGE_ARGS[*]}"
"$PY" bench/bridge.py --binary "$BIN" "${BRIDGE_ARGS[@]}" || status=$?
echo
echo "=== (c) wide-block TES table: bench/tes.py ${QUICK[*]}"
"$PY" bench/tes.py --binary "$BIN" "${QUICK[@]}" || status=$?
echo
echo "=== (d) file encryption: bench/file.py ${QUICK[*]}"
"$PY" bench/file.py --binary "$BIN" "${QUICK[@]}" || status=$?

chart=docs/bench/bench-bridge.png
if [ "${#QUICK[@]}" -gt 0 ]; then chart=bench/out/bench-bridge.png; fi
prev=
for a in "${BRIDGE_ARGS[@]}"; do
    case "$a" in --chart=*) chart=${a#--chart=} ;; esac
    if [ "$prev" = --chart ]; then chart=$a; fi
    prev=$a
done
echo
echo "=== results"
echo "  engine:  bench/out/engine.json"
echo "  bridge:  bench/out/bridge.json, bench/out/bridge.md (tables for a docs/bench/ page), $chart"
echo "  file:    bench/out/file.json, bench/out/file.md, docs/bench/bench-file{,-speedup,-sweep}.png (bench/out/ with --quick)"
echo "  logs:    bench/out/logs/ (servers), bench/out/fio/ (per-job fio JSON)"
exit "$status"
