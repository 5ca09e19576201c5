"""The `quantized` drafter: the target's own weights, quantized, as its draft model.

No second model and no training: a quantized copy of the target (an int8 copy,
models/quantize.py; over float32 weights read from a GGUF file, the file's own
blocks; `LlamaTarget.quantized_copy`) drafts with its own KV cache, as a draft model does, so
drafts are sampled from the copy's distributions under the request's sampling
transform and verification stays exact. `quantized-tree` adds alternative
leaves at the copy's low-confidence positions (drafters/draft_model.py). The
copy agrees with the target on almost every token; it pays off only where its forward pass is cheaper than
the target's. On the C++ kernels it is: a draft step streams int8 weights, a
quarter of the float32 target's bytes, or a GGUF file's 4- to 8-bit blocks. On the
torch fallback it is not (see BENCHMARKS.md).

The copy is made by the target's backend (the `QuantizedCopies` capability;
the fast backend's is an int8 copy on its own kernels). Like every draft model
it fills its cache at the first draft of a request, not at its start, so a K
policy that settles on K = 0 never pays for it. Where the copy can adopt the
target's K and V of the context (`AdoptsCache`: same layout), a copy that costs
next to nothing, it does so instead of a prefill of its own, which costs about as
much as the target's (many rows are bound by arithmetic, not by the weights'
bytes). So it does at every later draft for the tokens it did not draft
(`catch_up`): after a run of plain steps, or of steps a lookup drafter drafted
(`suffix+quantized`), feeding them would cost a pass over all of them, which the
K policy would count against drafting, and under-draft.
Drafts then condition on the target's view of the context, which only brings
them closer to the target's; they stay exact, since the drafter returns the
distributions it sampled from.
"""

from __future__ import annotations

from specsample.drafters.draft_model import DraftModelDrafter
from specsample.models import LoadedModel, Target
from specsample.models.target import AdoptsCache, QuantizedCopies, require


class QuantizedDrafter(DraftModelDrafter):
    def __init__(self, model: Target, target: Target | None = None, width: int = 1) -> None:
        super().__init__(model, width=width)
        self.target = target  # whose cache the copy adopts, if the layouts agree

    def catch_up(self) -> None:
        """Cache the context but its last token. The positions the copy lacks (all of them at a request's
        first draft; after plain steps, or steps drafted by another drafter of `A+B`, the tokens they
        emitted) are the target's K and V where the target holds exactly those positions in the copy's
        layout; else the first draft prefills the copy, and a later one feeds them with its first pass."""
        cached = len(self.context) - 1
        if self.model.length == cached:
            return
        adopted = (
            isinstance(self.model, AdoptsCache)
            and self.target is not None
            and self.target.length == cached
            and self.model.adopt_cache(self.target, cached, start=self.model.length)
        )
        if not adopted:
            super().catch_up()


def quantized_drafter(model: LoadedModel, target: Target, width: int = 1) -> QuantizedDrafter:
    """The registry's factory: the target's backend makes the quantized copy; with `width` > 1 it drafts
    trees (`DraftModelDrafter`: up to width - 1 alternatives at each low-confidence position)."""
    return QuantizedDrafter(require(target, QuantizedCopies, "quantized").quantized_copy(), target, width)
