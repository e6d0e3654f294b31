"""Build the one C extension; all other metadata lives in pyproject.toml."""

import sys

from setuptools import Extension, setup

# shardio._atomics wraps Linux futexes for the shared-memory rings (shardio/ring.py).
ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "shardio._atomics",
            sources=["shardio/_atomics.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    )
    # shardio._sampleio reads a sample with one preadv, fields straight into their bytes
    # (shardio/formats/base.py's ShardReader.get falls back to Python without it).
    ext_modules.append(
        Extension(
            "shardio._sampleio",
            sources=["shardio/_sampleio.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    )
    # shardio._listdir lists and stats a pack source's directory (shardio/_scan.py falls back to
    # scandir without it).
    ext_modules.append(
        Extension(
            "shardio._listdir",
            sources=["shardio/_listdir.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    )
    # shardio._tarpack is the hot loop of a tar pack (shardio/formats/tar.py falls back to Python
    # without it); it reads a slow source's files in threads (pthreads).
    ext_modules.append(
        Extension(
            "shardio._tarpack",
            sources=["shardio/_tarpack.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-pthread"],
            extra_link_args=["-pthread"],
        )
    )

setup(ext_modules=ext_modules)
