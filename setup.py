"""Build the dcpx._C extension: a C compiler and the Python headers are all
it needs (no libtorch, no CUDA toolkit, no pybind11).

Environment switches:
  DCPX_SANITIZE=1   build with -fsanitize=address,undefined (see .ci/run)
  DCPX_SANITIZE=thread  build with -fsanitize=thread (see scripts/tsan.sh)
  DCPX_WERROR=1     turn warnings into errors (CI)
  DCPX_DEBUG=1      -O0 -g
"""
import os

from setuptools import Extension, setup

SOURCES = [
    "csrc/module.c",
    "csrc/crc32.c",
    "csrc/dlpack.c",
    "csrc/zipwrite.c",
    "csrc/zipread.c",
    "csrc/writer.c",
    "csrc/reader.c",
    "csrc/stage.c",
    "csrc/picklescan.c",
    "csrc/workers.c",
    "csrc/files.c",
]

cflags = ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-fvisibility=hidden"]
ldflags = ["-pthread"]
if os.environ.get("DCPX_DEBUG") == "1":
    cflags += ["-O0", "-g"]
else:
    cflags += ["-O2"]
if os.environ.get("DCPX_WERROR") == "1":
    cflags += ["-Werror"]
if os.environ.get("DCPX_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
           "-fno-sanitize-recover=undefined"]
    cflags += san + ["-g", "-O1"]
    ldflags += san
elif os.environ.get("DCPX_SANITIZE") == "thread":
    # The interpreter and torch are not instrumented: libtsan is preloaded
    # (scripts/sanitizer_env.sh) and only dcpx's own accesses are checked.
    san = ["-fsanitize=thread", "-fno-omit-frame-pointer"]
    cflags += san + ["-g", "-O1"]
    ldflags += san

setup(
    ext_modules=[
        Extension(
            "dcpx._C",
            sources=SOURCES,
            depends=["csrc/dcpx.h"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ],
)
