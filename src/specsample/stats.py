"""Per-request statistics of speculative decoding.

- acceptance rate: accepted draft tokens / drafted tokens.
- mean accepted length: tokens emitted per verification step, the recovered or
  bonus token included (plain decoding scores 1.0).
- acceptance by draft position: of the chain drafts that reached position i, the
  fraction whose token i was accepted. A draft token after the answer's end (an
  EOS or a stop string among the accepted tokens) counts as neither.
- of tree drafts (`tree`, only when some step drafted a tree): the tree size,
  the accepted depth, and the acceptance by depth and sibling rank: of the
  nodes verification reached (children of the root or of an accepted node) at
  depth d with rank r (the parent's (r + 1)-th child), the fraction accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import Tensor

from specsample.tree import reached


@dataclass(frozen=True)
class Step:
    drafted: int  # draft tokens verified this step (proposed, less those `cut`)
    accepted: int  # of them accepted and emitted (none past an EOS)
    emitted: int  # tokens emitted (accepted + 1, less any cut at EOS or a limit)
    draft_seconds: float
    verify_seconds: float
    parents: Tensor | None = None  # a tree draft's parent array, None for a chain
    path: tuple[int, ...] | None = None  # a tree draft's accepted nodes
    cut: int = 0  # draft tokens drafted (and paid for) but not verified: cut by the K policy (`KPolicy.keep`)
    chosen: int | None = None  # the K the policy chose for this step (`KPolicy.choose`), before any limit
    asked: int | None = None  # the K asked of the drafter: `chosen` within the tokens left (and a batch slot's rows)
    ended_in_path: bool = False  # the answer ended inside a tree's accepted path, which `path` is cut to

    def answered(self, kept: int) -> "Step":
        """The step as far as the answer goes, its first `kept` emitted tokens (an EOS or a stop string ends
        it there): accepted draft tokens after them, and their nodes on a tree's path, are not counted."""
        accepted = min(self.accepted, kept)
        if self.path is None or kept > len(self.path):  # the token after the path is in the answer too
            return replace(self, accepted=accepted, emitted=kept)
        return replace(self, accepted=accepted, emitted=kept, path=self.path[:accepted], ended_in_path=True)

    def reached(self) -> list[tuple[int, int, bool]]:
        """(depth, sibling rank, accepted) of the tree nodes this step's verification reached (`tree.reached`)
        within the answer: where the answer ended inside the accepted path, the children of its last node
        were judged after the answer's end, and count as neither accepted nor rejected."""
        nodes = reached(self.parents, self.path or ())
        return [node for node in nodes if node[0] < len(self.path)] if self.ended_in_path else nodes


@dataclass
class Stats:
    """What decoding a request did and took. Tokens are counted as far as the answer goes: where a stop
    string ends the text inside a step's tokens, the step's later tokens are taken out of generated_tokens
    and accepted_tokens (`answer_ends`), as the engine leaves out tokens after an EOS, so generated_tokens
    is the completion's token count; drafted_tokens (the draft tokens verified: a K policy's cut ones are
    `Step.cut`, not among them) and the seconds are all the work done."""

    drafter: str = ""  # the `--drafter` value of the configuration that ran
    prompt_tokens: int = 0
    load_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of the decode loop, drafting and verifying included
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # drafts reaching position i
    accepted_at: list[int] = field(default_factory=list)  # of them, accepted at position i
    policy: dict = field(default_factory=dict)  # the K policy's estimates as the request ended
    tree_steps: int = 0  # steps that verified a tree draft
    tree_nodes: int = 0  # their nodes
    tree_depth: int = 0  # their accepted depths, summed
    reached_at: dict[tuple[int, int], int] = field(default_factory=dict)  # (depth, rank) -> nodes reached
    accepted_in_tree: dict[tuple[int, int], int] = field(default_factory=dict)  # of them accepted
    chosen_k: dict[int, int] = field(default_factory=dict)  # K chosen by the policy -> steps (0: a plain step)
    last: Step | None = field(default=None, repr=False)  # the step recorded last (`answer_ends`)

    def record(self, step: Step) -> None:
        self.last = step
        self.steps += 1
        self.drafted_tokens += step.drafted
        self.accepted_tokens += step.accepted
        self.generated_tokens += step.emitted
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        if step.chosen is not None:
            self.chosen_k[step.chosen] = self.chosen_k.get(step.chosen, 0) + 1
        self.count_positions(step, 1)
        self.count_tree(step, 1)

    def answer_ends(self, kept: int) -> None:
        """The answer ends with the first `kept` tokens of the last step (at a stop string's last token):
        the step's later tokens, accepted draft tokens among them, are not counted."""
        step = self.last
        if step is None or not 0 < kept <= step.emitted:
            raise ValueError(f"the answer cannot end after {kept} tokens of a step that emitted "
                             f"{0 if step is None else step.emitted}")
        answered = step.answered(kept)
        self.generated_tokens -= step.emitted - answered.emitted
        self.accepted_tokens -= step.accepted - answered.accepted
        for count in self.count_positions, self.count_tree:
            count(step, -1)
            count(answered, 1)

    def count_positions(self, step: Step, sign: int) -> None:
        """Add (sign 1) or take back (-1) a chain step's draft positions: all of them, or, where the answer
        ended among the accepted tokens (the step emitted no token after them), those before the end.
        A tree's nodes are not positions: `tree_dict` counts them by depth and rank."""
        if step.parents is not None:
            return
        positions = step.drafted if step.emitted > step.accepted else step.accepted
        grow = positions - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(positions):
            self.drafted_at[i] += sign
            self.accepted_at[i] += sign * (i < step.accepted)
        while self.drafted_at and not self.drafted_at[-1]:  # positions only a taken-back step reached
            self.drafted_at.pop()
            self.accepted_at.pop()

    def count_tree(self, step: Step, sign: int) -> None:
        """Add (sign 1) or take back (-1) a tree step: its nodes, accepted depth, and the nodes it reached.
        A chain's step, or a tree drafter's that found nothing, verified no tree: it counts nothing."""
        if step.parents is None or not step.drafted:
            return
        path = step.path or ()
        self.tree_steps += sign
        self.tree_nodes += sign * step.parents.shape[0]
        self.tree_depth += sign * len(path)
        for depth, rank, accepted in step.reached():
            key = depth, rank
            self.reached_at[key] = self.reached_at.get(key, 0) + sign
            self.accepted_in_tree[key] = self.accepted_in_tree.get(key, 0) + sign * accepted
            if not self.reached_at[key]:  # reached only by a path a stop string took back
                del self.reached_at[key], self.accepted_in_tree[key]

    def tree_dict(self) -> dict:
        """Tree size, accepted depth and acceptance by "depth,rank" of the tree steps."""
        return {
            "steps": self.tree_steps,
            "mean_nodes": self.tree_nodes / self.tree_steps,
            "mean_accepted_depth": self.tree_depth / self.tree_steps,
            "acceptance_by_depth_rank": {
                f"{d},{r}": self.accepted_in_tree[d, r] / n for (d, r), n in sorted(self.reached_at.items())
            },
        }

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.decode_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "tokens_per_second": self.tokens_per_second,
            "load_seconds": self.load_seconds,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "policy": self.policy,
            "chosen_k": dict(sorted(self.chosen_k.items())),
            **({"tree": self.tree_dict()} if self.tree_steps else {}),
        }
