#!/usr/bin/env bash
# Sets up cryo on a fresh machine and runs the main job, `cryo demo`, on the embedded default
# (the simulated GPU when there is no real one).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then
  bash scripts/install-criu.sh
else
  echo "scripts/demo.sh: not root; skipping the CRIU install (freeze/thaw steps of the demo need root and CRIU)" >&2
fi
cargo build --release -p cryo-cli
exec target/release/cryo demo "$@"
