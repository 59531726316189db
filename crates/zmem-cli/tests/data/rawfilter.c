// Fills 64 MiB, then puts every thread of the process under a seccomp
// filter with a raw `syscall` instruction (no library call the shim could
// see; Chromium's sandbox does the same), which answers `ioctl` with the
// action argv[1] names: "kill" (SECCOMP_RET_KILL_THREAD) or "errno"
// (EPERM). Then reads everything back, and says how much was wrong.
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

static long raw3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}

static unsigned char byte_at(size_t i) { return (unsigned char)(i * 2654435761u >> 13); }

int main(int argc, char **argv) {
    unsigned action = argc > 1 && !strcmp(argv[1], "errno") ? SECCOMP_RET_ERRNO | 1 : SECCOMP_RET_KILL_THREAD;
    size_t n = 64u << 20;
    unsigned char *p = malloc(n);
    if (!p) return 2;
    for (size_t i = 0; i < n; i++) p[i] = byte_at(i);
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_ioctl, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, action),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    long r = raw3(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, (long)&prog);
    if (r != 0) {
        fprintf(stderr, "seccomp: %ld\n", r);
        return 2;
    }
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += p[i] != byte_at(i);
    printf("bad %zu\n", bad);
    return bad != 0;
}
