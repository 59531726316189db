/* Built twice: with -DLIB as a library whose constructor writes and reads
 * back 3x zmem's limit, and without it as a program that dlopens it. A
 * constructor runs with the dynamic loader's lock held, so every fault it
 * takes is served while the program holds that lock: zmem's threads must
 * never wait for it (a thread-local's first use does, through
 * __cxa_thread_atexit_impl). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef LIB
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
