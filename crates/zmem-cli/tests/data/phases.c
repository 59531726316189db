/* A program whose working set changes phase, for `zmem run
 * --max-slowdown`: for each size in MiB on the command line, it maps that
 * much (keeping what it had), fills what is new with text-like words,
 * then re-reads and updates pages of the first SIZE MiB at random for
 * SECS seconds (argv[1]); a smaller size than before unmaps the rest. At
 * the end of each phase it prints "phase N PID" and waits for a line on
 * stdin, so that a test can look at its stats in between. Every page
 * keeps a check word, verified at every touch: a wrong page exits 2. With
 * PHASES_HOT_MIB set, only that many MiB at the start are re-read: the
 * rest, filled once, stays cold. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MIB (1UL << 20)
#define PAGE 4096UL
#define MAX_MIB 1024

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static uint64_t rng = 88172645463325252ULL;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void fill(uint64_t *p, uint64_t page) {
    static const char words[] = "id=00000000;user=u000000;balance=000000000;state=active;";
    memcpy(p, words, sizeof words - 1);
    for (size_t i = 8; i < PAGE / 8; i++)
        p[i] = i % 5 == 0 ? page * 2654435761u + i : 0x3d657461747324ULL + (i & 31);
    p[7] = page;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: phases SECS MIB...\n");
        return 1;
    }
    double secs = atof(argv[1]);
    const char *hot_env = getenv("PHASES_HOT_MIB");
    size_t hot = hot_env ? strtoul(hot_env, NULL, 10) * MIB : 0;
    /* One reservation for all phases: a phase grows or shrinks its end. */
    char *base = mmap(NULL, MAX_MIB * MIB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
        return 1;
    size_t have = 0;
    uint64_t sink = 0;
    for (int ph = 2; ph < argc; ph++) {
        size_t want = strtoul(argv[ph], NULL, 10) * MIB;
        if (want > MAX_MIB * MIB || want == 0)
            return 1;
        if (want > have) {
            if (mprotect(base + have, want - have, PROT_READ | PROT_WRITE))
                return 1;
            for (size_t off = have; off < want; off += PAGE)
                fill((uint64_t *)(base + off), off / PAGE);
        } else if (want < have) {
            if (munmap(base + want, have - want) ||
                mmap(base + want, have - want, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                     -1, 0) == MAP_FAILED)
                return 1;
        }
        have = want;
        size_t pages = (hot && hot < want ? hot : want) / PAGE;
        double end = now() + secs;
        while (now() < end) {
            for (int k = 0; k < 4096; k++) {
                uint64_t page = next() % pages;
                uint64_t *p = (uint64_t *)(base + page * PAGE);
                if (p[7] != page) {
                    fprintf(stderr, "page %lu holds %lu\n", (unsigned long)page, (unsigned long)p[7]);
                    return 2;
                }
                size_t w = 8 + next() % (PAGE / 8 - 8);
                sink += p[w] + p[(w + 1) % (PAGE / 8)];
                p[w] ^= 1;
            }
        }
        printf("phase %d %d\n", ph - 1, (int)getpid());
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 3;
    }
    printf("done %lu\n", (unsigned long)(sink & 1));
    return 0;
}
