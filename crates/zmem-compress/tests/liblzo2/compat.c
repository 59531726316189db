/* Dev-only helper for the liblzo2 compatibility test (tests/it/liblzo2.rs).
 *   compat c IN OUT   compress 4 KiB pages of IN with lzo1x_1 into length-prefixed objects
 *   compat d IN OUT   decompress length-prefixed objects with lzo1x_decompress_safe
 *   compat b IN       print liblzo2's own compress/decompress MB/s over the pages of IN
 */
#include <lzo/lzo1x.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PAGE 4096
static unsigned char wrk[LZO1X_1_MEM_COMPRESS];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 3 || lzo_init() != LZO_E_OK) return 2;
    FILE *in = fopen(argv[2], "rb");
    if (!in) return 2;
    unsigned char page[PAGE], buf[PAGE + PAGE / 16 + 64 + 3];
    if (argv[1][0] == 'b') {
        fseek(in, 0, SEEK_END);
        long n = ftell(in) / PAGE;
        rewind(in);
        unsigned char *pages = malloc(n * PAGE), *objs = malloc(n * sizeof buf);
        lzo_uint *lens = malloc(n * sizeof *lens);
        if (fread(pages, PAGE, n, in) != (size_t)n) return 2;
        double best_c = 0, best_d = 0;
        for (int round = 0; round < 5; round++) {
            double t0 = now();
            for (long i = 0; i < n; i++) {
                lens[i] = sizeof buf;
                lzo1x_1_compress(pages + i * PAGE, PAGE, objs + i * sizeof buf, &lens[i], wrk);
            }
            double t1 = now();
            for (long i = 0; i < n; i++) {
                lzo_uint m = PAGE;
                lzo1x_decompress_safe(objs + i * sizeof buf, lens[i], page, &m, NULL);
            }
            double t2 = now();
            double c = n * PAGE / (t1 - t0) / 1e6, d = n * PAGE / (t2 - t1) / 1e6;
            if (c > best_c) best_c = c;
            if (d > best_d) best_d = d;
        }
        printf("%.1f %.1f\n", best_c, best_d);
        return 0;
    }
    FILE *out = fopen(argv[3], "wb");
    if (!out) return 2;
    if (argv[1][0] == 'c') {
        while (fread(page, 1, PAGE, in) == PAGE) {
            lzo_uint n = sizeof buf;
            if (lzo1x_1_compress(page, PAGE, buf, &n, wrk) != LZO_E_OK) return 3;
            unsigned int len = (unsigned int)n;
            fwrite(&len, 4, 1, out);
            fwrite(buf, 1, n, out);
        }
    } else {
        unsigned int len;
        while (fread(&len, 4, 1, in) == 1) {
            if (len > sizeof buf || fread(buf, 1, len, in) != len) return 4;
            lzo_uint n = PAGE;
            int r = lzo1x_decompress_safe(buf, len, page, &n, NULL);
            if (r != LZO_E_OK || n != PAGE) {
                fprintf(stderr, "lzo1x_decompress_safe: %d, %lu bytes\n", r, (unsigned long)n);
                return 5;
            }
            fwrite(page, 1, PAGE, out);
        }
    }
    return fclose(out) == 0 ? 0 : 2;
}
