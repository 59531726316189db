/* A program whose executable defines the malloc family itself, as rustc
 * (jemalloc linked in) and many programs with a static allocator do. The
 * executable comes first in symbol lookup, before any preload, so glibc's
 * own allocations go to this allocator too: among them the thread vector
 * (DTV) of every thread pthread_create makes, zmem's threads included.
 * The allocator hands out pieces of 4 MiB chunks it maps itself, so its
 * first chunk (zmem's threads' vectors) is adopted and goes cold while the
 * program fills and reads back MIB mebibytes, in order and then at random.
 * Usage:
 * own_malloc MIB. Prints "N blocks, B bad words". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define CHUNK (4 << 20)
#define BLOCK (64 << 10)

static char *cur, *end;
/* zmem's threads allocate here too (glibc's opendir on its stats thread). */
static int busy;

static void *take(size_t size) {
    /* A header holds the size, for realloc. */
    size_t need = (size + 16 + 15) & ~(size_t)15;
    if (need > CHUNK) return NULL;
    while (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE)) {
    }
    if (!cur || (size_t)(end - cur) < need) {
        cur = mmap(NULL, CHUNK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (cur == MAP_FAILED) cur = NULL;
        end = cur ? cur + CHUNK : NULL;
    }
    char *p = cur;
    if (p) cur += need;
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    if (!p) return NULL;
    *(size_t *)p = size;
    return p + 16;
}

/* The first chunk is mapped before any library starts (an executable's
 * .preinit_array runs first), as jemalloc maps its first extent when the
 * loader first allocates: the shim's threads then take their vectors from
 * the program's own memory, which the shim adopts. */
static void first_chunk(void) { free(take(16)); }
__attribute__((section(".preinit_array"), used)) static void (*preinit)(void) = first_chunk;

void *malloc(size_t size) { return take(size); }
void free(void *p) { (void)p; }
void *calloc(size_t n, size_t size) {
    /* Fresh chunks read as zeros, and nothing is ever reused. */
    return n && size > SIZE_MAX / n ? NULL : take(n * size);
}
void *realloc(void *p, size_t size) {
    void *q = take(size);
    if (p && q) {
        size_t old = *(size_t *)((char *)p - 16);
        memcpy(q, p, old < size ? old : size);
    }
    return q;
}
void *memalign(size_t align, size_t size) {
    char *p = take(size + align);
    return p ? (void *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1)) : NULL;
}
int posix_memalign(void **out, size_t align, size_t size) {
    *out = memalign(align, size);
    return *out ? 0 : 12;
}
void *aligned_alloc(size_t align, size_t size) { return memalign(align, size); }
size_t malloc_usable_size(void *p) { return p ? *(size_t *)((char *)p - 16) : 0; }

int main(int argc, char **argv) {
    size_t n = (size_t)atol(argc > 1 ? argv[1] : "256") * (1 << 20) / BLOCK;
    uint64_t **blocks = calloc(n, sizeof *blocks);
    if (!blocks) return 2;
    for (size_t i = 0; i < n; i++) {
        blocks[i] = malloc(BLOCK - 64);
        if (!blocks[i]) return 2;
        for (size_t w = 0; w < (BLOCK - 64) / 8; w++) blocks[i][w] = (i << 20) ^ w ^ 0x5a5a5a5a5a5aULL;
    }
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t w = 0; w < (BLOCK - 64) / 8; w++)
            bad += blocks[i][w] != ((i << 20) ^ w ^ 0x5a5a5a5a5a5aULL);
    /* Then blocks at random, which loads from the swap file at random and
     * switches new stores to zstd: a new pool, whose codec contexts zmem's
     * threads allocate as they first need them. */
    uint64_t x = 88172645463325252ULL;
    for (size_t k = 0; k < 4 * n; k++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t i = x % n, w = (x >> 32) % ((BLOCK - 64) / 8);
        bad += blocks[i][w] != ((i << 20) ^ w ^ 0x5a5a5a5a5a5aULL);
    }
    printf("%zu blocks, %zu bad words\n", n, bad);
    return bad != 0;
}
