"""Ray Serve OpenAI applications with method "tfm", on Ray Serve LLM (``ray.serve.llm``).

:func:`llm_config_dict` turns a :class:`~vllm_tfm.serve.config.TfmServeConfig` into the plain
dict of a Ray Serve LLM ``LLMConfig`` (no Ray import); :func:`build_llm_config` validates it as an
``LLMConfig``; :func:`build_tfm_openai_app` wraps it with ``ray.serve.llm.build_openai_app`` into an
application with the OpenAI routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``);
:func:`build_app` is the same for Serve's ``import_path`` (``serve run vllm_tfm.serve:build_app``
or a Serve YAML with ``args``).

What the LLMConfig holds for tfm:

* ``engine_kwargs.speculative_config = {"method": "tfm", "model": drafter,
  "num_speculative_tokens": B, <tree options>, "attention_backend": ...}``: the same speculative
  config as ``vllm serve --speculative-config``; the plugin builds and checks it in the Ray task
  where Ray Serve LLM creates the vLLM engine config;
* ``engine_kwargs.tensor_parallel_size``; Ray Serve LLM runs vLLM with
  ``distributed_executor_backend="ray"`` on GPUs, one placement-group bundle per rank;
* ``deployment_config.autoscaling_config``: ``min_replicas`` / ``max_replicas`` /
  ``target_ongoing_requests``;
* ``runtime_env.env_vars``: the ``VLLM_TFM_*`` variables of the builder's environment plus
  ``TfmServeConfig.env`` (see ``vllm_tfm.serve.environment``);
* ``callback_config.callback_class``: ``vllm_tfm.serve.replica_callback.TfmReplicaCallback``,
  which registers the plugin in the replica process, where vLLM's request validation runs but
  vLLM itself never loads plugins (``vllm_tfm.serve.replica``).

Before anything is deployed the builder refuses, in one line: an unknown field or tree option,
engine arguments it sets itself, a ``VLLM_TFM_*`` typo, an environment without vllm-tfm's entry
point, and (when the drafter is a local directory) tree options that the engine would refuse (the
same resolution as the plugin: ``tfm_config.json`` < ``VLLM_TFM_*`` < ``tree``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from vllm_tfm.vllm_plugin.options import resolve_tfm_options

from .config import TfmServeConfig, load_serve_config
from .environment import check_plugin_loadable, replica_env_vars
from .replica import CALLBACK_CLASS

if TYPE_CHECKING:
    from ray.serve.deployment import Application
    from ray.serve.llm import LLMConfig

__all__ = [
    "TFM_METHOD",
    "build_app",
    "build_llm_config",
    "build_tfm_openai_app",
    "llm_config_dict",
    "speculative_config",
]

TFM_METHOD = "tfm"
RAY_EXTRA_HINT = "install the Ray extra: pip install 'vllm-tfm[ray]'"


def speculative_config(cfg: TfmServeConfig) -> dict[str, Any]:
    """The vLLM speculative config of ``cfg`` (what ``--speculative-config`` would hold)."""
    spec: dict[str, Any] = {"method": TFM_METHOD, "model": cfg.drafter, "num_speculative_tokens": cfg.num_speculative_tokens}
    spec.update(cfg.tree)
    if cfg.drafter_attention_backend is not None:
        spec["attention_backend"] = cfg.drafter_attention_backend
    return spec


def _check_tree_options(cfg: TfmServeConfig, env: Mapping[str, str]) -> None:
    """Resolve the tree options now when the drafter is a local directory (else the engine does)."""
    if Path(cfg.drafter).is_dir():
        resolve_tfm_options(cfg.drafter, cfg.tree, cfg.num_speculative_tokens, environ=env)


def llm_config_dict(config: TfmServeConfig | Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Ray Serve LLM ``LLMConfig`` of ``config``, as a plain dict (checked; no Ray import).

    ``environ``: where the builder's ``VLLM_TFM_*`` variables come from (default ``os.environ``).
    """
    cfg = load_serve_config(config)
    env = replica_env_vars(cfg.env, cfg.runtime_env.get("env_vars"), environ)
    _check_tree_options(cfg, env)
    if cfg.max_replicas > cfg.min_replicas and cfg.target_ongoing_requests is None:
        raise ValueError(
            f"max_replicas {cfg.max_replicas} > min_replicas {cfg.min_replicas} needs target_ongoing_requests "
            "(Ray Serve LLM's default never scales up)"
        )
    engine_kwargs = {
        **cfg.engine_kwargs,
        "speculative_config": speculative_config(cfg),
        "tensor_parallel_size": cfg.tensor_parallel_size,
    }
    autoscaling: dict[str, Any] = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas}
    if cfg.target_ongoing_requests is not None:
        autoscaling["target_ongoing_requests"] = cfg.target_ongoing_requests
    out: dict[str, Any] = {
        "model_loading_config": {"model_id": cfg.served_name, "model_source": cfg.model},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {**cfg.deployment_config, "autoscaling_config": autoscaling},
        "runtime_env": {**cfg.runtime_env, "env_vars": env},
        "callback_config": {"callback_class": CALLBACK_CLASS},
    }
    if cfg.accelerator_type is not None:
        out["accelerator_type"] = cfg.accelerator_type
    if cfg.placement_group_config is not None:
        out["placement_group_config"] = cfg.placement_group_config
    return out


def _ray_serve_llm() -> Any:
    try:
        import ray.serve.llm as serve_llm
    except ImportError as e:
        raise ImportError(f"vllm_tfm.serve needs ray[serve,llm] ({e}); {RAY_EXTRA_HINT}") from None
    return serve_llm


def build_llm_config(config: TfmServeConfig | Mapping[str, Any], environ: Mapping[str, str] | None = None) -> LLMConfig:
    """``ray.serve.llm.LLMConfig`` for ``config``, validated by Ray Serve LLM as well.

    Refuses an environment without vllm-tfm's entry point (see ``environment.check_plugin_loadable``).
    """
    data = llm_config_dict(config, environ)
    # VLLM_PLUGINS of the replicas: theirs, else the builder's (a local cluster inherits it)
    plugins = data["runtime_env"]["env_vars"].get("VLLM_PLUGINS", (os.environ if environ is None else environ).get("VLLM_PLUGINS"))
    check_plugin_loadable({} if plugins is None else {"VLLM_PLUGINS": plugins})
    serve_llm = _ray_serve_llm()
    try:
        return serve_llm.LLMConfig.model_validate(data)
    except ValidationError as e:  # Ray's own schema (accelerator types, deployment options): one line
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "<config>"
        raise ValueError(f"ray.serve.llm.LLMConfig: {loc}: {err['msg'].removeprefix('Value error, ')}") from None


def build_tfm_openai_app(config: TfmServeConfig | Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Application:
    """An OpenAI-compatible Ray Serve application serving ``config`` with method "tfm".

    Deploy it with ``ray.serve.run(app)``; clients send ``model=<model_id>``.
    """
    cfg = load_serve_config(config)
    llm_config = build_llm_config(cfg, environ)
    serve_llm = _ray_serve_llm()
    args: dict[str, Any] = {"llm_configs": [llm_config]}
    if cfg.ingress_deployment_config:
        args["ingress_deployment_config"] = dict(cfg.ingress_deployment_config)
    return serve_llm.build_openai_app(args)


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: ``import_path: vllm_tfm.serve:build_app`` with ``args`` a
    :class:`TfmServeConfig` (``serve run vllm_tfm.serve:build_app model=... drafter=...``)."""
    return build_tfm_openai_app(args)
