#!/usr/bin/env bash
# cryo on a real GPU: the "On a real GPU" parts of issues 2-5 and issue 9 item 12, as one prepared script. Builds
# nothing; runs a carried release `cryo` with `--gpu cuda` against PyTorch workers that hold seeded
# data in device memory (scripts/gpu/worker.py; worker2.py adds `fault`), talking through files
# only, so plain CRIU can dump them.
#
# On the lent GPU machine (device tool `run`), after `scripts/gpu-carry.sh` here:
#   command:   bash scripts/gpu-check.sh
#   carry:     [".carry"]
#   timeout_s: 540
# Results come back in $OUT (6 files): steps.jsonl (one JSON object per step), summary.json (the
# numbers docs/gpu-results.md quotes), gpu-check.log, timeline.jsonl (cryo's journal), host.txt
# (nvidia-smi, versions, gpu ls/ps), logs.txt (worker, guard and cryo stderr tails).
#
# Without a GPU, the same sections run against the simulated GPU (`cryo sim driver` + sim workers
# behind the same worker adapter), with real CRIU, ending with the wedge ledger checked empty:
#   GPU_CHECK_BACKEND=sim CRYO=target/release/cryo scripts/gpu-check.sh
#
# Sections (SECTIONS="s1 s2 s6 s3 s5 s4" by default: the longest last): s1 inventory; s2 issue 2, the
# driver calls one by one; s6 issue 9 item 12, the driver's raw answers (GetRestoreThreadId,
# GetState, Lock with a short timeout, each under a timeout) for a shell, a process that only ran
# cuInit, a zombie, a pid that does not exist, a SIGSTOPped worker and a worker addressed by a
# non-leader thread id: recorded as issue9.answers in summary.json on a real GPU, checked against
# the simulator's documented answers on the simulated one; s3 issue 3, `cryo stop` (restored
# worker, overhead over the raw lock+checkpoint; a tree with 2 CUDA workers; the sticky-error
# refusal, the fault made through libcuda + PTX, no CuPy); s4 issue 4, freeze/thaw at FREEZE_GIBS;
# s5 issue 5, the guard (SIGTERM suspended, SIGKILL pinned until released). Every step checks the
# answer it expects (a state, a code, a thread of the right process, data verified), not only
# that a command or a worker answered. Each runs in its own
# process under a timeout cut to the time left of BUDGET_S; a section that fails or times out is
# recorded and the next one runs. After each section and at exit (trap), the teardown ends every
# process the check started: restored ones only through `cryo stop` (suspend-before-kill; a
# refusal leaves them running and fails the check), never-restored ones may be killed.
# Exit status 0 only if every step passed.
#
# Env: GPU_CHECK_BACKEND (cuda|sim), CRYO (default .carry/bin/cryo, else target/release/cryo),
# CRYO_CRIU (default .carry/criu/criu), OUT, GIB (s2/s3 worker, 2), TREE_GIB (1), FREEZE_GIBS
# ("2 8"), GUARD_GIB (1), BUDGET_S (480), SECTIONS, RAW_LIMIT (s6: seconds per raw call, 8),
# RAW_LOCK_MS (s6: the lock's timeoutMs, 500), LIMIT_<section> (seconds), PYTHON,
# KEEP_WORK=1 keeps the work directory.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$ROOT/scripts/gpu-check.sh"
# shellcheck source=scripts/gpu/lib.sh
. "$ROOT/scripts/gpu/lib.sh"

# --- internal entry points (the script runs itself: sections, workers, health checks) ------------
case "${1:-}" in
  --worker-exec) worker_exec "$2" "$3" "$4" ;;
  --verify) verify "$2" >/dev/null; exit ;;
  --tree-parent)
    # A parent without CUDA and two CUDA workers under it, as a server with worker processes.
    TREE_PARENT=1
    worker_spawn "$2.a" "$3"
    worker_spawn "$2.b" "$3"
    wait
    exit
    ;;
esac

# --- configuration (exported: the sections, workers and health checks are new processes) ---------
if [ -z "${GPU_CHECK_CHILD:-}" ]; then
  export GPU_CHECK_CHILD=1 SELF ROOT
  export BACKEND=${GPU_CHECK_BACKEND:-cuda}
  default_cryo=$ROOT/.carry/bin/cryo
  [ -x "$default_cryo" ] || default_cryo=$ROOT/target/release/cryo
  CRYO=$(realpath -m "${CRYO:-$default_cryo}")
  CRYO_CRIU=$(realpath -m "${CRYO_CRIU:-$ROOT/.carry/criu/criu}")
  OUT=$(realpath -m "${OUT:-/tmp/gpu-check-out}")
  export CRYO CRYO_CRIU OUT
  export PYTHON=${PYTHON:-python3}
  export WORKER=$ROOT/scripts/gpu/worker.py WORKER2=$ROOT/scripts/gpu/worker2.py
  export GIB=${GIB:-2} TREE_GIB=${TREE_GIB:-1} FREEZE_GIBS=${FREEZE_GIBS:-"2 8"} GUARD_GIB=${GUARD_GIB:-1}
  export SIM_MIB_PER_GIB=${SIM_MIB_PER_GIB:-64}   # sim workers: 1 "GiB" of the PyTorch worker
  export START_TIMEOUT=${START_TIMEOUT:-180} CALL_TIMEOUT=${CALL_TIMEOUT:-120}
  WORK=$(mktemp -d /tmp/cryo-gpu-check.XXXXXX)
  export WORK
  # A private journal, so that the timeline and the restored/fresh origins are this run's only.
  export CRYO_STATE_DIR=$WORK/state
  export CRYO_SIM_DIR=$WORK/sim
fi

# --- sections ------------------------------------------------------------------------------------

# s1: what this host is; prerequisites (loud failures, never skips).
s1() {
  check cryo_version "$CRYO" --version
  check criu_version env LD_LIBRARY_PATH="$(dirname "$CRYO_CRIU")" "$CRYO_CRIU" --version
  if [ "$BACKEND" = cuda ]; then
    check torch_sees_gpu "$PYTHON" -c 'import torch; assert torch.cuda.is_available(); print(torch.__version__)'
    check libcuda_loads "$PYTHON" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")'
  fi
  cj gpu_ls -- gpu ls --json || return 1
  check gpu_ls.some_gpu test "$(jx "$J" 'len(d) > 0 and all(g["uuid"].startswith("GPU-") for g in d)')" = true
  fact host.gpus "$(jx "$J" '[{"name": g["name"], "uuid": g["uuid"], "memory_total": g["memory_total"]} for g in d]')"
  jx "$J" 'd[0]["uuid"]' >"$WORK/uuid"
  cj gpu_ps -- gpu ps --json
  fact host.gpu_processes_before "$(jx "$J" 'len(d)')"
  {
    echo "== cryo --version"; "$CRYO" --version
    echo "== criu --version"; LD_LIBRARY_PATH=$(dirname "$CRYO_CRIU") "$CRYO_CRIU" --version
    echo "== uname -a"; uname -a
    echo "== cryo gpu ls"; cryo_ gpu ls
    echo "== cryo gpu ps (before)"; cryo_ gpu ps
    if [ "$BACKEND" = cuda ]; then
      echo "== nvidia-smi"; nvidia-smi
      echo "== THP"; cat /sys/kernel/mm/transparent_hugepage/enabled
      echo "== python/torch"; "$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)'
    fi
  } >>"$OUT/host.txt" 2>&1
  return 0
}

# s2 (issue 2): the driver's checkpoint API one call at a time on a GIB GiB worker, NVML as the
# witness, data verified after each restore, then the suspend-before-kill end.
s2() {
  local w=i2 pid uuid
  worker_spawn $w "$GIB"
  pid=$(worker_wait $w) || return 1
  check nvml_listed nvml_holds "$pid"
  fact issue2.device_bytes "$(nvml_mem "$pid")"
  check state_running expect_state "$pid" running
  cj restore_tid -- gpu restore-tid --pid "$pid" --json &&
    check restore_tid.thread_of_worker thread_of "$(jx "$J" 'd["restore_tid"]')" "$pid"
  check verify_before verify $w

  cj cycle1.lock -- gpu lock --pid "$pid" --timeout 30000 --json || return 1
  fact issue2.cycle1.lock_ms "$(jx "$J" 'd["elapsed_ms"]')"
  cj cycle1.checkpoint -- gpu checkpoint --pid "$pid" --json || return 1
  fact issue2.cycle1.checkpoint_ms "$(jx "$J" 'd["elapsed_ms"]')"
  check cycle1.state_checkpointed expect_state "$pid" checkpointed
  check cycle1.nvml_gone nvml_gone "$pid"
  mark_restored "$pid"
  cj cycle1.restore -- gpu restore --pid "$pid" --json || return 1
  fact issue2.cycle1.restore_ms "$(jx "$J" 'd["elapsed_ms"]')"
  check cycle1.state_locked expect_state "$pid" locked
  cj cycle1.unlock -- gpu unlock --pid "$pid" --json || return 1
  fact issue2.cycle1.unlock_ms "$(jx "$J" 'd["elapsed_ms"]')"
  check cycle1.nvml_back nvml_holds "$pid"
  check cycle1.verify verify $w && fact issue2.cycle1.verified true

  # The CUDA 13.0 gpuPairs layout: identity map onto this GPU, by UUID.
  uuid=$(cat "$WORK/uuid")
  cj cycle2.lock -- gpu lock --pid "$pid" --timeout 30000 --json || return 1
  cj cycle2.checkpoint -- gpu checkpoint --pid "$pid" --json || return 1
  fact issue2.cycle2.checkpoint_ms "$(jx "$J" 'd["elapsed_ms"]')"
  if cj cycle2.restore_gpu_map -- gpu restore --pid "$pid" --gpu-map "$uuid=$uuid" --json; then
    fact issue2.cycle2.restore_gpu_map_ms "$(jx "$J" 'd["elapsed_ms"]')"
    cj cycle2.unlock -- gpu unlock --pid "$pid" --json
    check cycle2.verify verify $w && fact issue2.cycle2.verified true
  fi

  # Suspend-before-kill by hand: SIGKILL only once the driver says CHECKPOINTED and NVML agrees.
  [ "$(state "$pid")" = running ] && cj end.lock -- gpu lock --pid "$pid" --timeout 30000 --json
  [ "$(state "$pid")" = locked ] && cj end.checkpoint -- gpu checkpoint --pid "$pid" --json
  check end.state_checkpointed expect_state "$pid" checkpointed || return 1
  check end.nvml_gone nvml_gone "$pid" || return 1
  kill -9 "$pid"
  check end.killed wait_for 10 gone "$pid"
  return 0
}

# stop_facts KEY: the per-pid timings of the `cryo stop --json` in $J.
stop_facts() {
  fact "$1.elapsed_ms" "$(jx "$J" 'd["elapsed_ms"]')"
  fact "$1.wall_ms" "$(calc "$WALL_S * 1000")"
  fact "$1.processes" "$(jx "$J" '[{k: p[k] for k in ("pid", "comm", "cuda", "restored", "suspended", "ended")} for p in d["processes"]]')"
}

# s3 (issue 3): `cryo stop` of a restored worker (overhead over the raw driver lock+checkpoint of
# the same worker, target < 5%), of a tree with two CUDA workers, and the sticky-error refusal.
s3() {
  local r t f raw tree a b
  # All three start at once (they only hold memory and poll while the others are measured).
  worker_spawn i3r "$GIB"
  setsid bash "$SELF" --tree-parent i3t "$TREE_GIB" </dev/null >"$WORK/w/i3t.parent.log" 2>&1 &
  register $! i3t.parent
  worker_spawn i3f "$TREE_GIB" faulty

  # (a) A restored worker: raw lock + checkpoint, restore + unlock (journaled as restored by
  # `cryo gpu restore`), data verified, then `cryo stop`.
  if r=$(worker_wait i3r); then
    fact issue3.restored.device_bytes "$(nvml_mem "$r")"
    cj restored.raw_lock -- gpu lock --pid "$r" --timeout 30000 --json &&
      fact issue3.restored.raw_lock_ms "$(jx "$J" 'd["elapsed_ms"]')" &&
      cj restored.raw_checkpoint -- gpu checkpoint --pid "$r" --json &&
      fact issue3.restored.raw_checkpoint_ms "$(jx "$J" 'd["elapsed_ms"]')" &&
      raw=$(jx "$J" 'd["elapsed_ms"]') &&
      raw=$(calc "$raw + $(jx "$WORK/out/s3.restored.raw_lock.json" 'd["elapsed_ms"]')") &&
      check restored.nvml_gone nvml_gone "$r" &&
      mark_restored "$r" &&
      cj restored.restore -- gpu restore --pid "$r" --json &&
      cj restored.unlock -- gpu unlock --pid "$r" --json &&
      check restored.verify verify i3r &&
      cj restored.stop -- stop "$r" --json &&
      {
        stop_facts issue3.restored.stop
        check restored.stop_journal_restored test "$(jx "$J" 'd["processes"][0]["restored"]')" = true
        check restored.stop_ended test "$(jx "$J" 'all(p["ended"] for p in d["processes"])')" = true
        check restored.gone_from_nvml nvml_gone "$r"
        local lk ck el
        lk=$(jx "$J" 'd["processes"][0]["suspended"]["lock_ms"]')
        ck=$(jx "$J" 'd["processes"][0]["suspended"]["checkpoint_ms"]')
        el=$(jx "$J" 'd["elapsed_ms"]')
        fact issue3.restored.raw_lock_plus_checkpoint_ms "$raw"
        fact issue3.restored.overhead_pct "$(calc "($el - $lk - $ck) / ($lk + $ck) * 100")"
        fact issue3.restored.overhead_vs_raw_pct "$(calc "($el - $raw) / $raw * 100")"
        fact issue3.restored.wall_overhead_vs_raw_pct "$(calc "($WALL_S * 1000 - $raw) / $raw * 100")"
        # The target is judged on the real GPU only (a sim checkpoint takes milliseconds).
        t=$(calc "($el - $lk - $ck) / ($lk + $ck) * 100 < 5")
        fact issue3.restored.overhead_target_met "$([ "$t" = 1 ] && echo true || echo false)"
        record restored.overhead_under_5pct "$({ [ "$t" = 1 ] || [ "$BACKEND" = sim ]; } && echo 1 || echo 0)" 0 \
          "stop ${el} ms, its lock+checkpoint $(calc "$lk + $ck") ms, raw lock+checkpoint before $raw ms, wall $WALL_S s"
      }
  fi

  # (b) A tree: a parent without CUDA and two CUDA workers; one `cryo stop` of the parent.
  if a=$(worker_wait i3t.a) && b=$(worker_wait i3t.b); then
    tree=$(awk '$3 == "i3t.parent" { print $1 }' "$WORK/registry")
    check tree.both_listed nvml_holds "$b"
    if cj tree.stop -- stop "$tree" --json; then
      stop_facts issue3.tree.stop
      check tree.three_processes test "$(jx "$J" 'len(d["processes"])')" = 3
      check tree.two_suspended test "$(jx "$J" 'sum(1 for p in d["processes"] if p["suspended"])')" = 2
      check tree.all_ended test "$(jx "$J" 'all(p["ended"] for p in d["processes"])')" = true
      fact issue3.tree.checkpoint_ms_sum "$(jx "$J" 'sum(p["suspended"]["checkpoint_ms"] for p in d["processes"] if p["suspended"])')"
      fact issue3.tree.checkpoint_ms_max "$(jx "$J" 'max(p["suspended"]["checkpoint_ms"] for p in d["processes"] if p["suspended"])')"
      check tree.a_gone_from_nvml nvml_gone "$a"
      check tree.b_gone_from_nvml nvml_gone "$b"
    fi
  fi

  # (c) A sticky error (illegal address in a kernel): `cryo stop` refuses (exit 3), kills nothing;
  # the worker was never restored, so `--fresh` may then end it with a plain kill.
  if f=$(worker_wait i3f); then
    check sticky.fault fault i3f
    if cj sticky.stop_refused 3 -- stop "$f" --json --timeout 5000 --lock-attempts 1; then
      fact issue3.sticky.refusal "$(jx "$J" 'd["refusals"]')"
      fact issue3.sticky.elapsed_ms "$(jx "$J" 'd["elapsed_ms"]')"
      check sticky.refusal_names_pid test "$(jx "$J" '[r["pid"] for r in d["refusals"]]')" = "[$f]"
      check sticky.still_alive alive "$f"
      check sticky.state_after expect_state "$f" running
    fi
    if cj sticky.stop_fresh -- stop "$f" --fresh --json; then
      fact issue3.sticky.fresh_stop "$(jx "$J" '{"elapsed_ms": d["elapsed_ms"], "unsafe_kills": d["unsafe_kills"]}')"
      check sticky.ended wait_for 10 gone "$f"
      check sticky.freed wait_for 20 nvml_gone "$f"
    fi
  fi
  return 0
}

# s4 (issue 4): freeze and thaw at each size of FREEZE_GIBS, data verified after the thaw, then
# `cryo stop` of the thawed (restored) worker. A size that does not fit the time left is skipped.
s4() {
  local g w pid img need
  mkdir -p "$WORK/img"
  for g in $FREEZE_GIBS; do
    need=$([ "$BACKEND" = cuda ] && echo $((30 + 8 * g)) || echo 1)
    if [ "$(date +%s)" -gt $((SECTION_DEADLINE - need)) ]; then
      record "g$g.skipped" 0 0 "not enough time left in the section for $g GiB (needs ~${need} s)"
      continue
    fi
    w=i4g$g img=$WORK/img/g$g
    worker_spawn "$w" "$g"
    pid=$(worker_wait "$w") || continue
    fact "issue4.g$g.device_bytes" "$(nvml_mem "$pid")"
    check "g$g.verify_before" verify "$w" || continue
    cj "g$g.freeze" -- freeze "$pid" --image "$img" --json || continue
    fact "issue4.g$g.freeze" "$(jx "$J" '{k: d[k] for k in ("elapsed_ms", "suspend_ms", "dump_ms", "publish_ms")}')"
    fact "issue4.g$g.freeze_wall_ms" "$(calc "$WALL_S * 1000")"
    fact "issue4.g$g.image_bytes" "$(jx "$J" 'd["manifest"]["total_bytes"]')"
    fact "issue4.g$g.suspended" "$(jx "$J" 'd["suspended"]')"
    check "g$g.frozen_worker_gone" wait_for 10 gone "$pid"
    check "g$g.nvml_gone" nvml_gone "$pid"
    mark_restored "$pid"
    register_thaw "$pid" "$w"
    cj "g$g.thaw" -- thaw "$img" --health-cmd "bash $SELF --verify $w" --health-timeout 120 --json || continue
    fact "issue4.g$g.thaw" "$(jx "$J" '{k: d.get(k) for k in ("elapsed_ms", "criu_ms", "gpu_restore_ms", "verify_ms", "first_answer_ms")}')"
    fact "issue4.g$g.thaw_wall_ms" "$(calc "$WALL_S * 1000")"
    check "g$g.thawed_same_pid" test "$(jx "$J" 'd["root_pid"]')" = "$pid"
    check "g$g.nvml_back" nvml_holds "$pid"
    check "g$g.verify_after_thaw" verify "$w" && fact "issue4.g$g.verified_after_thaw" true
    cj "g$g.stop" -- stop "$pid" --json &&
      stop_facts "issue4.g$g.stop" &&
      check "g$g.stop_journal_restored" test "$(jx "$J" 'd["processes"][0]["restored"]')" = true
    check "g$g.stopped" wait_for 10 gone "$pid"
    rm -rf "$img"
  done
  return 0
}

# guard_status EXPR: true when the Python expression over `cryo status --json` (`d`) is true.
guard_status() {
  cryo_ status --json >"$WORK/status.json" 2>/dev/null &&
    [ "$(jx "$WORK/status.json" "$1")" = true ]
}
# events PID: the journal's event types for PID, in order.
events() { cryo_ timeline --pid "$1" --json 2>/dev/null >"$WORK/events.jsonl"; jx "$WORK/events.jsonl" '[r["event"]["type"] for r in d]'; }

# s5 (issue 5): the guard, on workers that were never restored (killing them is safe; the guard
# treats `--pid` processes as restored). SIGTERM: suspended before it dies. SIGKILL: its driver fds
# are pinned, NVML keeps listing its memory until the operator releases the pins.
s5() {
  local t k gpid t0 uuid ev
  worker_spawn i5t "$GUARD_GIB"
  worker_spawn i5k "$GUARD_GIB"
  t=$(worker_wait i5t) || return 1
  k=$(worker_wait i5k) || return 1
  fact issue5.device_bytes "$(nvml_mem "$t")"
  setsid "$CRYO" --gpu "$BACKEND" guard --pid "$t" --pid "$k" --no-memory-watch </dev/null >"$WORK/guard.log" 2>&1 &
  gpid=$!
  echo "$gpid $(start_time $gpid) guard" >>"$WORK/guards"
  check guard.attached wait_for 30 guard_status "sorted(p[\"pid\"] for p in d[\"guard\"][\"guarded\"]) == sorted([$t, $k])" || return 1

  # SIGTERM: held at the signal stop, suspended (lock, checkpoint, NVML), then let die.
  t0=$(now)
  kill -TERM "$t"
  check sigterm.died wait_for 90 gone "$t"
  fact issue5.sigterm.signal_to_exit_s "$(since "$t0")"
  ev=$(events "$t")
  fact issue5.sigterm.events "$ev"
  fact issue5.sigterm.journal "$(jx "$WORK/events.jsonl" '[r["event"] for r in d if r["event"]["type"] in ("fatal_signal", "locked", "checkpointed", "process_exited")]')"
  check sigterm.suspended_before_death python3 -c 'import json, sys
e = json.loads(sys.argv[1]); need = ["fatal_signal", "locked", "checkpointed", "verified", "process_exited"]
print(e); sys.exit(0 if [x for x in e if x in need] == need else 1)' "$ev"
  check sigterm.nvml_gone nvml_gone "$t"

  # SIGKILL: seen only at the exit stop; the fds are pinned, the GPU quarantined.
  t0=$(now)
  kill -KILL "$k"
  check sigkill.pinned wait_for 30 guard_status "any(p[\"pid\"] == $k for p in d[\"guard\"][\"pins\"])"
  fact issue5.sigkill.pins "$(jx "$WORK/status.json" 'd["guard"]["pins"]')"
  fact issue5.sigkill.quarantined "$(jx "$WORK/status.json" 'd["quarantined"]')"
  check sigkill.died wait_for 30 gone "$k"
  fact issue5.sigkill.kill_to_pinned_s "$(since "$t0")"
  uuid=$(jx "$WORK/status.json" 'd["guard"]["pins"][0]["gpus"][0]')
  check sigkill.quarantined test -n "$uuid"
  check sigkill.memory_listed_while_pinned nvml_holds "$k"
  fact issue5.sigkill.listed_bytes_while_pinned "$(nvml_mem "$k")"
  sleep 5
  check sigkill.memory_still_listed_after_5s nvml_holds "$k"
  cryo_ gpu ls >"$WORK/gpu-ls-quarantined.txt" 2>&1
  check sigkill.gpu_ls_shows_quarantine grep -q QUARANTINED "$WORK/gpu-ls-quarantined.txt"

  # The operator closes the pins: the driver tears the (never restored) context down.
  t0=$(now)
  check sigkill.release cryo_ guard release --gpu "$uuid" --i-understand-this-may-wedge-the-host
  check sigkill.freed_after_release wait_for 30 nvml_gone "$k"
  fact issue5.sigkill.release_to_freed_s "$(since "$t0")"
  check sigkill.quarantine_lifted wait_for 10 guard_status 'd["quarantined"] == []'
  fact issue5.sigkill.events "$(events "$k")"

  kill -TERM "$gpid"
  check guard.stopped wait_for 15 gone "$gpid"
  return 0
}

# raw_call STEP CALL PID [LOCK_TIMEOUT_MS]: one raw driver call (no cryo logic in between: no pid
# normalisation, no state check first) under a timeout of RAW_LIMIT seconds; the answer, or
# {"timed_out": true}, goes to $J and to the facts as issue9.answers.STEP.
raw_call() {
  local step=$1 call=$2 pid=$3 ms=${4:-} t0 rc=0
  J="$WORK/out/$SECTION.$step.json"
  t0=$(now)
  case $BACKEND in
    cuda) timeout -k 2 "$RAW_LIMIT" "$PYTHON" "$ROOT/scripts/gpu/driver_call.py" "$call" "$pid" $ms >"$J" 2>"$J.err" || rc=$? ;;
    sim) timeout -k 2 "$RAW_LIMIT" "$CRYO" sim call "$call" --pid "$pid" ${ms:+--timeout "$ms"} >"$J" 2>"$J.err" || rc=$? ;;
  esac
  WALL_S=$(since "$t0")
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo '{"timed_out": true}' >"$J"
  fi
  fact "issue9.answers.$step" "$(python3 -c 'import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception: d = {"unreadable": open(sys.argv[1]).read()[:200]}
d["seconds"] = float(sys.argv[2]); d["rc"] = int(sys.argv[3]); print(json.dumps(d))' "$J" "$WALL_S" "$rc")"
  # A call that answered printed one JSON answer; one that did not answer was cut by the timeout.
  record "$step" "$({ [ "$rc" = 0 ] && jx "$J" 'd["name"]' >/dev/null; } || [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo 1 || echo 0)" \
    "$WALL_S" "rc=$rc $(head -c 300 "$J" | tr '\n' ' ') $(tail -c 200 "$J.err" | tr '\n' ' ')"
}

# answer STEP: the recorded answer's code name, `timeout` when it did not answer, `tid=N`/state word
# appended for a successful GetRestoreThreadId/GetState.
answer() {
  jx "$WORK/out/$SECTION.$1.json" 'd.get("timed_out") and "timeout" or d["name"] + ("" if d["value"] is None else " " + str(d["value"]))'
}

# success STEP: the recorded call answered CUDA_SUCCESS. value STEP: what it returned.
success() { [ "$(jx "$WORK/out/$SECTION.$1.json" 'd.get("result")')" = 0 ]; }
value() { jx "$WORK/out/$SECTION.$1.json" 'd["value"]'; }

# expect STEP WANT...: on the simulated GPU, the answer is one of WANT (the simulator's documented
# answers, which this check holds it to); on a real GPU the answer is recorded, not judged (these
# are the measurements the simulator is to be matched against), except where noted by the caller.
expect() {
  local step=$1 got
  shift
  got=$(answer "$step")
  fact "issue9.answer_words.$step" "\"$got\""
  [ "$BACKEND" = sim ] || return 0
  local w
  for w in "$@"; do
    # "CUDA_SUCCESS tid": any thread id.
    case "$w" in
      "CUDA_SUCCESS tid") [[ "$got" =~ ^CUDA_SUCCESS\ [0-9]+$ ]] && { echo "$got"; return 0; } ;;
      *) [ "$got" = "$w" ] && { echo "$got"; return 0; } ;;
    esac
  done
  echo "answer '$got', expected one of: $*"
  return 1
}

# probe NAME PID: GetRestoreThreadId, GetState, Lock (RAW_LOCK_MS) on PID, in that order (the
# only call that can answer for a process that cannot run comes first).
probe() {
  raw_call "$1.restore_tid" restore-tid "$2"
  raw_call "$1.state" state "$2"
  raw_call "$1.lock" lock "$2" "$RAW_LOCK_MS"
}

# settle_lock PID: a lock that took effect (at once, or late: queued while the process could not
# run) is undone, so the worker is left running as it was found. Records the state it found.
settle_lock() {
  local name=$1 pid=$2 s
  s=$(state "$pid")
  fact "issue9.answers.$name.state_after" "\"$s\""
  if [ "$s" = locked ]; then
    cj "$name.unlock" -- gpu unlock --pid "$pid" --json
  fi
  check "$name.left_running" expect_state "$pid" running
}

# s6 (issue 9 item 12): the driver's raw answers (GetRestoreThreadId, GetState, Lock with a short
# timeout), each under a timeout, for processes whose answers were never measured: a shell, a
# process that only ran cuInit, a zombie, a pid that does not exist, a SIGSTOPped worker, and a
# worker addressed by one of its non-leader thread ids. On the simulated GPU each answer is
# checked against what the simulator documents; on a real GPU they are recorded in summary.json
# (issue9.answers) for the simulator to be matched against.
s6() {
  local sh ci z zp gone st t tid
  export RAW_LIMIT=${RAW_LIMIT:-8} RAW_LOCK_MS=${RAW_LOCK_MS:-500}
  # The workers start together (a PyTorch worker takes seconds) while the first cases run.
  worker_spawn i6init 0 initonly
  worker_spawn i6stop 1
  worker_spawn i6tid 1
  # The zombie-to-be: a worker under a parent that never reaps (bash execs sleep).
  zp=$(wctl i6zombie)
  rm -rf "$zp"
  mkdir -p "$zp"
  setsid bash -c "bash '$SELF' --worker-exec i6zombie 1 plain & echo \$! >'$zp/spawned'; exec sleep 3600" </dev/null >/dev/null 2>&1 &
  register $! i6zombie.parent
  disown $!
  wait_for 10 test -s "$zp/spawned" && register "$(cat "$zp/spawned")" i6zombie

  # A shell: no CUDA at all.
  setsid bash -c 'while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &
  sh=$!
  register "$sh" shell
  disown "$sh"
  probe shell "$sh"
  check shell.restore_tid.answer expect shell.restore_tid CUDA_ERROR_NOT_INITIALIZED
  check shell.state.answer expect shell.state CUDA_ERROR_NOT_INITIALIZED
  check shell.lock.answer expect shell.lock CUDA_ERROR_NOT_INITIALIZED
  check shell.still_alive alive "$sh"

  # A pid that does not exist: one that just exited and was reaped, checked free right before.
  sleep 0 &
  gone=$!
  wait "$gone"
  if check nopid.free test ! -e "/proc/$gone"; then
    probe nopid "$gone"
    check nopid.restore_tid.answer expect nopid.restore_tid CUDA_ERROR_INVALID_VALUE
    check nopid.state.answer expect nopid.state CUDA_ERROR_INVALID_VALUE
    check nopid.lock.answer expect nopid.lock CUDA_ERROR_INVALID_VALUE
  fi

  # A process that only ran cuInit (a launcher, an API server): driver fds, no context.
  if ci=$(worker_wait i6init); then
    check cuinit.nvml_not_listed nvml_gone "$ci"
    probe cuinit "$ci"
    check cuinit.restore_tid.answer expect cuinit.restore_tid "CUDA_SUCCESS tid"
    success cuinit.restore_tid && check cuinit.restore_tid.thread_of_process thread_of "$(value cuinit.restore_tid)" "$ci"
    check cuinit.state.answer expect cuinit.state "CUDA_SUCCESS running"
    check cuinit.lock.answer expect cuinit.lock CUDA_SUCCESS
    settle_lock cuinit "$ci"
  fi

  # A zombie: the worker killed (never restored: killing it is safe), its parent never reaps it.
  # Its files are closed, so the driver has let its context go.
  if z=$(worker_wait i6zombie); then
    kill -9 "$z"
    if check zombie.is_zombie wait_for 20 is_zombie "$z"; then
      check zombie.nvml_freed wait_for 20 nvml_gone "$z"
      probe zombie "$z"
      check zombie.restore_tid.answer expect zombie.restore_tid CUDA_ERROR_NOT_INITIALIZED
      check zombie.state.answer expect zombie.state CUDA_ERROR_NOT_INITIALIZED
      check zombie.lock.answer expect zombie.lock CUDA_ERROR_NOT_INITIALIZED
    fi
  fi

  # A SIGSTOPped worker: its restore thread cannot run. The simulator answers only the restore
  # thread id (the driver knows it without the thread) and leaves every other call unanswered; a
  # lock whose caller gave up still takes effect once the process runs again (settle_lock).
  if st=$(worker_wait i6stop); then
    kill -STOP "$st"
    if check stopped.is_stopped wait_for 10 is_stopped "$st"; then
      probe stopped "$st"
      check stopped.restore_tid.answer expect stopped.restore_tid "CUDA_SUCCESS tid"
      success stopped.restore_tid && check stopped.restore_tid.thread_of_process thread_of "$(value stopped.restore_tid)" "$st"
      check stopped.state.answer expect stopped.state timeout
      check stopped.lock.answer expect stopped.lock timeout
    fi
    kill -CONT "$st"
    settle_lock stopped "$st"
    check stopped.verify verify i6stop
  fi

  # A multi-threaded worker addressed by a thread id that is not its leader's (the newest one).
  if t=$(worker_wait i6tid); then
    tid=$(ls "/proc/$t/task" | grep -vx "$t" | sort -n | tail -n1)
    fact issue9.answers.tid.threads "$(ls "/proc/$t/task" | wc -l)"
    if check tid.has_threads test -n "$tid"; then
      probe tid "$tid"
      check tid.restore_tid.answer expect tid.restore_tid "CUDA_SUCCESS tid"
      success tid.restore_tid && check tid.restore_tid.thread_of_process thread_of "$(value tid.restore_tid)" "$t"
      check tid.state.answer expect tid.state "CUDA_SUCCESS running"
      check tid.lock.answer expect tid.lock CUDA_SUCCESS
      settle_lock tid "$t"
      check tid.verify verify i6tid
    fi
  fi
  return 0
}

# --- running the sections ------------------------------------------------------------------------

if [ "${1:-}" = --section ]; then
  SECTION=$2
  export SECTION SECTION_DEADLINE=$3
  "$2"
  exit
fi

SECTION=main
FAILED_SECTIONS=""
section_limit() { case $1 in s1) echo 60 ;; s2) echo 120 ;; s3) echo 150 ;; s4) echo 240 ;; s5) echo 120 ;; s6) echo 120 ;; *) echo 60 ;; esac; }
# The wedge ledger of the simulated GPU, after each section: its records are the check's failures.
ledger_check() {
  cryo_ sim ledger --json >"$WORK/ledger.json" 2>&1
  record wedge_ledger_empty "$([ "$(jx "$WORK/ledger.json" 'len(d)')" = 0 ] && echo 1 || echo 0)" 0 "$(head -c 400 "$WORK/ledger.json")"
}

finish() {
  local rc=$? bad=0
  trap - EXIT INT TERM
  teardown || bad=1
  if [ "$BACKEND" = sim ]; then
    ledger_check
    fact sim.wedge_ledger "$(cat "$WORK/ledger.json")"
  fi
  cryo_ timeline --json >"$OUT/timeline.jsonl" 2>/dev/null
  cryo_ gpu ps --json >"$WORK/ps-after.json" 2>/dev/null
  [ -n "${SIMPID:-}" ] && kill "$SIMPID" 2>/dev/null
  {
    echo "== cryo gpu ps (after)"; cat "$WORK/ps-after.json"
  } >>"$OUT/host.txt"
  # None of this run's processes may still hold device memory.
  record final.no_pid_of_this_run_in_nvml "$(python3 -c 'import json, sys
ours = {int(l.split()[0]) for l in open(sys.argv[2])}
held = [r["pid"] for r in json.load(open(sys.argv[1])) if r["pid"] in ours]
print(1 if not held else 0)' "$WORK/ps-after.json" "$WORK/registry" 2>/dev/null || echo 0)" 0 "after teardown"
  [ "$bad" = 0 ] || record final.teardown 0 0 "a restored process was left running (see gpu-check.log)"
  {
    for f in "$WORK"/w/*.log "$WORK/guard.log" "$WORK/teardown.log" "$WORK/cryo-stderr.log"; do
      [ -f "$f" ] && { echo "== $f"; tail -c 20000 "$f"; }
    done
  } >"$OUT/logs.txt" 2>&1
  python3 - "$WORK/facts.tsv" "$OUT/steps.jsonl" "$OUT/summary.json" "$BACKEND" "$FAILED_SECTIONS" <<'EOF'
import json, sys
facts, steps, out, backend, failed_sections = sys.argv[1:6]
summary = {"backend": backend}
for line in open(facts):
    key, _, raw = line.rstrip("\n").partition("\t")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    node = summary
    *path, last = key.split(".")
    for p in path:
        node = node.setdefault(p, {})
    node[last] = value
rows = [json.loads(l) for l in open(steps) if l.strip()]
summary["steps"] = {"total": len(rows), "failed": [r["step"] for r in rows if not r["ok"]]}
summary["failed_sections"] = failed_sections.split()
json.dump(summary, open(out, "w"), indent=2)
print("summary: %d steps, %d failed: %s" % (len(rows), len(summary["steps"]["failed"]), summary["steps"]["failed"]))
EOF
  if [ "$bad" = 0 ] && [ "${KEEP_WORK:-0}" != 1 ]; then rm -rf "$WORK"; else log "work directory kept: $WORK"; fi
  if [ "$rc" = 0 ] && [ "$(jx "$OUT/summary.json" 'len(d["steps"]["failed"])')" = 0 ]; then
    log "gpu-check: PASSED ($BACKEND)"
    exit 0
  fi
  log "gpu-check: FAILED ($BACKEND, exit status $rc)"
  exit 1
}

mkdir -p "$OUT" "$WORK/out" "$WORK/w" "$WORK/restored"
: >"$OUT/gpu-check.log"
: >"$OUT/steps.jsonl"
: >"$OUT/host.txt"
: >"$WORK/facts.tsv"
: >"$WORK/registry"
trap finish EXIT
trap 'exit 130' INT TERM
T_START=$(date +%s)
DEADLINE=$((T_START + ${BUDGET_S:-480} - 45)) # 45 s kept for the teardown
log "gpu-check: backend $BACKEND, cryo $CRYO, work $WORK, out $OUT"
fact started "\"$(date -u +%FT%TZ)\""

[ -x "$CRYO" ] || { log "no cryo binary at $CRYO (run scripts/gpu-carry.sh and carry .carry)"; exit 1; }
[ -x "$CRYO_CRIU" ] || { log "no CRIU at $CRYO_CRIU (scripts/install-criu.sh makes .carry/criu)"; exit 1; }
if [ "$BACKEND" = sim ]; then
  command -v curl >/dev/null || { log "sim mode needs curl"; exit 1; }
  setsid "$CRYO" sim driver --dir "$CRYO_SIM_DIR" </dev/null >"$WORK/sim-driver.log" 2>&1 &
  SIMPID=$!
  wait_for 10 test -S "$CRYO_SIM_DIR/driver.sock" || { log "sim driver did not start"; exit 1; }
fi

for s in ${SECTIONS:-s1 s2 s6 s3 s5 s4}; do
  limit_var=LIMIT_$s # LIMIT_s4=5: a shorter limit, to exercise the timeout path
  limit=${!limit_var:-$(section_limit "$s")}
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$left" -lt 20 ]; then
    SECTION=$s record not_run 0 0 "out of time ($left s left of BUDGET_S)"
    FAILED_SECTIONS="$FAILED_SECTIONS $s"
    continue
  fi
  log "=== section $s (limit ${limit} s)"
  t0=$(now)
  rc=0
  timeout -k 15 "$limit" bash "$SELF" --section "$s" "$(($(date +%s) + limit))" || rc=$?
  [ "$rc" = 124 ] && SECTION=$s record timed_out 0 "$(since "$t0")" "section killed after $limit s"
  [ "$rc" = 0 ] || FAILED_SECTIONS="$FAILED_SECTIONS $s"
  SECTION=$s record section_done "$([ "$rc" = 0 ] && echo 1 || echo 0)" "$(since "$t0")" "rc=$rc"
  SECTION=$s teardown || SECTION=$s record teardown 0 0 "a restored process was left running"
  [ "$BACKEND" = sim ] && SECTION=$s ledger_check
done
