// A daemon's idiom: close the standard streams, then open /dev/null three
// times and count on getting 0, 1 and 2 back. In between, it pages through
// 64 MiB (under a smaller limit), so zmem's threads are busy (and open
// files) while those numbers are free. Repeated; exits 0 only if every
// open got the number the program counted on, and every page read back.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(void) {
    size_t n = 64u << 20;
    unsigned char *p = malloc(n);
    if (!p) return 2;
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31 >> 12);
    int err = dup(2);
    int wrong = 0;
    for (int round = 0; round < 20 && !wrong; round++) {
        close(0);
        close(1);
        close(2);
        unsigned long sum = 0;
        for (int pass = 0; pass < 2; pass++)
            for (size_t i = 0; i < n; i += 4096) sum += p[i] += 1;
        usleep(30000);
        for (int want = 0; want < 3; want++) {
            int fd = open("/dev/null", want ? O_WRONLY : O_RDONLY);
            if (fd != want) {
                dprintf(err, "round %d: open gave %d, not %d\n", round, fd, want);
                wrong = 1;
            }
        }
        (void)sum;
    }
    size_t bad = 0;
    for (size_t i = 0; i < n; i += 4096) bad += p[i] != (unsigned char)((i * 31 >> 12) + 40);
    dprintf(err, "wrong %d bad %zu\n", wrong, bad);
    return wrong || bad;
}
