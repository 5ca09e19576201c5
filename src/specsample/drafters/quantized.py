"""The `quantized` drafter: the target's own weights in int8 as its draft model.

No second model and no training: a weight-only int8 copy of the target
(models/quantize.py) drafts with its own KV cache, through the draft-model
drafter, so drafts are sampled from the copy's distributions under the
request's sampling transform and verification stays exact. The copy agrees
with the target on almost every token; it pays off only where its forward
pass is cheaper than the target's, which depends on the CPU's int8 kernels
(see BENCHMARKS.md).
"""

from __future__ import annotations

from specsample.drafters.draft_model import DraftModelDrafter
from specsample.models import LoadedModel, Target
from specsample.models.llama import UnsupportedModel
from specsample.models.quantize import int8_target


def quantized_drafter(model: LoadedModel, target: Target) -> DraftModelDrafter:
    """The registry's factory: an int8 copy of `model` as the draft model, as long a context as the target's."""
    try:
        return DraftModelDrafter(int8_target(model.model, target.max_length))
    except UnsupportedModel as e:
        raise ValueError(f"quantized needs a model the fast backend supports: {e}") from None
