"""Build the dcpx._C extension: a C compiler and the Python headers are all
it needs (no libtorch, no CUDA toolkit, no pybind11).  The CUDA driver is
loaded at run time (csrc/cuda.c); its types come from the Toolkit's cuda.h
when one is found ($CUDA_HOME/include, /usr/local/cuda/include,
/usr/local/cuda-*/include), else from csrc/cuda_min.h.

Environment switches:
  DCPX_SANITIZE=1   build with -fsanitize=address,undefined (see .ci/run)
  DCPX_SANITIZE=thread  build with -fsanitize=thread (see scripts/tsan.sh)
  DCPX_WERROR=1     turn warnings into errors (CI)
  DCPX_DEBUG=1      -O0 -g
  DCPX_NO_CUDA_H=1  ignore any cuda.h (build with csrc/cuda_min.h)
"""
import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

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
    "csrc/mdindex.c",
    "csrc/mdpickle.c",
    "csrc/workers.c",
    "csrc/cuda.c",
    "csrc/cuda_stage.c",
    "csrc/cuda_load.c",
    "csrc/cuda_copy.c",
    "csrc/cuda_pipeline.c",
    "csrc/gate.c",
    "csrc/files.c",
    "csrc/flatten.c",
    "csrc/payloads.c",
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



def find_cuda_h():
    """The Toolkit's include directory holding cuda.h, or None.  Not
    /usr/include: <linux/cuda.h> is an unrelated kernel header."""
    if os.environ.get("DCPX_NO_CUDA_H") == "1":
        return None
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
             "/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


include_dirs = []
cuda_inc = find_cuda_h()
if cuda_inc is not None:
    include_dirs.append(cuda_inc)
    cflags.append("-DDCPX_HAVE_CUDA_H")

class build_ext(_build_ext):
    """build_ext whose in-place copy (``--inplace``, ``pip install -e``)
    swaps the new ``dcpx/_C*.so`` in with one rename: distutils' copy
    truncates and rewrites the file where it is, so a process importing
    dcpx meanwhile would find no or half an extension (a misleading
    "partially initialized module" error) and one that has it mapped could
    crash.  After the rename, a process sees the old file or the new one."""

    def copy_file(self, infile, outfile, *args, **kwargs):
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        if not outfile.endswith(".so") or kwargs.get("dry_run") or self.dry_run:
            return super().copy_file(infile, outfile, *args, **kwargs)
        tmp = "%s.%d.tmp" % (outfile, os.getpid())
        try:
            shutil.copyfile(infile, tmp)
            shutil.copymode(infile, tmp)
            os.replace(tmp, outfile)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return outfile, 1


setup(
    cmdclass={"build_ext": build_ext},
    ext_modules=[
        Extension(
            "dcpx._C",
            sources=SOURCES,
            depends=sorted(glob.glob("csrc/*.h")),
            include_dirs=include_dirs,
            libraries=["dl"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ],
)
