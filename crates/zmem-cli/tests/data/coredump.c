/* A program that crashes with its memory evicted, to check its core dump.
 *
 * Fills a buffer several times the limit (each 8-byte word holds its own
 * offset times a constant), prints "buf ADDR BYTES", and then crashes as
 * argv[2] says:
 * - "segv": a second thread writes through a null pointer (SIGSEGV from
 *   the kernel, on a thread whose id is not the process's);
 * - "abort": the main thread calls abort() (SIGABRT);
 * - "faulthandler": a handler the program installs for SIGSEGV puts back
 *   the action it found and raises the signal again, as Python's
 *   faulthandler does; then a null write on the main thread;
 * - "signal": a handler installed with signal() ends as many crash
 *   handlers do, with signal(sig, SIG_DFL) and raise(sig). Prints
 *   "prev dfl 1" if signal() returned SIG_DFL as the old handler.
 * argv[1]: MiB in the buffer. */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MUL 2654435761u

static struct sigaction found;

static void chained(int sig) {
    sigaction(sig, &found, NULL);
    raise(sig);
}

static void idiom(int sig) {
    signal(sig, SIG_DFL);
    raise(sig);
}

static void *crash(void *arg) {
    (void)arg;
    *(volatile int *)(uintptr_t)0 = 1;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: coredump MIB segv|abort|faulthandler|signal\n");
        return 2;
    }
    size_t n = (size_t)atoi(argv[1]) << 20;
    uint64_t *buf = malloc(n);
    if (!buf) {
        perror("malloc");
        return 1;
    }
    for (size_t i = 0; i < n / 8; i++)
        buf[i] = (uint64_t)i * 8 * MUL;
    /* The program sees SIG_DFL, whatever zmem put there. */
    struct sigaction now;
    sigaction(SIGSEGV, NULL, &now);
    printf("buf %p %zu dfl %d\n", (void *)buf, n, now.sa_handler == SIG_DFL);
    fflush(stdout);
    usleep(300000); /* the stats thread writes its file meanwhile */
    if (!strcmp(argv[2], "segv")) {
        pthread_t t;
        pthread_create(&t, NULL, crash, NULL);
        pthread_join(t, NULL);
    } else if (!strcmp(argv[2], "abort")) {
        abort();
    } else if (!strcmp(argv[2], "faulthandler")) {
        struct sigaction act;
        memset(&act, 0, sizeof act);
        act.sa_handler = chained;
        act.sa_flags = SA_NODEFER;
        sigaction(SIGSEGV, &act, &found);
        crash(NULL);
    } else if (!strcmp(argv[2], "signal")) {
        void (*prev)(int) = signal(SIGSEGV, idiom);
        printf("prev dfl %d\n", prev == SIG_DFL);
        fflush(stdout);
        crash(NULL);
    }
    return 3;
}
