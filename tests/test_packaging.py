"""Packaging facts: our `kernels` package must not look like Hugging Face's `kernels` to transformers,
and the public API is importable under the folder names."""

import subprocess
import sys

import pytest


def test_transformers_does_not_mistake_our_kernels_package():
    # transformers probes for HF's `kernels` hub package; ours shares the import name. It must stay
    # "not available" so transformers never tries to load hub kernels through our package.
    code = (
        "import kernels, transformers.utils as u; "
        "assert kernels.__file__.endswith('kernels/__init__.py'); "
        "print(u.is_kernels_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_public_api_imports():
    from engine import LLM, AsyncLLM, SamplingParams, SpeculativeConfig  # noqa: F401
    from kernels import get_attention_backend  # noqa: F401


def test_the_cpu_row_kernels_build_where_the_cpu_can_run_them():
    """kernels/csrc/ is compiled at first use; if it stopped compiling, the engine would fall
    back to the torch path with a warning and every kernel test would skip: on a CPU with
    AVX2/FMA and a C++ compiler the build must succeed."""
    import os
    import shutil

    from kernels import cpu_kernels

    if os.environ.get(cpu_kernels.ENV_DISABLE) == "0":
        pytest.skip(f"{cpu_kernels.ENV_DISABLE}=0 turns them off")
    if not cpu_kernels.cpu_supports_avx2_fma() or shutil.which("c++") is None:
        pytest.skip("no AVX2/FMA or no C++ compiler: the torch path serves")
    assert cpu_kernels.available(), "kernels/csrc/ failed to build (see the warning logged by cpu_kernels)"
