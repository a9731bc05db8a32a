"""The kernel report (``llm-speed kernels``): every op's kernels compiled for a GPU that is not there,
exactly as its launcher would launch them, and what the compiler made of each: registers, spills (and
whether they sit inside loops), shared memory against the device's limit, blocks and warps per SM, the
tensor-core instructions, how deep the asynchronous waits in the loops are, and whether loads use TMA.

Modules: ``problems`` (what to launch: one builder per op-table row, and the problems that pick every
shipped configuration), ``capture`` (the plans the ops make for them, under a simulated GPU), ``build`` and
``worker`` (compile and disassemble, in a process of the Triton build checked), ``analysis`` (reading the
ptxas log, SASS and PTX; occupancy), ``budgets`` (what ``make test`` requires of every shipped kernel),
``report`` (runs the workers) and ``command`` (the CLI). Documented in docs/guides/kernel-report.md.
"""
