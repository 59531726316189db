/* Changes its root (as OpenSSH's pre-authentication child and chrooted
 * servers do) with part of its memory written before, maps and fills more
 * after, reads all of it back, prints its peak RSS, and then forks a child
 * that checks the memory too. Usage: chroot DIR MIB */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>

static unsigned long before(size_t i) { return i * 2654435761u; }
static unsigned long after(size_t i) { return i ^ 0x5555; }

static int check(const unsigned long *a, const unsigned long *b, size_t words, const char *who) {
    for (size_t i = 0; i < words; i++)
        if (a[i] != before(i) || b[i] != after(i)) {
            fprintf(stderr, "%s: bad word %zu\n", who, i);
            return 1;
        }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    size_t words = ((size_t)atoi(argv[2]) << 20) / 8;
    unsigned long *a = malloc(words * 8);
    if (!a) return 2;
    for (size_t i = 0; i < words / 4; i++) a[i] = before(i);
    if (chroot(argv[1]) || chdir("/")) {
        perror("chroot");
        return 2;
    }
    for (size_t i = words / 4; i < words; i++) a[i] = before(i);
    unsigned long *b = mmap(0, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b == MAP_FAILED) return 2;
    for (size_t i = 0; i < words; i++) b[i] = after(i);
    for (int r = 0; r < 2; r++)
        if (check(a, b, words, "parent")) return 1;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("maxrss_kib=%ld\n", ru.ru_maxrss);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) _exit(check(a, b, words, "child"));
    int st;
    if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "child failed: %#x\n", st);
        return 1;
    }
    printf("ok\n");
    return 0;
}
