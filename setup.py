"""The compiled pieces of gaussdp: the vectorised Box-Muller kernel of the torch engine's default
noise (src/gaussdp/_gauss.c), and the fused exact nearest-word kernel of text search (_search.c).
Everything else is in pyproject.toml.

Both optional: where _search cannot be built, text search uses its numpy path; where _gauss cannot
be built (no C compiler, no glibc libmvec) the install goes on without it and the engine falls back to
torch's generator (``PrivacyEngine.noise_stream`` says which is used).
``-ffast-math`` is given to the compiler only, so that GCC calls glibc's vector log/sin/cos; the link
has no ``-ffast-math``, so crtfastmath.o, which would switch the whole process to flush-to-zero, is not
linked in (tests/torch/test_fast_noise.py checks this).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gaussdp._gauss",
            sources=["src/gaussdp/_gauss.c"],
            extra_compile_args=["-O3", "-ffast-math"],
            libraries=["mvec", "m"],
            optional=True,
        ),
        # The fused exact nearest-word kernel of gaussdp.text.search (optional: numpy fallback).
        # No -ffast-math: its error bounds assume IEEE 754 comparisons and float64 sums.
        Extension(
            "gaussdp._search",
            sources=["src/gaussdp/_search.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
