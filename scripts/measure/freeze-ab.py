#!/usr/bin/env python3
"""Freeze-only A/B of cryo builds (or settings, or the bare route), paired rounds, alternating.

usage: freeze-ab.py SIZE ROUNDS A B [C ...] [--busy N] [--busy-nice NICE] [--out FILE]

Each arm: `PATH` of a cryo build, `PATH@VAR=VALUE[,VAR=VALUE...]` (the arm runs with those
variables set: one binary, several settings), or `bare` (the bare route, as `cryo bench freeze`
runs it: `cryo cuda-checkpoint --action lock` and `--action checkpoint` from the first cryo
arm's binary, `criu dump -t PID -D DIR -o dump.log` with the `criu` on PATH or `$CRIU`, then a
fsync of every image file and the directory). The first arm is the baseline. Each round (round
0 warms up, not counted) runs every arm, in the order given, then reversed in the next round
(A B C, C B A: ABBA for two arms), each on a fresh simulated worker of SIZE, on a private
simulated GPU (the driver and the workers from the first cryo arm's binary); a cryo arm runs
`PATH freeze --json PID --image IMG`.

Per freeze, ms from the launch of its first process (CLOCK_MONOTONIC, as `cryo bench freeze`
measures them): GPU free, worker gone and published (durable), each less the simulated
checkpoint copy as the driver timed it (the copy swings with the host's memory, the same work
in every arm): the *overhead*; the copy itself (`ckpt`); the dump step (GPU free to worker
gone), CRIU's page loop in it as CRIU timed it (`stats-dump`'s memdump), and the step less the
loop (`besides`); cryo's dump and publish steps and its dump's moments (`gate`, `verdict`,
`criu_exit`, from the dump's start), the bytes its follower hashed; `MemFree` at the start;
whether the dump was pinned to one CPU (a `cpus_pinned` record in the journal).

`--busy N` (default 2) starts N CPU burners (`while :; do :; done`) and one writer (128 MiB
through the page cache, `fdatasync`, 0.2 s pause, in a loop) at nice `--busy-nice` (default
0: the priority of another worker serving, the kubelet, an agent) 20 s before the first round,
and ends them by pid after the last; `--busy 0` starts none (a quiet host). The load average is
printed at the start and the end, and kept with each freeze.

Prints per measure each arm's median and its paired ratio against the first arm (per round,
the first arm's time over this arm's; above 1: this arm faster) with a 90% bootstrap interval
resampling blocks of two rounds (one of each order), and the median per-round difference
(this arm less the first) in ms. Needs root and CRIU. Hold the machine's benchmark lock:
  flock /work/bench.lock python3 scripts/measure/freeze-ab.py 1GiB 12 OLD NEW --busy 0
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import tempfile
import time


def mono_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def parse_size(s):
    for unit, mult in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if s.endswith(unit):
            return int(s[: -len(unit)]) * mult
    return int(s)


def load():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def mem_free_mib():
    for line in open("/proc/meminfo"):
        if line.startswith("MemFree:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Busy:
    """CPU burners and a syncing writer, ended by pid."""

    def __init__(self, n, nice, d):
        self.procs = []
        pre = lambda: os.nice(nice)  # noqa: E731
        for _ in range(n):
            self.procs.append(subprocess.Popen(["bash", "-c", "while :; do :; done"],
                                               preexec_fn=pre, start_new_session=True))
        if n:
            f = os.path.join(d, "busy-writer")
            self.procs.append(subprocess.Popen(
                ["bash", "-c", f"while :; do dd if=/dev/zero of={f} bs=1M count=128 "
                 "conv=fdatasync status=none; sleep 0.2; done"],
                preexec_fn=pre, start_new_session=True))

    def end(self):
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("size")
    ap.add_argument("rounds", type=int)
    ap.add_argument("arms", nargs="+")
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--busy-nice", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    if len(args.arms) < 2:
        ap.error("at least two arms")
    size = parse_size(args.size)
    d = tempfile.mkdtemp(prefix="freeze-ab-", dir="/var/tmp")
    arms = []
    for i, spec in enumerate(args.arms):
        name = chr(ord("A") + i)
        if spec == "bare":
            arms.append({"name": name, "spec": spec, "exe": None, "env": {}})
            continue
        path, _, kv = spec.partition("@")
        env = dict(p.split("=", 1) for p in kv.split(",")) if kv else {}
        exe = os.path.join(d, f"cryo-{name}")
        shutil.copy(path, exe)
        arms.append({"name": name, "spec": spec, "exe": exe, "env": env})
    cryo_exes = [a["exe"] for a in arms if a["exe"]]
    if not cryo_exes:
        ap.error("at least one cryo arm (its binary runs the driver and the workers)")
    worker_exe = cryo_exes[0]
    for a in arms:
        print(f"arm {a['name']}: {a['spec']}", flush=True)
    env = dict(os.environ, CRYO_GPU="sim", CRYO_SIM_DIR=d, CRYO_STATE_DIR=os.path.join(d, "state"))
    env.pop("CRYO_FAILPOINT", None)
    busy = Busy(args.busy, args.busy_nice, d)
    drv = subprocess.Popen([worker_exe, "sim", "driver", "--gpus", "1", "--gpu-memory",
                            str(size + (64 << 20)), "--dir", d],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    rows = []
    try:
        t0 = time.time()
        while not os.path.exists(os.path.join(d, "driver.sock")):
            if drv.poll() is not None or time.time() - t0 > 60:
                raise RuntimeError("the simulated driver did not start")
            time.sleep(0.05)
        if args.busy:
            time.sleep(20)
        print(f"load average at start: {load()} (busy: {args.busy} burners + a writer at nice "
              f"{args.busy_nice})", flush=True)
        for r in range(args.rounds + 1):
            order = arms if r % 2 == 0 else list(reversed(arms))
            for a in order:
                arm_env = dict(env, **a["env"])
                if a["exe"]:
                    res = one(a["exe"], worker_exe, arm_env, d, size)
                else:
                    res = bare(worker_exe, arm_env, d, size)
                res.update(arm=a["name"], round=r, load=os.getloadavg()[0])
                if r > 0:
                    rows.append(res)
                print(json.dumps(res), flush=True)
        print(f"load average at end: {load()}", flush=True)
    finally:
        busy.end()
        drv.kill()
        drv.wait()
        shutil.rmtree(d, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arms": [{k: a[k] for k in ("name", "spec", "env")} for a in arms],
                       "rows": rows}, f)
    summary(rows, [a["name"] for a in arms])


def pins(d):
    """`cpus_pinned` records in the state's journal so far."""
    n = 0
    for root, _, files in os.walk(os.path.join(d, "state")):
        for f in files:
            if f.startswith("journal"):
                try:
                    with open(os.path.join(root, f), "rb") as fh:
                        n += fh.read().count(b'"cpus_pinned"')
                except OSError:
                    pass
    return n


def varint(b, i):
    v, s = 0, 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << s
        s += 7
        if not c & 0x80:
            return v, i


def memdump_ms(img):
    """CRIU's page loop, ms, from the image's `stats-dump` (two magics, a length, one
    `StatsEntry` whose field 1 is the dump's: field 3 `memdump_time`, microseconds)."""
    try:
        b = open(os.path.join(img, "stats-dump"), "rb").read()
    except OSError:
        return float("nan")
    (n,) = struct.unpack_from("<I", b, 8)
    msg, i = b[12:12 + n], 0
    while i < len(msg):
        key, i = varint(msg, i)
        if key & 7 == 2:
            ln, i = varint(msg, i)
            if key >> 3 == 1:
                sub, j = msg[i:i + ln], 0
                while j < len(sub):
                    k2, j = varint(sub, j)
                    v, j = varint(sub, j)
                    if k2 >> 3 == 3:
                        return v / 1000
            i += ln
        else:
            _, i = varint(msg, i)
    return float("nan")


def ckpt_copy_ms(d, pid, since_ns):
    """The simulated driver's checkpoint copies of `pid` since `since_ns`, ms (its `copies`)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.path.join(d, "driver.sock"))
    body = json.dumps("copies").encode()
    s.sendall(struct.pack("<I", len(body)) + body)
    hdr = b""
    while len(hdr) < 4:
        hdr += s.recv(4 - len(hdr))
    (n,) = struct.unpack("<I", hdr)
    buf = b""
    while len(buf) < n:
        buf += s.recv(n - len(buf))
    s.close()
    copies = json.loads(buf)["copies"]
    return sum((c["end"] - c["start"]) / 1e6 for c in copies
               if c["pid"] == pid and c["kind"] == "checkpoint" and c["start"] >= since_ns)


def start_worker(worker_exe, env, d, size):
    ready = os.path.join(d, "ready")
    if os.path.exists(ready):
        os.remove(ready)
    w = subprocess.Popen([worker_exe, "sim", "worker", "--memory", str(size), "--dir", d,
                          "--ready-file", ready], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env=env)
    t0 = time.time()
    while not os.path.exists(ready) or os.path.getsize(ready) == 0:
        if w.poll() is not None:
            raise RuntimeError(f"the worker exited ({w.returncode}) before it was ready")
        if time.time() - t0 > 120:
            w.kill()
            raise RuntimeError("worker not ready in 120 s")
        time.sleep(0.02)
    with open(ready) as f:
        return w, json.load(f)["pid"]


def one(exe, worker_exe, env, d, size):
    w, pid = start_worker(worker_exe, env, d, size)
    img = os.path.join(d, "img")
    pinned_before = pins(d)
    free = mem_free_mib()
    origin = mono_ns()
    p = subprocess.run([exe, "freeze", "--json", str(pid), "--image", img], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        w.kill()
        raise RuntimeError(p.stderr)
    v = json.loads(p.stdout)
    m = v["moments"]
    ck = ckpt_copy_ms(d, pid, origin)
    at = lambda k: (m[k] - origin) / 1e6  # noqa: E731
    w.wait()
    loop = memdump_ms(img)
    shutil.rmtree(img, ignore_errors=True)
    ph = v.get("dump_phases") or {}
    step = at("worker_gone") - at("gpu_free")
    return {"gf_over": at("gpu_free") - ck, "gone_over": at("worker_gone") - ck,
            "durable_over": at("published") - ck, "ckpt": ck, "step": step,
            "loop": loop, "besides": step - loop, "dump_ms": v.get("dump_ms"),
            "publish_ms": v.get("publish_ms"), "gate": ph.get("gate_ms"),
            "verdict": ph.get("verdict_ms"), "criu_exit": ph.get("criu_exit_ms"),
            "followed_mib": (ph.get("followed_bytes") or 0) / (1 << 20),
            "started": at("started"), "free_mib": free, "pinned": pins(d) - pinned_before}


def run(cmd, env):
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd}: {p.stderr}")


def bare(cryo, env, d, size):
    """The bare route: cuda-checkpoint lock and checkpoint, `criu dump`, a fsync of the image."""
    w, pid = start_worker(cryo, env, d, size)
    img = os.path.join(d, "img")
    os.mkdir(img)
    criu = os.environ.get("CRIU") or shutil.which("criu") or "/usr/local/sbin/criu"
    free = mem_free_mib()
    origin = mono_ns()
    ms = lambda: (mono_ns() - origin) / 1e6  # noqa: E731
    run([cryo, "cuda-checkpoint", "--action", "lock", "--pid", str(pid), "--timeout", "30000"],
        env)
    run([cryo, "cuda-checkpoint", "--action", "checkpoint", "--pid", str(pid)], env)
    gf = ms()
    run([criu, "dump", "-t", str(pid), "-D", img, "-o", "dump.log"], env)
    w.wait()
    gone = ms()
    for f in os.listdir(img):
        fd = os.open(os.path.join(img, f), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    durable = ms()
    ck = ckpt_copy_ms(d, pid, origin)
    loop = memdump_ms(img)
    shutil.rmtree(img, ignore_errors=True)
    return {"gf_over": gf - ck, "gone_over": gone - ck, "durable_over": durable - ck,
            "ckpt": ck, "step": gone - gf, "loop": loop, "besides": gone - gf - loop,
            "dump_ms": gone - gf, "publish_ms": durable - gone, "started": 0.0,
            "free_mib": free, "pinned": 0}


def interval(ratios, n=4000):
    """90% bootstrap interval of the median, blocks of two rounds (one of each order) as units."""
    rnd = random.Random(7)
    blocks = [ratios[i:i + 2] for i in range(0, len(ratios), 2)]
    meds = sorted(statistics.median([x for _ in blocks for x in rnd.choice(blocks)])
                  for _ in range(n))
    return meds[int(0.05 * n)], meds[int(0.95 * n)]


KEYS = ("gf_over", "gone_over", "durable_over", "ckpt", "step", "loop", "besides", "dump_ms",
        "publish_ms", "gate", "verdict", "criu_exit", "followed_mib", "started", "free_mib")


UNITS = {"followed_mib": "MiB", "free_mib": "MiB"}


def summary(rows, names):
    by = {n: {r["round"]: r for r in rows if r["arm"] == n} for n in names}
    base = names[0]
    for k in KEYS:
        for n in names[1:]:
            rounds = [r for r in by[base] if r in by[n]
                      and isinstance(by[base][r].get(k), (int, float))
                      and isinstance(by[n][r].get(k), (int, float))]
            a = [by[base][r][k] for r in rounds]
            b = [by[n][r][k] for r in rounds]
            pairs = [(x, y) for x, y in zip(a, b) if x == x and y == y]
            if not pairs:
                continue
            ratios = [x / y for x, y in pairs if y]
            diffs = [y - x for x, y in pairs]
            line = (f"{k:12s} {base} {statistics.median(x for x, _ in pairs):8.1f}  "
                    f"{n} {statistics.median(y for _, y in pairs):8.1f}  "
                    f"{n}-{base} {statistics.median(diffs):+7.1f} {UNITS.get(k, 'ms')}")
            if ratios:
                lo, hi = interval(ratios)
                line += (f"  paired {base}/{n} {statistics.median(ratios):.3f} [{lo:.3f}, "
                         f"{hi:.3f}]; {n} faster in {sum(1 for x in ratios if x > 1)}/"
                         f"{len(ratios)}")
            print(line)
    for n in names:
        rs = by[n].values()
        print(f"arm {n}: the dump pinned in {sum(1 for r in rs if r['pinned'])}/{len(rs)} "
              f"freezes")


if __name__ == "__main__":
    main()
