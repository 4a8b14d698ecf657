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

# ---- kube (issue 13): a real kube-apiserver + etcd on loopback for crates/kube's tests ----
# (built once from Debian's source into /var/tmp/cryo-k8s: ~4-4.5 min cold, then instant; stops
# itself when this script exits; the tests read CRYO_TEST_KUBECONFIG and fail when it is missing)
bash scripts/install-k8s.sh
k8s_env="$(bash scripts/k8s-cluster.sh start "$(mktemp -u /tmp/cryo-k8s-test.XXXXXX)" --until-exit-of $$)"
eval "$k8s_env"
# ---- end kube ----

# ---- leaks: no process the run starts may outlive it (scripts/lib/leaks.sh) ----
. scripts/lib/leaks.sh
leaks_begin
leaks_on_exit() {
  local status=$?
  leaks_end || status=1
  exit "$status"
}
trap leaks_on_exit EXIT
# ---- end leaks ----

cargo build --workspace --all-targets
cargo nextest run --workspace --no-fail-fast "$@"
