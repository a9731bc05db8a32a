"""The attention launcher's use of the Gluon kernels (issue 73, stage 3), seen on the host: under
``simulated_gpu`` (CPU tensors standing for an H100's, launches recorded, nothing run) ``flash_attention``
launches the Triton kernels as shipped, and the Gluon forward / backward only under a policy naming the head
dim (candidates ``gluon-forward`` / ``gluon-backward``) and for calls the Gluon kernels take."""

from __future__ import annotations

import pytest
import torch

from llm_speed.attention import flash
from llm_speed.attention.flash import flash_attention
from llm_speed.core import launch, runtime
from llm_speed.core.policy import use_policy
from llm_speed.gluon.attention import ATTENTION_FWD
from llm_speed.gluon.attention_bwd import ATTENTION_BWD

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")


def _qkv(head_dim=128, grad=False, heads_kv=2):
    q = torch.randn(1, 4, 256, head_dim, dtype=torch.float16)
    k, v = (torch.randn(1, heads_kv, 256, head_dim, dtype=torch.float16) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _ran(call) -> set[str]:
    before = runtime.launch_counts()
    call()
    return set(runtime.launch_counts() - before)


@pytest.fixture
def simulated():
    with launch.simulated_gpu():
        yield


def test_as_shipped_the_triton_forward_and_backward_run(simulated):
    q, k, v = _qkv(grad=True)
    ran = _ran(lambda: flash_attention(q, k, v).float().sum().backward())
    assert flash.FORWARD.name in ran and flash.BACKWARD_DKDV.name in ran
    assert not ran & {ATTENTION_FWD.name, ATTENTION_BWD.name}


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_gluon_forward_policy_launches_it_every_call(simulated, is_causal):
    q, k, v = _qkv()
    with use_policy("gluon-forward"):
        for _ in range(2):  # the second call is not served by a kept Triton launch
            assert _ran(lambda: flash_attention(q, k, v, is_causal=is_causal)) == {ATTENTION_FWD.name}
        # a head dim the policy does not name, or an option the kernel does not take: the Triton forward
        assert _ran(lambda: flash_attention(*_qkv(head_dim=64))) == {flash.FORWARD.name}
        assert _ran(lambda: flash_attention(q, k, v, softcap=30.0)) == {flash.FORWARD.name}
        assert _ran(lambda: flash_attention(q, k, v, window=(64, 0))) == {flash.FORWARD.name}
        assert _ran(lambda: flash_attention(q, k, v, scale=-0.1)) == {flash.FORWARD.name}


def test_d256_only_under_a_policy_naming_it_and_forward_only(simulated):
    q, k, v = _qkv(head_dim=256, grad=True)
    with use_policy("gluon-forward"):  # the candidate names d = 128 alone
        assert _ran(lambda: flash_attention(q, k, v)) == {flash.FORWARD.name}
    with use_policy(gluon_forward_head_dims=(256,), gluon_backward_head_dims=(256,)):
        assert _ran(lambda: flash_attention(q, k, v, is_causal=True)) == {ATTENTION_FWD.name}
        ran = _ran(lambda: flash_attention(q, k, v).float().sum().backward())  # no Gluon backward at 256
        assert ATTENTION_FWD.name in ran and ATTENTION_BWD.name not in ran


def test_fp8_under_its_own_candidate(simulated):
    q, k, v = (x.float().to(torch.float8_e4m3fn) for x in _qkv())
    one = torch.ones(())
    call = lambda **options: flash_attention(q, k, v, descale_q=one, descale_k=one, descale_v=one,  # noqa: E731
                                             **options)  # fmt: skip
    assert _ran(call) == {flash.FORWARD.name}  # as shipped
    with use_policy("gluon-forward"):  # the 16-bit candidate leaves fp8 alone
        assert _ran(call) == {flash.FORWARD.name}
    with use_policy("gluon-forward-fp8"):
        assert _ran(lambda: call(is_causal=True)) == {ATTENTION_FWD.name}
        assert _ran(lambda: call(softcap=20.0)) == {flash.FORWARD.name}
        assert _ran(lambda: flash_attention(*_qkv())) == {flash.FORWARD.name}  # 16-bit: the Triton forward


def test_the_gluon_backward_policy_launches_it_unless_determinism_is_asked(simulated):
    q, k, v = _qkv(grad=True)
    with use_policy("gluon-backward"):
        ran = _ran(lambda: flash_attention(q, k, v).float().sum().backward())
        assert ATTENTION_BWD.name in ran and flash.FORWARD.name in ran
        assert not ran & {flash.BACKWARD_DKDV.name, flash.BACKWARD_DQ.name}
        q.grad = k.grad = v.grad = None
        ran = _ran(lambda: flash_attention(q, k, v, deterministic=True).float().sum().backward())
        assert flash.BACKWARD_DKDV.name in ran and ATTENTION_BWD.name not in ran
        for scale in (-0.3, 0.0):  # the backward at any scale (the forward at positive ones only)
            q.grad = k.grad = v.grad = None
            ran = _ran(lambda: flash_attention(q, k, v, scale=scale).float().sum().backward())  # noqa: B023
            assert ran & {ATTENTION_BWD.name, flash.FORWARD.name} == {ATTENTION_BWD.name, flash.FORWARD.name}


def test_cpu_tensors_outside_the_simulation_never_take_it():
    q, k, v = _qkv()
    with use_policy("gluon-forward"):
        out = flash_attention(q.float(), k.float(), v.float())  # CPU: the Triton path or its reference
    assert out.shape == q.shape
