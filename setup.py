"""Build the Cython extensions.

Compiler directives live here, in one place. Environment switches:
  ENGRAM_STREAM_DEBUG=1  bounds/wraparound checks on, -O0 -g (for debugging and sanitizers)
  ENGRAM_STREAM_ASAN=1   also compile and link with -fsanitize=address (implies DEBUG)
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# Every .pyx of the package is one extension module: a variant's folder brings its engine by
# holding the file, with no list here to keep in step.
MOD_NAMES = sorted(os.path.splitext(p)[0].replace(os.sep, ".")
                   for p in glob.glob(os.path.join("engram_stream", "**", "*.pyx"), recursive=True))

# Every package under engram_stream ships (a variant's folder by holding an __init__.py), and the
# C headers as engram_stream.include (pyproject.toml maps it to include/).
PACKAGES = find_packages(include=["engram_stream", "engram_stream.*"]) + ["engram_stream.include"]

ASAN = os.environ.get("ENGRAM_STREAM_ASAN") == "1"
DEBUG = ASAN or os.environ.get("ENGRAM_STREAM_DEBUG") == "1"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}
CFLAGS = ["-O0", "-g", "-UNDEBUG"] if DEBUG else ["-O3"]
LDFLAGS = []
if ASAN:
    CFLAGS += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    LDFLAGS += ["-fsanitize=address"]

INCLUDE = [numpy.get_include(), "include"]  # include/: the one home of the C headers


def extension(name):
    return Extension(
        name,
        [os.path.join(*name.split(".")) + ".pyx"],
        include_dirs=INCLUDE,
        depends=sorted(glob.glob("include/*.h")),  # headers included by headers: rebuild on any change
        extra_compile_args=CFLAGS,
        extra_link_args=LDFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )



class BuildExt(build_ext):
    """The extensions compiled one job a core unless -j says otherwise: pip's build gives no -j,
    and one job leaves every other core idle for minutes."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


setup(
    cmdclass={"build_ext": BuildExt},
    packages=PACKAGES,
    ext_modules=cythonize(
        [extension(m) for m in MOD_NAMES],
        compiler_directives=DIRECTIVES,
        include_path=["."],
    ),
)
