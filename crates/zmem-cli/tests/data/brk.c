/* Fills glibc's main heap, which grows with sbrk (64 KiB blocks are below
 * malloc's mmap threshold), much faster than a scan of the address space
 * comes round, then checks every word. Usage: brk MIB. Prints
 * "N blocks, B bad words". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BLOCK (64 << 10)

int main(int argc, char **argv) {
    size_t n = (size_t)atol(argc > 1 ? argv[1] : "256") * (1 << 20) / BLOCK;
    uint64_t **blocks = calloc(n, sizeof *blocks);
    if (!blocks) return 2;
    for (size_t i = 0; i < n; i++) {
        blocks[i] = malloc(BLOCK);
        if (!blocks[i]) return 2;
        for (size_t w = 0; w < BLOCK / 8; w++) blocks[i][w] = (i << 20) ^ w ^ 0x5a5a5a5a5a5aULL;
    }
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t w = 0; w < BLOCK / 8; w++) bad += blocks[i][w] != ((i << 20) ^ w ^ 0x5a5a5a5a5a5aULL);
    printf("%zu blocks, %zu bad words\n", n, bad);
    return bad != 0;
}
