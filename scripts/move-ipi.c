// What a reclaim thread's UFFDIO_MOVE costs the *other* CPU when a thread
// of the same process runs there. A MOVE flushes the TLB once per run of
// present pages (ARCHITECTURE.md, Eviction), and the flush reaches every
// CPU that runs the mm: an IPI. Here the main thread (CPU 0) times a fixed
// job, 2000 memcpys of 1 MiB, while a sibling thread (CPU 1) first spins,
// then MOVEs 64 KiB folios (one ioctl each) back and forth between two
// registered areas, three times each. The difference, divided by the MOVEs
// made meanwhile, is what one flush IPI costs the CPU it lands on.
//   cc -O2 -pthread -o /tmp/move-ipi scripts/move-ipi.c && /tmp/move-ipi
// UFFDIO_MOVE's struct and number: uffd-move.h.
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "uffd-move.h"

#define FOLIO (64 << 10)
#define SPAN (4 << 20)
#define JOB (1 << 20)

static volatile int moving, stop;
static volatile long moved; // folios
static int uffd;
static char *a, *b;

static void move(char *dst, char *src) {
    struct uffdio_move_ m = {.dst = (uint64_t)dst, .src = (uint64_t)src, .len = FOLIO};
    must(ioctl(uffd, UFFDIO_MOVE_, &m), "UFFDIO_MOVE");
}

static void *sibling(void *unused) {
    (void)unused;
    pin(1);
    while (!stop) {
        if (!moving) {
            __asm__ volatile("pause");
            continue;
        }
        for (size_t o = 0; o < SPAN; o += FOLIO) {
            move(b + o, a + o);
            move(a + o, b + o);
            moved += 2;
        }
    }
    return NULL;
}

int main(void) {
    pin(0);
    uffd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_MOVE_};
    must(uffd < 0 || ioctl(uffd, UFFDIO_API, &api), "userfaultfd with UFFD_FEATURE_MOVE");
    for (char **p = &a; p; p = p == &a ? &b : NULL) {
        *p = mmap(0, SPAN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (*p == MAP_FAILED) exit((perror("mmap"), 1));
        madvise(*p, SPAN, MADV_NOHUGEPAGE); // small folios, as zmem's regions
    }
    memset(a, 1, SPAN);
    for (char *p = a; p; p = p == a ? b : NULL) {
        struct uffdio_register reg = {.range = {(uint64_t)p, SPAN}, .mode = UFFDIO_REGISTER_MODE_MISSING};
        must(ioctl(uffd, UFFDIO_REGISTER, &reg), "UFFDIO_REGISTER");
    }
    char *src = malloc(JOB), *dst = malloc(JOB);
    memset(src, 3, JOB);
    memset(dst, 0, JOB);
    pthread_t t;
    must(pthread_create(&t, NULL, sibling, NULL), "pthread_create");
    double idle = 0;
    for (int round = 0; round < 6; round++) {
        moving = round % 2;
        usleep(20000);
        long m0 = moved;
        double t0 = now_ns();
        for (int k = 0; k < 2000; k++) {
            memcpy(dst, src, JOB);
            src[k]++;
        }
        double ms = (now_ns() - t0) / 1e6;
        long moves = moved - m0;
        if (!moving) {
            idle = ms;
            printf("sibling spins: the job took %.1f ms\n", ms);
        } else {
            printf("sibling MOVEs: the job took %.1f ms; %ld MOVEs of 64 KiB meanwhile, %.2f us lost per MOVE\n", ms,
                   moves, (ms - idle) * 1e3 / (moves ? moves : 1));
        }
    }
    stop = 1;
    pthread_join(t, NULL);
    return 0;
}
