/* Vectors that grow as glibc grows a chunk it mmapped: mremap(MAYMOVE) by
 * an eighth at a time, in place where the next pages are free and moved
 * elsewhere where not, through raw syscalls (as glibc's realloc makes
 * them, unseen by any interposed call). Many such vectors side by side make
 * the kernel merge their mappings, so that a region zmem adopts spans
 * several; each later move splits it. Every word is checked before and
 * after each growth and at the end.
 *
 * usage: mremap STEPS; prints "STEPS steps, N bad words". */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NV 48
#define MAX_BYTES (4u << 20)

struct vec {
	uint64_t *p;
	size_t cap, n, map;
	uint64_t gen;
};

static struct vec V[NV];

static uint64_t tag(int v, uint64_t gen, size_t i)
{
	uint64_t x = (gen * 1000003u + v) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
	return x | 1;
}

static void *raw_mmap(size_t len)
{
	return (void *)syscall(SYS_mmap, 0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
}

static uint64_t check(int v)
{
	uint64_t bad = 0;
	for (size_t i = 0; i < V[v].n; i++)
		bad += V[v].p[i] != tag(v, V[v].gen, i);
	return bad;
}

int main(int argc, char **argv)
{
	long steps = argc > 1 ? atol(argv[1]) : 1000000;
	uint64_t seed = 12345, bad = 0;
	for (long s = 0; s < steps; s++) {
		seed = seed * 6364136223846793005ull + 1442695040888963407ull;
		int v = (seed >> 33) % NV;
		struct vec *x = &V[v];
		if (!x->p) {
			x->map = 256 << 10;
			x->p = raw_mmap(x->map);
			if (x->p == MAP_FAILED) {
				perror("mmap");
				return 2;
			}
			x->cap = x->map / 8;
			x->n = 0;
			x->gen++;
		}
		if (x->n == x->cap) {
			bad += check(v);
			if (x->map >= MAX_BYTES) {
				syscall(SYS_munmap, x->p, x->map);
				x->p = 0;
				continue;
			}
			size_t nm = (x->map + x->map / 8 + 4095) & ~4095ul;
			void *q = (void *)syscall(SYS_mremap, x->p, x->map, nm, MREMAP_MAYMOVE, 0);
			if (q == MAP_FAILED) {
				/* What glibc does when mremap fails. */
				q = raw_mmap(nm);
				if (q == MAP_FAILED) {
					perror("mmap");
					return 2;
				}
				memcpy(q, x->p, x->n * 8);
				syscall(SYS_munmap, x->p, x->map);
			}
			x->p = q;
			x->map = nm;
			x->cap = nm / 8;
			bad += check(v);
		}
		size_t add = x->cap - x->n < 64 ? x->cap - x->n : 64;
		for (size_t i = 0; i < add; i++)
			x->p[x->n + i] = tag(v, x->gen, x->n + i);
		x->n += add;
	}
	for (int v = 0; v < NV; v++)
		if (V[v].p)
			bad += check(v);
	printf("%ld steps, %lu bad words\n", steps, (unsigned long)bad);
	return bad != 0;
}
