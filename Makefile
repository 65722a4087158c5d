# cryptbridge: the two set-up commands are `make run` and `make test`.

CARGO      ?= cargo
PYTHON     ?= python3
BIN        := target/release/cryptbridge
DATA_DIR   ?= data
IMAGE_SIZE ?= 1G
LISTEN     ?= 127.0.0.1:10809

URI := nbd://$(LISTEN)

# Other CPUs (make test-portable, make test-aarch64).
HOST_ARCH := $(shell uname -m)
# aarch64: Debian's cross gcc links, qemu-aarch64 (user emulation) runs the tests. Cargo's per-target
# variables, so they touch nothing but aarch64 builds; .cargo/config.toml stays free of them.
AARCH64 := aarch64-unknown-linux-gnu
AARCH64_SYSROOT ?= /usr/aarch64-linux-gnu
# The aarch64 build must be free of warnings (`make test-aarch64 AARCH64_WARNFLAGS=` lets them through).
AARCH64_WARNFLAGS ?= -D warnings
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER ?= aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER ?= qemu-aarch64 -L $(AARCH64_SYSROOT)
export CC_aarch64_unknown_linux_gnu ?= aarch64-linux-gnu-gcc
# The Rust tests (native and cross) are built with the ci-test profile (Cargo.toml: release
# optimisation without thin LTO and debug info); TEST_PROFILE=release builds them as shipped.
TEST_PROFILE ?= ci-test
# What test-aarch64 lacks on this x86-64 machine (empty when it can run); set AARCH64_REQUIRED=1 to make a
# skip an error.
AARCH64_MISSING = $(strip \
	$(if $(shell command -v aarch64-linux-gnu-gcc),,aarch64-linux-gnu-gcc;) \
	$(if $(wildcard $(AARCH64_SYSROOT)/lib/crt1.o),,$(AARCH64_SYSROOT)/lib/crt1.o (libc6-dev-arm64-cross);) \
	$(if $(shell command -v qemu-aarch64),,qemu-aarch64;) \
	$(if $(wildcard $(shell rustc --print target-libdir --target $(AARCH64) 2>/dev/null)/libstd-*.rlib),,the Rust target $(AARCH64) (rustup target add $(AARCH64));))
define RUN_BANNER

cryptbridge: serving $(DATA_DIR)/volume.img ($(IMAGE_SIZE), sparse; only ciphertext is stored)
  key:  $(DATA_DIR)/volume.key (AES-256-XTS, aes-xts-plain64, 4096-byte sectors)
  URI:  $(URI)

Use it from another terminal:
  nbdinfo $(URI)                                  # size, block sizes, flags
  truncate -s 64M disk.img                        # an image to write (any raw image up to $(IMAGE_SIZE))
  nbdcopy disk.img $(URI)                         # write it through the bridge (encrypted)
  nbdcopy $(URI) copy.img                         # read it back (decrypted)
As root, an ext4 file system on it, and the undo:
  mkdir -p /tmp/nbd && nbdfuse /tmp/nbd/disk $(URI) &   # expose the export as a file
  until [ -e /tmp/nbd/disk ]; do sleep 0.1; done  # wait for nbdfuse
  dev=$$(losetup -f --show /tmp/nbd/disk) && mkfs.ext4 $$dev && mount $$dev /mnt
  umount /mnt && losetup -d $$dev && fusermount3 -u /tmp/nbd   # undo the three lines above
Same bytes as: cryptsetup open --type plain --cipher aes-xts-plain64 --key-size 512 \
  --sector-size 4096 --key-file $(DATA_DIR)/volume.key $(DATA_DIR)/volume.img NAME
Stop with Ctrl-C (answered writes are synced first).

endef
export RUN_BANNER

.PHONY: all build build-native fuzz run test test-rust test-portable test-aarch64 test-integration test-rtl deps bench rtl-report clean

all: build

$(BIN): $(shell find crates -name '*.rs' -o -name Cargo.toml) Cargo.toml Cargo.lock .cargo/config.toml
	@command -v $(CARGO) >/dev/null || { echo "cargo (Rust >= 1.89) is required: https://rustup.rs" >&2; exit 1; }
	$(CARGO) build --release --locked

build: $(BIN)

# For this host's CPU only: the compiler may use every instruction the host has, so the binary
# can die with SIGILL on another CPU. The kernels are chosen at run time either way, so the
# default build is as fast; this exists for those who want it. Kept apart in target/native.
build-native:
	RUSTFLAGS="-C target-cpu=native" CARGO_TARGET_DIR=target/native $(CARGO) build --release --locked
	@echo "built target/native/release/cryptbridge (for this CPU only)"

deps:
	@t0=$$(date +%s); set -e; set -x; scripts/install-deps.sh; rtl/install-deps.sh; \
	{ set +x; } 2>/dev/null; echo "deps: ok ($$(( $$(date +%s) - t0 ))s)"

# Serve the embedded default: a sparse image and a generated key under $(DATA_DIR).
run: build
	@scripts/install-deps.sh --run
	@mkdir -p $(DATA_DIR)
	@test -f $(DATA_DIR)/volume.key || $(BIN) keygen --cipher aes-xts-plain64 --key-size 512 $(DATA_DIR)/volume.key
	@echo "$$RUN_BANNER"
	exec $(BIN) serve --backing $(DATA_DIR)/volume.img --size $(IMAGE_SIZE) --key-file $(DATA_DIR)/volume.key \
		--cipher aes-xts-plain64 --sector-size 4096 --listen $(LISTEN)

# The integration tests spend most of their time waiting (on timers, fsyncs, real clients and
# servers), which leaves much of the CPU idle; so by default (TEST_OVERLAP=1) the other steps,
# which are mostly compiling, run beside them at nice 19, so they take only the CPU that
# test-integration leaves. Their output goes to target/test-overlap.log and is printed after;
# test-integration's is printed as it comes (and its tail again at the end when it fails).
# TEST_OVERLAP=0 runs the steps one after the other.
TEST_OVERLAP ?= 1
OVERLAPPED := test-rust test-portable test-aarch64 test-rtl
test: deps build
ifeq ($(TEST_OVERLAP),1)
	@log=target/test-overlap.log; ilog=target/test-integration.log; mkdir -p target; rm -f $$log.rc $$ilog.rc; \
	echo "test: $(OVERLAPPED) run at nice 19 beside test-integration; their output, in $$log, follows it"; \
	( nice -n 19 $(MAKE) --no-print-directory $(OVERLAPPED) > $$log 2>&1; echo $$? > $$log.rc ) & bg=$$!; \
	{ $(MAKE) --no-print-directory test-integration; echo $$? > $$ilog.rc; } 2>&1 | tee $$ilog; \
	wait $$bg; bgrc=$$(cat $$log.rc 2>/dev/null || echo 1); irc=$$(cat $$ilog.rc 2>/dev/null || echo 1); \
	echo "==== $$log: $(OVERLAPPED) ===="; cat $$log; echo "==== end of $$log ===="; \
	if [ "$$irc" != 0 ]; then echo "==== the end of test-integration's output ($$ilog) ===="; tail -n 60 $$ilog; fi; \
	[ "$$bgrc" = 0 ] && echo "test: $(OVERLAPPED): ok" || echo "test: $(OVERLAPPED): FAILED (exit $$bgrc; see above)"; \
	[ "$$irc" = 0 ] && echo "test: test-integration: ok" || echo "test: test-integration: FAILED (exit $$irc; see above)"; \
	[ "$$bgrc" = 0 ] && [ "$$irc" = 0 ]
else
	@$(MAKE) --no-print-directory test-rust test-portable test-aarch64 test-integration test-rtl
endif

test-rust:
	@t0=$$(date +%s); set -e; set -x; $(CARGO) test --profile $(TEST_PROFILE) --locked --workspace; \
	{ set +x; } 2>/dev/null; echo "test-rust: ok ($$(( $$(date +%s) - t0 ))s)"

# The default build is the portable one: x86_64-unknown-linux-gnu's default CPU is the x86-64
# baseline (no SSE4/AVX/AES-NI assumed at compile time), so with no CPU named in .cargo/config.toml
# or in the RUSTFLAGS of the environment, test-rust and build already compile and test the workspace
# for it, and every SIMD path must carry its own #[target_feature] and be chosen at run time. This
# checks that nothing names a CPU, then compiles the cipher crate (the only one with
# target-feature-dependent code) for x86-64-v3 (AVX2 at compile time, as distributions built for v3
# do), with warnings as errors: the run-time dispatch must still compile cleanly when the baseline
# already has some of the levels' features. Own target dir, so the normal builds are kept.
test-portable:
	@if grep -Ev '^[[:space:]]*(#|$$)' .cargo/config.toml | grep -Eq 'target-cpu|target-feature'; then \
		echo "test-portable: .cargo/config.toml sets target-cpu/target-feature; the default build must stay portable" >&2; \
		exit 1; \
	fi
	@if printf '%s\n' "$$RUSTFLAGS" "$$CARGO_BUILD_RUSTFLAGS" "$$CARGO_ENCODED_RUSTFLAGS" | grep -Eq 'target-cpu|target-feature'; then \
		echo "test-portable: RUSTFLAGS (or CARGO_BUILD_RUSTFLAGS) in the environment name a CPU, so test-rust did not test the portable build; unset them" >&2; \
		exit 1; \
	fi
	@if [ "$(HOST_ARCH)" != x86_64 ]; then echo "test-portable: SKIPPED (host is $(HOST_ARCH), not x86_64)"; exit 0; fi; \
	set -e; t0=$$(date +%s); set -x; \
	CARGO_TARGET_DIR=target/x86-64-v3 RUSTFLAGS="-C target-cpu=x86-64-v3 -D warnings" \
		$(CARGO) check --locked -p cryptbridge-cipher --all-targets; \
	{ set +x; } 2>/dev/null; echo "test-portable: ok ($$(( $$(date +%s) - t0 ))s)"

# Cross-build the whole workspace for aarch64 (libraries, binaries, tests and examples, in one build
# that the test run reuses) and run all its tests under qemu-aarch64, whose default CPU model
# (`max`) has AES and PMULL, so the `aes` crate's ARMv8 back end (aese/aesd) is what XTS runs.
# Left to test-rust, as the costliest under emulation and the same on every CPU: the exhaustive
# flip of every bit of a 512- and a 4096-byte sector for each wide-block scheme (tes_properties,
# some 300,000 encryptions; its random-bit property test still runs here), and the LUKS header
# corruption sweeps (volume's tests/corruption.rs: some 1,300 damaged headers parsed and refused,
# no cipher kernel involved).
AARCH64_SKIP ?= --skip every_bit_of_a_sector_changes_almost_every_block --skip luks1_every_header_byte --skip luks2_binary_headers_and_json_areas
test-aarch64:
	@if [ "$(HOST_ARCH)" != x86_64 ]; then echo "test-aarch64: SKIPPED (host is $(HOST_ARCH), not x86_64; test-rust tests this CPU)"; exit 0; fi; \
	if [ -n "$(AARCH64_MISSING)" ]; then \
		echo "test-aarch64: SKIPPED (missing: $(AARCH64_MISSING) scripts/install-deps.sh installs them)"; \
		exit $(if $(filter 1,$(AARCH64_REQUIRED)),1,0); \
	fi; \
	set -e; t0=$$(date +%s); set -x; \
	RUSTFLAGS="$(AARCH64_WARNFLAGS)" $(CARGO) build --profile $(TEST_PROFILE) --locked --workspace --all-targets --target $(AARCH64); \
	{ set +x; } 2>/dev/null; echo "test-aarch64: left to test-rust (not run under emulation): $(AARCH64_SKIP)"; set -x; \
	RUSTFLAGS="$(AARCH64_WARNFLAGS)" $(CARGO) test --profile $(TEST_PROFILE) --locked --workspace --target $(AARCH64) -- $(AARCH64_SKIP); \
	{ set +x; } 2>/dev/null; echo "test-aarch64: ok ($$(( $$(date +%s) - t0 ))s)"

test-integration: build
	@t0=$$(date +%s); set -e; set -x; $(PYTHON) -m pytest -q --durations=15 tests/integration; \
	{ set +x; } 2>/dev/null; echo "test-integration: ok ($$(( $$(date +%s) - t0 ))s)"

# Crash campaign (tests/integration/crash_campaign.py; not part of make test): 20 rounds of kill -9 of
# the server under an ext4 workload over nbdfuse + loop, each round checked after restart (journal
# replay, sha256 of every fsync'd file, fsck.ext4 -fn). Needs root, /dev/fuse and loop devices
# (SKIPPED with the reason otherwise). CRASH_ARGS passes options: --seed N, --keep, --json F, and
# --power-loss (after each kill, undo the backing writes that no completed fdatasync covered).
.PHONY: crash-campaign
crash-campaign: build
	$(PYTHON) tests/integration/crash_campaign.py --rounds 20 $(CRASH_ARGS)

# Reencryption crash campaign (tests/integration/reencrypt_crash.py; a short one runs in make test):
# 30 rounds per resilience mode of kill -9 of `serve --reencrypt` or `cryptsetup reencrypt` under
# client writes, half with the power-loss model, recovered by cryptbridge or cryptsetup.
.PHONY: crash-campaign-reencrypt
crash-campaign-reencrypt: build
	$(PYTHON) tests/integration/reencrypt_crash.py --rounds 30 --power-loss --modes checksum,journal,datashift,decrypt $(CRASH_ARGS)

test-rtl: build
	@t0=$$(date +%s); set -e; set -x; $(MAKE) -C rtl test; \
	{ set +x; } 2>/dev/null; echo "test-rtl: ok ($$(( $$(date +%s) - t0 ))s)"

bench: build
	bench/run.sh

rtl-report:
	$(MAKE) -C rtl report

clean:
	$(CARGO) clean

# The long, coverage-guided fuzz campaign (the short one runs in `make test`: crates/bridge/tests/
# fuzz_short.rs). cargo-fuzz needs a nightly toolchain; both are installed here when missing.
FUZZ_RUNS ?= 10000000
FUZZ_PIPELINE_SECONDS ?= 300
fuzz:
	rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd crates/bridge/fuzz && for t in handshake requests; do \
		$(CARGO) +nightly fuzz run $$t -- -runs=$(FUZZ_RUNS) -max_len=4096 || exit 1; done
	cd crates/bridge/fuzz && $(CARGO) +nightly fuzz run pipeline -- -max_total_time=$(FUZZ_PIPELINE_SECONDS) -max_len=2048
