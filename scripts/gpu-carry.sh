#!/usr/bin/env bash
# Prepares .carry/ (git-ignored) for the GPU machine, which has no Rust toolchain and no internet:
# the release `cryo` as .carry/bin/cryo and CRIU with its libraries in .carry/criu/ (made by
# scripts/install-criu.sh when missing). Then run scripts/gpu-check.sh there with the device tool:
#   command: bash scripts/gpu-check.sh    carry: [".carry"]    timeout_s: 480
# The carry limit is 64 MiB in all; this script fails if .carry is larger.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p cryo-cli
mkdir -p .carry/bin
cp target/release/cryo .carry/bin/cryo.tmp
# Line tables are not needed there and halve the size; symbols stay for backtraces.
strip --strip-debug .carry/bin/cryo.tmp
mv .carry/bin/cryo.tmp .carry/bin/cryo

if [ ! -x .carry/criu/criu ]; then
  [ "$(id -u)" = 0 ] || { echo "gpu-carry: .carry/criu/criu is missing; run scripts/install-criu.sh as root" >&2; exit 1; }
  bash scripts/install-criu.sh
fi
[ -x .carry/criu/criu ] || { echo "gpu-carry: scripts/install-criu.sh did not produce .carry/criu/criu" >&2; exit 1; }
LD_LIBRARY_PATH=.carry/criu .carry/criu/criu --version
.carry/bin/cryo --version

size=$(du -sm .carry | cut -f1)
echo "gpu-carry: .carry is ${size} MiB ($(du -sh .carry/bin .carry/criu | tr '\n\t' '  '))"
[ "$size" -lt 64 ] || { echo "gpu-carry: .carry is over the 64 MiB carry limit" >&2; exit 1; }
git check-ignore -q .carry || { echo "gpu-carry: .carry is not git-ignored (it must travel as a carry)" >&2; exit 1; }
echo 'gpu-carry: ready. Device run: command "bash scripts/gpu-check.sh", carry [".carry"], timeout_s 480'
