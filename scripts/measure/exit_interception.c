// Measures the options for intercepting exit_group/execve of a guarded process before its
// threads die (issue 10 item 4), on this kernel: the per-syscall cost of each way of tracing
// (N getppid() calls in a child, 7 rounds after a warm-up, order alternating, medians), what a
// seccomp SECCOMP_RET_TRACE filter does with no tracer (and what glibc's _exit then does, with one
// thread and with two), and whether the other threads still run at the seccomp stop of
// exit_group and at the PTRACE_EVENT_EXIT stop (the driver's restore thread must run for a
// lock and a checkpoint). Run: bash scripts/measure/exit-interception.sh (needs cc; x86_64).
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <linux/audit.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N 2000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int install_filter(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_exit_group, 3, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_execve, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_execveat, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRACE),
    };
    struct sock_fprog p = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) return -1;
    return syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &p);
}

// The child: waits for the go (SIGSTOP by itself), times N getppid() calls, writes ns/call.
static volatile double *shared;

static void loop_child(int filter) {
    if (filter && install_filter()) { perror("seccomp"); _exit(99); }
    raise(SIGSTOP);
    double t = now();
    for (long i = 0; i < N; i++) syscall(SYS_getppid);
    shared[0] = (now() - t) / N * 1e9;
    _exit(0);
}

// mode: 0 untraced, 1 seized with TRACEEXIT (today's guard), 2 + seccomp filter & TRACESECCOMP,
// 3 PTRACE_SYSCALL at every syscall.
static double run(int mode) {
    pid_t c = fork();
    if (c == 0) loop_child(mode == 2);
    int st;
    waitpid(c, &st, WUNTRACED);  // stopped by itself
    if (mode) {
        long opts = PTRACE_O_TRACEEXIT | (mode == 2 ? PTRACE_O_TRACESECCOMP : 0);
        if (ptrace(PTRACE_SEIZE, c, 0, opts)) { perror("seize"); exit(1); }
    }
    kill(c, SIGCONT);
    for (;;) {
        if (waitpid(c, &st, __WALL) < 0) break;
        if (WIFEXITED(st) || WIFSIGNALED(st)) break;
        if (WIFSTOPPED(st)) {
            int sig = WSTOPSIG(st);
            int ev = st >> 16;
            int deliver = (ev == 0 && sig != SIGTRAP && sig != (SIGTRAP | 0x80) && sig != SIGSTOP && sig != SIGCONT) ? sig : 0;
            if (ev == PTRACE_EVENT_STOP) deliver = 0;
            ptrace(mode == 3 ? PTRACE_SYSCALL : PTRACE_CONT, c, 0, deliver);
        }
    }
    return shared[0];
}

static volatile long *counter;
static void *spin(void *a) {
    (void)a;
    for (;;) __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED);
    return 0;
}

// With the filter and no tracer: what exit_group answers, and what glibc's _exit then does, in a
// process of one thread and of two.
static void no_tracer(int threads) {
    pid_t c = fork();
    if (c == 0) {
        if (install_filter()) _exit(99);
        pthread_t t;
        if (threads > 1) pthread_create(&t, 0, spin, 0);
        long r = syscall(SYS_exit_group, 3);
        dprintf(2, "  no tracer, %d thread(s): exit_group(3) returned %ld, errno %d (%s)\n", threads, r, errno, strerror(errno));
        _exit(0);  // glibc: exit_group, then exit (this thread only), then the abort instruction
    }
    usleep(200000);
    int st;
    pid_t w = waitpid(c, &st, WNOHANG);
    if (w == 0) {
        long a = *counter; usleep(50000); long b = *counter;
        fprintf(stderr, "  no tracer, %d thread(s): _exit(0) 200 ms ago and the process still runs (its other thread: %ld increments in 50 ms): it never exits\n", threads, b - a);
        kill(c, SIGKILL);
        waitpid(c, &st, 0);
    } else if (WIFSIGNALED(st))
        fprintf(stderr, "  no tracer, %d thread(s): then _exit(0) died of signal %d (%s)\n", threads, WTERMSIG(st), strsignal(WTERMSIG(st)));
    else
        fprintf(stderr, "  no tracer, %d thread(s): then _exit(0) exited with %d (glibc fell back to exit(2))\n", threads, WEXITSTATUS(st));
}

// At the seccomp stop of exit_group, do the other threads still run (the driver's restore
// thread must, to lock and checkpoint)? And at PTRACE_EVENT_EXIT of an exit_group?
static void other_threads(void) {
    pid_t c = fork();
    if (c == 0) {
        if (install_filter()) _exit(99);
        pthread_t t;
        pthread_create(&t, 0, spin, 0);
        raise(SIGSTOP);
        usleep(10000);
        syscall(SYS_exit_group, 0);
        _exit(1);
    }
    int st;
    waitpid(c, &st, WUNTRACED);
    ptrace(PTRACE_SEIZE, c, 0, PTRACE_O_TRACESECCOMP | PTRACE_O_TRACEEXIT);
    kill(c, SIGCONT);
    int seen_seccomp = 0;
    for (;;) {
        pid_t w = waitpid(-1, &st, __WALL);
        if (w < 0) break;
        if (!WIFSTOPPED(st)) continue;
        int ev = st >> 16;
        if (ev == PTRACE_EVENT_SECCOMP && !seen_seccomp) {
            seen_seccomp = 1;
            long a = *counter; usleep(50000); long b = *counter;
            fprintf(stderr, "  seccomp stop at exit_group entry (tid %d): other thread ran %ld increments in 50 ms (%s); fds intact, nothing has died yet\n",
                    w, b - a, b > a ? "running" : "stopped");
        } else if (ev == PTRACE_EVENT_EXIT) {
            long a = *counter; usleep(50000); long b = *counter;
            fprintf(stderr, "  exit stop of tid %d: other thread ran %ld increments in 50 ms (%s)\n", w, b - a, b > a ? "running" : "stopped/exiting");
        }
        int sig = WSTOPSIG(st);
        ptrace(PTRACE_CONT, w, 0, (ev == 0 && sig != SIGSTOP && sig != SIGCONT && sig != SIGTRAP) ? sig : 0);
    }
}

int main(void) {
    void *m = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    shared = m;
    counter = (long *)((char *)m + 64);
    const char *names[] = {"untraced", "PTRACE_SEIZE + O_TRACEEXIT (today's guard)",
                           "+ seccomp RET_TRACE filter (exit_group/execve/execveat)",
                           "PTRACE_SYSCALL (stop at every syscall)"};
    double v[4][7];
    int R = 7;
    for (int round = 0; round < R + 1; round++)
        for (int m = 0; m < 4; m++) {
            int mode = (round % 2) ? 3 - m : m;  // order alternates
            double ns = run(mode);
            if (round > 0) v[mode][round - 1] = ns;
        }
    double med[4];
    for (int mode = 0; mode < 4; mode++) {
        for (int i = 0; i < R; i++)
            for (int j = i + 1; j < R; j++)
                if (v[mode][j] < v[mode][i]) { double t = v[mode][i]; v[mode][i] = v[mode][j]; v[mode][j] = t; }
        med[mode] = v[mode][R / 2];
    }
    for (int mode = 0; mode < 4; mode++)
        printf("%-58s %8.1f ns/syscall (%.1f-%.1f)  %6.2fx untraced  %6.2fx today's guard\n", names[mode], med[mode], v[mode][0], v[mode][R - 1], med[mode] / med[0], med[mode] / med[1]);
    fflush(stdout);
    no_tracer(1);
    no_tracer(2);
    other_threads();
    return 0;
}
