/* A native backtrace on a fatal signal, before Python's faulthandler prints the Python one.
 *
 * faulthandler shows where each Python thread was; a crash inside C (a kernel, wasmtime, torch)
 * shows no C frames there, and a crash in a thread Python does not know shows none at all. This
 * handler writes the crashing thread's C frames (library and offset, or symbol) to stderr, then
 * puts back the handler it replaced and lets the signal take its course: a fault re-executes the
 * faulting instruction into that handler; a signal sent by another process is raised again.
 * backtrace() is called once at install, so that its lazy loading (which allocates) is done
 * before any signal.
 *
 * wasmtime turns a guest's out-of-bounds access into a trap from its own SIGSEGV handler, and
 * hands faults outside guest code to the handler that was there before it. So this handler must
 * come first (engines.py loads the library before the first engine); where wasmtime's is already
 * installed, it is not installed at all: it would take every guest's trap for a crash.
 */
#if defined(__linux__)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
#define N_FATAL (int)(sizeof fatal / sizeof fatal[0])
static struct sigaction previous[N_FATAL];

/* "0x..." of v into buf (no printf in a signal handler); returns the length. */
static int hex(char *buf, uint64_t v) {
    char digits[16];
    int n = 0;
    do {
        digits[n++] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v);
    buf[0] = '0', buf[1] = 'x';
    for (int i = 0; i < n; i++)
        buf[2 + i] = digits[n - 1 - i];
    return n + 2;
}

static void report(int sig, siginfo_t *info, void *context) {
    (void)context;
    /* the thread as faulthandler names it ("Thread 0x..." is its pthread_t) */
    char line[160] = "\nrudder: fatal signal; native backtrace of the crashing thread ";
    int n = (int)strlen(line);
    n += hex(line + n, (uint64_t)pthread_self());
    static const char tail[] = " (most recent call first):\n";
    memcpy(line + n, tail, sizeof tail - 1);
    ssize_t ignored = write(2, line, n + sizeof tail - 1);
    (void)ignored;
    void *frames[48];
    backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
    for (int i = 0; i < N_FATAL; i++)
        if (fatal[i] == sig)
            sigaction(sig, &previous[i], NULL);
    if (info->si_code <= 0) /* sent (kill, raise), not a fault: send it again to the old handler */
        raise(sig);
}

/* Whether the handler `sa` is code of a library named like wasmtime. */
static int wasmtime_handler(const struct sigaction *sa) {
    void *fn = sa->sa_flags & SA_SIGINFO ? (void *)sa->sa_sigaction : (void *)sa->sa_handler;
    if (fn == (void *)SIG_DFL || fn == (void *)SIG_IGN)
        return 0;
    Dl_info where;
    return dladdr(fn, &where) && where.dli_fname && strstr(where.dli_fname, "wasmtime");
}

/* Installs the handler for SIGSEGV, SIGBUS, SIGILL and SIGFPE (once): 0 when installed, 1 when
 * wasmtime's handlers came first (then it is not), -1 on an error. */
int rudder_crash_report_install(void) {
    static int installed;
    if (installed)
        return 0;
    struct sigaction now;
    for (int i = 0; i < N_FATAL; i++)
        if (sigaction(fatal[i], NULL, &now) != 0 || wasmtime_handler(&now))
            return 1;
    void *warm[1];
    backtrace(warm, 1);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = report;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_FATAL; i++)
        if (sigaction(fatal[i], &sa, &previous[i]) != 0)
            return -1;
    installed = 1;
    return 0;
}
#else
int rudder_crash_report_install(void) { return -1; }
#endif
