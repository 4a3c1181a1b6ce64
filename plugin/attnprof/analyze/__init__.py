"""analyze: pure functions over typed inputs. Kernel rules and the compatibility matrix,
backend advice, the memory model, scaling fits and OOM prediction (:mod:`.oom`), cost
what-ifs and their inputs (:mod:`.cost`, :mod:`.cost_inputs`), window maths
(:mod:`.sparsity`, :mod:`.window_advice`).

Nothing here installs hooks, opens sockets, runs a model, a benchmark or a profiler, or
imports torch: the measurements these models are checked against are in
:mod:`attnprof.tools.memory_measure` and :mod:`attnprof.tools.scaling_bench`. Asking the
installed vLLM itself is capture's (:mod:`attnprof.capture.vllm.backends`); the rules and the
derived matrix it falls back to are here (:mod:`.vllm_backends`, :mod:`.vllm_matrix`).
"""

