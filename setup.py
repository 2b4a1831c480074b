"""Build the one C extension of ringllm; all metadata lives in setup.cfg."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ringllm.ipc._atomics",
            sources=["ipc/_atomics.c", "ipc/_ringops.c"],
            depends=["ipc/_atomics.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        )
    ]
)
