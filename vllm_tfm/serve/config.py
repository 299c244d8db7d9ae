"""``TfmServeConfig``: what a user writes to deploy a tfm engine with Ray Serve LLM.

One model per application: the target, the drafter directory, the tree budget and options, the
vLLM engine arguments, the accelerator and replica settings, and the environment of the replicas
and their vLLM workers. Everything is checked when the config is built, each problem in one line
(``TfmServeConfig.model_validate(...)`` raises ``pydantic.ValidationError``; :func:`load_serve_config`
turns it into a one-line ``ValueError``). Importing this module imports neither Ray nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_tfm.vllm_plugin.options import MAX_BUDGET, MIN_BUDGET, OPTION_KEYS

__all__ = ["BUILDER_OWNED_ENGINE_KWARGS", "TfmServeConfig", "load_serve_config"]

BUILDER_OWNED_ENGINE_KWARGS: Mapping[str, str] = {
    "model": "the field 'model'",
    "served_model_name": "the field 'model_id'",
    "speculative_config": "the fields 'drafter', 'num_speculative_tokens' and 'tree'",
    "tensor_parallel_size": "the field 'tensor_parallel_size'",
    "distributed_executor_backend": "Ray Serve LLM ('ray' on GPUs)",
}
"""vLLM engine arguments the builder sets itself, and where their value comes from."""


class TfmServeConfig(BaseModel):
    """A Ray Serve OpenAI application serving one target with method "tfm".

    Example (Python or the ``args`` of a Serve YAML ``import_path: vllm_tfm.serve:build_app``)::

        {"model": "Qwen/Qwen3.6-27B", "drafter": "/models/qwen36-27b-tfm", "num_speculative_tokens": 16,
         "accelerator_type": "H200", "tensor_parallel_size": 1, "min_replicas": 1, "max_replicas": 4,
         "engine_kwargs": {"max_model_len": 32768, "gpu_memory_utilization": 0.9}}
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(min_length=1, description="target checkpoint: a local directory or a Hugging Face id")
    model_id: str | None = Field(
        default=None, min_length=1, description="the name clients send as OpenAI 'model' (default: model)"
    )
    drafter: str = Field(min_length=1, description="drafter directory (DFlash config + weights, tfm_config.json)")
    num_speculative_tokens: int = Field(
        ge=MIN_BUDGET, le=MAX_BUDGET, description="tree budget B: draft nodes per request per step"
    )
    tree: dict[str, Any] = Field(
        default_factory=dict,
        description=f"tree options, placed in the speculative config ({', '.join(OPTION_KEYS)})",
    )
    drafter_attention_backend: str | None = Field(
        default="TRITON_ATTN",
        description="attention backend of the drafter's own layers (None: vLLM's choice)",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="further vLLM engine arguments (max_model_len, gpu_memory_utilization, dtype, ...)",
    )
    accelerator_type: str | None = Field(
        default=None, description="Ray accelerator type the replicas need, e.g. 'H200' (None: any GPU)"
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica (vLLM tensor parallelism)")
    placement_group_config: dict[str, Any] | None = Field(
        default=None,
        description="Ray Serve LLM placement group of one replica's vLLM workers (None: one GPU bundle per TP rank)",
    )
    min_replicas: int = Field(default=1, ge=0, description="autoscaling: fewest replicas")
    max_replicas: int = Field(default=1, ge=1, description="autoscaling: most replicas")
    target_ongoing_requests: int | None = Field(
        default=None, ge=1, description="autoscaling: ongoing requests per replica to aim for (None: Ray's default)"
    )
    deployment_config: dict[str, Any] = Field(
        default_factory=dict,
        description="further Ray Serve deployment options of the LLM replicas (ray_actor_options, max_ongoing_requests, ...)",
    )
    ingress_deployment_config: dict[str, Any] = Field(
        default_factory=dict, description="Ray Serve deployment options of the OpenAI ingress"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment of the replicas and their vLLM workers (added to the builder's VLLM_TFM_* variables)",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict, description="further Ray runtime_env of the replicas (pip, working_dir, env_vars, ...)"
    )

    @field_validator("tree")
    @classmethod
    def _tree_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"unknown tree option {unknown[0]!r} (tree options are {', '.join(OPTION_KEYS)})")
        return value

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, instead in BUILDER_OWNED_ENGINE_KWARGS.items():
            if key in value:
                raise ValueError(f"{key!r} is set by the tfm builder from {instead}")
        return value

    @field_validator("deployment_config")
    @classmethod
    def _deployment_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("autoscaling_config", "num_replicas"):
            if key in value:
                raise ValueError(f"{key!r}: use min_replicas, max_replicas and target_ongoing_requests instead")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or "=" in name:
                raise ValueError(f"bad environment variable name {name!r}")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> TfmServeConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        return self

    @property
    def served_name(self) -> str:
        return self.model_id if self.model_id is not None else self.model


def load_serve_config(data: TfmServeConfig | Mapping[str, Any]) -> TfmServeConfig:
    """``data`` as a TfmServeConfig; a bad config raises a one-line ValueError naming the field."""
    if isinstance(data, TfmServeConfig):
        return data
    try:
        return TfmServeConfig.model_validate(dict(data))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "<config>"
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (fields are {', '.join(TfmServeConfig.model_fields)})"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ValueError(f"tfm serve config: {loc}: {msg}{more}") from None
