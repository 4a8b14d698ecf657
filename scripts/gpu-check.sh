#!/usr/bin/env bash
# cryo on a real GPU (issue 2, "On a real GPU"). Builds nothing: runs a carried release `cryo`
# with `--gpu cuda` against a PyTorch worker that holds seeded data in device memory.
#
#   CRYO=target/release/cryo  WORKER=scripts/gpu/worker.py  GIB=2  OUT=/tmp/out  scripts/gpu-check.sh
#
# Writes into $OUT: gpu-check.log (one line per step), steps.jsonl (one JSON object per step:
# step, ok, seconds, detail) and the raw outputs of `cryo gpu ls/ps`. Exit status 0 only if every
# step passed. Sections are numbered; later issues (freeze/thaw, stop, guard) add their own.
#
# Safety: the worker is killed only when the driver reports it CHECKPOINTED (suspend-before-kill).
# A restored worker that cannot be suspended is left running and reported, never killed.
set -euo pipefail
cd "$(dirname "$0")/.."

CRYO=${CRYO:-target/release/cryo}
WORKER=${WORKER:-scripts/gpu/worker.py}
PYTHON=${PYTHON:-python3}
GIB=${GIB:-2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CTL=$(mktemp -d)
LOG=$OUT/gpu-check.log
WPID=""       # the worker's pid once it is ready
RESTORED=0    # 1 once the worker's context came from a restore: then it must never die live
FAILED=0

g() { "$CRYO" --gpu cuda gpu "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
# record STEP OK SECONDS DETAIL: one log line and one JSON line.
record() {
  echo "$1 ok=$2 s=$3 $4" | tee -a "$LOG"
  python3 -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "ok": sys.argv[2] == "1", "seconds": float(sys.argv[3]), "detail": sys.argv[4]}))' \
    "$1" "$2" "$3" "$4" >>"$OUT/steps.jsonl"
  if [ "$2" != 1 ]; then FAILED=$((FAILED + 1)); fi
}
# check STEP CMD...: runs CMD, records pass/fail with its time and output; returns its status.
check() {
  local step=$1 t0 out rc=0; shift
  t0=$(now)
  out=$("$@" 2>&1) || rc=$?
  record "$step" "$([ $rc = 0 ] && echo 1 || echo 0)" "$(since "$t0")" "$(echo "$out" | tail -n 3 | tr '\n' ' ')"
  return $rc
}
# The driver's state word for a pid (running/locked/checkpointed/failed), whatever the JSON shape.
state() {
  g state --pid "$1" --json 2>/dev/null | python3 -c '
import json, sys
t = sys.stdin.read().strip()
try:
    d = json.loads(t)
    print((d.get("state") if isinstance(d, dict) else d) or "")
except ValueError:
    print(t.lower())' || true
}
expect_state() { [ "$(state "$1")" = "$2" ]; }
# Device memory NVML attributes to a pid (bytes, summed over GPUs); 0 when it is not listed.
nvml_mem() {
  g ps --json | python3 -c '
import json, sys
pid = int(sys.argv[1]); total = 0
def walk(x):
    global total
    if isinstance(x, dict):
        if x.get("pid") == pid:
            total += int(x.get("used_memory", x.get("memory", 0)) or 0)
        for v in x.values(): walk(v)
    elif isinstance(x, list):
        for v in x: walk(v)
walk(json.load(sys.stdin)); print(total)' "$1"
}
nvml_gone() { [ "$(nvml_mem "$1")" = 0 ]; }
nvml_holds() { [ "$(nvml_mem "$1")" -gt 0 ]; }
# Asks the worker to check every chunk's sum; true when it answers ok.
verify() {
  rm -f "$CTL/result"; echo verify >"$CTL/cmd"
  for _ in $(seq 600); do [ -f "$CTL/result" ] && break; sleep 0.2; done
  grep -q '"ok": true' "$CTL/result"
}
suspend() { check "$1.lock" g lock --pid "$WPID" --timeout 30000 && check "$1.checkpoint" g checkpoint --pid "$WPID"; }

# Ends the worker safely: suspend it if it is not CHECKPOINTED, kill it only if it then is.
teardown() {
  [ -n "$WPID" ] && kill -0 "$WPID" 2>/dev/null || return 0
  local s; s=$(state "$WPID")
  if [ "$s" = running ]; then g lock --pid "$WPID" --timeout 30000 || true; s=$(state "$WPID"); fi
  if [ "$s" = locked ]; then g checkpoint --pid "$WPID" || true; s=$(state "$WPID"); fi
  if [ "$s" = checkpointed ] || [ "$RESTORED" = 0 ]; then
    kill -9 "$WPID" || true; wait "$WPID" 2>/dev/null || true
    echo "teardown: killed pid $WPID in state '$s'" | tee -a "$LOG"
  else
    echo "teardown: REFUSING to kill restored pid $WPID in state '$s' (left running)" | tee -a "$LOG"
    FAILED=$((FAILED + 1))
  fi
  WPID=""
}
finish() {
  local rc=$?
  teardown; rm -rf "$CTL"
  echo "exit status $rc, failed steps: $FAILED" | tee -a "$LOG"
  if [ "$rc" = 0 ] && [ "$FAILED" = 0 ]; then exit 0; else exit 1; fi
}
trap finish EXIT

# 0. Prerequisites: loud failures, never skips.
: >"$LOG"; : >"$OUT/steps.jsonl"
[ -x "$CRYO" ] || { echo "no cryo binary at $CRYO (carry target/release/cryo)" >&2; exit 1; }
[ -f "$WORKER" ] || { echo "no worker at $WORKER" >&2; exit 1; }
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

# 1. Inventory through NVML.
check ls g ls
g ls --json >"$OUT/gpu-ls.json"
g ps --json >"$OUT/gpu-ps-before.json"

# 2. A worker holding $GIB GiB of seeded data.
t0=$(now)
"$PYTHON" "$WORKER" "$GIB" "$CTL" >"$OUT/worker.log" 2>&1 &
WPID=$!
for _ in $(seq 1200); do [ -f "$CTL/ready" ] || ! kill -0 "$WPID" 2>/dev/null && break; sleep 0.25; done
check worker.ready test -f "$CTL/ready"
record worker.start 1 "$(since "$t0")" "pid $WPID"
check worker.nvml_listed nvml_holds "$WPID"
record worker.device_memory 1 0 "$(nvml_mem "$WPID") bytes"
check state.running expect_state "$WPID" running
check restore_tid g restore-tid --pid "$WPID"

# 3. Suspend: lock, checkpoint; NVML no longer lists the pid.
suspend cycle1
check cycle1.state_checkpointed expect_state "$WPID" checkpointed
check cycle1.nvml_gone nvml_gone "$WPID"

# 4. Resume: restore (LOCKED), unlock, data verified through the worker.
RESTORED=1
check cycle1.restore g restore --pid "$WPID"
check cycle1.state_locked expect_state "$WPID" locked
check cycle1.unlock g unlock --pid "$WPID"
check cycle1.nvml_back nvml_holds "$WPID"
check cycle1.verify verify

# 5. Same cycle, restore through the CUDA 13.0 gpuPairs layout (identity map onto this GPU).
#    Not fatal: a failed restore leaves the worker CHECKPOINTED, which section 6 accepts.
UUID=$(python3 -c 'import json,re,sys; print(re.findall(r"GPU-[0-9a-f-]{36}", open(sys.argv[1]).read())[0])' "$OUT/gpu-ls.json")
suspend cycle2
if check cycle2.restore_gpu_map g restore --pid "$WPID" --gpu-map "$UUID=$UUID"; then
  check cycle2.unlock g unlock --pid "$WPID" || true
  check cycle2.verify verify || true
fi

# 6. Suspend-before-kill: lock + checkpoint, NVML shows nothing, then SIGKILL (in teardown).
[ "$(state "$WPID")" = checkpointed ] || suspend stop
check stop.state_checkpointed expect_state "$WPID" checkpointed
check stop.nvml_gone nvml_gone "$WPID"
t0=$(now)
teardown
record stop.kill 1 "$(since "$t0")" "killed only once checkpointed"
g ps --json >"$OUT/gpu-ps-after.json"
