/* Threads keep data on their stacks under pressure, then exit.
 * With ZMEM_STACKS=1 their stacks are managed while they run; once they
 * have exited, no stack they left may still be registered with zmem's
 * userfaultfd ("um" in smaps' VmFlags): glibc starts its next thread,
 * maybe zmem's own, on a cached stack. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <stdint.h>
#include <sys/mman.h>

#define THREADS 4
#define STACK_DATA (4 << 20)
#define HEAP (96 << 20)

static pthread_barrier_t filled;
static uintptr_t lo[THREADS], hi[THREADS];
static int was_managed[THREADS];
static size_t out_pages[THREADS];

/* Whether smaps marks any part of [a, b) "um" (registered for missing
 * faults with a userfaultfd). */
static int managed(uintptr_t a, uintptr_t b) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    uintptr_t s = 0, e = 0;
    int hit = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long x, y;
        if (sscanf(line, "%lx-%lx ", &x, &y) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            s = x, e = y;
        } else if (!strncmp(line, "VmFlags:", 8) && s < b && e > a && strstr(line, " um")) {
            hit = 1;
        }
    }
    fclose(f);
    return hit;
}

static uint64_t word(int id, size_t i) { return (i * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)id << 56) ^ (i % 97); }

static void *run(void *arg) {
    int id = (int)(intptr_t)arg;
    pthread_attr_t a;
    void *addr;
    size_t size;
    pthread_getattr_np(pthread_self(), &a);
    pthread_attr_getstack(&a, &addr, &size);
    pthread_attr_destroy(&a);
    lo[id] = (uintptr_t)addr, hi[id] = (uintptr_t)addr + size;
    volatile uint64_t buf[STACK_DATA / 8];
    for (size_t i = 0; i < STACK_DATA / 8; i++) buf[i] = word(id, i);
    pthread_barrier_wait(&filled);
    /* The main thread fills the heap meanwhile: the stacks go out. */
    pthread_barrier_wait(&filled);
    was_managed[id] = managed(lo[id], hi[id]);
    out_pages[id] = 0;
    /* How much of the data is out of memory now. */
    uintptr_t from = ((uintptr_t)buf + 4095) & ~(uintptr_t)4095, to = ((uintptr_t)buf + STACK_DATA) & ~(uintptr_t)4095;
    static __thread unsigned char vec[STACK_DATA / 4096];
    if (mincore((void *)from, to - from, vec) == 0)
        for (size_t p = 0; p < (to - from) / 4096; p++) out_pages[id] += !(vec[p] & 1);
    size_t bad = 0;
    for (size_t i = 0; i < STACK_DATA / 8; i++) bad += buf[i] != word(id, i);
    return (void *)bad;
}

int main(void) {
    for (int round = 0; round < 2; round++) {
        pthread_t t[THREADS];
        pthread_barrier_init(&filled, NULL, THREADS + 1);
        for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, run, (void *)(intptr_t)i);
        pthread_barrier_wait(&filled);
        sleep(1); /* a scan adopts the stacks */
        char *heap = malloc(HEAP);
        for (size_t i = 0; i < HEAP; i += 4096) heap[i] = (char)i, heap[i + 1] = 1 + (char)(i >> 12);
        sleep(1);
        pthread_barrier_wait(&filled);
        size_t bad = 0;
        int adopted = 0;
        size_t out = 0;
        for (int i = 0; i < THREADS; i++) {
            void *r;
            pthread_join(t[i], &r);
            bad += (size_t)r;
            adopted += was_managed[i];
            out += out_pages[i];
        }
        for (size_t i = 0; i < HEAP; i += 4096) bad += heap[i] != (char)i || heap[i + 1] != (char)(1 + (char)(i >> 12));
        free(heap);
        int left = 0;
        for (int i = 0; i < THREADS; i++) left += managed(lo[i], hi[i]);
        printf("round %d: bad words %zu, stacks managed while running %d, stack pages out %zu, managed after exit %d\n", round, bad, adopted, out, left);
        if (bad || left) return 1;
    }
    puts("stacks ok");
    return 0;
}
