"""Acceptance replay for speed benchmarks: off by default, refused unless benchmarking is confirmed.

Speed at full model scale is measured with dummy weights (``load_format="dummy"``), whose drafts
a target never accepts. To compare tfm with speculation-free decoding and vLLM's own DFlash at a
realistic acceptance, the tree sampler can replay a recorded acceptance profile
(``vllm_tfm.verify.acceptance_replay``): every step still drafts, builds the tree, runs the
target's tree verify forward and the real tree sampler, then accepts a path whose depth is drawn
from the profile. The generated tokens are then NOT the model's output. vLLM's in-tree chain
DFlash has the equivalent in ``rejection_sample_method="synthetic"`` with
``synthetic_acceptance_rates`` (``acceptance_profile.synthetic_acceptance_rates`` maps the same
profile onto it).

Switches (read once, where the engine config is built, like the tree options; the resolved
replay travels to the workers inside the drafter's HF config as :data:`HF_REPLAY_ATTR`):

* ``VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY=<file>``: a profile JSON or a ``vllm-tfm eval`` results
  JSON; the entry of the engine's proposal and tree budget is used (exactly one must exist);
* ``VLLM_TFM_I_AM_BENCHMARKING=1``: required with the above; without it the engine refuses to
  start (one line naming both variables). With it, a loud warning is logged at config time and
  again in the worker;
* ``VLLM_TFM_BENCHMARK_REPLAY_SEED`` (default 0): seed of the replay's draws;
* ``VLLM_TFM_BENCHMARK_SPINE_TOP1`` (default 0.9; ``none`` turns it off): the top-1 probability
  of the spine-first marginals the proposer uses in replay mode (dummy weights give flat
  marginals, whose best-first trees are depth-1 stars); see ``acceptance_replay``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vllm_tfm.verify.acceptance_profile import (
    load_profile,
    mean_accepted_length,
    resize_pmf,
)
from vllm_tfm.verify.acceptance_replay import (
    DEFAULT_SPINE_RANKS,
    DEFAULT_SPINE_TOP1,
    geometric_rank_ratio,
)

__all__ = [
    "REPLAY_ENV",
    "CONFIRM_ENV",
    "SEED_ENV",
    "SPINE_ENV",
    "BENCHMARK_ENV_VARS",
    "HF_REPLAY_ATTR",
    "ReplaySpec",
    "resolve_acceptance_replay",
    "get_acceptance_replay",
    "warn_replay",
]

logger = logging.getLogger("vllm_tfm")

REPLAY_ENV = "VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY"
CONFIRM_ENV = "VLLM_TFM_I_AM_BENCHMARKING"
SEED_ENV = "VLLM_TFM_BENCHMARK_REPLAY_SEED"
SPINE_ENV = "VLLM_TFM_BENCHMARK_SPINE_TOP1"
BENCHMARK_ENV_VARS = (REPLAY_ENV, CONFIRM_ENV, SEED_ENV, SPINE_ENV)
HF_REPLAY_ATTR = "tfm_acceptance_replay"


class ReplaySpec(BaseModel):
    """What a worker needs to replay acceptance (plain data: it travels inside the HF config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str = Field(description="the profile file")
    profile_source: str
    measured: bool
    entry: str = Field(description="method B=.. T=.. of the entry used")
    accepted_pmf: list[float] = Field(description="P(A = k), k = 0..D, D the engine's drafted depth")
    profile_mean_accepted_length: float = Field(description="MAL of the entry before resizing to D")
    seed: int
    spine_top1: float | None

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.accepted_pmf)


def _confirmed(env: Mapping[str, str]) -> bool:
    return env.get(CONFIRM_ENV, "").strip() == "1"


def resolve_acceptance_replay(
    proposal: str, budget: int, depth: int, environ: Mapping[str, str] | None = None
) -> ReplaySpec | None:
    """The replay of a tfm engine with tree proposal ``proposal``, budget B and drafted depth D,
    or None when :data:`REPLAY_ENV` is unset. Raises a one-line ValueError when replay is asked for
    without :data:`CONFIRM_ENV` = 1, or the profile / switches are unusable."""
    env = os.environ if environ is None else environ
    path = env.get(REPLAY_ENV, "").strip()
    if not path:
        return None
    if not _confirmed(env):
        raise ValueError(
            f"{REPLAY_ENV} is set, but acceptance replay is a benchmark mode: accepted paths are drawn from a "
            f"recorded profile instead of being checked against the target, so the output is NOT the model's; "
            f"set {CONFIRM_ENV}=1 to run it, or unset {REPLAY_ENV}"
        )
    profile = load_profile(path)
    entry = profile.select(proposal, budget)
    raw_seed = env.get(SEED_ENV, "0").strip() or "0"
    try:
        seed = int(raw_seed)
    except ValueError:
        raise ValueError(f"environment {SEED_ENV}={raw_seed!r}: expected an integer") from None
    raw_spine = env.get(SPINE_ENV, "").strip()
    spine: float | None
    if raw_spine.lower() in ("none", "null", "off"):
        spine = None
    else:
        try:
            spine = float(raw_spine) if raw_spine else DEFAULT_SPINE_TOP1
            geometric_rank_ratio(spine, DEFAULT_SPINE_RANKS)
        except ValueError:
            raise ValueError(
                f"environment {SPINE_ENV}={raw_spine!r}: expected a probability in (1/{DEFAULT_SPINE_RANKS}, 1) or 'none'"
            ) from None
    return ReplaySpec(
        profile=str(path),
        profile_source=profile.source,
        measured=profile.measured,
        entry=entry.label(),
        accepted_pmf=resize_pmf(entry.accepted_pmf, depth),
        profile_mean_accepted_length=entry.mean_accepted_length,
        seed=seed,
        spine_top1=spine,
    )


def get_acceptance_replay(config: Any) -> ReplaySpec | None:
    """The replay attached to a tfm engine's drafter HF config (None: normal verification)."""
    spec = getattr(config, "speculative_config", config)
    draft = getattr(spec, "draft_model_config", None)
    data = None if draft is None else getattr(draft.hf_config, HF_REPLAY_ATTR, None)
    return None if data is None else ReplaySpec.model_validate(data)


def warn_replay(spec: ReplaySpec, where: str) -> None:
    """The loud warning every replaying engine logs (config time and worker)."""
    bar = "!" * 100
    label = "" if spec.measured else " (a SYNTHETIC profile, not a measurement)"
    logger.warning(
        "\n%s\nvllm-tfm ACCEPTANCE REPLAY (benchmark mode, %s): accepted paths are drawn from %s, entry %s%s, "
        "MAL %.3f at this engine's depth; outputs are NOT the model's. Never serve with %s set.\n%s",
        bar, where, spec.profile, spec.entry, label, spec.mean_accepted_length, REPLAY_ENV, bar,
    )
