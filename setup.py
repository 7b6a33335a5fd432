"""Cython extensions; everything else is declared in pyproject.toml."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

KERNELS = ["segment_stats", "packing", "robust_agg"]

extensions = [
    Extension(
        f"capibara_exp.kernels.{name}",
        [f"capibara_exp/kernels/{name}.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
    for name in KERNELS
]

setup(ext_modules=cythonize(extensions, language_level=3))
