"""Per-request sampling parameters applied to the target logits at every tree node.

The target's distribution for the token after node i is ``softmax(processed logits[i])``; a
tree verifier must accept against exactly the distribution that non-speculative sampling would
use, so every node of request r is processed with request r's parameters (node -> request through
``cu_nodes``).

Order and semantics follow vLLM 0.26's ``Sampler`` (``vllm/v1/sample/sampler.py``: temperature,
then the argmax-invariant logits processors, of which min-p is the built-in one, then
``TopKTopPSampler``'s top-k and top-p):

1. logits are cast to float32 (float64 input stays float64, for exactness tests);
2. temperature: ``logits / T``; a request with ``T < 1e-5`` is greedy (vLLM's ``_SAMPLING_EPS``);
3. min-p: ``probs = softmax(logits)``; tokens with ``probs < min_p * max(probs)`` get -inf;
4. top-k: tokens whose logit is below the k-th largest get -inf (ties with the k-th are kept);
   ``k <= 0`` or ``k >= V`` disables it (vLLM stores "off" as ``k = V``);
5. top-p: sort ascending, ``cumsum(softmax)``; tokens whose cumulative mass is ``<= 1 - p`` get
   -inf, the largest token always stays; applied to the top-k-filtered logits;
6. ``probs = softmax(logits)``.

Greedy requests get the one-hot distribution of their raw-logit argmax (lowest token id on ties,
like ``torch.argmax``): the temperature-0 limit, so a stochastic verifier fed these rows behaves
greedily.

Two differences from vLLM worth knowing. vLLM 0.26's own ``RejectionSampler`` applies only
temperature, top-k and top-p at draft positions (``apply_sampling_constraints``) while its bonus
token goes through the full ``Sampler`` (min-p included), so with min-p its chain speculative
decoding samples draft positions from a different distribution than non-speculative decoding; we
apply min-p at every node, which is what non-speculative sampling does. Where several tokens share
the logit at the top-p boundary, vLLM's unstable sort leaves the choice unspecified; we sort
stably, so among equal logits the lower token id is dropped first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "TreeSamplingParams",
    "per_node",
    "apply_temperature",
    "apply_min_p",
    "apply_top_k_top_p",
    "process_logits",
]

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""


def _check_values(temperature: np.ndarray, top_p: np.ndarray | None, min_p: np.ndarray | None) -> None:
    """The value checks of TreeSamplingParams, on host arrays (shapes and dtypes already checked)."""
    if bool((temperature < 0).any()) or bool(np.isnan(temperature).any()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    if top_p is not None and bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    if min_p is not None and bool(((min_p < 0) | (min_p > 1)).any()):
        raise ValueError(f"min_p must be in [0, 1], got {min_p.tolist()}")


@dataclass(frozen=True)
class TreeSamplingParams:
    """Sampling parameters of R requests, one entry per request (all [R], on the logits' device).

    temperature: float, >= 0; ``< 1e-5`` means greedy.
    top_k: int64 or None; ``k <= 0`` or ``k >= V`` means off (vLLM accepts 0 and -1 as "off").
    top_p: float in (0, 1] or None; 1 means off.
    min_p: float in [0, 1] or None; 0 means off.
    Values are checked once here (this reads them on the host: one device-to-host copy each when
    they live on a GPU). Keyword-only: ``host_greedy`` [R] bool numpy, a host copy of
    :meth:`greedy_mask` (lets ``verify_tree`` choose its verifiers without reading the device);
    ``check=False`` skips the value checks, for values checked on the host before
    (:meth:`from_host` does both).
    """

    temperature: Tensor
    top_k: Tensor | None = None
    top_p: Tensor | None = None
    min_p: Tensor | None = None
    _: KW_ONLY
    host_greedy: np.ndarray | None = field(default=None, compare=False, repr=False)
    check: InitVar[bool] = True

    def __post_init__(self, check: bool) -> None:
        t = self.temperature
        if t.dim() != 1 or not t.dtype.is_floating_point:
            raise ValueError(f"temperature must be a 1-D float tensor [R], got {tuple(t.shape)} {t.dtype}")
        r = t.numel()
        for name, v in (("top_k", self.top_k), ("top_p", self.top_p), ("min_p", self.min_p)):
            if v is not None and (v.dim() != 1 or v.numel() != r):
                raise ValueError(f"{name} must have shape [{r}] (one per request), got {tuple(v.shape)}")
        if self.top_k is not None and self.top_k.dtype.is_floating_point:
            raise ValueError(f"top_k must be an integer tensor, got {self.top_k.dtype}")
        if self.host_greedy is not None and self.host_greedy.shape != (r,):
            raise ValueError(f"host_greedy must have shape [{r}], got {self.host_greedy.shape}")
        if check:
            host = lambda v: None if v is None else v.detach().to("cpu", torch.float64).numpy()  # noqa: E731
            _check_values(host(t), host(self.top_p), host(self.min_p))

    @staticmethod
    def from_lists(
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
    ) -> "TreeSamplingParams":
        """Build from per-request Python lists (float64 for the float parameters)."""
        f = lambda v: None if v is None else torch.tensor(v, dtype=torch.float64, device=device)  # noqa: E731
        k = None if top_k is None else torch.tensor(top_k, dtype=torch.long, device=device)
        return TreeSamplingParams(f(temperature), k, f(top_p), f(min_p))

    @staticmethod
    def from_host(
        temperature: np.ndarray,
        top_k: np.ndarray | None,
        top_p: np.ndarray | None,
        min_p: np.ndarray | None,
        device: torch.device | str,
    ) -> TreeSamplingParams:
        """From per-request host arrays ([R] each, None = unused): float64 floats, int64 top_k,
        checked on the host, copied to ``device`` in one transfer, with ``host_greedy`` set."""
        from .packed_upload import packed_upload

        floats = {n: None if a is None else np.array(a, dtype=np.float64)
                  for n, a in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p))}
        k = None if top_k is None else np.array(top_k, dtype=np.int64)
        t = floats["temperature"]
        if t.ndim != 1:
            raise ValueError(f"temperature must be a 1-D float tensor [R], got {t.shape} float64")
        _check_values(t, floats["top_p"], floats["min_p"])
        arrays = {n: a.view(np.int64) for n, a in floats.items() if a is not None}  # float64 bits travel as int64
        if k is not None:
            arrays["top_k"] = k
        dev = packed_upload(arrays, device)
        f = lambda n: None if floats[n] is None else dev[n].view(torch.float64)  # noqa: E731
        return TreeSamplingParams(f("temperature"), dev.get("top_k"), f("top_p"), f("min_p"),
                                  host_greedy=t < GREEDY_TEMPERATURE_EPS, check=False)

    @property
    def num_requests(self) -> int:
        return int(self.temperature.numel())

    def greedy_mask(self) -> Tensor:
        """[R] bool: requests sampled greedily (temperature < 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS


def per_node(values: Tensor, cu_nodes: Tensor, num_nodes: int) -> Tensor:
    """Expand a per-request tensor [R, ...] to every node [T, ...] (node -> request via cu_nodes)."""
    return torch.repeat_interleave(values, cu_nodes.diff(), dim=0, output_size=num_nodes)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits [T, V] / temperature [T] (rows with temperature < 1e-5 are left unscaled)."""
    t = torch.where(temperature < GREEDY_TEMPERATURE_EPS, torch.ones_like(temperature), temperature)
    return logits / t.to(logits.dtype).unsqueeze(1)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens with ``softmax(logits) < min_p * max(softmax(logits))`` to -inf (vLLM MinPLogitsProcessor).

    logits [T, V] float, min_p [T] float (0 = off). Returns a new tensor.
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Top-k then top-p masking (to -inf) of logits [T, V]; top_k [T] int64, top_p [T] float.

    Same masks as vLLM's ``apply_top_k_top_p_pytorch``: one ascending (here stable) sort; top-k
    keeps logits >= the k-th largest; top-p drops the ascending prefix whose softmax mass over the
    top-k-filtered logits is <= 1 - p, always keeping the largest. Returns a new tensor.
    """
    if top_k is None and top_p is None:
        return logits
    num_tokens, vocab = logits.shape
    sorted_logits, order = torch.sort(logits, dim=-1, stable=True)
    if top_k is not None:
        k = top_k.to(torch.long)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p.to(cum.dtype)).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def process_logits(logits: Tensor, params: TreeSamplingParams, cu_nodes: Tensor) -> Tensor:
    """Target probabilities [T, V] at every node after the request's sampling parameters.

    logits: [T, V] raw target logits at every node of the ragged batch (any float dtype).
    params: per-request parameters ([R] each); cu_nodes: [R+1] int64.
    Returns float32 probabilities (float64 if logits are float64). Greedy rows are one-hot at the
    raw argmax. See the module docstring for the order of the steps.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    num_nodes = logits.shape[0]
    if cu_nodes.numel() != params.num_requests + 1:
        raise ValueError(
            f"params hold {params.num_requests} requests but cu_nodes describes {cu_nodes.numel() - 1}"
        )
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype)
    expand = lambda v: None if v is None else per_node(v.to(x.device), cu_nodes, num_nodes)  # noqa: E731
    temperature = expand(params.temperature)
    # with a host copy of the greedy mask saying no request is greedy, the unit temperatures and
    # the one-hot rows would be replaced by nothing: skipped (same values, 8 kernels fewer)
    none_greedy = params.host_greedy is not None and not bool(params.host_greedy.any())
    x = x / temperature.to(x.dtype).unsqueeze(1) if none_greedy else apply_temperature(x, temperature)
    if params.min_p is not None:
        x = apply_min_p(x, expand(params.min_p))
    x = apply_top_k_top_p(x, expand(params.top_k), expand(params.top_p))
    probs = torch.softmax(x, dim=-1)
    if none_greedy:
        return probs
    greedy = temperature < GREEDY_TEMPERATURE_EPS
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)
