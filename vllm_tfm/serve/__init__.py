"""Ray Serve deployments of vLLM with method "tfm" (the optional extra ``vllm-tfm[ray]``).

    from ray import serve
    from vllm_tfm.serve import build_tfm_openai_app

    app = build_tfm_openai_app({"model": "Qwen/Qwen3.6-27B", "drafter": "/models/tfm-drafter",
                                "num_speculative_tokens": 64, "accelerator_type": "H200"})
    serve.run(app)   # OpenAI routes on http://<head>:8000/v1

``config``: :class:`TfmServeConfig` (what users write); ``environment``: what replicas and vLLM
workers need to load the plugin; ``app``: the builders. Importing this package imports neither
Ray nor vLLM; the builders import ``ray.serve.llm`` (which imports vLLM). See docs/ray.md.
"""

from .app import build_app, build_llm_config, build_tfm_openai_app, llm_config_dict, speculative_config
from .config import TfmServeConfig, load_serve_config
from .environment import check_plugin_loadable, plugin_entry_point_installed, replica_env_vars

__all__ = [
    "TfmServeConfig",
    "build_app",
    "build_llm_config",
    "build_tfm_openai_app",
    "check_plugin_loadable",
    "llm_config_dict",
    "load_serve_config",
    "plugin_entry_point_installed",
    "replica_env_vars",
    "speculative_config",
]
