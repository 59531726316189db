// Built with -fsanitize=address: 150 MB of 4000-byte blocks, a third of
// them freed and made again, every block checked; everything freed at the
// end (LeakSanitizer runs at exit). Prints ASAN_OPTIONS as it found it.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoul(argv[1], NULL, 10) : 37500, bad = 0;
    const char *opts = getenv("ASAN_OPTIONS");
    printf("ASAN_OPTIONS=%s\n", opts ? opts : "");
    char **v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) {
        v[i] = malloc(4000);
        memset(v[i], (int)(i & 0xff), 4000);
    }
    for (size_t i = 0; i < n; i += 3) {
        free(v[i]);
        v[i] = malloc(4000);
        memset(v[i], (int)(i & 0xff), 4000);
    }
    for (size_t i = 0; i < n; i++)
        for (int j = 0; j < 4000; j += 97) bad += v[i][j] != (char)(i & 0xff);
    for (size_t i = 0; i < n; i++) free(v[i]);
    free(v);
    printf("%s: %zu bad\n", bad ? "BAD" : "ok", bad);
    return bad != 0;
}
