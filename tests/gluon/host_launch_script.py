"""Run in a subprocess by test_gluon_host_launch.py: every Gluon kernel's public function launched through
Triton's own host path (the Gluon JIT's binding and specialisation, the launcher's descriptor expansion) on
a stand-in sm_90 GPU (tests/fake_gpu.py, native launcher) with CPU tensors for CUDA ones. The simulated GPU
of the other CPU tests stops before Triton; this goes down to the launcher's C function."""

import json
import sys

sys.path.insert(0, sys.argv[1])  # tests/
import fake_gpu  # noqa: E402

fake_gpu.install(native=True)

import torch  # noqa: E402
import triton  # noqa: E402

from llm_speed.gluon import attention, attention_bwd, gemm, gemm_fp8  # noqa: E402


def _cpu_is_the_gpu(name, tensor, function):  # the stand-in GPU is device 0, its tensors are CPU ones
    assert tensor.device.type == "cpu", (name, function)


for module in (attention, attention_bwd, gemm, gemm_fp8):
    module.check_device = _cpu_is_the_gpu

report = {"triton": triton.__version__, "calls": []}


def record(label, function, *args, **kwargs):
    before_launches, before_maps = len(fake_gpu.LAUNCHES), len(fake_gpu.ENCODED)
    function(*args, **kwargs)
    compiled = fake_gpu.COMPILED[-1]
    signature = compiled["signature"]
    # each CUtensorMap encoding: (global address, swizzle, elem size, type, box, shape, strides, padding)
    maps = [[list(x) if isinstance(x, tuple) else x for x in e[6:8]] for e in fake_gpu.ENCODED[before_maps:]]
    report["calls"].append({
        "label": label,
        "launches": len(fake_gpu.LAUNCHES) - before_launches,
        "kernel": compiled["name"],
        "descriptors": {k: v for k, v in signature.items() if str(v).startswith("tensordesc")},
        "maps": maps,
    })  # fmt: skip


bf16, e4m3, int8 = torch.bfloat16, torch.float8_e4m3fn, torch.int8
for d in (64, 128, 256):
    for causal in (False, True):
        q = torch.randn(2, 4, 100, d).to(bf16)
        k, v = (torch.randn(2, 2, 90, d).to(bf16) for _ in range(2))
        record(f"forward d{d} causal={causal}", attention.forward, q, k, v, is_causal=causal)
        if d in attention.BACKWARD_HEAD_DIMS:
            out, lse, dout = torch.randn_like(q), torch.randn(2, 4, 100), torch.randn_like(q)
            record(f"backward d{d} causal={causal}", attention_bwd.backward, q, k, v, out, lse, dout,
                   is_causal=causal)  # fmt: skip
q8, k8, v8 = (torch.randn(2, h, 100, 128).to(e4m3) for h in (4, 2, 2))
record("forward fp8 d128", attention.forward, q8, k8, v8, descale_q=torch.ones(2, 2))
record("gemm bf16", gemm.gemm, torch.randn(256, 128).to(bf16), torch.randn(128, 192).to(bf16))
record("gemm int8", gemm.gemm_int8, torch.ones(256, 128, dtype=int8), torch.ones(192, 128, dtype=int8))
a8, b8 = torch.randn(256, 256).to(e4m3), torch.randn(384, 256).to(e4m3)
record("gemm fp8", gemm_fp8.gemm_fp8, a8, b8, torch.ones(256, 2), torch.ones(3, 2))
print(json.dumps(report))
