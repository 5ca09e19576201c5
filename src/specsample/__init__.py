"""specsample: lossless speculative sampling for language models."""

from specsample.api import Chunk, Completion, Generation, SpecSampler
from specsample.sampling import SamplingParams
from specsample.stats import Stats

__all__ = ["Chunk", "Completion", "Generation", "SamplingParams", "SpecSampler", "Stats"]
