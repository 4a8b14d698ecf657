#!/usr/bin/env python3
"""What CRIU's action hooks cost a bare restore, and what CRIU does when its RPC client dies at
the post-restore notify.

  criu-hooks.py DIR ROUNDS SIZE_MIB   one image of a plain process of SIZE_MIB (made once in
      DIR/img), restored ROUNDS times by each arm, arms rotated: `bare` (`criu restore -d`, no
      hooks), `script` (`--action-script` of cryo's gate script's shape, every stage exiting at
      its first test), `rpc` (`criu swrk` with `notify_scripts`, each notify answered "go on" at
      once). Per restore: the wall time from spawn to CRIU's answer (the CLI arms: its exit),
      and from CRIU's -v4 log the time CRIU waited on each hook (from its `Running X scripts`
      line to its next line after the script or the notify).
  criu-hooks.py DIR die   a small image of a process that counts into a file every ms,
      restored through `criu swrk` with notify; the client process that holds the socket is
      SIGKILLed when CRIU's post-restore notify reaches it. Checks that CRIU exits, the restored
      root (the notify's pid) is gone and the counter never moved: the tree never ran.
      `CONTROL=1`: the client answers instead, and the same check must print FAIL.

Needs root. Hold the machine's benchmark lock around timed runs:
  flock /work/bench.lock python3 scripts/measure/criu-hooks.py /var/tmp/hooks 12 1024
"""
import os, socket, subprocess, sys, time, re, signal, statistics, json, tempfile

CRIU = "/usr/local/sbin/criu" if os.path.exists("/usr/local/sbin/criu") else "criu"
D = sys.argv[1]
DIE = sys.argv[2] == "die"
# CONTROL=1: the client answers the post-restore notify instead of dying; the check must fail.
CONTROL = os.environ.get("CONTROL") == "1"
ROUNDS, SIZE = (0, 16 << 20) if DIE else (int(sys.argv[2]), int(sys.argv[3]) << 20)
NOPL = os.path.join(D, "no-plugins"); os.makedirs(NOPL, exist_ok=True)
IMG = os.path.join(D, "img")
SCRIPT = os.path.join(D, "hook.sh")
with open(SCRIPT, "w") as f:
    f.write('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0\nexit 0\n')
os.chmod(SCRIPT, 0o755)

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F; n >>= 7
        if n: out.append(b | 0x80)
        else: out.append(b); return bytes(out)
def key(f, wt): return varint(f << 3 | wt)
def vi(f, n): return key(f, 0) + varint(n)
def ld(f, b): return key(f, 2) + varint(len(b)) + b
def parse(b):
    i, out = 0, {}
    while i < len(b):
        k = 0; s = 0
        while True:
            c = b[i]; i += 1; k |= (c & 0x7F) << s; s += 7
            if not c & 0x80: break
        f, wt = k >> 3, k & 7
        if wt == 0:
            v = 0; s = 0
            while True:
                c = b[i]; i += 1; v |= (c & 0x7F) << s; s += 7
                if not c & 0x80: break
        elif wt == 2:
            l = 0; s = 0
            while True:
                c = b[i]; i += 1; l |= (c & 0x7F) << s; s += 7
                if not c & 0x80: break
            v = b[i:i + l]; i += l
        else: raise ValueError(wt)
        out.setdefault(f, v)
    return out

COUNTER = os.path.join(D, "counter")
TICK = (f"fd=os.open('{COUNTER}',os.O_WRONLY|os.O_CREAT,0o600)\ni=0\n"
        "while True:\n i+=1\n os.pwrite(fd,b'%20d'%i,0)\n time.sleep(0.001)") if DIE else "while True: time.sleep(1)"

def make_image():
    if os.path.exists(os.path.join(IMG, "inventory.img")): return
    os.makedirs(IMG, exist_ok=True)
    p = subprocess.Popen(["python3", "-c",
        f"import time,os\nb=bytearray(os.urandom(1<<20))*({SIZE>>20})\nopen('{D}/ready','w').close()\n" + TICK],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while not os.path.exists(f"{D}/ready"): time.sleep(0.1)
    subprocess.run([CRIU, "dump", "-t", str(p.pid), "-D", IMG, "-L", NOPL, "-v4", "-o", "dump.log"], check=True)
    p.wait()

def hooks_ms(log):
    t = []; lines = open(log, errors="replace").read().splitlines()
    ts = lambda l: float(re.match(r"\(\s*([\d.]+)\)", l).group(1))
    for i, l in enumerate(lines):
        if "scripts" in l and "Running " in l and i + 1 < len(lines):
            j = i + 1
            while j < len(lines) and re.match(r"\(\s*[\d.]+\)\s+(\[|RPC)", lines[j]): j += 1
            if j < len(lines):
                t.append((l.split("Running ")[1].split()[0], round((ts(lines[j]) - ts(l)) * 1000, 3)))
    return t

def kill_wait(pid, child=False):
    os.kill(pid, signal.SIGKILL)
    if child: os.waitpid(pid, 0); return
    while os.path.exists(f"/proc/{pid}"): time.sleep(0.002)

def cli(extra):
    w = tempfile.mkdtemp(dir=D)
    t0 = time.monotonic_ns()
    r = subprocess.run([CRIU, "restore", "-d", "-D", IMG, "-L", NOPL, "-W", w, "-v4", "-o", "restore.log",
                        "--pidfile", "p"] + extra, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    ms = (time.monotonic_ns() - t0) / 1e6
    assert r.returncode == 0, r
    kill_wait(int(open(os.path.join(w, "p")).read()))
    return ms, hooks_ms(os.path.join(w, "restore.log"))

def rpc():
    w = tempfile.mkdtemp(dir=D)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dfd = os.open(IMG, os.O_RDONLY | os.O_DIRECTORY); wfd = os.open(w, os.O_RDONLY | os.O_DIRECTORY)
    env = dict(os.environ, CRIU_LIBS_DIR=NOPL)
    t0 = time.monotonic_ns()
    p = subprocess.Popen([CRIU, "swrk", "0"], stdin=theirs, stdout=subprocess.DEVNULL, env=env)
    theirs.close()
    opts = vi(1, dfd) + vi(9, 4) + ld(10, b"restore.log") + vi(12, 1) + vi(17, wfd) + vi(26, 1)
    ours.send(vi(1, 2) + ld(2, opts))
    notes = 0
    while True:
        m = parse(ours.recv(1 << 16))
        if m.get(1) == 6:
            notes += 1
            ours.send(vi(1, 6) + vi(3, 1)); continue
        break
    ms = (time.monotonic_ns() - t0) / 1e6
    assert m.get(2) == 1, m
    pid = parse(m[4])[1]
    ours.close(); p.wait(); os.close(dfd); os.close(wfd)
    kill_wait(pid, child=True)
    return ms, hooks_ms(os.path.join(w, "restore.log")) + [("notifies", notes)]

def die():
    """The client dies (SIGKILL) holding CRIU at its post-restore notify."""
    w = tempfile.mkdtemp(dir=D)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dfd = os.open(IMG, os.O_RDONLY | os.O_DIRECTORY); wfd = os.open(w, os.O_RDONLY | os.O_DIRECTORY)
    before = open(COUNTER, "rb").read()
    rd, wr = os.pipe()
    client = os.fork()
    if client == 0:
        os.close(rd)
        p = subprocess.Popen([CRIU, "swrk", "0"], stdin=theirs, stdout=subprocess.DEVNULL,
                             env=dict(os.environ, CRIU_LIBS_DIR=NOPL))
        os.write(wr, b"%d\n" % p.pid)
        theirs.close()
        opts = vi(1, dfd) + vi(9, 4) + ld(10, b"restore.log") + vi(12, 1) + vi(17, wfd) + vi(26, 1)
        ours.send(vi(1, 2) + ld(2, opts))
        while True:
            m = parse(ours.recv(1 << 16))
            if m.get(1) == 2:
                os._exit(0)  # CONTROL: the restore's answer; the tree runs on
            if m.get(1) == 6 and parse(m[5]).get(1) == b"post-restore" and CONTROL:
                os.write(wr, b"%d\n" % parse(m[5])[2])
            elif m.get(1) == 6 and parse(m[5]).get(1) == b"post-restore":
                os.write(wr, b"%d\n" % parse(m[5])[2])
                os.kill(os.getpid(), signal.SIGKILL)
            ours.send(vi(1, 6) + vi(3, 1))
    os.close(wr); theirs.close(); ours.close()
    lines = os.fdopen(rd).read().split()
    os.waitpid(client, 0)
    criu, root = int(lines[0]), int(lines[1])
    # Both were the dead client's children, reparented now; each is waited for by its pidfd
    # (a process that already ended: no pidfd, gone). The root is held at the gate until CRIU
    # reads the dead socket, so its pidfd names it.
    def ended(pid):
        try:
            pfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        return bool(select.select([pfd], [], [], 3 if CONTROL else 30)[0])
    import select
    gone = ended(criu) and ended(root)
    log = open(os.path.join(w, "restore.log"), errors="replace").read()
    after = open(COUNTER, "rb").read()
    print(json.dumps({"criu": criu, "root": root, "root_gone": gone, "counter_before": before.decode().strip(),
                      "counter_after": after.decode().strip(),
                      "criu_says": [l for l in log.splitlines() if "unexpectedly" in l or "Killing" in l or "FAILED" in l or "post-restore" in l]}))
    ok = gone and before == after and "Client exited unexpectedly" in log
    print("PASS: the tree never ran and is gone" if ok else "FAIL")
    if CONTROL and not gone:
        os.kill(root, signal.SIGKILL)
    sys.exit(0 if ok else 1)

make_image()
if DIE:
    die()
arms = {"bare": lambda: cli([]), "script": lambda: cli(["--action-script", SCRIPT]), "rpc": rpc}
names = list(arms); res = {n: [] for n in names}; hk = {n: [] for n in names}
load0 = open("/proc/loadavg").read().split()[:3]
for r in range(ROUNDS):
    order = names[r % 3:] + names[:r % 3]
    if r % 2: order = order[::-1]
    for n in order:
        ms, h = arms[n]()
        res[n].append(ms); hk[n].append(h)
        print(json.dumps({"round": r, "arm": n, "ms": round(ms, 1), "hooks": h}), flush=True)
load1 = open("/proc/loadavg").read().split()[:3]
print("load", load0, "->", load1)
for n in names:
    tot = [sum(x[1] for x in h if x[0] != "notifies") for h in hk[n]]
    print(f"{n:7s} wall median {statistics.median(res[n]):7.1f} ms  hooks in CRIU median {statistics.median(tot):6.1f} ms  (n={len(res[n])})")
for a in ("script", "rpc"):
    rat = [x / y for x, y in zip(res[a], res["bare"])]
    print(f"{a}/bare per-round wall ratio median {statistics.median(rat):.3f}  min {min(rat):.3f} max {max(rat):.3f}")
rat = [x / y for x, y in zip(res["script"], res["rpc"])]
print(f"script/rpc per-round wall ratio median {statistics.median(rat):.3f}  min {min(rat):.3f} max {max(rat):.3f}")
