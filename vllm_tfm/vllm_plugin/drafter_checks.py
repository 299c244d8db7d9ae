"""Config-time checks of a tfm drafter directory against the target, before vLLM builds it.

A drafter directory (DESIGN.md section 8) holds a z-lab DFlash drafter (``config.json`` with
``architectures: ["DFlashDraftModel"]`` and a ``dflash_config`` object, plus its weights) and,
for proposal ``tfm``, ``tfm_config.json`` with ``tfm/weaver.safetensors`` (``tfm/treeflash.safetensors``
for ``treeflash``). Everything here runs in
the process that builds the engine config; each refusal is a one-line ValueError naming the
directory or file and the problem, so that a user does not meet a vLLM stack trace instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vllm_tfm.models.io import read_json
from vllm_tfm.models.tfm_config import TREEFLASH_WEIGHTS_NAME, WEAVER_WEIGHTS_NAME, TfmConfig

__all__ = [
    "check_draft_lm_head",
    "check_draft_vocab",
    "draft_vocab_path",
    "DFLASH_ARCHITECTURE",
    "locate_drafter",
    "read_drafter_config",
    "check_drafter_against_target",
    "check_drafter_quantization",
    "check_drafter_weights",
    "check_proposal_files",
    "check_treeflash_shape",
    "check_weaver_shape",
]

DFLASH_ARCHITECTURE = "DFlashDraftModel"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_TFM_WEIGHT_FILES = (WEAVER_WEIGHTS_NAME, TREEFLASH_WEIGHTS_NAME)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.count("/") != 1


def locate_drafter(model: str, revision: str | None = None) -> tuple[Path, bool]:
    """(directory, is_local) for the speculative ``model``: a local directory or a hub repo id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path, True
    if path.exists():
        raise ValueError(f"drafter {model}: not a directory (the speculative model of method 'tfm' is a drafter directory)")
    if _looks_like_path(model):
        raise ValueError(f"drafter directory {model} does not exist")
    try:
        from huggingface_hub import snapshot_download

        # config.json, tfm_config.json and the small tfm weights; vLLM's loader fetches DFlash's
        local = snapshot_download(repo_id=model, revision=revision, allow_patterns=["*.json", *_TFM_WEIGHT_FILES])
    except Exception as e:  # network, auth, offline cache miss: one line either way
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"drafter {model!r} is neither a local directory nor a reachable Hugging Face repository ({type(e).__name__}: {first})"
        ) from None
    return Path(local), False


def read_drafter_config(directory: Path) -> dict[str, Any]:
    """config.json as a dict; one-line errors for a missing file, bad JSON or a non-object."""
    return read_json(directory, "config.json")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_drafter_against_target(
    config: dict[str, Any],
    source: str,
    target_vocab_size: int,
    target_hidden_size: int,
    target_num_layers: int,
) -> int | None:
    """Refuse a drafter config vLLM's DFlash (V1 runner) cannot run for this target.

    Returns the DFlash block size L (None when absent). Checks, in order: a DFlash architecture
    with a ``dflash_config`` object; the vocabulary equals the target's (drafts are target token
    ids, the drafter shares the target's lm_head); the fc input width (``target_hidden_size`` or
    ``hidden_size``) equals the target's hidden size; ``target_layer_ids`` index existing target
    layers; ``mask_token_id`` is inside the vocabulary; the layers do not mix sliding-window and
    full attention (vLLM 0.26 runs those DFlash drafters only on Model Runner V2, which hybrid
    targets cannot use); the block size, when given, is an integer >= 2.
    """
    archs = config.get("architectures")
    if not isinstance(archs, list) or DFLASH_ARCHITECTURE not in archs:
        raise ValueError(f"{source}: architectures {archs!r} is not a DFlash drafter (expected {DFLASH_ARCHITECTURE!r})")
    dfc = config.get("dflash_config")
    if not isinstance(dfc, dict):
        raise ValueError(f"{source}: missing dflash_config object (not a z-lab DFlash drafter config)")

    vocab = config.get("vocab_size")
    if not _int(vocab):
        raise ValueError(f"{source}: vocab_size must be an integer, got {vocab!r}")
    if vocab != target_vocab_size:
        raise ValueError(
            f"{source}: drafter vocab_size {vocab} does not match the target's vocab_size {target_vocab_size}"
        )
    fc_width = config.get("target_hidden_size", config.get("hidden_size"))
    if not _int(fc_width):
        raise ValueError(f"{source}: hidden_size must be an integer, got {fc_width!r}")
    if fc_width != target_hidden_size:
        key = "target_hidden_size" if "target_hidden_size" in config else "hidden_size"
        raise ValueError(f"{source}: drafter {key} {fc_width} does not match the target's hidden_size {target_hidden_size}")

    ids = dfc.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(_int(i) for i in ids):
        raise ValueError(f"{source}: dflash_config.target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < target_num_layers]
    if bad:
        raise ValueError(
            f"{source}: dflash_config.target_layer_ids has layer {bad[0]}, but the target has layers 0..{target_num_layers - 1}"
        )
    mask = dfc.get("mask_token_id")
    if not _int(mask) or not 0 <= mask < vocab:
        raise ValueError(f"{source}: dflash_config.mask_token_id must be a token id in [0, {vocab}), got {mask!r}")

    layer_types = config.get("layer_types") or []
    n_sliding = sum(t == "sliding_attention" for t in layer_types)
    if 0 < n_sliding < len(layer_types):
        raise ValueError(
            f"{source}: the drafter mixes sliding-window and full-attention layers; vLLM 0.26 runs such DFlash "
            "drafters only on Model Runner V2, which method 'tfm' (V1 runner) cannot use"
        )

    block = dfc.get("block_size", config.get("block_size"))
    if block is not None and (not _int(block) or block < 2):
        raise ValueError(f"{source}: dflash_config.block_size must be an integer >= 2, got {block!r}")
    return block


def check_drafter_quantization(config: dict[str, Any], source: str, quantization: Any, dtype: Any = None) -> None:
    """Refuse the speculative config's ``quantization`` where vLLM cannot apply it to this drafter checkpoint.

    A checkpoint with its own ``quantization_config`` (or ``compression_config``) is vLLM's to check. An
    unquantized one can only be quantized at load, by a method that needs no config file (``fp8`` and vLLM's
    other online methods; ``draft_quantization`` makes vLLM 0.26 reach them for a tfm drafter); one that needs
    a file (AWQ, GPTQ, ...) would fail in the worker, so it is refused here in one line; so is a model dtype
    (``dtype``, the target's, which the drafter runs in) outside the method's activation dtypes (FP8: bfloat16 and
    float16, not float32).
    """
    if quantization is None:
        return
    if config.get("quantization_config") is not None or config.get("compression_config") is not None:
        return
    from vllm.model_executor.layers.quantization import get_quantization_config

    try:
        method = get_quantization_config(str(quantization))
    except ValueError:
        return  # an unknown method: vLLM's own config check names it
    if method.get_config_filenames():
        raise ValueError(
            f"{source}: speculative_config quantization={quantization!r} needs a drafter checkpoint quantized with it "
            "(a quantization_config in config.json); an unquantized drafter is quantized at load only by methods "
            "that need no checkpoint config, such as 'fp8'"
        )
    supported = method.get_supported_act_dtypes()
    if dtype is not None and dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(
            f"speculative_config: quantization={quantization!r} runs the drafter in {names}, not the model's "
            f"{str(dtype).removeprefix('torch.')}; set dtype to one of them"
        )


def check_draft_lm_head(options: TfmConfig, source: str, dtype: Any, tensor_parallel_size: int) -> None:
    """``draft_lm_head: "fp8"`` needs one GPU (the lm_head copy is not vocabulary-split) and a bfloat16 or float16
    model (the FP8 GEMM writes those); the load-time checks are in ``runtime/draft_head.py``."""
    if options.draft_lm_head != "fp8":
        return
    if tensor_parallel_size != 1:
        raise ValueError(f"{source}: draft_lm_head='fp8' runs on one GPU; this engine has tensor_parallel_size "
                         f"{tensor_parallel_size}; use draft_lm_head='model'")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{source}: draft_lm_head='fp8' needs a bfloat16 or float16 model, not "
                         f"{str(dtype).removeprefix('torch.')}; set dtype or use draft_lm_head='model'")


def draft_vocab_path(options: TfmConfig, drafter_dir: str | Path) -> Path | None:
    """The ``draft_vocab`` file: a relative path lies in the drafter directory (None: no draft vocabulary)."""
    if options.draft_vocab is None:
        return None
    p = Path(options.draft_vocab).expanduser()
    return p if p.is_absolute() else Path(drafter_dir) / p


def check_draft_vocab(options: TfmConfig, source: str, drafter_dir: str | Path, vocab_size: int,
                      tensor_parallel_size: int) -> None:
    """``draft_vocab`` on one GPU (the lm_head is vocabulary-split under tensor parallelism), a readable file
    of this vocabulary holding ``draft_vocab_size`` and at least ``top_k`` ids; read again at load."""
    path = draft_vocab_path(options, drafter_dir)
    if path is None:
        return
    if tensor_parallel_size != 1:
        raise ValueError(f"{source}: draft_vocab runs on one GPU; this engine has tensor_parallel_size "
                         f"{tensor_parallel_size}")
    from vllm_tfm.models.draft_vocab import load_draft_vocab

    try:
        ids = load_draft_vocab(path, options.draft_vocab_size, vocab_size)
    except ValueError as e:
        raise ValueError(f"{source}: draft_vocab: {e}") from None
    if ids.numel() < options.top_k:
        raise ValueError(f"{source}: draft_vocab: {path} holds {ids.numel()} token ids, fewer than top_k {options.top_k}")


def _is_dflash_weight(path: Path) -> bool:
    return path.is_file() and path.suffix in _WEIGHT_SUFFIXES and path.name not in _TFM_WEIGHT_FILES


def check_drafter_weights(directory: Path) -> None:
    """The DFlash weights must be there (any ``*.safetensors`` / ``*.bin`` / ``*.pt`` besides the
    Weaver and TreeFlash files); skipped by the caller for ``load_format="dummy"``."""
    if not any(_is_dflash_weight(p) for p in directory.iterdir()):
        raise ValueError(
            f"drafter directory {directory} has no DFlash weights (*.safetensors or *.bin); "
            "use load_format='dummy' for random weights"
        )


def check_proposal_files(directory: Path, options: TfmConfig) -> None:
    """Weights the chosen proposal loads besides DFlash (Weaver for ``tfm``, the AR approximator
    for ``treeflash``).

    The runtime loads them from the directory itself, whatever vLLM's ``load_format`` (``dummy``
    gives random DFlash weights only), so they are required in every case.
    """
    for proposal, weights in (("tfm", WEAVER_WEIGHTS_NAME), ("treeflash", TREEFLASH_WEIGHTS_NAME)):
        if options.proposal == proposal and not (directory / weights).is_file():
            raise ValueError(
                f"drafter directory {directory} has no {weights}, which proposal '{proposal}' loads "
                "(use proposal 'ddtree' or 'chain' for a plain DFlash drafter)"
            )


def check_weaver_shape(options: TfmConfig, source: str, target_hidden_size: int, depth: int) -> None:
    """For proposal ``tfm``: the Weaver reads target hidden states and embedding rows (its d_model
    is the target width) and scores every drafted depth (its max_depth covers D = min(B, L - 1))."""
    weaver = options.weaver
    if options.proposal != "tfm" or weaver is None:
        return
    if weaver.d_model != target_hidden_size:
        raise ValueError(f"{source}: weaver.d_model {weaver.d_model} does not match the target's hidden_size {target_hidden_size}")
    if weaver.max_depth < depth:
        raise ValueError(
            f"{source}: weaver.max_depth {weaver.max_depth} is below the {depth} depths drafted per step "
            "(min(num_speculative_tokens, DFlash block_size - 1)); lower num_speculative_tokens"
        )


def check_treeflash_shape(options: TfmConfig, source: str, target_hidden_size: int) -> None:
    """For proposal ``treeflash``: the AR approximator reads the DFlash residual stream and target
    embedding rows, both of the target width."""
    tf = options.treeflash
    if options.proposal != "treeflash" or tf is None:
        return
    if tf.hidden_size != target_hidden_size:
        raise ValueError(f"{source}: treeflash.hidden_size {tf.hidden_size} does not match the target's hidden_size {target_hidden_size}")
