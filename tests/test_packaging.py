"""Packaging facts: our `kernels` package must not look like Hugging Face's `kernels` to transformers,
and the public API is importable under the folder names."""

import subprocess
import sys


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
