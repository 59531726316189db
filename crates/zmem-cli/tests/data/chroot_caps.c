/* Changes its root, then (with "drop") gives up every capability of its
 * thread through glibc's `syscall`, as libcap can, and says so on stdout.
 * It then waits for a line on stdin (the test looks at its threads
 * meanwhile), maps and fills more memory, and ends its main thread with
 * pthread_exit while a worker checks every word. The process ends when the
 * worker returns. Usage: chroot_caps DIR MIB drop|keep */
#include <linux/capability.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static unsigned long *a, *b;
static size_t words;

static void *work(void *arg) {
    (void)arg;
    /* main has ended by now. */
    usleep(300 * 1000);
    size_t bad = 0;
    for (int r = 0; r < 2; r++)
        for (size_t i = 0; i < words; i++)
            bad += a[i] != i * 2654435761u || b[i] != (i ^ 0x5555);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("worker: %zu bad words, maxrss_kib=%ld\n", bad, ru.ru_maxrss);
    fflush(stdout);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    words = ((size_t)atoi(argv[2]) << 20) / 8;
    a = malloc(words * 8);
    b = malloc(words * 8);
    if (!a || !b) return 2;
    for (size_t i = 0; i < words; i++) a[i] = i * 2654435761u;
    /* A walk back over it: loads that may read the swap file ahead, whose
     * io_uring may start a worker thread before the chroot. */
    size_t early = 0;
    for (size_t i = 0; i < words; i++) early += a[i] != i * 2654435761u;
    if (early) return 1;
    if (chroot(argv[1]) || chdir("/")) {
        perror("chroot");
        return 2;
    }
    if (!strcmp(argv[3], "drop")) {
        struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct d[2];
        memset(d, 0, sizeof d);
        if (syscall(SYS_capset, &h, d)) {
            perror("capset");
            return 2;
        }
    }
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 2;
    for (size_t i = 0; i < words; i++) b[i] = i ^ 0x5555;
    pthread_t t;
    if (pthread_create(&t, NULL, work, NULL)) return 2;
    pthread_exit(NULL);
}
