"""The choice of K, the speculation length, before each verification step."""

from __future__ import annotations

from typing import Protocol

from specsample.stats import Step


class KPolicy(Protocol):
    def begin(self) -> None:
        """A new request starts."""
        ...

    def choose(self) -> int:
        """K for the next step (0: decode one token without drafting)."""
        ...

    def observe(self, step: Step) -> None:
        """The outcome of the step just taken."""
        ...


class FixedK:
    """Always the same K."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def begin(self) -> None:
        pass

    def choose(self) -> int:
        return self.k

    def observe(self, step: Step) -> None:
        pass


def parse_k(spec: str | int) -> KPolicy:
    """A K policy from the command line: an integer K >= 0."""
    try:
        return FixedK(int(spec))
    except ValueError:
        raise ValueError(f"k must be an integer >= 0, got {spec!r}") from None
