#!/usr/bin/env bash
# Build and run dcpx's libFuzzer targets.
#
#   fuzz/run.sh [SECONDS] [TARGET]   build, then fuzz TARGET for SECONDS
#                                    (default 60, fuzz_zipread); 1 process
#                                    (FORK=1: go on after crashes)
#   fuzz/run.sh build                only build the three targets into fuzz/build/
#   fuzz/run.sh merge [TARGET]       minimise fuzz/work/TARGET (+ seeds) into
#                                    the committed fuzz/corpus/TARGET
#   fuzz/run.sh replay [TARGET]      run every committed input once (the
#                                    crash inputs too: they report open bugs)
#
# TARGET: fuzz_zipread (csrc/zipread.c + crc32.c), fuzz_reader (the real
# csrc/reader.c read_one over a memfd, and writer->reader round trips through
# csrc/zipwrite.c) or fuzz_picklescan (csrc/picklescan.c).  Inputs are up to MAX_LEN bytes
# (default 16384).  The working corpus is fuzz/work/TARGET (not committed),
# seeded from fuzz/corpus/TARGET and fuzz/seeds/TARGET (make_corpus.py);
# crashes, leaks, UB and timeouts land in fuzz/work/artifacts/ and the run's
# log and final stats (execs, cov, ft) in fuzz/stats/.
set -euo pipefail
cd "$(dirname "$0")/.."

CC=${CC:-clang}
MAX_LEN=${MAX_LEN:-16384}
PYINC=$(python3-config --includes)
PYLIBDIR=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
PYLIB=python$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
CFLAGS=(-g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
        -fno-sanitize-recover=undefined -std=c11 -D_GNU_SOURCE -Wall -Wextra
        -Wno-unused-function -Icsrc)

build() {
    mkdir -p fuzz/build
    # shellcheck disable=SC2086
    $CC "${CFLAGS[@]}" $PYINC fuzz/fuzz_zipread.c csrc/zipread.c csrc/crc32.c \
        -o fuzz/build/fuzz_zipread
    # these two #include a csrc file whose Python wrapper needs libpython
    # (never called)
    # shellcheck disable=SC2086
    $CC "${CFLAGS[@]}" $PYINC fuzz/fuzz_reader.c csrc/zipread.c csrc/crc32.c \
        csrc/zipwrite.c csrc/workers.c csrc/files.c -L"$PYLIBDIR" -Wl,-rpath,"$PYLIBDIR" -l"$PYLIB" \
        -lpthread -o fuzz/build/fuzz_reader
    # shellcheck disable=SC2086
    $CC "${CFLAGS[@]}" $PYINC fuzz/fuzz_picklescan.c \
        -L"$PYLIBDIR" -Wl,-rpath,"$PYLIBDIR" -l"$PYLIB" \
        -o fuzz/build/fuzz_picklescan
}

opts() {
    echo -max_len="$MAX_LEN" -timeout=10 -rss_limit_mb=2048 \
         -print_final_stats=1 -artifact_prefix=fuzz/work/artifacts/
    # FORK=1: one worker process that libFuzzer restarts after a crash, so a
    # run goes on past a known bug (every crash input still lands in
    # fuzz/work/artifacts/)
    [ "${FORK:-0}" = 1 ] && echo -fork=1 -ignore_crashes=1
    true
}

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

case "${1:-60}" in
build)
    build
    ;;
merge)
    t=${2:-fuzz_zipread}
    build
    mkdir -p "fuzz/corpus/$t" fuzz/work/merged
    rm -rf "fuzz/work/merged/$t"
    mkdir -p "fuzz/work/merged/$t"
    srcs=("fuzz/corpus/$t")
    [ -d "fuzz/work/$t" ] && srcs+=("fuzz/work/$t")
    [ -d "fuzz/seeds/$t" ] && srcs+=("fuzz/seeds/$t")
    # shellcheck disable=SC2046
    "fuzz/build/$t" -merge=1 $(opts) "fuzz/work/merged/$t" "${srcs[@]}"
    rm -rf "fuzz/corpus/$t"
    mv "fuzz/work/merged/$t" "fuzz/corpus/$t"
    du -sh "fuzz/corpus/$t"
    ;;
replay)
    t=${2:-fuzz_zipread}
    build
    # every committed input, the crash inputs included (each on its own, so
    # that one report does not hide the others)
    # shellcheck disable=SC2046
    "fuzz/build/$t" $(opts) -runs=0 "fuzz/corpus/$t" || exit 1
    rc=0
    for f in fuzz/corpus/crashes/*; do
        [ -f "$f" ] || continue
        if ! out=$("fuzz/build/$t" $(opts) "$f" 2>&1); then
            echo "== $f"; echo "$out" | grep -E "ERROR|SUMMARY|runtime error"; rc=1
        fi
    done
    [ "$rc" = 0 ] && echo "replay: all inputs ran clean"
    exit "$rc"
    ;;
*)
    secs=$1
    t=${2:-fuzz_zipread}
    build
    mkdir -p "fuzz/work/$t" "fuzz/corpus/$t" fuzz/work/artifacts fuzz/stats
    seeds=("fuzz/corpus/$t")
    [ -d "fuzz/seeds/$t" ] && seeds+=("fuzz/seeds/$t")
    stamp=$(date -u +%Y%m%dT%H%M%SZ)
    log="fuzz/stats/$t-$stamp.log"
    set +e
    # shellcheck disable=SC2046
    "fuzz/build/$t" $(opts) -max_total_time="$secs" \
        "fuzz/work/$t" "${seeds[@]}" 2>&1 | tee "$log" | grep -E "INIT|DONE|ERROR|SUMMARY|pulse" 
    rc=${PIPESTATUS[0]}
    set -e
    {
        echo "target: $t  date: $stamp  seconds: $secs  max_len: $MAX_LEN  exit: $rc"
        grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|^#[0-9]+: cov" "$log" | tail -2 || true
        grep -E "runtime error|ERROR: (Address|libFuzzer)" "$log" | head -2 || true
        grep -E "^stat::" "$log" || true
    } > "fuzz/stats/$t-$stamp.txt"
    cat "fuzz/stats/$t-$stamp.txt"
    exit "$rc"
    ;;
esac
