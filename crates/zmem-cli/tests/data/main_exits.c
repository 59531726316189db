/* main() ends with pthread_exit while its worker thread goes on, as a
 * daemon may: the worker writes 4x the limit (128 MiB) twice, then checks
 * every word. The process ends when the worker returns (exit status 0). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *work(void *arg) {
    (void)arg;
    /* main has ended by now. */
    usleep(300 * 1000);
    size_t n = (size_t)128 << 20, words = n / sizeof(unsigned long), bad = 0;
    unsigned long *p = malloc(n);
    if (!p)
        return NULL;
    for (int round = 0; round < 2; round++)
        for (size_t i = 0; i < words; i++)
            p[i] = i * 2654435761u + round;
    for (size_t i = 0; i < words; i++)
        bad += p[i] != i * 2654435761u + 1;
    printf("worker: %zu bad words\n", bad);
    fflush(stdout);
    return NULL;
}

int main(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, work, NULL) != 0)
        return 1;
    pthread_exit(NULL);
}
