/* What a C program sees of the machine's memory: sysinfo(2)'s total and
 * free RAM, glibc's get_phys_pages, in bytes, and /proc/meminfo's MemTotal
 * (kB) read through fopen(3) and through open(2). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

static unsigned long long mem_total(const char *text) {
    const char *p = strstr(text, "MemTotal:");
    return p ? strtoull(p + 9, NULL, 10) : 0;
}

int main(void) {
    struct sysinfo s;
    if (sysinfo(&s) != 0) {
        perror("sysinfo");
        return 1;
    }
    unsigned long long unit = s.mem_unit ? s.mem_unit : 1, page = (unsigned long long)sysconf(_SC_PAGESIZE);
    char buf[8192];
    FILE *f = fopen("/proc/meminfo", "re");
    if (!f) {
        perror("fopen");
        return 1;
    }
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    unsigned long long via_fopen = mem_total(buf);
    int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        perror("open");
        return 1;
    }
    ssize_t k = read(fd, buf, sizeof buf - 1);
    buf[k > 0 ? k : 0] = 0;
    close(fd);
    unsigned long long via_open = mem_total(buf);
    printf("total %llu free %llu phys %llu meminfo %llu %llu\n", (unsigned long long)s.totalram * unit,
           (unsigned long long)s.freeram * unit, (unsigned long long)get_phys_pages() * page, via_fopen * 1024,
           via_open * 1024);
    return 0;
}
