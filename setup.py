"""Build the Cython extensions.

Compiler directives live here, in one place. Environment switches:
  ENGRAM_STREAM_DEBUG=1  bounds/wraparound checks on, -O0 -g (for debugging and sanitizers)
  ENGRAM_STREAM_ASAN=1   also compile and link with -fsanitize=address (implies DEBUG)
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

MOD_NAMES = ["engram_stream._hash", "engram_stream.rows._cache", "engram_stream.rows._direct", "engram_stream.rows._source",
             "engram_stream.rows._stamps", "engram_stream.engine._window", "engram_stream.engine._batch",
             "engram_stream.engine._base", "engram_stream.demo._engine", "engram_stream.v41._engine",
             "engram_stream.qwen._engine", "engram_stream.integrations._vllm_rows", "engram_stream.integrations._vllm_graph"]

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


setup(
    ext_modules=cythonize(
        [extension(m) for m in MOD_NAMES],
        compiler_directives=DIRECTIVES,
        include_path=["."],
    ),
)
