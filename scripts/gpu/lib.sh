# shellcheck shell=bash
# Helpers of scripts/gpu-check.sh: recording, JSON, the worker adapter, the process registry and
# the safe teardown. Sourced; expects the variables gpu-check.sh exports (BACKEND, CRYO, WORK,
# OUT, ...).
#
# Every process the check starts is written to $WORK/registry the moment it is spawned (pid and
# start time, so a reused pid is never touched), and a pid gets a mark in $WORK/restored/ *before*
# any call that may restore its context. The teardown reads only these files, so it works after a
# section was killed by its timeout half-way.

# --- time and JSON -------------------------------------------------------------------------------

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
# calc EXPR: a Python arithmetic expression, rounded; "null" when it cannot be computed.
calc() { python3 -c 'import sys
try: print(round(eval(sys.argv[1]), 3))
except Exception: print("null")' "$1"; }
# jx FILE EXPR: evaluates a Python expression over the JSON document `d` in FILE (a *.jsonl file:
# `d` is the list of its records). Strings print bare, everything else as JSON. Fails on no/bad JSON.
jx() {
  python3 -c 'import json, sys
t = open(sys.argv[1]).read()
d = [json.loads(l) for l in t.splitlines() if l.strip()] if sys.argv[1].endswith(".jsonl") else json.loads(t)
r = eval(sys.argv[2], {"d": d})
print(r if isinstance(r, str) else json.dumps(r))' "$1" "$2" 2>/dev/null
}

# --- recording -----------------------------------------------------------------------------------

log() { echo "$*" | tee -a "$OUT/gpu-check.log" >&2; }
# record STEP OK(1/0) SECONDS DETAIL: one log line and one JSON line in steps.jsonl.
record() {
  local step="${SECTION:-main}.$1"
  log "$step ok=$2 s=$3 $4"
  python3 -c 'import json, sys
print(json.dumps({"section": sys.argv[1], "step": sys.argv[2], "ok": sys.argv[3] == "1",
                  "seconds": float(sys.argv[4]), "backend": sys.argv[6], "detail": sys.argv[5][:600]}))' \
    "${SECTION:-main}" "$step" "$2" "$3" "$4" "$BACKEND" >>"$OUT/steps.jsonl"
}
# fact KEY JSON: one value for summary.json (KEY is dotted: issue3.stop.elapsed_ms).
fact() { printf '%s\t%s\n' "$1" "${2:-null}" >>"$WORK/facts.tsv"; }
# check STEP CMD...: runs CMD, records pass/fail with its time and the tail of its output.
check() {
  local step=$1 t0 out rc=0
  shift
  t0=$(now)
  out=$("$@" 2>&1) || rc=$?
  record "$step" "$([ "$rc" = 0 ] && echo 1 || echo 0)" "$(since "$t0")" "$(echo "$out" | tail -n 3 | tr '\n' ' ')"
  return "$rc"
}

# --- cryo ----------------------------------------------------------------------------------------

cryo_() { "$CRYO" --gpu "$BACKEND" "$@"; }
# cj STEP [EXPECTED_RC] -- CRYO_ARGS...: runs cryo, stdout to $WORK/out/STEP.json (path in $J),
# stderr to STEP.err (and cryo-stderr.log), records the step (ok when the exit code is the one
# expected, 0 by default) with its wall time in $WALL_S; returns 0 when as expected.
cj() {
  local step=$1 want=0 t0 rc=0 detail
  shift
  if [ "$1" != -- ]; then want=$1; shift; fi
  shift
  J="$WORK/out/$SECTION.$step.json"
  t0=$(now)
  cryo_ "$@" >"$J" 2>"$J.err" || rc=$?
  WALL_S=$(since "$t0")
  { echo "== $SECTION.$step: cryo $* (rc $rc)"; cat "$J.err"; } >>"$WORK/cryo-stderr.log"
  detail="rc=$rc $(head -c 300 "$J" | tr '\n' ' ')"
  [ "$rc" = 0 ] || detail="$detail | $(grep -v 'using the simulated GPU' "$J.err" | tail -n 3 | tr '\n' ' ')"
  record "$step" "$([ "$rc" = "$want" ] && echo 1 || echo 0)" "$WALL_S" "$detail"
  [ "$rc" = "$want" ]
}

# The driver's state word for a pid (running/locked/checkpointed/failed), "" when it says nothing.
state() { cryo_ gpu state --pid "$1" --json 2>/dev/null | python3 -c 'import json, sys
try: print(json.load(sys.stdin)["state"])
except Exception: print("")'; }
expect_state() { local s; s=$(state "$1"); echo "state of $1: $s"; [ "$s" = "$2" ]; }
# Device memory NVML attributes to a pid (bytes, summed over GPUs); 0 when it is not listed.
nvml_mem() { cryo_ gpu ps --json 2>/dev/null | python3 -c 'import json, sys
print(sum(int(r.get("used_memory") or 0) for r in json.load(sys.stdin) if r["pid"] == int(sys.argv[1])))' "$1"; }
nvml_holds() { local m; m=$(nvml_mem "$1"); echo "pid $1: $m bytes"; [ "${m:-0}" -gt 0 ]; }
nvml_gone() { local m; m=$(nvml_mem "$1"); echo "pid $1: $m bytes"; [ "$m" = 0 ]; }
# wait_for SECONDS CMD...: polls CMD every 0.1 s until it succeeds.
wait_for() {
  local end
  end=$(awk -v n="$(now)" -v s="$1" 'BEGIN { printf "%d", n + s }')
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || return 1
    sleep 0.1
  done
}

# --- processes -----------------------------------------------------------------------------------

# start_time PID: field 22 of /proc/PID/stat (after the parenthesised comm); "" when gone.
start_time() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $20 }'; }
# alive PID [START]: the process exists, is not a zombie, and (if given) started at START.
alive() {
  local st
  st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $1 " " $20 }') || return 1
  [ -n "$st" ] && [ "${st%% *}" != Z ] && { [ -z "${2:-}" ] || [ "${st#* }" = "$2" ]; }
}
gone() { ! alive "$@"; }
# is_zombie PID: it exited and nobody reaped it.
is_zombie() { [ "$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" = Z ]; }
# is_stopped PID: every thread is in a stop (T: SIGSTOP or job control, t: a tracer's stop).
is_stopped() {
  local f s n=0
  for f in /proc/"$1"/task/*/stat; do
    s=$(sed 's/^.*) //' "$f" 2>/dev/null | cut -d' ' -f1)
    case $s in T | t) n=$((n + 1)) ;; "") ;; *) return 1 ;; esac
  done
  [ "$n" -gt 0 ]
}
register() { echo "$1 $(start_time "$1") $2" >>"$WORK/registry"; }
# register_thaw PID NAME: before a thaw. CRIU brings the worker back under the same pid but with a
# new start time, so this entry matches by the worker's control directory in its command line.
register_thaw() { echo "$1 thaw $2" >>"$WORK/registry"; }
mark_restored() { touch "$WORK/restored/$1"; }
is_restored() { [ -e "$WORK/restored/$1" ]; }

# --- the worker adapter: one interface, a PyTorch worker (cuda) or a sim worker (sim) -------------
# A worker NAME has the control directory $WORK/w/NAME: `ready` (JSON with its pid) once it holds
# GIB GiB of seeded data; requests through `cmd` -> `result` files (PyTorch) or HTTP on `sock`
# (sim). KIND: `plain` (worker.py), `faulty` (worker2.py: adds `fault`, `busy S`) or `initonly` (a
# process that only ran cuInit: driver fds, no context, no device memory; no requests).

wctl() { echo "$WORK/w/$1"; }
# worker_exec NAME GIB KIND: replaces the shell with the worker (stdio to files: CRIU wants no tty).
worker_exec() {
  local ctl
  ctl=$(wctl "$1")
  case $BACKEND in
    cuda)
      local script=$WORKER
      [ "$3" = faulty ] && script=$WORKER2
      [ "$3" = initonly ] && exec "$PYTHON" -c 'import ctypes, json, os, sys, time
r = ctypes.CDLL("libcuda.so.1").cuInit(0)
open(os.path.join(sys.argv[1], "ready.tmp"), "w").write(json.dumps({"pid": os.getpid(), "cuInit": r}))
os.rename(os.path.join(sys.argv[1], "ready.tmp"), os.path.join(sys.argv[1], "ready"))
while True: time.sleep(3600)' "$ctl" </dev/null >"$ctl.log" 2>&1
      exec "$PYTHON" "$script" "$2" "$ctl" </dev/null >"$ctl.log" 2>&1
      ;;
    sim)
      [ "$3" = initonly ] && exec "$CRYO" sim worker --init-only --http-unix "$ctl/sock" \
        --ready-file "$ctl/ready" --log-file "$ctl.log" </dev/null >/dev/null 2>&1
      exec "$CRYO" sim worker --memory "$(($2 * SIM_MIB_PER_GIB))MiB" --seed "$RANDOM" \
        --http-unix "$ctl/sock" --ready-file "$ctl/ready" --log-file "$ctl.log" </dev/null >/dev/null 2>&1
      ;;
  esac
}
# worker_spawn NAME GIB [KIND]: starts the worker in its own session (CRIU needs a session leader)
# and registers it at once.
worker_spawn() {
  local ctl
  ctl=$(wctl "$1")
  rm -rf "$ctl"
  mkdir -p "$ctl"
  setsid bash "$SELF" --worker-exec "$1" "$2" "${3:-plain}" &
  echo $! >"$ctl/spawned"
  register $! "$1"
  # Not a job of this shell (no "Killed" notices), except under the tree parent, which waits.
  [ -n "${TREE_PARENT:-}" ] || disown $!
}
# worker_wait NAME [SECONDS]: waits for `ready`; prints the worker's pid.
worker_wait() {
  local ctl pid="" t0 spawned
  ctl=$(wctl "$1")
  spawned=$(cat "$ctl/spawned" 2>/dev/null)
  t0=$(now)
  for _ in $(seq $((${2:-$START_TIMEOUT} * 10))); do
    pid=$(jx "$ctl/ready" 'd["pid"]') && break
    if [ -n "$spawned" ] && gone "$spawned"; then break; fi
    sleep 0.1
  done
  if [ -z "$pid" ]; then
    record "$1.ready" 0 "$(since "$t0")" "no ready file; log: $(tail -c 400 "$ctl.log" 2>/dev/null | tr '\n' ' ')"
    return 1
  fi
  # setsid does not fork here, so the pid is the registered one; register it anyway if not.
  [ "$pid" = "$spawned" ] || register "$pid" "$1"
  record "$1.ready" 1 "$(since "$t0")" "pid $pid"
  echo "$pid"
}
# wcall NAME CMD: one request; prints the worker's JSON answer.
wcall() {
  local ctl
  ctl=$(wctl "$1")
  case $BACKEND in
    cuda)
      rm -f "$ctl/result"
      echo "$2" >"$ctl/cmd.tmp" && mv "$ctl/cmd.tmp" "$ctl/cmd"
      wait_for "$CALL_TIMEOUT" test -f "$ctl/result" || { echo '{"error": "no answer"}'; return 1; }
      cat "$ctl/result"
      ;;
    sim)
      local c=(curl -sS --max-time "$CALL_TIMEOUT" --unix-socket "$ctl/sock")
      case $2 in
        verify) "${c[@]}" http://worker/verify ;;
        fault) "${c[@]}" -X POST http://worker/fault ;;
        busy\ *) "${c[@]}" -X POST "http://worker/busy?ms=$(calc "${2#busy } * 1000" | cut -d. -f1)" ;;
        *) echo "{\"error\": \"no such request $2\"}"; return 1 ;;
      esac
      ;;
  esac
}
# verify NAME: the worker checks every chunk of its device memory against the seeded values.
verify() {
  local r
  r=$(wcall "$1" verify) || { echo "$r"; return 1; }
  echo "$r"
  python3 -c 'import json, sys; sys.exit(0 if json.loads(sys.argv[1]).get("ok") is True else 1)' "$r"
}

# fault NAME: a kernel of the worker stores to an illegal address; true when the worker answers
# that the fault happened (CUDA_ERROR_ILLEGAL_ADDRESS, now sticky in its context).
fault() {
  local r
  r=$(wcall "$1" fault) || { echo "$r"; return 1; }
  echo "$r"
  python3 -c 'import json, sys; sys.exit(0 if json.loads(sys.argv[1]).get("fault") == "CUDA_ERROR_ILLEGAL_ADDRESS" else 1)' "$r"
}
# thread_of TID PID: TID is a thread of PID.
thread_of() { echo "tid $1 of pid $2"; [ -n "$1" ] && [ -e "/proc/$2/task/$1" ]; }

# --- teardown ------------------------------------------------------------------------------------

# safe_end PID START NAME: ends one registered process without ever killing a live restored
# context. Restored (or possibly restored): `cryo stop`, which suspends first and refuses rather
# than kill; a refusal leaves it running and counts as a failure. Never restored: `cryo stop
# --fresh`, then SIGKILL if needed (tearing down a never-restored context is the ordinary exit).
safe_end() {
  local pid=$1 start=$2 name=$3 rc=0 ctl
  if [ "$start" = thaw ]; then
    ctl=$(wctl "$name")
    tr '\0' '\n' 2>/dev/null <"/proc/$pid/cmdline" | grep -q -e "^$ctl\$" -e "^$ctl/" || return 0
    start=$(start_time "$pid")
  fi
  alive "$pid" "$start" || return 0
  if is_restored "$pid"; then
    timeout 120 "$CRYO" --gpu "$BACKEND" stop "$pid" --json >>"$WORK/teardown.log" 2>&1 || rc=$?
    if alive "$pid" "$start"; then
      log "teardown: REFUSING to kill restored pid $pid ($name, state '$(state "$pid")', cryo stop rc $rc): left running"
      return 1
    fi
    log "teardown: restored pid $pid ($name) suspended and stopped by cryo stop"
  else
    timeout 60 "$CRYO" --gpu "$BACKEND" stop "$pid" --fresh --json >>"$WORK/teardown.log" 2>&1 || rc=$?
    alive "$pid" "$start" && kill -9 "$pid" 2>/dev/null
    wait_for 10 gone "$pid" "$start"
    log "teardown: never-restored pid $pid ($name) ended (cryo stop --fresh rc $rc)"
  fi
}
# stop_guards: SIGTERM to every guard this check started (a guard detaches from its tracees when
# it stops, and never kills them); SIGKILL after 10 s (its tracees are then detached by the kernel).
stop_guards() {
  local pid start name
  [ -f "$WORK/guards" ] || return 0
  while read -r pid start name; do
    alive "$pid" "$start" || continue
    kill -TERM "$pid" 2>/dev/null
    wait_for 10 gone "$pid" "$start" || kill -KILL "$pid" 2>/dev/null
    log "teardown: guard $pid ($name) stopped"
  done <"$WORK/guards"
}
# teardown: guards first (so a kill below is not caught by one), then every registered process,
# newest first (children before the parents that spawned them). Returns 1 if one was left alive.
teardown() {
  local pid start name bad=0
  stop_guards
  [ -f "$WORK/registry" ] || return 0
  while read -r pid start name; do
    safe_end "$pid" "$start" "$name" || bad=1
  done < <(tac "$WORK/registry")
  return "$bad"
}
