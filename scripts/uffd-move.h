// What scripts/move-vs-copy.c, scripts/move-ipi.c and
// scripts/free-pageout.c share. Debian's headers predate UFFDIO_MOVE: its
// struct and number are the kernel's uapi ones, written out here. Include
// it after defining _GNU_SOURCE (for `pin`).
#ifndef ZMEM_SCRIPTS_UFFD_MOVE_H
#define ZMEM_SCRIPTS_UFFD_MOVE_H

#include <linux/userfaultfd.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <time.h>

struct uffdio_move_ {
    uint64_t dst, src, len, mode;
    int64_t move;
};
#define UFFDIO_MOVE_ _IOWR(UFFDIO, 0x05, struct uffdio_move_)
#define UFFD_FEATURE_MOVE_ (1ULL << 16)

static inline double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static inline void must(int r, const char *what) {
    if (r) exit((perror(what), 1));
}

// Runs the calling thread on `cpu` only.
static inline void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    must(sched_setaffinity(0, sizeof s, &s), "sched_setaffinity");
}

#endif
