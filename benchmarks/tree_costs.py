"""Where a tree step's time goes on the bundled model (gguf blocks): a pass over 1, 9 and 17 tokens as a
chain and as a tree (recycle's template shape), the cache move of a 4-node path, and recycle's table
refresh; medians of 15 interleaved rounds over 200 cached tokens.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/tree_costs.py
"""
import statistics
import time

import torch

from specsample.drafters.recycle import RecycleDrafter, template
from specsample.models import load_target

model, target = load_target(None, "gguf")
context = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(0))
def tree_parents(n):
    return torch.tensor([-1] + [p + 1 for p, _ in template(n - 1, 4)])
times = {}
def timed(name, fn):
    t = time.perf_counter(); fn(); times.setdefault(name, []).append(time.perf_counter() - t)
target.prefill(context)
drafter = RecycleDrafter()
for _ in range(15):
    for n in (1, 9, 17):
        tokens = torch.randint(0, 1000, (n,))
        timed(f"chain {n}", lambda: target.score(tokens)); target.rollback(200)
        parents = tree_parents(n)
        out = {}
        timed(f"tree {n}", lambda: out.setdefault("l", target.score_tree(tokens, parents)))
        if n == 17:
            timed("keep_path 4 of 17", lambda: target.keep_path(200, [0, 3, 9, 16]))
            timed("recycle refresh 17 rows", lambda: drafter.refresh(tokens.tolist(), out["l"]))
        target.rollback(200)
for name, values in times.items():
    print(f"{name}: {1e3 * statistics.median(values):.2f} ms")
