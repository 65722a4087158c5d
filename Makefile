# cryptbridge: the two set-up commands are `make run` and `make test`.

CARGO      ?= cargo
PYTHON     ?= python3
BIN        := target/release/cryptbridge
DATA_DIR   ?= data
IMAGE_SIZE ?= 1G
LISTEN     ?= 127.0.0.1:10809

URI := nbd://$(LISTEN)
define RUN_BANNER

cryptbridge: serving $(DATA_DIR)/volume.img ($(IMAGE_SIZE), sparse; only ciphertext is stored)
  key:  $(DATA_DIR)/volume.key (AES-256-XTS, aes-xts-plain64, 4096-byte sectors)
  URI:  $(URI)

Use it from another terminal:
  nbdinfo $(URI)                                  # size, block sizes, flags
  nbdcopy disk.img $(URI)                         # write an image through the bridge
  nbdcopy $(URI) copy.img                         # read it back (decrypted)
  mkdir -p /tmp/nbd && nbdfuse /tmp/nbd/disk $(URI) &   # expose the export as a file
  until [ -e /tmp/nbd/disk ]; do sleep 0.1; done  # wait for nbdfuse
  dev=$$(losetup -f --show /tmp/nbd/disk) && mkfs.ext4 -b 4096 $$dev && mount $$dev /mnt
Same bytes as: cryptsetup open --type plain --cipher aes-xts-plain64 --key-size 512 \
  --sector-size 4096 --key-file $(DATA_DIR)/volume.key $(DATA_DIR)/volume.img NAME
Stop with Ctrl-C (answered writes are synced first).

endef
export RUN_BANNER

.PHONY: all build run test test-rust test-integration test-rtl deps bench rtl-report clean

all: build

$(BIN): $(shell find crates -name '*.rs' -o -name Cargo.toml) Cargo.toml Cargo.lock .cargo/config.toml
	@command -v $(CARGO) >/dev/null || { echo "cargo (Rust >= 1.89) is required: https://rustup.rs" >&2; exit 1; }
	$(CARGO) build --release --locked

build: $(BIN)

deps:
	scripts/install-deps.sh
	rtl/install-deps.sh

# Serve the embedded default: a sparse image and a generated key under $(DATA_DIR).
run: build
	@command -v nbdinfo >/dev/null || scripts/install-deps.sh
	@mkdir -p $(DATA_DIR)
	@test -f $(DATA_DIR)/volume.key || $(BIN) keygen --cipher aes-xts-plain64 --key-size 512 $(DATA_DIR)/volume.key
	@echo "$$RUN_BANNER"
	exec $(BIN) serve --backing $(DATA_DIR)/volume.img --size $(IMAGE_SIZE) --key-file $(DATA_DIR)/volume.key \
		--cipher aes-xts-plain64 --sector-size 4096 --listen $(LISTEN)

test: deps build test-rust test-integration test-rtl

test-rust:
	$(CARGO) test --release --locked --workspace

test-integration: build
	$(PYTHON) -m pytest -q tests/integration

test-rtl: build
	$(MAKE) -C rtl test

bench: build
	bench/run.sh

rtl-report:
	$(MAKE) -C rtl report

clean:
	$(CARGO) clean
