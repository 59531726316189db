// What it costs the kernel to fill a 64 KiB folio of a userfaultfd region,
// three ways (per folio, 4096 folios a round, three rounds):
//   1. UFFDIO_COPY from a buffer: how the handler loads today;
//   2. MADV_POPULATE_WRITE of a fresh buffer, then UFFDIO_MOVE it in;
//   3. UFFDIO_MOVE out to a registered staging area (an eviction), then
//      UFFDIO_MOVE back (a load into pages an eviction left there: no page
//      is allocated or freed).
// It also times MADV_DONTNEED of the whole region, which is how staging
// gives its pages back after a pass.
// Rounds 4-6 repeat it with a second thread of the process spinning on the
// other CPU, as a program's threads and zmem's reclaim thread are: a MOVE
// flushes the TLB (once per run of present pages, ARCHITECTURE.md), and
// with another thread of the mm running the flush is an IPI to its CPU.
// COPY fills empty entries and flushes nothing. scripts/move-ipi.c times
// what that IPI costs the CPU it lands on.
// (Not timed here: MOVE maps the page writable without its uffd-wp bit,
// even where the source had it, so a write-tracked load by MOVE needs a
// UFFDIO_WRITEPROTECT after it, and a write by another thread between the
// two is not seen.)
//   cc -O2 -pthread -o /tmp/move-vs-copy scripts/move-vs-copy.c && /tmp/move-vs-copy
// UFFDIO_MOVE's struct and number: uffd-move.h.
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "uffd-move.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define FOLIO (64 << 10)
#define FOLIOS 4096
#define SPAN ((size_t)FOLIOS * FOLIO)

static char *map(void) {
    char *p = mmap(0, SPAN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) exit((perror("mmap"), 1));
    madvise(p, SPAN, MADV_NOHUGEPAGE); // small folios, as zmem's regions
    return p;
}

static void move(int uffd, char *dst, char *src) {
    struct uffdio_move_ m = {.dst = (uint64_t)dst, .src = (uint64_t)src, .len = FOLIO};
    must(ioctl(uffd, UFFDIO_MOVE_, &m), "UFFDIO_MOVE");
}

static volatile int stop;

static void *spin(void *unused) {
    (void)unused;
    while (!stop) __asm__ volatile("pause");
    return NULL;
}

int main(void) {
    int uffd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_MOVE_};
    must(uffd < 0 || ioctl(uffd, UFFDIO_API, &api), "userfaultfd with UFFD_FEATURE_MOVE");
    char *region = map(), *staging = map(), *src = malloc(FOLIO);
    memset(src, 7, FOLIO);
    for (char *p = region; p; p = p == region ? staging : NULL) {
        struct uffdio_register reg = {.range = {(uint64_t)p, SPAN}, .mode = UFFDIO_REGISTER_MODE_MISSING};
        must(ioctl(uffd, UFFDIO_REGISTER, &reg), "UFFDIO_REGISTER");
    }
    pthread_t sibling;
    for (int round = 0; round < 6; round++) {
        if (round == 3) {
            must(pthread_create(&sibling, NULL, spin, NULL), "pthread_create");
            printf("with a sibling thread spinning:\n");
        }
        double t, copy = 0, populate = 0, move_in = 0, move_out = 0, move_back = 0, dontneed;
        for (int i = 0; i < FOLIOS; i++) {
            struct uffdio_copy c = {.dst = (uint64_t)(region + (size_t)i * FOLIO), .src = (uint64_t)src, .len = FOLIO};
            t = now_ns();
            must(ioctl(uffd, UFFDIO_COPY, &c), "UFFDIO_COPY");
            copy += now_ns() - t;
        }
        t = now_ns();
        madvise(region, SPAN, MADV_DONTNEED);
        dontneed = now_ns() - t;
        char *fresh = map();
        for (int i = 0; i < FOLIOS; i++) {
            char *b = fresh + (size_t)i * FOLIO;
            t = now_ns();
            must(madvise(b, FOLIO, MADV_POPULATE_WRITE), "MADV_POPULATE_WRITE");
            populate += now_ns() - t;
            memcpy(b, src, FOLIO);
            t = now_ns();
            move(uffd, region + (size_t)i * FOLIO, b);
            move_in += now_ns() - t;
        }
        munmap(fresh, SPAN);
        for (int i = 0; i < FOLIOS; i++) {
            char *r = region + (size_t)i * FOLIO, *s = staging + (size_t)i * FOLIO;
            t = now_ns();
            move(uffd, s, r);
            move_out += now_ns() - t;
            memcpy(s, src, FOLIO); // the decompressed page, written in place
            t = now_ns();
            move(uffd, r, s);
            move_back += now_ns() - t;
        }
        madvise(region, SPAN, MADV_DONTNEED);
        printf("per 64 KiB: COPY %.2f us | POPULATE_WRITE %.2f + MOVE in %.2f us | "
               "MOVE out %.2f, MOVE back %.2f us | DONTNEED %.2f us\n",
               copy / FOLIOS / 1e3, populate / FOLIOS / 1e3, move_in / FOLIOS / 1e3, move_out / FOLIOS / 1e3,
               move_back / FOLIOS / 1e3, dontneed / FOLIOS / 1e3);
    }
    stop = 1;
    pthread_join(sibling, NULL);
    return 0;
}
