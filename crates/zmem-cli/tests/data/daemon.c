/* A daemon, made the classic way: fills N MiB in 8 MiB blocks (malloc),
 * then forks; the first parent exits at once. The child calls setsid()
 * and forks again, and its parent exits too. The grandchild, the daemon,
 * reparented away from whoever started the program, closes its stdio,
 * checks every word it inherited, rewrites every block with a new pattern
 * (its own memory now, several times the limit), checks that again, and
 * writes "N MiB checked twice, B bad words" to the file named by argv[2]. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BLOCK (8u << 20)

static uint64_t word(size_t block, size_t i, uint64_t round) {
    return (uint64_t)(i / 64) * 0x0101010101010101ull ^ ((uint64_t)block << 40) ^ (i % 7) ^ (round << 56);
}

static size_t check(uint64_t **blocks, size_t n, uint64_t round) {
    size_t bad = 0;
    for (size_t b = 0; b < n; b++)
        for (size_t i = 0; i < BLOCK / 8; i++)
            bad += blocks[b][i] != word(b, i, round);
    return bad;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    size_t mib = strtoul(argv[1], 0, 10), n = mib / 8;
    uint64_t **blocks = calloc(n, sizeof *blocks);
    for (size_t b = 0; b < n; b++) {
        blocks[b] = malloc(BLOCK);
        if (!blocks[b]) { perror("malloc"); return 2; }
        for (size_t i = 0; i < BLOCK / 8; i++) blocks[b][i] = word(b, i, 0);
    }
    pid_t p = fork();
    if (p < 0) { perror("fork"); return 2; }
    if (p > 0) _exit(0); /* the first parent */
    if (setsid() < 0) { perror("setsid"); _exit(2); }
    p = fork();
    if (p < 0) _exit(2);
    if (p > 0) _exit(0); /* the session leader */
    /* The daemon. */
    if (chdir("/") != 0) _exit(2);
    fclose(stdin);
    fclose(stdout);
    size_t bad = check(blocks, n, 0);
    for (size_t b = 0; b < n; b++)
        for (size_t i = 0; i < BLOCK / 8; i++) blocks[b][i] = word(b, i, 1);
    bad += check(blocks, n, 1);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[2]);
    FILE *f = fopen(tmp, "w");
    if (!f) _exit(2);
    fprintf(f, "%zu MiB checked twice, %zu bad words\n", mib, bad);
    fclose(f);
    rename(tmp, argv[2]);
    _exit(bad != 0);
}
