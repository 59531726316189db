/* The C API of include/zmem.h, linked against libzmem_preload.so. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "zmem.h"

int main(void) {
    size_t len = 64u << 20;
    unsigned char *p = zmem_map(len);
    if (!p || !zmem_is_managed(p) || !zmem_is_managed(p + len - 1)) return 1;
    for (size_t i = 0; i < len; i++) p[i] = (unsigned char)(i * 7 + i / 4096);
    for (size_t i = 0; i < len; i++) if (p[i] != (unsigned char)(i * 7 + i / 4096)) return 2;
    char buf[8192];
    ssize_t n = zmem_stats_json(buf, sizeof buf);
    if (n <= 0 || !strstr(buf, "\"evicted_folios\"")) return 3;
    int x;
    if (zmem_unmap(&x) != -1 || errno != EINVAL) return 4;
    if (zmem_unmap(p) != 0 || zmem_is_managed(p)) return 5;
    if (zmem_map(0) != NULL || errno != EINVAL) return 6;
    puts("api ok");
    return 0;
}
