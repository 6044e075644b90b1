# Sourced by setup.sh, test.sh and tsan.sh when DCPX_SANITIZE is set: the
# interpreter is not instrumented, so the sanitizer runtimes must be
# preloaded into it.
#
# DCPX_SANITIZE=1: ASan + UBSan.  Leak checking is off because CPython
# itself keeps memory until exit.
if [ "${DCPX_SANITIZE:-0}" = "1" ]; then
    export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
fi
# DCPX_SANITIZE=thread: ThreadSanitizer.  Only dcpx is instrumented, but the
# runtime intercepts every pthread and memcpy call, so the GIL (a pthread
# mutex and condition variable in CPython) and thread create/join are seen
# as synchronisation, and no suppression is needed.  One exception:
# OpenMP's worker threads (torch's intra-op pool) synchronise with raw
# futexes that TSan cannot see, so the memcpys torch's kernels make on them
# are reported against each other (libtorch_cpu frames only).  One intra-op
# thread keeps those out without suppressing anything; dcpx's own threads
# are unaffected.  A report in any process (children inherit this
# environment) fails the run: exitcode=66, and scripts/tsan.sh checks the
# per-process logs under DCPX_TSAN_LOGS.
if [ "${DCPX_SANITIZE:-0}" = "thread" ]; then
    export LD_PRELOAD="$(gcc -print-file-name=libtsan.so)"
    export TSAN_OPTIONS="halt_on_error=0:exitcode=66:second_deadlock_stack=1${DCPX_TSAN_LOGS:+:log_path=$DCPX_TSAN_LOGS/tsan}"
    export OMP_NUM_THREADS=1
fi
