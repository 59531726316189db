/* Reserves address space PROT_NONE and commits it 256 KiB at a time with
 * mprotect, as V8 grows its heap, filling each piece at once, much faster
 * than a scan of the address space comes round; then checks every word.
 * Usage: commit MIB. Prints "N pieces, B bad words". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define PIECE (256 << 10)

int main(int argc, char **argv) {
    size_t n = (size_t)atol(argc > 1 ? argv[1] : "256") * (1 << 20) / PIECE;
    uint64_t *base = mmap(NULL, n * PIECE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return 2;
    const size_t words = PIECE / 8;
    for (size_t i = 0; i < n; i++) {
        uint64_t *p = base + i * words;
        if (mprotect(p, PIECE, PROT_READ | PROT_WRITE)) return 2;
        for (size_t w = 0; w < words; w++) p[w] = (i << 20) ^ w ^ 0x5a5a5a5a5a5aULL;
    }
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t w = 0; w < words; w++) bad += base[i * words + w] != ((i << 20) ^ w ^ 0x5a5a5a5a5a5aULL);
    printf("%zu pieces, %zu bad words\n", n, bad);
    return bad != 0;
}
