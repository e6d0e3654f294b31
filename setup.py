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

setup(ext_modules=ext_modules)
