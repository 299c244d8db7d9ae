"""``WeaverGraphs`` on CPU tensors with captures recorded instead of made (tests of which Weaver
graphs are captured when: ``test_weaver_graphs.py``, ``test_runtime_vllm.py``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs, _Captured


class Replayed(Exception):
    """A build reached the replay of a graph (the recorder's graphs only say so)."""


class _Graph:
    def replay(self) -> None:
        raise Replayed


class RecordingGraphs(WeaverGraphs):
    """Every device counts as capturable and a capture only records its bucket and fills its
    input buffers: the class's own decisions (which key, which bucket, when to capture, which
    input buffers) run unchanged; a build that would replay raises ``Replayed``."""

    def capturable(self, device: Any, embed: Any, lm_head: Any) -> bool:
        return True

    def _capture(self, bucket: int, weaver: Any, logits: Tensor, hidden: Tensor, verifier: Tensor, roots: Tensor,
                 embed: Any, lm_head: Any, budget: int, top_k: int, width: int, cpn: int) -> _Captured:
        inputs = self._static_inputs(bucket, logits, hidden, verifier, roots)
        inputs.fill(logits, hidden, verifier, roots)
        self.captured.append(bucket)
        return _Captured(_Graph(), inputs, None, {}, None, None, None)
