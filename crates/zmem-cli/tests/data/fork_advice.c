/* Fills a 64 MiB mapping and a 64 MiB malloc, advises the first half of
 * the mapping with ADVICE (a number: MADV_WIPEONFORK 18, MADV_DONTFORK 10,
 * MADV_HUGEPAGE 14, which only splits the mapping), and forks. The child
 * checks what fork gave it: zeros in a wiped half, the parent's bytes
 * everywhere else it has (it has no DONTFORK half to read). Usage:
 * fork_advice ADVICE */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define N ((size_t)64 << 20)

static unsigned char at(size_t i) { return (unsigned char)((i * 7) | 1); }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    int advice = atoi(argv[1]);
    unsigned char *p = mmap(0, N, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    unsigned char *q = malloc(N);
    if (p == MAP_FAILED || !q) return 2;
    for (size_t i = 0; i < N; i++) {
        p[i] = at(i);
        q[i] = (unsigned char)(i * 3);
    }
    if (madvise(p, N / 2, advice)) {
        perror("madvise");
        return 2;
    }
    pid_t c = fork();
    if (c == 0) {
        size_t wiped = 0, bad = 0;
        if (advice == MADV_WIPEONFORK)
            for (size_t i = 0; i < N / 2; i++) wiped += p[i] != 0;
        else if (advice != MADV_DONTFORK)
            for (size_t i = 0; i < N / 2; i++) bad += p[i] != at(i);
        for (size_t i = N / 2; i < N; i++) bad += p[i] != at(i);
        for (size_t i = 0; i < N; i++) bad += q[i] != (unsigned char)(i * 3);
        printf("child: %zu nonzero bytes wiped, %zu bad bytes\n", wiped, bad);
        fflush(stdout);
        _exit(wiped || bad);
    }
    int st;
    if (waitpid(c, &st, 0) != c) return 2;
    size_t bad = 0;
    for (size_t i = 0; i < N; i++) bad += p[i] != at(i);
    printf("parent: %zu bad bytes, child %s\n", bad, WIFEXITED(st) && !WEXITSTATUS(st) ? "ok" : "failed");
    return bad || !WIFEXITED(st) || WEXITSTATUS(st);
}
