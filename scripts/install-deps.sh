#!/usr/bin/env bash
# Install what the integration tests need (Debian 12), and the aarch64 cross tool chain that
# `make test-aarch64` uses (x86-64 hosts: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user and
# rustup's aarch64-unknown-linux-gnu target). Idempotent: when every command and Python module is
# already present it touches neither apt, pip nor rustup and returns in well under a second.
#
#   scripts/install-deps.sh            # install what is missing
#   scripts/install-deps.sh --check    # only report what is missing (exit 1 if anything is)
#   scripts/install-deps.sh --run      # only what `make run` and the commands it prints use
set -euo pipefail
cd "$(dirname "$0")/.."

check_only=0
run_only=0
case "${1:-}" in
    --check) check_only=1 ;;
    --run) run_only=1 ;;
    "") ;;
    *) echo "usage: scripts/install-deps.sh [--check|--run]" >&2; exit 2 ;;
esac

export DEBIAN_FRONTEND=noninteractive

# command -> Debian package that provides it
declare -A CMD_PKG=(
    [nbdinfo]=libnbd-bin
    [nbdcopy]=libnbd-bin
    [nbdfuse]=libnbd-bin      # bookworm ships nbdfuse inside libnbd-bin
    [nbdsh]=python3-libnbd
    [qemu-img]=qemu-utils
    [qemu-io]=qemu-utils
    [fio]=fio
    [nbdkit]=nbdkit           # includes the file/memory plugins and the luks filter (>= 1.32)
    [mkfs.ext4]=e2fsprogs
    [fsck.ext4]=e2fsprogs
    [losetup]=mount
    [mount]=mount
    [fusermount3]=fuse3
    [sha256sum]=coreutils
    [openssl]=openssl         # test_tls.py makes its certificates with it
)
# optional: only used to compare with real dm-crypt where device-mapper works
declare -A OPT_CMD_PKG=(
    [cryptsetup]=cryptsetup-bin
    [mkfs.xfs]=xfsprogs       # test_luks.py: luks format names an XFS signature it would overwrite
    [mkfs.btrfs]=btrfs-progs  # ... and a btrfs one
    [qemu-system-x86_64]=qemu-system-x86  # test_vhost_user.py: its firmware boots from the vhost-user-blk device
)

# `make run` and the commands its banner prints (nbdinfo, nbdcopy, nbdfuse, losetup, mkfs.ext4,
# mount, fusermount3, cryptsetup): the rest is for the tests.
if ((run_only)); then
    for cmd in "${!CMD_PKG[@]}"; do
        case "$cmd" in
            nbdinfo | nbdcopy | nbdfuse | mkfs.ext4 | losetup | mount | fusermount3) ;;
            *) unset "CMD_PKG[$cmd]" ;;
        esac
    done
    unset "OPT_CMD_PKG[qemu-system-x86_64]"
fi

have_cmd() {
    command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]] || [[ -x "/sbin/$1" ]]
}

missing_pkgs=()
add_pkg() {
    local p
    for p in "${missing_pkgs[@]}"; do [[ "$p" == "$1" ]] && return 0; done
    missing_pkgs+=("$1")
}

for cmd in "${!CMD_PKG[@]}"; do
    have_cmd "$cmd" || add_pkg "${CMD_PKG[$cmd]}"
done

# nbdkit plugins/filters the tests may use
if ((!run_only)) && have_cmd nbdkit; then
    plugdir="$(nbdkit --dump-config 2>/dev/null | sed -n 's/^plugindir=//p')"
    filtdir="$(nbdkit --dump-config 2>/dev/null | sed -n 's/^filterdir=//p')"
    [[ -n "$plugdir" && -e "$plugdir/nbdkit-file-plugin.so" ]] || add_pkg nbdkit
    [[ -n "$filtdir" && -e "$filtdir/nbdkit-luks-filter.so" ]] || add_pkg nbdkit
fi

# aarch64 cross tool chain for `make test-aarch64` (cross build + tests under qemu-aarch64), x86-64
# hosts only. libc6-dev-arm64-cross is only a Recommends of the compiler, and apt runs here with
# --no-install-recommends, so it is checked by a file of its own.
AARCH64_TARGET=aarch64-unknown-linux-gnu
host_arch="$(uname -m)"
if [[ "$host_arch" == x86_64 ]] && ((!run_only)); then
    have_cmd aarch64-linux-gnu-gcc || add_pkg gcc-aarch64-linux-gnu
    [[ -e /usr/aarch64-linux-gnu/lib/crt1.o ]] || add_pkg libc6-dev-arm64-cross
    have_cmd qemu-aarch64 || add_pkg qemu-user
fi

opt_missing=()
for cmd in "${!OPT_CMD_PKG[@]}"; do
    have_cmd "$cmd" || opt_missing+=("${OPT_CMD_PKG[$cmd]}")
done

if ((${#missing_pkgs[@]} + ${#opt_missing[@]})); then
    if ((check_only)); then
        ((${#missing_pkgs[@]})) && echo "missing packages: ${missing_pkgs[*]}"
        ((${#opt_missing[@]})) && echo "missing optional packages: ${opt_missing[*]}"
    else
        SUDO=()
        if [[ $(id -u) -ne 0 ]]; then
            command -v sudo >/dev/null 2>&1 && SUDO=(sudo -E) || {
                echo "install-deps: not root and no sudo; install: ${missing_pkgs[*]}" >&2
                exit 1
            }
        fi
        apt_opts=(-o DPkg::Lock::Timeout=600 -y -q --no-install-recommends)
        echo "install-deps: apt-get install ${missing_pkgs[*]} ${opt_missing[*]}" >&2
        "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
        if ((${#missing_pkgs[@]})); then
            "${SUDO[@]}" apt-get "${apt_opts[@]}" install "${missing_pkgs[@]}"
        fi
        # optional packages one by one: a missing one must not fail the script
        for p in "${opt_missing[@]}"; do
            if apt-cache show "$p" >/dev/null 2>&1; then
                "${SUDO[@]}" apt-get "${apt_opts[@]}" install "$p" ||
                    echo "install-deps: optional package $p failed to install (ignored)" >&2
            else
                echo "install-deps: optional package $p not available (ignored)" >&2
            fi
        done
    fi
fi

# The Rust standard library for aarch64 (rustup only; without rustup `make test-aarch64` reports
# itself SKIPPED, and so does this script).
rust_target_missing=0
have_rust_target() {
    local libdir
    libdir="$(rustc --print target-libdir --target "$1" 2>/dev/null)" || return 1
    compgen -G "$libdir/libstd-*.rlib" >/dev/null
}
if ((run_only)); then
    exit 0
fi
if [[ "$host_arch" == x86_64 ]] && ! have_rust_target "$AARCH64_TARGET"; then
    if ! command -v rustup >/dev/null 2>&1; then
        echo "install-deps: aarch64 Rust target: SKIPPED (rustup not found; install $AARCH64_TARGET's" \
            "standard library some other way, or make test-aarch64 is skipped)" >&2
    elif ! rustup target list --installed 2>/dev/null | grep -qx "$AARCH64_TARGET"; then
        if ((check_only)); then
            rust_target_missing=1
            echo "missing rustup target: $AARCH64_TARGET"
        else
            echo "install-deps: rustup target add $AARCH64_TARGET" >&2
            rustup target add "$AARCH64_TARGET"
        fi
    fi
fi

# fio must have the NBD engine (Debian's fio links libnbd)
if have_cmd fio && ! fio --enghelp 2>/dev/null | grep -qw nbd; then
    echo "install-deps: warning: this fio has no nbd ioengine; fio tests will be skipped" >&2
fi

# Python modules (imported name -> tests/requirements.txt)
py_missing=0
python3 - <<'EOF' >/dev/null 2>&1 || py_missing=1
import cryptography.hazmat.primitives.ciphers  # noqa: F401
import pytest  # noqa: F401
import hypothesis  # noqa: F401
EOF
if ((py_missing)); then
    if ((check_only)); then
        echo "missing python modules (tests/requirements.txt)"
    else
        echo "install-deps: pip install -r tests/requirements.txt" >&2
        python3 -m pip install -q -r tests/requirements.txt 2>/dev/null ||
            python3 -m pip install -q --break-system-packages -r tests/requirements.txt
    fi
fi

if ((check_only)); then
    ((${#missing_pkgs[@]} == 0 && py_missing == 0 && rust_target_missing == 0)) || exit 1
fi
exit 0
