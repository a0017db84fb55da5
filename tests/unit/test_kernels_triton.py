"""The Triton forms equal the references, forward and gradients: on CUDA in fp32 and bf16, and
on CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` (a check of the kernels'
arithmetic, not of their speed). Skipped where Triton is not installed, unless
``TRITON_INTERPRET=1`` asks for the interpreter run (.ci/run's), which then fails without it."""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels import CASES, Case, check_against_reference

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
    DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
    DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
else:
    pytest.skip("Triton kernels need CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)


@pytest.mark.parametrize(("dtype", "rtol", "atol"), DTYPES, ids=lambda v: str(v))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_form_equals_reference(
    case: Case, dtype: torch.dtype, rtol: float, atol: float
) -> None:
    check_against_reference(case, "triton", DEVICE, dtype, rtol=rtol, atol=atol)
