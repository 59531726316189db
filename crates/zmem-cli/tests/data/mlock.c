/* Locked memory is never managed. Fills 128 MiB of malloc'd blocks (managed:
 * several times the limit), 16 MiB mapped MAP_LOCKED, and 16 MiB locked with
 * mlock() (mapped read-only first, so no scan can see it writable before it
 * is locked); waits for a few scans of the address space; then prints how
 * many of its two locked mappings are registered with a userfaultfd ("um"
 * in their VmFlags in /proc/self/smaps) and checks every word. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define BLOCK (8u << 20)
#define LOCKED (16u << 20)

static uint64_t word(size_t block, size_t i) {
    return (uint64_t)(i / 64) * 0x0101010101010101ull ^ ((uint64_t)block << 40) ^ (i % 7);
}

static int registered(void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    unsigned long start = 0, end = 0;
    int in = 0, um = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (sscanf(line, "%lx-%lx ", &start, &end) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in = (unsigned long)p >= start && (unsigned long)p < end;
        } else if (in && strncmp(line, "VmFlags:", 8) == 0) {
            um = strstr(line, " um") != 0;
        }
    }
    if (f) fclose(f);
    return um;
}

int main(void) {
    size_t n = 128 / 8;
    uint64_t *blocks[16];
    for (size_t b = 0; b < n; b++) {
        blocks[b] = malloc(BLOCK);
        if (!blocks[b]) return 2;
        for (size_t i = 0; i < BLOCK / 8; i++) blocks[b][i] = word(b, i);
    }
    uint64_t *a = mmap(0, LOCKED, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_LOCKED, -1, 0);
    uint64_t *m = mmap(0, LOCKED, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED || m == MAP_FAILED) { perror("mmap"); return 2; }
    if (mlock(m, LOCKED) != 0 || mprotect(m, LOCKED, PROT_READ | PROT_WRITE) != 0) { perror("mlock"); return 2; }
    for (size_t i = 0; i < LOCKED / 8; i++) a[i] = m[i] = word(99, i);
    /* Scans run every 100 ms, and as RSS grows. */
    for (int k = 0; k < 5; k++) {
        for (size_t b = 0; b < n; b++) blocks[b][0] = word(b, 0);
        usleep(100000);
    }
    size_t bad = 0;
    for (size_t b = 0; b < n; b++)
        for (size_t i = 0; i < BLOCK / 8; i++) bad += blocks[b][i] != word(b, i);
    for (size_t i = 0; i < LOCKED / 8; i++) bad += (a[i] != word(99, i)) + (m[i] != word(99, i));
    printf("locked mappings registered: %d; %zu bad words\n", registered(a) + registered(m), bad);
    return bad != 0;
}
