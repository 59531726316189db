/* Makes children with a raw clone, as bubblewrap does (no fork handlers
 * run), while zmem's stats thread looks at the process every millisecond
 * or two: each child changes its root the way bubblewrap's does
 * (`pivot_root` through glibc's `syscall`, here with paths that fail),
 * maps and fills memory, and ends. A lock the stats thread held at the
 * clone is held for good in the child. Usage: rawclone CHILDREN MIB */
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int children = atoi(argv[1]);
    size_t len = (size_t)atoi(argv[2]) << 20;
    /* Past a quarter of a 32M limit: the stats thread looks often. */
    char *held = malloc(len);
    if (!held) return 2;
    memset(held, 7, len);
    for (int i = 0; i < children; i++) {
        long pid = syscall(SYS_clone, (long)SIGCHLD, 0L, 0L, 0L, 0L);
        if (pid < 0) {
            perror("clone");
            return 2;
        }
        if (pid == 0) {
            syscall(SYS_pivot_root, "/nonexistent-new-root", "/nonexistent-old-root");
            char *m = mmap(0, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) _exit(3);
            memset(m, i, 4 << 20);
            _exit(held[len - 1] == 7 && m[12345] == (char)i ? 0 : 4);
        }
        int st;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("bad child %d: status %#x\n", i, st);
            return 1;
        }
    }
    printf("ok %d\n", children);
    return 0;
}
