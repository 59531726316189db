/* zmem.h: explicit managed memory for C and C++ programs.
 *
 * Link against (or preload) libzmem_preload.so, built by
 *   cargo build --release -p zmem-preload
 * The library reads the ZMEM_* environment variables (see `zmem run --help`)
 * when it is first used. Under `zmem run`, large malloc/mmap allocations are
 * managed without any of this; these calls are for programs that want to
 * choose which memory is managed. A process whose pager waits to start
 * until its memory nears the limit (ZMEM_START_PERCENT) starts it at its
 * first call of zmem_map or zmem_stats_json.
 */
#ifndef ZMEM_H
#define ZMEM_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Maps len bytes (rounded up to a folio, 64 KiB by default) of managed
 * memory: zero-filled, private, under the process's zmem limit. Returns NULL
 * with errno set (EINVAL for len 0, ENOMEM otherwise, and a message on
 * stderr if zmem could not start). */
void *zmem_map(size_t len);

/* Frees memory from zmem_map (free() and munmap() of the whole mapping work
 * too). Returns 0, or -1 with errno EINVAL for a pointer zmem did not hand
 * out. */
int zmem_unmap(void *p);

/* 1 if p points into managed memory, else 0. */
int zmem_is_managed(const void *p);

/* This process's zmem stats as JSON, written NUL-terminated into buf and
 * truncated to len. Returns the full length (as snprintf does), or -1 when
 * zmem is off. */
ssize_t zmem_stats_json(char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* ZMEM_H */
