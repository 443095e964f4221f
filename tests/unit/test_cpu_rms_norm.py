"""models/cpu_rms_norm.py: on the CPU, vLLM's RMSNorm dispatches to the C++ kernel
vLLM's CPU build ships (our `dllm_cpu` provider) instead of the native torch formula,
normalises as that formula does, and leaves a user's --ir-op-priority alone."""

from __future__ import annotations

import pytest
import torch
from vllm import ir
from vllm.platforms import current_platform

import vllm_dllm
from vllm_dllm.models import cpu_rms_norm
from vllm_dllm.tools.make_tiny import make_tiny

from tests.engine.test_plugin import engine_config


# On a CUDA install `torch.ops._C` holds CUDA kernels and the provider is unsupported.
pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's CPU kernels: a CPU install of vLLM")


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    vllm_dllm.register()
    return make_tiny("llada", tmp_path_factory.mktemp("llada"), seed=3)


def native(op):
    return getattr(ir.ops, op).impls["native"].impl_fn


def assert_same_norm(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Each output is x * rsqrt(mean(x^2) + eps) * w, a product (no cancellation), so the
    two computations differ relatively by their roundings to the dtype (at most three
    between them: the formula rounds the normalised value, then the product; the
    fused kernel rounds the residual it then normalises) plus the float32 sum of
    squares taken in another order (at most n float32 roundings, halved by the rsqrt;
    taken whole here).  The largest seen over 300 seeds in bfloat16 was 1.73 eps."""
    n = expected.shape[-1]
    rtol = 3 * torch.finfo(expected.dtype).eps + n * 2.0**-24
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 192), (37, 192), (5, 3, 64)])
def test_the_kernel_normalises_as_vllms_native_formula(dtype, shape):
    vllm_dllm.register()
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(*shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    if not cpu_rms_norm.takes_dtype(dtype):
        # bfloat16 from a vLLM build that truncates (a CPU without AVX-512-BF16): native.
        assert dtype == torch.bfloat16 and not cpu_rms_norm._rounds_bfloat16_to_nearest()
        with ir.ops.rms_norm.set_priority([cpu_rms_norm.PROVIDER, "native"]):
            assert ir.ops.rms_norm.dispatch(x, weight, 1e-5).provider == "native"
        return
    impl = ir.ops.rms_norm.impls[cpu_rms_norm.PROVIDER]
    out = impl.impl_fn(x, weight, 1e-5)
    assert_same_norm(out, native("rms_norm")(x, weight, 1e-5))
    expected_out, expected_residual = native("fused_add_rms_norm")(x.clone(), residual.clone(), weight, 1e-5)
    x_in, residual_in = x.clone(), residual.clone()
    got_out, got_residual = ir.ops.fused_add_rms_norm.impls[cpu_rms_norm.PROVIDER].impl_fn(x_in, residual_in, weight, 1e-5)
    assert got_out.data_ptr() == x_in.data_ptr() and got_residual.data_ptr() == residual_in.data_ptr()  # in place
    assert torch.equal(got_residual, expected_residual)
    assert_same_norm(got_out, expected_out)


def test_dispatch_takes_the_kernel_only_for_what_it_can_read():
    vllm_dllm.register()
    x = torch.randn(6, 64)
    weight = torch.randn(64)
    with ir.ops.rms_norm.set_priority([cpu_rms_norm.PROVIDER, "native"]):
        assert ir.ops.rms_norm.dispatch(x, weight, 1e-5).provider == cpu_rms_norm.PROVIDER
        # A strided view (a head's slice of a fused projection), another weight dtype or
        # width, no weight, a variance override, a width the kernel's vectors do not
        # divide: the native formula.
        strided = torch.randn(6, 128)[:, :64]
        odd = torch.randn(6, 12)
        for args in [(strided, weight, 1e-5), (x, weight.double(), 1e-5), (x, torch.randn(32), 1e-5),
                     (x, None, 1e-5), (x, weight, 1e-5, 32), (odd, torch.randn(12), 1e-5)]:
            assert ir.ops.rms_norm.dispatch(*args).provider == "native"
        torch.testing.assert_close(ir.ops.rms_norm(odd, torch.ones(12), 1e-5), native("rms_norm")(odd, torch.ones(12), 1e-5))
        torch.testing.assert_close(ir.ops.rms_norm(strided, weight, 1e-5), native("rms_norm")(strided, weight, 1e-5))


def test_fused_add_takes_the_kernel_only_for_a_residual_of_the_inputs_shape():
    vllm_dllm.register()
    x, weight = torch.randn(6, 64), torch.randn(64)
    with ir.ops.fused_add_rms_norm.set_priority([cpu_rms_norm.PROVIDER, "native"]):
        assert ir.ops.fused_add_rms_norm.dispatch(x, torch.randn(6, 64), weight, 1e-5).provider == cpu_rms_norm.PROVIDER
        for residual in (torch.randn(1, 64), torch.randn(6, 128)[:, :64], torch.randn(6, 64).double()):
            assert ir.ops.fused_add_rms_norm.dispatch(x, residual, weight, 1e-5).provider == "native"


def test_serving_on_the_cpu_puts_the_kernel_first(llada_dir):
    priority = engine_config(llada_dir, dtype="float32").kernel_config.ir_op_priority
    assert priority.rms_norm == [cpu_rms_norm.PROVIDER, "native"]
    assert priority.fused_add_rms_norm == [cpu_rms_norm.PROVIDER, "native"]


def test_a_users_priority_stands(llada_dir):
    config = engine_config(llada_dir, dtype="float32", ir_op_priority={"rms_norm": ["native"]})
    assert config.kernel_config.ir_op_priority.rms_norm == ["native"]
    assert cpu_rms_norm.PROVIDER not in config.kernel_config.ir_op_priority.fused_add_rms_norm
