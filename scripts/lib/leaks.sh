# Sourced by scripts/test.sh: no process a test run starts may outlive the run.
#
# leaks_begin moves the calling shell into a fresh cgroup of the unified (v2) hierarchy, below the
# one it is in: everything the run starts from then on is in that cgroup's subtree (the test
# kit's per-test cgroups are made below it, `crates/testkit/src/own.rs`), and carries the run's
# tag in its environment (CRYO_TEST_RUN), which a process that moves to another cgroup keeps
# (cryo's pin holder moves to `cryo-pins`). leaks_end, once the run is over, waits (bounded) for
# both to be empty, and otherwise lists what is left, ends what is in the run's cgroup
# (`cgroup.kill`: no pid or name is matched) and returns 1. It also prints what the test kit
# ended at the end of a test that had left it running (not a failure: the kit ended it).

# Sets LEAKS_HOME (the shell's cgroup), LEAKS_CGROUP, LEAKS_LEFT; exports the run's tag.
leaks_begin() {
    local mount
    mount="$(findmnt -n -t cgroup2 -o TARGET | head -n1)"
    if [ -z "$mount" ]; then
        echo "leaks: no cgroup v2 (unified) hierarchy is mounted; the leak check needs one" >&2
        return 1
    fi
    LEAKS_HOME="$mount$(sed -n 's/^0:://p' /proc/self/cgroup)"
    LEAKS_HOME="${LEAKS_HOME%/}"
    local id
    id="$$-$(date +%s%N)"
    LEAKS_CGROUP="$LEAKS_HOME/cryo-test-run-$id"
    mkdir "$LEAKS_CGROUP"
    LEAKS_LEFT="$(mktemp -d /tmp/cryo-test-left.XXXXXX)"
    echo $$ > "$LEAKS_CGROUP/cgroup.procs"
    export CRYO_TEST_RUN="$id" CRYO_TEST_LEFT_DIR="$LEAKS_LEFT"
}

# The pids in the run's cgroup subtree, one a line.
leaks_in_cgroup() {
    find "$LEAKS_CGROUP" -name cgroup.procs -exec cat {} + 2>/dev/null
}

# The pids that carry the run's tag anywhere, one a line.
leaks_tagged() {
    grep -lzx "CRYO_TEST_RUN=$LEAKS_RUN" /proc/[0-9]*/environ 2>/dev/null \
        | sed -n 's|^/proc/\([0-9]*\)/environ$|\1|p'
}

leaks_describe() {
    local pid
    for pid in "$@"; do
        echo "  $pid [$(sed -n 's/^0:://p' "/proc/$pid/cgroup" 2>/dev/null)] $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"
    done
}

# Returns 1, listing them, when processes of the run are still running.
leaks_end() {
    # What runs from here on is not the run's.
    LEAKS_RUN="$CRYO_TEST_RUN"
    unset CRYO_TEST_RUN CRYO_TEST_LEFT_DIR
    echo $$ > "$LEAKS_HOME/cgroup.procs"
    local i in_cgroup tagged outside
    for i in $(seq 300); do
        in_cgroup="$(leaks_in_cgroup)"
        tagged="$(leaks_tagged)"
        [ -z "$in_cgroup$tagged" ] && break
        sleep 0.1
    done
    if [ -n "$(ls -A "$LEAKS_LEFT")" ]; then
        echo "leaks: processes the test kit ended at the end of the test that left them running:"
        cat "$LEAKS_LEFT"/*
    fi
    rm -rf "$LEAKS_LEFT"
    local status=0
    if [ -n "$in_cgroup$tagged" ]; then
        echo "leaks: processes started by the test run are still running after it:" >&2
        # shellcheck disable=SC2086
        leaks_describe $(printf '%s\n%s\n' "$in_cgroup" "$tagged" | sort -un) >&2
        status=1
    fi
    echo 1 > "$LEAKS_CGROUP/cgroup.kill"
    for i in $(seq 300); do
        grep -qx 'populated 0' "$LEAKS_CGROUP/cgroup.events" && break
        sleep 0.1
    done
    find "$LEAKS_CGROUP" -depth -type d -exec rmdir {} + 2>/dev/null || true
    outside="$(printf '%s\n' $tagged | grep -vxF -f <(printf '%s\n' $in_cgroup) || true)"
    if [ -n "$outside" ]; then
        echo "leaks: those outside the run's cgroup are left running (ended by hand only):" >&2
        # shellcheck disable=SC2086
        leaks_describe $outside >&2
    fi
    return "$status"
}
