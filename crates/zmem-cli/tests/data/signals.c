/* A signal handler that reads evicted memory while the program is inside
 * the shim.
 *
 * A SIGALRM every 100 us reads (and checks) a random page of a buffer
 * several times the limit, so most reads fault on an evicted page. Between
 * signals, the main thread maps and unmaps memory the shim manages or
 * adopts: glibc's large chunks (malloc/free, and realloc's growth) and
 * plain anonymous mmaps. If the shim took one of the pager's locks with
 * the signal open, the handler's fault waited for that lock, held by the
 * thread the handler interrupted: a hang (bash's SIGCHLD handler did it).
 *
 * A thread the program starts has the signal mask its creator had (the
 * shim makes it inside its own code, where signals are blocked: memcached's
 * workers kept them blocked, and its `shutdown` never ended it).
 *
 * argv[1]: MiB in the buffer; argv[2]: rounds of mapping. Prints
 * "signals ok ROUNDS HANDLED" and exits 0 if every page read back as
 * written. */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>

#define PAGE 4096

static uint64_t *buf;
static size_t pages;
static volatile sig_atomic_t bad, handled;
static uint64_t rng = 0x9e3779b97f4a7c15u;

static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint64_t word(size_t page, size_t i) { return (page * 0x100000001b3u) ^ (i * 0x9e3779b97f4a7c15u); }

static int page_ok(size_t p) {
    const uint64_t *w = buf + p * (PAGE / 8);
    for (size_t i = 0; i < PAGE / 8; i += 61)
        if (w[i] != word(p, i)) return 0;
    return 1;
}

static void on_alarm(int sig) {
    (void)sig;
    /* Its own state: the main thread never runs at the same time. */
    if (!page_ok(next(&rng) % pages)) bad = 1;
    handled = handled + 1;
}

static void *mask_of_thread(void *out) {
    sigset_t cur;
    pthread_sigmask(SIG_BLOCK, 0, &cur);
    *(int *)out = sigismember(&cur, SIGINT) || sigismember(&cur, SIGALRM) || sigismember(&cur, SIGTERM);
    return 0;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 96;
    long rounds = argc > 2 ? strtol(argv[2], 0, 10) : 2000;
    pages = mib << 20 >> 12;
    buf = malloc(pages * PAGE);
    if (!buf) return 2;
    for (size_t p = 0; p < pages; p++)
        for (size_t i = 0; i < PAGE / 8; i++) buf[p * (PAGE / 8) + i] = word(p, i);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, 0);
    struct itimerval it = {{0, 100}, {0, 100}};
    setitimer(ITIMER_REAL, &it, 0);

    uint64_t s = 12345;
    for (long r = 0; r < rounds; r++) {
        size_t len = (1 + next(&s) % 4) << 20;
        char *m = malloc(len);
        char *q = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (!m || q == MAP_FAILED) return 2;
        memset(m, (int)r, len);
        memset(q, (int)r, len);
        m = realloc(m, 2 * len);
        if (!m || m[len - 1] != (char)r) bad = 1;
        munmap(q, len);
        free(m);
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, 0);
    for (size_t p = 0; p < pages; p++)
        if (!page_ok(p)) bad = 1;
    int blocked = -1;
    pthread_t t;
    if (pthread_create(&t, 0, mask_of_thread, &blocked) || pthread_join(t, 0) || blocked) {
        printf("a new thread blocks signals its creator does not (%d)\n", blocked);
        bad = 1;
    }
    if (bad) {
        puts("signals BAD");
        return 1;
    }
    printf("signals ok %ld %d\n", rounds, (int)handled);
    return 0;
}
