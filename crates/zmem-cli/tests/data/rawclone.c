/* Fills MIB MiB, then makes children with a raw clone through glibc's
 * `syscall`, as bubblewrap does (no fork handlers run): each child changes
 * its root the way bubblewrap's does (`pivot_root` through `syscall`,
 * here with paths that fail), reads every page of the parent's memory
 * back, maps and fills memory of its own, forks a child that ends at
 * once, and ends. Under a few MiB the
 * parent waits to start its pager and zmem's stats thread looks at it
 * every millisecond or two (a lock it held at the clone is held for good
 * in the child); past the limit, the parent has pages evicted at each
 * clone. HOW is the system call: clone, clone-files (with CLONE_FILES),
 * clone3 or fork.
 * Usage: rawclone CHILDREN MIB HOW */
#include <linux/sched.h>
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
    if (argc != 4) return 2;
    const char *how = argv[3];
    int children = atoi(argv[1]);
    size_t len = (size_t)atoi(argv[2]) << 20;
    char *held = malloc(len);
    if (!held) return 2;
    for (size_t o = 0; o < len; o += 4096) memset(held + o, (int)(o >> 12) % 251, 4096);
    for (int i = 0; i < children; i++) {
        long pid;
        if (!strcmp(how, "clone3")) {
            struct clone_args args = {.exit_signal = SIGCHLD};
            pid = syscall(SYS_clone3, &args, sizeof args);
        } else if (!strcmp(how, "fork")) {
            pid = syscall(SYS_fork);
        } else if (!strcmp(how, "clone-files")) {
            /* The descriptor table shared: zmem's descriptors are the
             * parent's still. */
            pid = syscall(SYS_clone, (long)(SIGCHLD | CLONE_FILES), 0L, 0L, 0L, 0L);
        } else {
            pid = syscall(SYS_clone, (long)SIGCHLD, 0L, 0L, 0L, 0L);
        }
        if (pid < 0) {
            perror("clone");
            return 2;
        }
        if (pid == 0) {
            syscall(SYS_pivot_root, "/nonexistent-new-root", "/nonexistent-old-root");
            char *m = mmap(0, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) _exit(3);
            memset(m, i, 4 << 20);
            for (size_t o = 0; o < len; o += 4096)
                if (held[o] != (char)((o >> 12) % 251) || held[o + 4095] != held[o]) _exit(5);
            /* bubblewrap's pid 1 forks the sandbox's program (glibc's
             * fork: the shim's handlers run). */
            pid_t g = fork();
            if (g == 0) _exit(0);
            int gst;
            if (g < 0 || waitpid(g, &gst, 0) != g || gst != 0) _exit(6);
            _exit(m[12345] == (char)i ? 0 : 4);
        }
        int st;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("bad child %d: status %#x\n", i, st);
            return 1;
        }
    }
    for (size_t o = 0; o < len; o += 4096)
        if (held[o] != (char)((o >> 12) % 251) || held[o + 4095] != held[o]) {
            printf("bad page %zu in the parent\n", o >> 12);
            return 1;
        }
    printf("ok %d\n", children);
    return 0;
}
