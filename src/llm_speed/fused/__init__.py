"""Fused LLM ops in Triton, one file per op (kernels, launcher, torch.library op, autograd, reference).

The public functions are exported from ``llm_speed`` itself (``llm_speed.rms_norm`` ...); this package's
submodules keep the ops' names (``llm_speed.fused.rms_norm`` is the module), so it re-exports nothing.
"""
