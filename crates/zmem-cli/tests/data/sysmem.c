/* What a C program sees of the machine's memory: sysinfo(2)'s total and
 * free RAM, and glibc's get_phys_pages, in bytes. */
#include <stdio.h>
#include <sys/sysinfo.h>
#include <unistd.h>

int main(void) {
    struct sysinfo s;
    if (sysinfo(&s) != 0) {
        perror("sysinfo");
        return 1;
    }
    unsigned long long unit = s.mem_unit ? s.mem_unit : 1, page = (unsigned long long)sysconf(_SC_PAGESIZE);
    printf("total %llu free %llu phys %llu\n", (unsigned long long)s.totalram * unit,
           (unsigned long long)s.freeram * unit, (unsigned long long)get_phys_pages() * page);
    return 0;
}
