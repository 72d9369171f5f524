"""Which tensors of a model are shared and which stay private, per architecture.

A policy is tested, not inferred: every parameter and buffer name of the model must be matched
by exactly one pattern, so a parameter added to the model later stops sharing at once (an
unmatched name is an error at start-up and in the tests) until someone decides which set it
belongs to. An architecture without a policy cannot share at all.

Shared: the big matrices nothing writes after loading — one copy on the device for the whole
run. Private: the small tensors not worth the bookkeeping (norm weights, biases), copied by
every follower; also where anything a request may write would go (nothing in omni-dp-tts
writes a parameter). Per-process state that is not a parameter or buffer — the KV pool,
sampling state, the talker's rotary cos/sin tables (plain attributes) — is never in the
manifest: each process builds its own (a follower's rotary tables are built on the CPU when its
model is built, on the meta device or not, as every replica's are).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from omni_dp.engine.config import ARCHITECTURE
from omni_dp.engine.share import ShareError


class PolicyError(ShareError):
    """A model's tensor names and its architecture's policy disagree, or there is no policy."""


@dataclass(frozen=True)
class SharePolicy:
    name: str  # "<architecture>/<version>": a follower attaches only to the same one
    shared: tuple[str, ...]  # regular expressions, each matched against a whole name
    private: tuple[str, ...]

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(shared, private) names, in the order given; PolicyError naming every name that no
        pattern, or more than one, matches."""
        patterns = [(p, re.compile(p), "shared") for p in self.shared]
        patterns += [(p, re.compile(p), "private") for p in self.private]
        shared, private, problems = [], [], []
        for name in names:
            hits = [(p, kind) for p, rx, kind in patterns if rx.fullmatch(name)]
            if not hits:
                problems.append(f"{name} is matched by no pattern")
            elif len(hits) > 1:
                problems.append(f"{name} is matched by " + " and ".join(
                    f"{kind} {p!r}" for p, kind in hits))
            else:
                (shared if hits[0][1] == "shared" else private).append(name)
        if problems:
            raise PolicyError(f"the weight-share policy {self.name} does not fit this model: "
                              + "; ".join(problems)
                              + " (every tensor must be declared shared or private once)")
        return shared, private


_LAYER = r"talker\.layers\.\d+\."

POLICIES: dict[str, SharePolicy] = {
    ARCHITECTURE: SharePolicy(
        name=f"{ARCHITECTURE}/1",
        shared=(
            r"talker\.embed\.weight",
            _LAYER + r"attn\.(qkv_proj|o_proj)\.weight",
            _LAYER + r"mlp\.(gate_up_proj|down_proj)\.weight",
            r"talker\.lm_head\.weight",
            r"vocoder\.embed\.weight",
            r"vocoder\.(pre|post)\.weight",
            r"vocoder\.ups\.\d+\.weight",
        ),
        private=(
            _LAYER + r"(input_norm|post_attn_norm)\.weight",
            r"talker\.norm\.weight",
            r"vocoder\.(pre|post)\.bias",
            r"vocoder\.ups\.\d+\.bias",
        ),
    ),
}


def policy_for(architecture: str) -> SharePolicy:
    policy = POLICIES.get(architecture)
    if policy is None:
        raise PolicyError(f"architecture {architecture} has no tested weight-share policy; run "
                          "without --share-weights")
    return policy
