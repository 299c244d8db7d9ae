"""vLLM's asynchronous scheduling for method 'tfm': vLLM's default at tensor parallelism 1, synchronous above.

With asynchronous scheduling the engine schedules step N + 1 while the GPU still runs step N: the
scheduler gives every decode B placeholder drafts and counts them as accepted, and the model
runner corrects the counts on the device from the sampler's output (``_update_states`` and
``_prepare_inputs`` of vLLM 0.26's ``gpu_model_runner.py``: ``prev_num_draft_len``,
``update_num_computed_tokens_for_batch_change``), writes the bonus token and the drafts into the
input ids from the device (``_prepare_input_ids``) and never reads a sampled token on the host on
the step's path. vLLM turns it on by default for no speculation and for EAGLE / MTP / DFlash, and
off, or refuses it when asked for, for every other method (``VllmConfig.__post_init__``,
config/vllm.py 1028-1107), so without this module tfm engines run with synchronous scheduling: on a
host-bound batch-1 step the GPU then waits ~1.7 ms for the host between the drafter and the next
forward (bench/NOTES.md section 46).

The default (``async_scheduling`` unset): at tensor parallelism 1, vLLM's own choice, asynchronous
unless an option vLLM knows rules it out (its log line "Asynchronous scheduling is enabled." says
which); synchronous at tensor parallelism above 1, where tfm has not run asynchronously yet, and when
``VLLM_TFM_TRACE`` is set (one INFO line says why). ``--async-scheduling`` / ``--no-async-scheduling``
(``async_scheduling=True`` / ``False``) are taken as asked.

A tfm step is, to vLLM's bookkeeping, a chain step of B drafts with p accepted: the commit leaves
the state after the last accepted token where a chain would have left it (``runtime/commit.py``)
and the tree sampler returns the accepted path's tokens then -1 (``runtime/sampler.py``), which is
what vLLM's corrections count. What the runtime does differently when the runner schedules
asynchronously (``runtime/hooks.py``, ``runtime/deferred_drafts.py``):

* no early copy of the sampled tokens for vLLM's bookkeeping: it reads none on the host;
* placeholders without any proposal behind them (the drafter skipped a step, near
  ``max_model_len``) are verified as a chain of the tokens vLLM wrote, instead of raising;
* a running request scheduled with one token and no drafts reads GDN slot 0: its committed state
  is moved there on the device from the device's accepted count (``fix_accepted_offsets``), since
  the host's counts are placeholders of 1 in this mode;
* ``VLLM_TFM_TRACE`` is refused (it reads every step's acceptance on the host).

Here, in every process (each patch once, through ``patching``):

* ``vllm.config.vllm.EagleModelTypes``, the name ``VllmConfig.__post_init__`` tests the method
  against, also holds "tfm", so that an engine asked for asynchronous scheduling builds;
* ``VllmConfig.__post_init__``: for method 'tfm' an unset ``async_scheduling`` stays unset (vLLM
  decides) at tensor parallelism 1 without ``VLLM_TFM_TRACE``, else becomes False (one INFO line says
  why); True stays True (one INFO line says so) and False stays False. Other methods are untouched.

Status (bench/NOTES.md sections 49-52): sections 49-50 found other greedy tokens at batch 8 on the toy zoo; the
cause was the full tree graphs' shared tree-attention plan region (fixed in b2d2366: one region per batch size),
which synchronous serving could hit too. Since the fix every engine, eager and full graphs, synchronous and
asynchronous, gives no-spec's greedy tokens on the zoo at batch 8, batch 1 and with shrinking and regrowing
batches (section 52, on an H100). At the 27B shape it decodes 4.9% more tokens/s at batch 1 and the same at batch
8 (section 53). Its serving soak (section 54, ``bench/run_gpu_soak.sh soak --cuda-graphs --async-scheduling``,
on an H100) passed every check but one: a request with ``allowed_token_ids`` got two tokens outside its allowed
ids. The cause was vLLM's, not tfm's nor asynchrony's (section 55): vLLM 0.26's ``InputBatch.swap_states`` loses
the allowed-token mask of a request its decode-first reorder moves, which synchronous engines hit as well
(``bench/async_request_params.py --replace-aborted --without-mask-fix`` reproduces it in both); the plugin fixes it
(``allowed_token_masks.py``), and a shortened asynchronous soak with the fix passed its probes, greedy comparisons
and memory checks. Section 56, on one H100 80GB HBM3: the preemption soak
(``bench/run_gpu_soak.sh preempt --async-scheduling``, ``bench/results/preempt_zoo_async_s56.json.gz``) started
40 of 40 requests twice with 0 errors, dropped 4 of 4 disconnects mid-stream, preempted 16 and 9 times with trees
in flight, gave no-spec's greedy tokens 31/31 in both rounds, grew memory +100 MiB then +0 MiB, drained, and left
0 unexpected server tracebacks; the full-size serving soak with full CUDA graphs (``bench/run_gpu_soak.sh soak
--cuda-graphs --async-scheduling --requests 800 --deadline-s 450``, ``bench/results/soak_zoo_graphs_async_s56.json.gz``)
started 800 of 800 with 0 errors, dropped 40 of 40 disconnects mid-stream, answered every parameter probe as
documented (``allowed_token_ids`` included), gave no-spec's greedy tokens 382/382 in both rounds, grew memory +416
then +0 MiB, drained, and left 0 unexpected tracebacks (tfm/no-spec throughput 0.832 on the toy zoo, mean accepted
length 1.76: not a speed claim). Section 58, on one H100 80GB HBM3: the Ray executor and a Ray Serve app gave the
default executor's greedy tokens with every worker asynchronous (``bash bench/run_gpu_ray.sh --target zoo/target
--drafter zoo/drafter --async-scheduling``, ``bench/results/ray_zoo_async_s58.json.gz``), and the zoo's target in
the VL layout (``Qwen3_5ForConditionalGeneration``, Qwen3.6-27B's class) gave no-spec's greedy tokens eager and
with full graphs, asynchronous and not, at batch 8, batch 1 and in waves (``TFM_GRAPHS_MODELS=zoo-vl bash
bench/run_gpu_graphs.sh``, ``bench/results/graphs_zoo_vl_async_s58.json.gz``). So vLLM's default is tfm's at
tensor parallelism 1. Not run asynchronously: tensor parallelism 2 (``bash bench/run_gpu_tp2.sh
--async-scheduling`` needs two GPUs), which keeps synchronous scheduling by default.
"""

from __future__ import annotations

import functools
import logging
import typing
from collections.abc import Callable
from typing import Any, Literal

from .guards import TFM_METHOD
from .patching import replace_attribute
from .runtime.settings import trace_settings

__all__ = ["install_async_scheduling_patches", "synchronous_default_reason"]

logger = logging.getLogger("vllm_tfm")


@functools.cache
def _log_async_on() -> None:
    logger.info("vllm-tfm: asynchronous scheduling is on for method 'tfm' (--async-scheduling)")


def synchronous_default_reason(vllm_config: Any) -> str | None:
    """Why a tfm engine that did not ask schedules synchronously, or None: vLLM's default then (module
    docstring)."""
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    if tp > 1:
        return f"tensor parallelism {tp}: tfm has run asynchronously at tensor parallelism 1 only"
    if trace_settings() is not None:
        return "VLLM_TFM_TRACE reads every step's acceptance on the host"
    return None


def _make_post_init(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> Any:
        spec = getattr(self, "speculative_config", None)
        sched = getattr(self, "scheduler_config", None)
        if spec is not None and sched is not None and getattr(spec, "method", None) == TFM_METHOD:
            wanted = sched.async_scheduling
            if wanted is None:  # unset: vLLM's default, unless a reason of ours rules it out
                reason = synchronous_default_reason(self)
                if reason is not None:
                    sched.async_scheduling = False
                    logger.info("vllm-tfm: method 'tfm' schedules synchronously here (%s); --async-scheduling "
                                "turns asynchronous scheduling on", reason)
            elif wanted:
                _log_async_on()
        return original(self)

    return __post_init__


def _widened(original: Any) -> Any:
    values = typing.get_args(original)
    return original if TFM_METHOD in values else Literal[(*values, TFM_METHOD)]  # type: ignore[valid-type]


def install_async_scheduling_patches() -> None:
    """Widen ``vllm.config.vllm.EagleModelTypes`` by "tfm" and wrap ``VllmConfig.__post_init__`` (module
    docstring); idempotent."""
    import vllm.config.vllm as vllm_config_module

    replace_attribute(
        vllm_config_module,
        "EagleModelTypes",
        _widened,
        reason="VllmConfig's async-scheduling check accepts method 'tfm'",
    )
    replace_attribute(
        vllm_config_module.VllmConfig,
        "__post_init__",
        _make_post_init,
        reason="method 'tfm': vLLM's default scheduling at tensor parallelism 1, synchronous above or with the trace",
    )
