"""What the examples share: their model arguments, random tiny models (a text-only Qwen3.5 hybrid
target and a DFlash drafter), and the OpenAI client check of the two serving examples.

Config files only (vLLM fills the target and DFlash weights with ``load_format="dummy"``), plus:

* a byte-level tokenizer covering the whole target vocabulary (256 byte tokens, an end-of-text
  token, then filler tokens ``<x257>`` ... that no text encodes to), so that text prompts and
  ``vllm serve`` work without downloading anything;
* ``tfm_config.json`` naming the proposal, and for proposal ``tfm`` a random Weaver
  (``tfm/weaver.safetensors``, written by ``vllm_tfm.models.Weaver``): the runtime loads the Weaver
  from the drafter directory itself, whatever vLLM's load format.

Shapes follow shared/gpu/dflash_smoke.py (vocab 4096, hidden 512, 8 layers: GDN x3 + attention
pattern; DFlash block 8 tapping target layers 1, 3, 5). Dummy weights give meaningless tokens and
acceptance: these models check that the whole path runs and that tfm reproduces no-spec greedy
output, not speed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

VOCAB = 4096
HIDDEN = 512
TARGET_LAYERS = 8
BLOCK_SIZE = 8
EOS_ID = 256


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    table = dict(zip(printable, chars))
    return [chr(table[b]) for b in range(256)]


def write_byte_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    """tokenizer.json + tokenizer_config.json: byte-level BPE without merges over ``vocab_size`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    vocab["<|endoftext|>"] = EOS_ID
    for i in range(EOS_ID + 1, vocab_size):
        vocab[f"<x{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(directory)


def write_target(directory: Path, dtype: str) -> Path:
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        torch_dtype=dtype,
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


def write_drafter(directory: Path, proposal: str, dtype: str) -> Path:
    """A z-lab layout DFlash config (no weights: load_format="dummy") and tfm_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000,
        "torch_dtype": dtype,
        "tie_word_embeddings": False,
        "block_size": BLOCK_SIZE,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 5], "block_size": BLOCK_SIZE},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if proposal == "tfm":
        import torch

        from vllm_tfm.models import Weaver, WeaverConfig

        torch.manual_seed(0)
        weaver_cfg = WeaverConfig(d_model=HIDDEN, d_rank=128, n_layers=1, n_heads=4, d_mlp=256, max_depth=BLOCK_SIZE - 1)
        Weaver(weaver_cfg).save_pretrained(directory)  # tfm/weaver.safetensors + tfm_config.json (weaver section)
        data = json.loads((directory / "tfm_config.json").read_text())
        data["proposal"] = "tfm"
        (directory / "tfm_config.json").write_text(json.dumps(data, indent=2))
    else:
        (directory / "tfm_config.json").write_text(json.dumps({"proposal": proposal}, indent=2))
    return directory


def make_tiny_models(root: Path, proposal: str, dtype: str = "bfloat16") -> tuple[Path, Path]:
    """(target_dir, drafter_dir) under ``root``."""
    return write_target(root / "tiny-qwen35", dtype), write_drafter(root / "tiny-dflash", proposal, dtype)


def resolve_models(target: str | None, drafter: str | None, proposal: str | None, prefix: str) -> tuple[str, str, bool]:
    """(target, drafter, random) for an example's --target/--drafter: both given, or neither (then
    random tiny models are written to a fresh temporary directory and announced)."""
    import sys
    import tempfile

    if (target is None) != (drafter is None):
        sys.exit("give both --target and --drafter, or neither (random tiny models)")
    if target is not None:
        return target, drafter, False
    root = Path(tempfile.mkdtemp(prefix=prefix))
    t, d = make_tiny_models(root, proposal or "ddtree")
    print(f"serving RANDOM tiny models (dummy weights: the text is gibberish) from {root}")
    return str(t), str(d), True


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target, --drafter, --budget, --proposal: the model arguments every example takes."""
    p.add_argument("--target", help="target model dir or hub id (default: random tiny Qwen3.5 hybrid)")
    p.add_argument("--drafter", help="drafter directory (default: random tiny DFlash drafter)")
    p.add_argument("--budget", type=int, default=16, help="tree budget B = num_speculative_tokens")
    p.add_argument("--proposal", choices=["chain", "ddtree", "tfm"], help="override tfm_config.json's proposal")


def query_and_check_refusal(base_url: str, model: str, max_tokens: int) -> bool:
    """Two greedy OpenAI completions (printed), then a ``prompt_logprobs`` request that tfm must
    refuse with HTTP 400; True when it was refused."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=base_url, api_key="unused")
    for prompt in ("def fibonacci(n):", "The capital of France is"):
        t1 = time.time()
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        print(f"{prompt!r} -> {resp.choices[0].text!r} ({resp.usage.completion_tokens} tokens, {time.time() - t1:.2f} s)")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"prompt_logprobs": 1})
    except BadRequestError as e:
        print(f"refused as expected (HTTP {e.status_code}): {e.message}")
        return True
    print("UNEXPECTED: a prompt_logprobs request was accepted")
    return False
