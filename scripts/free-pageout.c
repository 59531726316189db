// Eviction without MOVE: `MADV_FREE`, then `MADV_PAGEOUT`, drops exactly
// the pages not written since the FREE (the kernel discards a lazily freed
// page only while it is clean), which is the atomic "drop unless written"
// that a write-protect, copy and DONTNEED lacks. This checks that on the
// running kernel, says what it costs beside UFFDIO_MOVE, and shows why
// zmem cannot use it as it is.
//
// 1. Correctness, unregistered memory: 64 MiB written, FREEd, every 16th
//    page written again, PAGEOUTed. Each page must be either gone (zeros)
//    or resident with its bytes; every page written again must be resident.
// 2. Cost per 64 KiB folio, victims every other folio (apart, as a random
//    reader's are): one MOVE ioctl per folio into a registered area, against
//    one `process_madvise` of FREE over 16 folios and one of PAGEOUT over the
//    same. Each alone, then with a sibling thread of the process spinning on
//    the other CPU (a flush then needs an IPI there).
// 3. The catch: on a range registered with UFFD_FEATURE_EVENT_REMOVE (zmem
//    needs the event to see the program drop pages), FREE raises a REMOVE
//    event, and the call waits until a handler has read it.
//   cc -O2 -pthread -o /tmp/free-pageout scripts/free-pageout.c && /tmp/free-pageout
// UFFDIO_MOVE's struct and number: uffd-move.h.
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "uffd-move.h"

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif
#define FOLIO (64 << 10)
#define SPAN (64 << 20)
#define PAGE 4096
#define BATCH 16

static volatile int stop;

static void *spin(void *unused) {
    (void)unused;
    pin(1);
    while (!stop) __asm__ volatile("pause");
    return NULL;
}

static char *area(void) {
    char *p = mmap(0, SPAN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) exit((perror("mmap"), 1));
    madvise(p, SPAN, MADV_NOHUGEPAGE); // small folios, as zmem's regions
    return p;
}

static unsigned char fill_byte(size_t page) { return page % 251 + 1; }

static void fill(char *p) {
    for (size_t i = 0; i < SPAN; i += PAGE) memset(p + i, fill_byte(i / PAGE), PAGE);
}

static int uffd_open(uint64_t features) {
    int fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = {.api = UFFD_API, .features = features};
    must(fd < 0 || ioctl(fd, UFFDIO_API, &api), "userfaultfd");
    return fd;
}

static void reg(int fd, char *p) {
    struct uffdio_register r = {.range = {(uint64_t)p, SPAN}, .mode = UFFDIO_REGISTER_MODE_MISSING};
    must(ioctl(fd, UFFDIO_REGISTER, &r), "UFFDIO_REGISTER");
}

// One process_madvise of `advice` over the victims f, f+2, ..., BATCH of
// them from folio `first`.
static void advise_batch(char *p, size_t first, int advice) {
    struct iovec iov[BATCH];
    size_t bytes = 0;
    for (int k = 0; k < BATCH; k++) {
        iov[k].iov_base = p + (first + 2 * k) * FOLIO;
        iov[k].iov_len = FOLIO;
        bytes += FOLIO;
    }
    long r = syscall(SYS_process_madvise, -10001 /* PIDFD_SELF */, iov, BATCH, advice, 0);
    if (r != (long)bytes) exit((perror("process_madvise"), 1));
}

// µs per victim folio: MOVE, FREE, PAGEOUT.
static void cost(int sibling) {
    pthread_t t;
    stop = 0;
    if (sibling) pthread_create(&t, NULL, spin, NULL);
    usleep(10000);
    int fd = uffd_open(UFFD_FEATURE_MOVE_);
    char *a = area(), *b = area();
    fill(a);
    reg(fd, a);
    reg(fd, b);
    size_t folios = SPAN / FOLIO, victims = folios / 2;
    double t0 = now_ns();
    for (size_t f = 0; f < folios; f += 2) {
        struct uffdio_move_ m = {.dst = (uint64_t)(b + f * FOLIO), .src = (uint64_t)(a + f * FOLIO), .len = FOLIO};
        must(ioctl(fd, UFFDIO_MOVE_, &m), "UFFDIO_MOVE");
    }
    double t1 = now_ns();
    close(fd);
    munmap(a, SPAN);
    munmap(b, SPAN);
    char *c = area();
    fill(c);
    double t2 = now_ns();
    for (size_t f = 0; f < folios; f += 2 * BATCH) advise_batch(c, f, MADV_FREE);
    double t3 = now_ns();
    for (size_t f = 0; f < folios; f += 2 * BATCH) advise_batch(c, f, MADV_PAGEOUT);
    double t4 = now_ns();
    munmap(c, SPAN);
    stop = 1;
    if (sibling) pthread_join(t, NULL);
    printf("%-26s MOVE %5.1f   FREE %5.1f   PAGEOUT %5.1f   µs per 64 KiB folio\n",
           sibling ? "a sibling thread spinning:" : "alone:", (t1 - t0) / 1e3 / victims, (t3 - t2) / 1e3 / victims,
           (t4 - t3) / 1e3 / victims);
}

static int check(void) {
    char *p = area();
    fill(p);
    must(madvise(p, SPAN, MADV_FREE), "MADV_FREE");
    for (size_t i = 0; i < SPAN; i += 16 * PAGE) p[i + 1] = 0x55;
    must(madvise(p, SPAN, MADV_PAGEOUT), "MADV_PAGEOUT");
    unsigned char *vec = malloc(SPAN / PAGE);
    must(mincore(p, SPAN, vec), "mincore");
    size_t gone = 0, kept = 0, bad = 0;
    for (size_t i = 0; i < SPAN / PAGE; i++) {
        char *q = p + i * PAGE;
        int again = i % 16 == 0;
        if (vec[i] & 1) {
            kept++;
            bad += (unsigned char)q[0] != fill_byte(i) || (again && q[1] != 0x55);
        } else {
            gone++;
            bad += again || q[0] != 0; // written again, yet dropped
        }
    }
    printf("check: %zu pages dropped, %zu kept (%zu written again), %zu wrong\n", gone, kept, (size_t)(SPAN / PAGE / 16),
           bad);
    free(vec);
    munmap(p, SPAN);
    return bad != 0;
}

static volatile long removes;
static int event_fd;

static void *reader(void *unused) {
    (void)unused;
    struct uffd_msg m;
    while (!stop) {
        struct pollfd pfd = {.fd = event_fd, .events = POLLIN};
        if (poll(&pfd, 1, 10) <= 0) continue;
        while (read(event_fd, &m, sizeof m) == sizeof m)
            if (m.event == UFFD_EVENT_REMOVE) removes++;
    }
    return NULL;
}

static void remove_event(void) {
    event_fd = uffd_open(UFFD_FEATURE_EVENT_REMOVE);
    char *p = area();
    fill(p);
    reg(event_fd, p);
    pthread_t t;
    stop = 0;
    pthread_create(&t, NULL, reader, NULL);
    double t0 = now_ns();
    for (size_t f = 0; f < SPAN / FOLIO; f += 2 * BATCH) advise_batch(p, f, MADV_FREE);
    double t1 = now_ns();
    stop = 1;
    pthread_join(t, NULL);
    printf("registered with EVENT_REMOVE: %ld REMOVE events for %d FREE calls, %.1f µs per folio\n", removes,
           SPAN / FOLIO / (2 * BATCH), (t1 - t0) / 1e3 / (SPAN / FOLIO / 2));
    close(event_fd);
    munmap(p, SPAN);
}

int main(void) {
    pin(0);
    int bad = check();
    cost(0);
    cost(1);
    remove_event();
    return bad;
}
