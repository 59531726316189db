/* Built twice: with -DLIB as a library whose constructor writes and reads
 * back 3x zmem's limit, and without it as a program that dlopens it. A
 * constructor runs with the dynamic loader's lock held, so every fault it
 * takes is served while the program holds that lock: zmem's threads must
 * never wait for it (a thread-local's first use does, through
 * __cxa_thread_atexit_impl). A second constructor starts a thread and waits
 * for it to run, as OpenBLAS's starts its pool when numpy is imported: the
 * new thread must not wait for that lock before its start routine either. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef LIB
static volatile int started;

static void *worker(void *arg) {
    (void)arg;
    __atomic_store_n(&started, 1, __ATOMIC_RELEASE);
    return NULL;
}

__attribute__((constructor)) static void start_thread(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) != 0) {
        perror("pthread_create");
        exit(1);
    }
    /* Natively the thread runs at once; 10 s is a hang. */
    for (int i = 0; i < 10000 && !__atomic_load_n(&started, __ATOMIC_ACQUIRE); i++)
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    if (!__atomic_load_n(&started, __ATOMIC_ACQUIRE)) {
        fprintf(stderr, "constructor: the thread it started did not run in 10 s\n");
        exit(1);
    }
    pthread_join(t, NULL);
    puts("constructor: its thread ran");
    fflush(stdout);
}

__attribute__((constructor)) static void touch(void) {
    size_t mib = 96, n = (mib << 20) / sizeof(unsigned long), bad = 0;
    unsigned long *p = malloc(n * sizeof *p);
    if (!p) {
        perror("malloc");
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        p[i] = i * 2654435761UL ^ (i >> 9);
    for (size_t i = 0; i < n; i++)
        bad += p[i] != (i * 2654435761UL ^ (i >> 9));
    printf("constructor: %zu MiB checked, %zu bad words\n", mib, bad);
    fflush(stdout);
    free(p);
}
#else
int main(int argc, char **argv) {
    if (argc < 2 || !dlopen(argv[1], RTLD_NOW)) {
        fprintf(stderr, "dlopen: %s\n", argc < 2 ? "no library named" : dlerror());
        return 1;
    }
    puts("loaded");
    return 0;
}
#endif
