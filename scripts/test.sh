#!/usr/bin/env bash
# Runs every test of the workspace, the root-only ones (real CRIU, ptrace, cgroups) included.
# Installs what the tests need first (CRIU 4.x), so it works on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "scripts/test.sh: the CRIU, ptrace and cgroup tests need root; run as root" >&2
  exit 1
fi

bash scripts/install-criu.sh

# ---- telemetry (issue 11): rsyslog, promtool and systemd-analyze for the telemetry tests ----
bash scripts/install-test-deps.sh
# ---- end telemetry ----

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "scripts/test.sh: cargo-nextest not found; installing it" >&2
  cargo install --locked cargo-nextest
fi

cargo build --workspace --all-targets
cargo nextest run --workspace --no-fail-fast "$@"
