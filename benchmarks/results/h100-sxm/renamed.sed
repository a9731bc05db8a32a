# Old results folder names (date and call number) -> commit and step (README.md here). Apply to any file
# that cites them: sed -i -f benchmarks/results/h100-sxm/renamed.sed FILE...
s#2026-11-25-suite2/call3#5e051eb-tests-fp8-overhead#g
s#2026-11-25-suite2/call4-6#unrecorded-ab-overhead#g
s#2026-11-25-suite2/call7#eafec86-fp8#g
s#2026-11-25-suite2/call8#b9171ef-fused#g
s#2026-11-25-suite2/call10#f4de76f-ce-train-step#g
s#2026-11-25-suite2#0cce093-tests-bench#g
s#2026-11-25-suite#d1b0227-quick-tests-bench#g
s#2026-11-25-call4#2b2a055-ab-fp8-decode#g
s#2026-11-25-call5#4c378d4-ab-fp8#g
s#2026-11-22-baseline#af147ec-baseline#g
s#2026-11-22-call1#de6b100-quick-tests#g
s#2026-11-22-call2#eaeac89-doctor-tests#g
s#2026-11-22-call4#unrecorded-tile-sweep-1#g
s#2026-11-22-call5#unrecorded-tile-sweep-2#g
