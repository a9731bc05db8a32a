"""The foundation under every kernel: argument checks, output allocation, kernel math shims, the hardware
and its one device-spec table, the configuration type, and the launch path.

Nothing here imports a layer above it (kernels and ops, the op table, the analytic model, benchmarks or the
command line), and this package imports none of its modules itself: ``llm_speed.core.gpus`` and
``llm_speed.core.args`` load without torch, so the analytic model can read them.
"""
