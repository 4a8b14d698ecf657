# One raw call of the CUDA driver's checkpoint API through libcuda (ctypes), with no help from
# cryo: no pid normalisation, no state check first. Prints one JSON line:
#   {"call": "state", "pid": 123, "result": 0, "name": "CUDA_SUCCESS", "value": "running"}
# value: the state word (state), the thread id (restore-tid), null (lock, unlock).
# Usage: driver_call.py state|lock|unlock|restore-tid PID [LOCK_TIMEOUT_MS]
# The caller runs it under `timeout`: a call that never returns is an answer too.
import ctypes, json, sys

call, pid = sys.argv[1], int(sys.argv[2])
timeout_ms = int(sys.argv[3]) if len(sys.argv) > 3 else 0
cuda = ctypes.CDLL("libcuda.so.1")
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed", 4: "checkpointing", 5: "restoring"}


def name(r):
    s = ctypes.c_char_p()
    if cuda.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value:
        return s.value.decode()
    return "CUresult %d" % r


init = cuda.cuInit(0)
value = None
if call == "state":
    st = ctypes.c_int(-1)
    r = cuda.cuCheckpointProcessGetState(pid, ctypes.byref(st))
    value = STATES.get(st.value, st.value) if r == 0 else None
elif call == "restore-tid":
    tid = ctypes.c_int(0)
    r = cuda.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
    value = tid.value if r == 0 else None
elif call == "lock":
    args = (ctypes.c_uint32 * 16)()  # CUcheckpointLockArgs: 64 bytes, timeoutMs first
    args[0] = timeout_ms
    r = cuda.cuCheckpointProcessLock(pid, ctypes.byref(args))
elif call == "unlock":
    r = cuda.cuCheckpointProcessUnlock(pid, None)
else:
    sys.exit("unknown call %r" % call)
print(json.dumps({"call": call, "pid": pid, "result": r, "name": name(r), "value": value,
                  "cuInit": init}))
