#!/usr/bin/env python3
"""Freeze-only A/B of cryo builds, on a host made busy by this script, paired ABBA rounds.

usage: freeze-ab.py SIZE ROUNDS A B [--busy N] [--busy-nice NICE] [--out FILE]

A and B: `PATH` of a cryo build, or `PATH@VAR=VALUE` (the arm runs with that variable set:
one binary, two settings). Each round (round 0 warms up, not counted) runs both arms, in the
order A B, then B A: a fresh simulated worker of SIZE, then `PATH freeze --json PID --image
IMG` on a private simulated GPU (the driver and the workers from A's binary). Per freeze:
GPU free, worker gone and published (durable) from the launch (CLOCK_MONOTONIC, as
`cryo bench freeze` measures them), each less the simulated checkpoint copy (`--json`'s
`checkpoint_ms`: the copy swings with the host's memory, the same work in both arms): the
*overhead*; cryo's dump and publish steps; and whether the dump was pinned to one CPU (a
`cpus_pinned` record in the journal).

`--busy N` (default 2) starts N CPU burners (`while :; do :; done`) and one writer (128 MiB
through the page cache, `fdatasync`, 0.2 s pause, in a loop) at nice `--busy-nice` (default
0: the priority of another worker serving, the kubelet, an agent) 20 s before the first round,
and ends them by pid after the last; `--busy 0` starts none. The load average is printed at
the start and the end, and kept with each freeze.

Prints per measure the medians and the paired A/B ratio (per round, A's time over B's; above 1:
B faster) with a 90% bootstrap interval resampling blocks of two rounds (an ABBA block). Needs
root and CRIU. Hold the machine's benchmark lock around it:
  flock /work/bench.lock python3 scripts/measure/freeze-ab.py 1GiB 12 OLD NEW
"""
import argparse
import json
import os
import random
import shutil
import signal
import statistics
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
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--busy-nice", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    size = parse_size(args.size)
    d = tempfile.mkdtemp(prefix="freeze-ab-", dir="/var/tmp")
    exes, envs = {}, {}
    for k, spec in (("A", args.a), ("B", args.b)):
        path, _, kv = spec.partition("@")
        envs[k] = dict([kv.split("=", 1)]) if kv else {}
        exes[k] = os.path.join(d, f"cryo-{k}")
        shutil.copy(path, exes[k])
    worker_exe = exes["A"]
    env = dict(os.environ, CRYO_GPU="sim", CRYO_SIM_DIR=d, CRYO_STATE_DIR=os.path.join(d, "state"))
    env.pop("CRYO_FAILPOINT", None)
    busy = Busy(args.busy, args.busy_nice, d)
    drv = subprocess.Popen([worker_exe, "sim", "driver", "--gpus", "1", "--gpu-memory",
                            str(size + (64 << 20)), "--dir", d],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    rows = []
    try:
        if args.busy:
            time.sleep(20)
        print(f"load average at start: {load()} (busy: {args.busy} burners + a writer at nice "
              f"{args.busy_nice})", flush=True)
        for r in range(args.rounds + 1):
            for arm in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
                res = one(exes[arm], worker_exe, dict(env, **envs[arm]), d, size)
                res.update(arm=arm, round=r, load=os.getloadavg()[0])
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
            json.dump(rows, f)
    summary(rows)


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


def one(exe, worker_exe, env, d, size):
    ready = os.path.join(d, "ready")
    if os.path.exists(ready):
        os.remove(ready)
    w = subprocess.Popen([worker_exe, "sim", "worker", "--memory", str(size), "--dir", d,
                          "--ready-file", ready], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env=env)
    t0 = time.time()
    while not os.path.exists(ready) or os.path.getsize(ready) == 0:
        if time.time() - t0 > 120:
            w.kill()
            raise RuntimeError("worker not ready in 120 s")
        time.sleep(0.02)
    with open(ready) as f:
        pid = json.load(f)["pid"]
    img = os.path.join(d, "img")
    pinned_before = pins(d)
    origin = mono_ns()
    p = subprocess.run([exe, "freeze", "--json", str(pid), "--image", img], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        w.kill()
        raise RuntimeError(p.stderr)
    v = json.loads(p.stdout)
    m = v["moments"]
    ck = sum(s.get("checkpoint_ms") or 0 for s in v["suspended"])
    at = lambda k: (m[k] - origin) / 1e6  # noqa: E731
    w.wait()
    shutil.rmtree(img, ignore_errors=True)
    return {"gf_over": at("gpu_free") - ck, "gone_over": at("worker_gone") - ck,
            "durable_over": at("published") - ck, "dump_ms": v.get("dump_ms"),
            "publish_ms": v.get("publish_ms"), "started": at("started"), "ckpt": ck,
            "pinned": pins(d) - pinned_before}


def interval(ratios, n=4000):
    """90% bootstrap interval of the median ratio, ABBA blocks of two rounds as units."""
    rnd = random.Random(7)
    blocks = [ratios[i:i + 2] for i in range(0, len(ratios), 2)]
    meds = sorted(statistics.median([x for _ in blocks for x in rnd.choice(blocks)])
                  for _ in range(n))
    return meds[int(0.05 * n)], meds[int(0.95 * n)]


def summary(rows):
    by = {"A": [], "B": []}
    for r in rows:
        by[r["arm"]].append(r)
    for k in ("gf_over", "gone_over", "durable_over", "dump_ms", "publish_ms", "started", "ckpt"):
        a = [r[k] for r in by["A"]]
        b = [r[k] for r in by["B"]]
        ratios = [x / y for x, y in zip(a, b) if y]
        if not ratios:
            continue
        lo, hi = interval(ratios)
        print(f"{k:12s} A {statistics.median(a):8.1f}  B {statistics.median(b):8.1f} ms  "
              f"paired A/B {statistics.median(ratios):.3f} [{lo:.3f}, {hi:.3f}]; "
              f"B faster in {sum(1 for x in ratios if x > 1)}/{len(ratios)}")
    for k, rs in sorted(by.items()):
        print(f"arm {k}: the dump pinned in {sum(1 for r in rs if r['pinned'])}/{len(rs)} freezes")


if __name__ == "__main__":
    main()
