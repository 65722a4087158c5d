#!/usr/bin/env bash
# Installs the RTL tool chain from Debian's packages when missing: verilator (5.006 in Debian 12),
# iverilog (11), yosys (0.23), a C++ compiler and make. Needs root (or sudo) and apt.
set -euo pipefail
need=()
command -v verilator >/dev/null || need+=(verilator)
command -v iverilog  >/dev/null || need+=(iverilog)
command -v vvp       >/dev/null || need+=(iverilog)
command -v g++       >/dev/null || need+=(g++)
command -v make      >/dev/null || need+=(make)
command -v python3   >/dev/null || need+=(python3)
if [ "${1:-}" = "--with-yosys" ]; then
    command -v yosys >/dev/null || need+=(yosys)
fi
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "rtl/install-deps.sh: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${need[@]}"
