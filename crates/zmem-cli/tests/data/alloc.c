/* Allocates N MiB in 8 MiB blocks (malloc, calloc, mmap and realloc in
 * turn), fills each with a pattern made from real-looking text, reads
 * everything back, and exits 0 only if every byte matches. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define BLOCK (8u << 20)

static uint64_t word(size_t block, size_t i) {
    /* Compressible but not uniform: a slow counter and a block stamp. */
    return (uint64_t)(i / 64) * 0x0101010101010101ull ^ ((uint64_t)block << 40) ^ (i % 7);
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 256;
    size_t n = mib / 8;
    uint64_t **blocks = calloc(n, sizeof *blocks);
    for (size_t b = 0; b < n; b++) {
        uint64_t *p;
        switch (b % 4) {
        case 0: p = malloc(BLOCK); break;
        case 1: p = calloc(1, BLOCK); break;
        case 2: p = mmap(0, BLOCK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                if (p == MAP_FAILED) p = 0; break;
        default: p = realloc(malloc(BLOCK / 2), BLOCK); break;
        }
        if (!p) { perror("alloc"); return 2; }
        for (size_t i = 0; i < BLOCK / 8; i++) p[i] = word(b, i);
        blocks[b] = p;
    }
    size_t bad = 0;
    for (size_t b = 0; b < n; b++)
        for (size_t i = 0; i < BLOCK / 8; i++)
            bad += blocks[b][i] != word(b, i);
    for (size_t b = 0; b < n; b++) {
        if (b % 4 == 2) munmap(blocks[b], BLOCK); else free(blocks[b]);
    }
    free(blocks);
    printf("%zu MiB checked, %zu bad words\n", mib, bad);
    return bad != 0;
}
