#!/usr/bin/env python3
"""Thaw-only A/B of cryo builds, with the bare route as the baseline of the same run.

One worker on a private simulated GPU is frozen once (by the first build); the same image is
then thawed round after round by each arm in turn, from the page cache and after dropping the
caches (cold); each round runs every arm once, a rotation of the arms, reversed every other
round (two arms: A B, B A; three: ABC CBA BCA ACB CAB BAC), so that no arm always follows the
same one. Arms:

  NAME=PATH  `PATH thaw IMAGE --json --health-url unix:SOCK:/health` (a cryo build)
  bare       `criu restore -d`, `cryo cuda-checkpoint --action restore`, `--action unlock`, then
             the health URL polled here (`--bare-poll`: fixed 20 ms as cryo's old check, or
             1 ms doubling to 20 ms as its new one)
  NAME=bare:ARGS  the bare route with ARGS (split at spaces) added to its `criu restore`, to
             measure one of cryo's CRIU options alone (`-v4`, `--action-script PATH`)

Per thaw: the first answer from the arm's first process launch (CLOCK_MONOTONIC, as `cryo bench
freeze` measures it), the simulated driver's restore copy in that window (its cost swings with
the host's memory: the *overhead* is the moment less the copy), and the steps (cryo: its
`--json` report; bare: timed around each process). Prints medians, and for every pair of arms
the paired ratio (per round, the first-named arm's time over the other's; above 1: the other
arm is faster) with a 90% interval resampling blocks of two rounds (a rotation and its reverse).
`--fincore` records what of the pages files, the cryo binary and CRIU was cached before each
thaw (other processes that drop the caches show there); `--sample MS` records, every MS ms of
each thaw, how much of the pages files is cached, the host's CPU split and the disk's reads,
and per thaw the CPU of the arm's processes and of the restored root and the kernel's reclaim
counters (in the `--out` records; the medians of the CPU are printed); `--trace DIR` runs the first rounds
under `strace -f -b execve` (cryo's own threads; CRIU cannot restore under ptrace, so its
children are let go at their exec and the bare route is not traced).

The restore's fault mode: on this project's VMs a restorer faults its memory in at one of two
speeds, at random, in any arm (about 0.35 s of CPU per GiB, or twice that: the hypervisor's
faults count as the guest's CPU). Each thaw records its restorer's CPU (`cpu_main`, the restored
root's main thread); a thaw is slow-fault when that is over SLOW_FAULT times the median of every
thaw of its cache mode, the count per arm is printed, and every paired ratio is printed twice:
over all rounds, and like with like (`like`: only the rounds whose restores all ran fast).
`--settle` faults in and frees twice the size (and 64 MiB) on small pages right before every
thaw, all arms alike (measured in session 20: it did not make the slow mode rarer).

Needs root (CRIU, drop_caches). Hold the machine's benchmark lock around it:
  flock /work/bench.lock python3 scripts/measure/thaw-ab.py --arm A=target/release/cryo ...
"""

import argparse
import ctypes
import json
import re
import os
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time


# A restore is in the slow-fault mode when its restorer's CPU is over this many times the median
# of every thaw of its cache mode (on this host fast about 0.35 s per GiB, within 1.16x of the
# median; slow 1.45x to 2x and more: 0.55-0.75 s per GiB on a quiet host, session 20).
SLOW_FAULT = 1.3


def now_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def parse_size(s):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.lower().removesuffix("ib").removesuffix("b")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def sim_copies(d):
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.path.join(d, "driver.sock"))
    body = json.dumps("copies").encode()
    s.sendall(struct.pack("<I", len(body)) + body)
    n = struct.unpack("<I", recv_exact(s, 4))[0]
    reply = json.loads(recv_exact(s, n))
    s.close()
    return reply["copies"]


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise OSError("connection closed")
        b += c
    return b


class Sampler:
    """Every `ms` during one thaw: how much of the pages files is cached (mincore over a
    mapping never touched, so it faults nothing in), the host's CPU split (/proc/stat) and the
    disk's reads (/proc/diskstats); and over the whole thaw the kernel's reclaim counters
    (/proc/vmstat). Started before the arm's first process, stopped after its first answer."""

    def __init__(self, files, ms):
        import threading
        self.ms = ms
        self.files = files
        self.samples = []
        self.stop_ev = threading.Event()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.maps = []
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            n = os.fstat(fd).st_size
            addr = self.libc.mmap(None, n, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            os.close(fd)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            self.maps.append((addr, n, ctypes.create_string_buffer((n + 4095) // 4096)))
        self.vm0 = self.vmstat()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def cached_mib(self):
        total = 0
        for addr, n, vec in self.maps:
            if self.libc.mincore(addr, n, vec) != 0:
                return -1
            total += len(vec) - vec.raw.count(0)
        return total * 4096 / (1 << 20)

    @staticmethod
    def cpu():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
        # user+nice, system+irq+softirq, idle, iowait (clock ticks)
        return (v[0] + v[1], v[2] + v[5] + v[6], v[3], v[4])

    @staticmethod
    def disk_read_mib():
        total = 0
        with open("/proc/diskstats") as f:
            for line in f:
                x = line.split()
                if re.fullmatch(r"(sd[a-z]+|vd[a-z]+|nvme\d+n\d+|xvd[a-z]+)", x[2]):
                    total += int(x[5])
        return total * 512 / (1 << 20)

    @staticmethod
    def vmstat():
        keep = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct",
                "pgmajfault", "workingset_refault_file", "allocstall_normal", "allocstall_movable")
        out = {}
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k in keep:
                    out[k] = int(v)
        return out

    def loop(self):
        t0 = now_ns()
        while True:
            self.samples.append(((now_ns() - t0) / 1e6, self.cached_mib(), self.cpu(),
                                 self.disk_read_mib()))
            if self.stop_ev.wait(self.ms / 1000):
                break

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stop_ev.set()
        self.thread.join()
        for addr, n, _ in self.maps:
            self.libc.munmap(addr, n)
        vm1 = self.vmstat()
        reclaim = {k: vm1[k] - self.vm0.get(k, 0) for k in vm1}
        rows = []
        prev = None
        for t, cached, cpu, disk in self.samples:
            row = dict(t=round(t, 1), cached=round(cached), disk=round(disk))
            if prev is not None:
                d = [a - b for a, b in zip(cpu, prev[2])]
                tot = sum(d) or 1
                row.update(user=round(d[0] / tot, 2), sys=round(d[1] / tot, 2),
                           idle=round(d[2] / tot, 2), iowait=round(d[3] / tot, 2),
                           disk_mibs=round((disk - prev[3]) / ((t - prev[0]) / 1000)))
            rows.append(row)
            prev = (t, cached, cpu, disk)
        if rows:
            base = rows[0]["disk"]
            for r in rows:
                r["disk"] -= base
        return dict(samples=rows, vm=reclaim)


def settle(nbytes):
    """Fault in `nbytes` of fresh anonymous memory on small pages (as CRIU's restorer takes its
    memory) and free it: the step every arm takes right before its thaw when `--settle` asks.
    Returns the ms it took (not part of any thaw)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    t = now_ns()
    addr = libc.mmap(None, nbytes, 3, 0x22, -1, 0)  # RW, MAP_PRIVATE | MAP_ANONYMOUS
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap for the settle step")
    ctypes.memset(addr, 1, nbytes)
    libc.munmap(addr, nbytes)
    return (now_ns() - t) / 1e6


def children_cpu_ms():
    r = os.times()
    return (r.children_user + r.children_system) * 1000


def proc_cpu_ms(pid, tid=None):
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def restore_copy_ms(d, pid, origin):
    total = 0.0
    for c in sim_copies(d):
        if c["pid"] == pid and c["kind"] == "restore" and c["start"] >= origin:
            total += (c["end"] - c["start"]) / 1e6
    return total


def health_once(sock):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    try:
        s.connect(sock)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
        head = s.recv(64)
        return head.split(b" ")[1:2] == [b"200"]
    except OSError:
        return False
    finally:
        s.close()


def poll_health(sock, mode, timeout=60):
    deadline = time.monotonic() + timeout
    delay = 0.001 if mode == "backoff" else 0.020
    while time.monotonic() < deadline:
        if health_once(sock):
            return now_ns()
        time.sleep(delay)
        if mode == "backoff":
            delay = min(delay * 2, 0.020)
    raise RuntimeError("the bare route's worker never answered")


class Run:
    def __init__(self, a):
        self.a = a
        self.dir = tempfile.mkdtemp(prefix="thaw-ab-", dir=a.dir)
        self.exes = {}
        for name, path in a.arm:
            if path is not None:
                # Each build from the same disk, read cold alike after every drop.
                p = os.path.join(self.dir, f"cryo-{name}")
                shutil.copy(path, p)
                self.exes[name] = p
        # The worker and the driver: a private copy CRIU finds unchanged at every restore.
        first = next(p for _, p in a.arm if p is not None)
        self.exe = os.path.join(self.dir, "cryo")
        shutil.copy(first, self.exe)
        self.env = dict(os.environ)
        self.env.update(
            CRYO_GPU="sim",
            CRYO_SIM_DIR=self.dir,
            CRYO_STATE_DIR=os.path.join(self.dir, "state"),
            CRYO_CRIU=a.criu,
        )
        self.env.pop("CRYO_FAILPOINT", None)
        self.sock = os.path.join(self.dir, "w.sock")
        self.image = os.path.join(self.dir, "img")
        # The bare route's CRIU log and work files, out of the image (cryo refuses extra files).
        self.work = os.path.join(self.dir, "bare-work")
        os.makedirs(self.work)
        self.driver = None
        self.pid = None
        # A thaw ran and its worker was not stopped since.
        self.thawed = False

    def start(self):
        self.driver = subprocess.Popen(
            [self.exe, "sim", "driver", "--gpus", "1", "--gpu-memory",
             str(self.a.size + (64 << 20)), "--dir", self.dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(self.dir, "driver.sock")):
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated driver did not start")
            time.sleep(0.01)
        ready = os.path.join(self.dir, "w.ready")
        w = subprocess.Popen(
            ["setsid", self.exe, "sim", "worker", "--memory", str(self.a.size), "--dir",
             self.dir, "--http-unix", self.sock, "--ready-file", ready],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not os.path.exists(ready):
            if time.monotonic() > deadline or w.poll() is not None:
                raise RuntimeError("the worker did not start")
            time.sleep(0.05)
        time.sleep(0.05)
        self.pid = json.load(open(ready))["pid"]
        out = self.cryo(self.exe, ["freeze", "--json", str(self.pid), "--image", self.image])
        w.wait()
        return json.loads(out)

    def cryo(self, exe, args):
        r = subprocess.run([exe] + args, env=self.env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{exe} {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def cryo_traced(self, cmd):
        r = subprocess.run(cmd, env=self.env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        return r.stdout

    def reap(self):
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def stop_cryo(self):
        self.cryo(self.exe, ["stop", str(self.pid), "--deadline", "0"])
        self.reap()
        self.thawed = False

    def stop_bare(self):
        # Suspended first (a live restored context is never torn down), then killed.
        self.cryo(self.exe, ["cuda-checkpoint", "--action", "lock", "--pid", str(self.pid),
                             "--timeout", "30000"])
        self.cryo(self.exe, ["cuda-checkpoint", "--action", "checkpoint", "--pid",
                             str(self.pid)])
        os.kill(self.pid, signal.SIGKILL)
        self.reap()
        self.thawed = False

    def cached(self):
        """Bytes of the image's page contents, the cryo binary and CRIU in the page cache."""
        files = [os.path.join(self.image, f) for f in os.listdir(self.image)
                 if f.startswith("pages-")] + [self.exe, self.a.criu]
        r = subprocess.run(["fincore", "-b", "-n", "-o", "RES,FILE"] + files,
                           capture_output=True, text=True)
        out = {}
        for line in r.stdout.splitlines():
            res, f = line.split(None, 1)
            out[os.path.basename(f)] = int(res) >> 20
        return out

    def traced(self, cmd, name, cold, r):
        # CRIU cannot restore under ptrace: the bare route's `criu restore` is never traced.
        if self.a.trace is None or r >= self.a.trace_rounds or name in self.a.bare:
            return cmd
        os.makedirs(self.a.trace, exist_ok=True)
        mode = "cold" if cold else "page"
        return ["strace", "-f", "-b", "execve", "-tt", "-T", "-o",
                os.path.join(self.a.trace, f"{name}-{mode}-r{r}.st")] + cmd

    def thaw(self, name, cold, rnd=0):
        if cold:
            drop_caches()
        before = self.cached() if self.a.fincore else None
        pages = [os.path.join(self.image, f) for f in sorted(os.listdir(self.image))
                 if f.startswith("pages-")]
        settled = settle(self.a.settle_bytes) if self.a.settle_bytes else None
        sampler = Sampler(pages, self.a.sample).start() if self.a.sample else None
        cpu0 = children_cpu_ms()
        self.thawed = True
        origin = now_ns()
        if name in self.a.bare:
            r = subprocess.run(self.traced([self.a.criu, "restore", "-d", "-D", self.image, "-o",
                                "restore.log", "-W", self.work] + self.a.bare[name], name, cold,
                                           rnd), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"criu restore: {r.stderr.strip()}")
            criu = (now_ns() - origin) / 1e6
            for action in ("restore", "unlock"):
                self.cryo(self.exe, ["cuda-checkpoint", "--action", action, "--pid",
                                     str(self.pid)])
            gpu = (now_ns() - origin) / 1e6 - criu
            at = poll_health(self.sock, self.a.bare_poll)
            wall = (at - origin) / 1e6
            rec = dict(wall=wall, pre=0.0, criu=criu, gpu=gpu, rest=wall - criu - gpu)
            rec.update(self.cpu_of_thaw(sampler, cpu0))
            copy = restore_copy_ms(self.dir, self.pid, origin)
            self.stop_bare()
        else:
            out = self.cryo_traced(self.traced([self.exes[name], "thaw", self.image, "--json",
                                                "--health-url", f"unix:{self.sock}:/health"],
                                               name, cold, rnd))
            v = json.loads(out)
            wall = (v["first_answer_at"] - origin) / 1e6
            criu, gpu = v["criu_ms"], v["gpu_restore_ms"]
            # cryo's steps are whole ms; "pre" is its start and checks up to CRIU's launch,
            # "rest" from the unlock to the first answer (first_answer_ms counts from the
            # request, which is its process's start).
            fa = v["first_answer_ms"]
            rec = dict(wall=wall, verify=v["verify_ms"], criu=criu, gpu=gpu,
                       first_answer_ms=fa, phases=v.get("criu_phases", {}),
                       start=wall - fa, rest=fa - v["verify_ms"] - criu - gpu)
            rec.update(self.cpu_of_thaw(sampler, cpu0))
            copy = restore_copy_ms(self.dir, self.pid, origin)
            self.stop_cryo()
        rec["copy"] = copy
        rec["overhead"] = wall - copy
        if settled is not None:
            rec["settle_ms"] = settled
        if before is not None:
            rec["cached_mib"] = before
        return rec

    def cpu_of_thaw(self, sampler, cpu0):
        """CPU of the arm's processes (cryo with its CRIU, or the bare route's CRIU and
        cuda-checkpoint calls: the children this harness waited for) and of the restored root,
        and the sampler's timeline; the health poll of the bare arm is in this process, not
        counted."""
        # The root's main thread: CRIU's restorer faulted in and read every page there.
        out = dict(cpu_arm=children_cpu_ms() - cpu0, cpu_root=proc_cpu_ms(self.pid),
                   cpu_main=proc_cpu_ms(self.pid, self.pid))
        if sampler is not None:
            out["timeline"] = sampler.stop()
        return out

    def close(self):
        # A thaw that failed after its restore (or a harness error between a thaw and its
        # stop) leaves the restored worker: suspended and ended while the driver still runs.
        if self.thawed and os.path.exists(f"/proc/{self.pid}"):
            try:
                self.stop_cryo()
            except (RuntimeError, OSError) as e:
                print(f"thaw-ab: cannot stop worker {self.pid}: {e}", file=sys.stderr)
        if self.driver:
            self.driver.kill()
            self.driver.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def interval(pairs_by_block, stat=statistics.median, n=2000, seed=7):
    rng = random.Random(seed)
    blocks = [b for b in pairs_by_block if b]
    flat = [x for b in blocks for x in b]
    if not flat:
        return (float("nan"),) * 3
    meds = []
    for _ in range(n):
        pick = [x for _ in blocks for x in rng.choice(blocks)]
        meds.append(stat(pick))
    meds.sort()
    return stat(flat), meds[int(0.05 * n)], meds[int(0.95 * n) - 1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", action="append", required=True,
                   help="NAME=PATH of a cryo build, `bare`, or NAME=bare:ARGS")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--modes", default="page,cold")
    p.add_argument("--criu", default=shutil.which("criu") or "/usr/local/sbin/criu")
    p.add_argument("--dir", default=None)
    p.add_argument("--bare-poll", choices=["fixed", "backoff"], default="fixed")
    p.add_argument("--out", default=None, help="every thaw's record, JSON lines")
    p.add_argument("--trace", default=None, help="strace -f -tt -T the first rounds into DIR")
    p.add_argument("--trace-rounds", type=int, default=1)
    p.add_argument("--sample", type=float, default=0,
                   help="every MS ms of each thaw: pages cached, CPU split, disk reads")
    p.add_argument("--fincore", action="store_true",
                   help="record what of the image, cryo and CRIU is cached before each thaw")
    p.add_argument("--settle", action="store_true",
                   help="right before every thaw, fault in and free twice the size and 64 MiB "
                        "on small pages (the restore's memory and the GPU copy's), all arms alike")
    a = p.parse_args()
    arms = []
    # The bare arms, by name: the arguments each adds to its `criu restore`.
    a.bare = {}
    for s in a.arm:
        n, _, path = s.partition("=")
        if s == "bare":
            a.bare["bare"] = []
            arms.append(("bare", None))
        elif path == "bare" or path.startswith("bare:"):
            a.bare[n] = path.removeprefix("bare").removeprefix(":").split()
            arms.append((n, None))
        else:
            arms.append((n, os.path.abspath(path)))
    a.arm = arms
    # The worker and the driver run from a cryo build: refused before anything is made.
    if not any(path is not None for _, path in arms):
        p.error("at least one --arm must be a cryo build (NAME=PATH): the worker and the "
                "simulated driver run from it")
    if len({n for n, _ in arms}) != len(arms):
        p.error("two --arm share a name")
    a.size = parse_size(a.size)
    a.settle_bytes = 2 * a.size + (64 << 20) if a.settle else 0
    modes = a.modes.split(",")
    # A timeout's SIGTERM ends the run like ^C: the worker stopped, the driver ended.
    def interrupted(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("cannot become a child subreaper")
    run = Run(a)
    out = open(a.out, "a") if a.out else None
    names = [n for n, _ in arms]
    print(f"thaw-ab: {a.size >> 20} MiB, arms {names}, {a.rounds} rounds, modes {modes}, "
          f"load {load()}", flush=True)
    recs = {(m, n): [] for m in modes for n in names}
    try:
        run.start()
        for r in range(a.rounds):
            # Each arm in each position alike: rotation r//2 of the arms, reversed in odd
            # rounds (a round and the next are an ABBA block: 2 arms A B, B A; 3 arms ABC CBA
            # BCA ACB CAB BAC).
            k = (r // 2) % len(names)
            rot = names[k:] + names[:k]
            order = rot if r % 2 == 0 else rot[::-1]
            for m in modes:
                for n in order:
                    rec = run.thaw(n, m == "cold", r)
                    rec.update(round=r, mode=m, arm=n, load=load())
                    recs[(m, n)].append(rec)
                    if out:
                        out.write(json.dumps(rec) + "\n")
                        out.flush()
                    print(f"  r{r} {m:5} {n:6} wall {rec['wall']:7.1f} copy {rec['copy']:6.1f} "
                          f"overhead {rec['overhead']:7.1f} criu {rec['criu']:6.1f} "
                          f"gpu {rec['gpu']:6.1f}", flush=True)
    finally:
        run.close()
    print(f"load at the end {load()}")
    for m in modes:
        # The restore's fault mode: on this project's VMs a restorer sometimes faults its memory
        # in at about twice the CPU (the hypervisor's faults count as the guest's CPU), at
        # random, in any arm; the CRIU step grows by that much. One threshold for every arm: a
        # restore is slow-fault when its restorer's CPU is over SLOW_FAULT times the median of
        # every thaw of this mode.
        ref = statistics.median(r["cpu_main"] for n in names for r in recs[(m, n)]) \
            if any(recs[(m, n)] for n in names) else float("nan")
        for n in names:
            for r in recs[(m, n)]:
                r["slow_fault"] = r["cpu_main"] > SLOW_FAULT * ref
        fast_rounds = [r for r in range(a.rounds)
                       if all(r < len(recs[(m, n)]) and not recs[(m, n)][r]["slow_fault"]
                              for n in names)]
        counts = ", ".join(f"{n} {sum(r['slow_fault'] for r in recs[(m, n)])}/{len(recs[(m, n)])}"
                           for n in names)
        print(f"{m}: restores in the slow-fault mode (restorer's CPU over {SLOW_FAULT}x the "
              f"median {ref:.0f} ms of all arms): {counts}; like with like: the "
              f"{len(fast_rounds)} of {a.rounds} rounds whose restores all ran in the fast mode")
        print(f"{m}: medians (ms)")
        for n in names:
            rs = recs[(m, n)]
            if not rs:
                continue
            keys = ["wall", "copy", "overhead", "criu", "gpu"]
            extra = ["start", "verify", "rest"] if n not in a.bare else ["rest"]
            extra += ["cpu_arm", "cpu_root", "cpu_main"]
            cells = " ".join(f"{k} {statistics.median(r[k] for r in rs):7.1f}"
                             for k in keys + extra)
            print(f"  {n:6} {cells}")
        for i, x in enumerate(names):
            for y in names[i + 1:]:
                for k in ("wall", "overhead", "criu"):
                    for like, rounds in (("", range(a.rounds)), (" like", fast_rounds)):
                        blocks = []
                        for b in range(0, a.rounds, 2):
                            blk = []
                            for r in (b, b + 1):
                                if r in rounds and r < len(recs[(m, x)]) \
                                        and r < len(recs[(m, y)]):
                                    blk.append(recs[(m, x)][r][k] / recs[(m, y)][r][k])
                            blocks.append(blk)
                        med, lo, hi = interval(blocks)
                        n_pairs = sum(len(blk) for blk in blocks)
                        print(f"  {x}/{y} {k:8} paired{like:5} {med:.3f} [{lo:.3f}, {hi:.3f}] "
                              f"({n_pairs} rounds)")


if __name__ == "__main__":
    main()
