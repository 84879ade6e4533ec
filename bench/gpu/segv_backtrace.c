/* A native backtrace for a crashing process on a machine without gdb: an LD_PRELOAD library whose constructor
 * installs a handler for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT. The handler writes to stderr the signal, the
 * faulting address and instruction, then every frame of backtrace(), each as
 *     segv_backtrace: #N <module> +0x<offset> (<symbol>+0x<d>) [0x<absolute>]
 * where offset is relative to the module's load base, as `addr2line -f -C -i -e <module> <offset>` reads it (for a
 * return address the offset is that of the call instruction, address - 1, so addr2line names the calling line).
 * It then restores the default action and raises the signal again, so the exit status stays that of the crash.
 * It also makes stdout line-buffered: a library's printf debug output (DeepGEMM's DG_JIT_DEBUG) into a pipe is
 * otherwise lost in the stdio buffer when the process dies.
 *
 * Build: cc -O1 -g -fPIC -shared -o segv_backtrace.so segv_backtrace.c -ldl
 * Use:   LD_PRELOAD=$PWD/segv_backtrace.so python3 ...        (bench/gpu/native_backtrace.sh does both) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

enum { kMaxFrames = 128, kAltStackBytes = 1 << 16 };

static char alt_stack[kAltStackBytes];

/* A line to stderr with write(2), which a signal handler may call. */
static void say(const char *line) {
  size_t n = strlen(line);
  while (n > 0) {
    ssize_t w = write(STDERR_FILENO, line, n);
    if (w <= 0) return;
    line += w;
    n -= (size_t)w;
  }
}

static void describe(int index, uintptr_t addr, int is_return_address) {
  char line[1024];
  Dl_info info;
  const uintptr_t look = is_return_address && addr > 0 ? addr - 1 : addr;
  if (dladdr((void *)look, &info) && info.dli_fname) {
    const uintptr_t off = look - (uintptr_t)info.dli_fbase;
    if (info.dli_sname)
      snprintf(line, sizeof line, "segv_backtrace: #%d %s +0x%lx (%s+0x%lx) [0x%lx]\n", index, info.dli_fname,
               (unsigned long)off, info.dli_sname, (unsigned long)(look - (uintptr_t)info.dli_saddr),
               (unsigned long)addr);
    else
      snprintf(line, sizeof line, "segv_backtrace: #%d %s +0x%lx [0x%lx]\n", index, info.dli_fname,
               (unsigned long)off, (unsigned long)addr);
  } else {
    snprintf(line, sizeof line, "segv_backtrace: #%d ?? [0x%lx]\n", index, (unsigned long)addr);
  }
  say(line);
}

static uintptr_t faulting_pc(void *context) {
  const ucontext_t *uc = (const ucontext_t *)context;
#if defined(__x86_64__)
  return (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
  return (uintptr_t)uc->uc_mcontext.pc;
#else
  (void)uc;
  return 0;
#endif
}

static void on_fatal(int sig, siginfo_t *si, void *context) {
  char line[256];
  snprintf(line, sizeof line, "segv_backtrace: signal %d (%s), fault address %p, pid %d\n", sig, strsignal(sig),
           si ? si->si_addr : NULL, (int)getpid());
  say(line);
  const uintptr_t pc = faulting_pc(context);
  if (pc) {
    say("segv_backtrace: faulting instruction:\n");
    describe(0, pc, 0);
  }
  void *frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  say("segv_backtrace: frames (this handler first):\n");
  for (int i = 0; i < n; ++i) describe(i + 1, (uintptr_t)frames[i], 1);
  say("segv_backtrace: end\n");
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* backtrace() loads libgcc on its first call, which must not happen inside the handler. */
  void *warm[2];
  backtrace(warm, 2);
  stack_t ss;
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  sigaltstack(&ss, NULL); /* a stack overflow still gets its backtrace (on the thread that loaded this) */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  const int signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (size_t i = 0; i < sizeof signals / sizeof signals[0]; ++i) sigaction(signals[i], &sa, NULL);
  say("segv_backtrace: handler installed\n");
}
