# Sourced by setup.sh and test.sh when DCPX_SANITIZE=1: the interpreter is
# not instrumented, so the ASan/UBSan runtimes must be preloaded into it.
# Leak checking is off because CPython itself keeps memory until exit.
if [ "${DCPX_SANITIZE:-0}" = "1" ]; then
    export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
fi
