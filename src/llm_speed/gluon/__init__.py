"""Gluon kernels (``triton.experimental.gluon``) for Hopper: warp-specialized, persistent, TMA-fed, written
with explicit layouts, shared memory, mbarriers and register budgets per partition (issue 73).

No shipped launch policy selects anything here until a GPU proof shows it correct and faster (the attention
launcher takes the attention kernels under a policy naming them: candidates ``gluon-forward`` and
``gluon-backward``); each kernel is also reached explicitly (:func:`llm_speed.gluon.gemm.gemm`,
:func:`llm_speed.gluon.gemm.gemm_int8` (int32 products kept in flight; candidate ``gluon-gemm-int8``),
:func:`llm_speed.gluon.gemm_fp8.gemm_fp8` (block-scaled fp8; candidate ``gluon-gemm-fp8``),
:func:`llm_speed.gluon.attention.forward`, :func:`llm_speed.gluon.attention_bwd.backward`,
:func:`llm_speed.gluon.flash.flash_attention`), and :mod:`llm_speed.gluon.select` says whether the launch
policy lets an attention call take them. Gluon has no interpreter: on a CPU the maths is tested through
PyTorch models of each kernel's schedule (``*_schedule`` modules) and the build by the kernel report
(``llm-speed kernels --op gluon_gemm``). docs/gluon.md says what is built and what is unproven.
"""
