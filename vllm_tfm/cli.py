"""``vllm-tfm`` command line.

    vllm-tfm demo [--prompt TEXT | --prompt-ids 1,2,3] [--max-new-tokens N] [--budget B]
                  [--block-size G] [--method tfm] [--temperature T] [--acceptance A] [--seed S]
                  [--zoo DIR] [--random-models] [--threads N]
    vllm-tfm eval [--zoo DIR | --random-models] [--methods chain,ddtree,treeflash,tfm]
                  [--budgets 16,32,64,128] [--temperatures 0,1] [--prompts N] [--max-new-tokens M]
                  [--prompt-len L] [--seed S] [--device cpu|cuda] [--out JSON] [--plots-dir DIR]
                  [--data-root DIR ...] [--threads N]

``demo`` runs the reference speculative decoder (``vllm_tfm.reference``) on the CPU with a
`transformers` target: the default method first (its text, tokens/s, mean accepted length and
acceptance by depth), then every method side by side, plus the target alone. It uses the trained
toy zoo when one is found (see ``vllm_tfm.reference.zoo``), else random tiny models, and says so.
``eval`` measures mean accepted length and acceptance by depth per (method, budget, temperature)
and the drafters' quality by depth (``vllm_tfm.reference.evaluate``) into a JSON file and a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-tfm", description="Trees from Marginals: tree speculative decoding for hybrid GDN models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="CPU demo of every speculative method with a transformers target")
    src = demo.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the zoo's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt as comma-separated token ids")
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.add_argument("--budget", type=int, default=16, help="draft nodes per tree B (default 16)")
    demo.add_argument("--block-size", type=int, default=None, help="DFlash block size gamma (default: the drafter's)")
    demo.add_argument("--method", default="tfm", help="method shown first (chain, ddtree, treeflash, tfm; default tfm)")
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    demo.add_argument("--acceptance", default="target_only", help="tree acceptance when sampling: target_only (default) or traversal")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random models and of sampling")
    demo.add_argument("--zoo", help="toy zoo directory (default: search $VLLM_TFM_ZOO, ./zoo next to the package)")
    demo.add_argument("--random-models", action="store_true", help="use random tiny models even if a zoo exists")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the models are tiny)")
    demo.set_defaults(func=_demo)
    _add_eval_parser(sub)
    _add_draft_vocab_parser(sub)
    train = sub.add_parser("train", add_help=False,
                           help="train the toy zoo (tokenizer, target, dflash, weaver, treeflash, all); "
                                "`vllm-tfm train --help` for its options")
    train.add_argument("train_args", nargs=argparse.REMAINDER)
    train.set_defaults(func=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllm-tfm`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser (vllm_tfm.train.cli), options passed through untouched
        from vllm_tfm.train.cli import train_main

        return train_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"vllm-tfm: error: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------- train


def _train(args: argparse.Namespace) -> int:
    from vllm_tfm.train.cli import train_main

    return train_main(args.train_args)


# ---------------------------------------------------------------------- demo


def _fmt_depths(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _demo(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from vllm_tfm.reference.decoder import SamplingConfig, SpeculativeDecoder
    from vllm_tfm.reference.drafters import METHODS, make_proposer
    from vllm_tfm.reference.zoo import (
        is_zoo,
        load_zoo,
        random_demo_models,
        zoo_search_paths,
    )

    if args.method not in METHODS:
        raise ValueError(f"unknown method {args.method!r}; choose one of {', '.join(METHODS)}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    # transformers warns once per kernel that the optional CUDA packages (causal_conv1d, fla) are
    # missing and it uses its torch reference; on a CPU that is expected, so keep the demo quiet.
    transformers.utils.logging.get_logger("transformers.integrations.hub_kernels").setLevel(40)

    print(f"vllm-tfm demo: reference decoder on the CPU (torch {torch.__version__}, transformers {transformers.__version__})")
    notes = []
    if args.random_models:
        models = random_demo_models(args.seed)
        notes.append("--random-models given: the zoo is not used.")
    elif args.zoo:
        models = load_zoo(args.zoo)
    else:
        found = next((p for p in zoo_search_paths() if is_zoo(p)), None)
        if found is not None:
            models = load_zoo(found)
        else:
            models = random_demo_models(args.seed)
            looked = ", ".join(str(p) for p in zoo_search_paths())
            notes.append(f"no trained toy zoo found (looked in: {looked}).")
    print(f"models: {models.description}")
    if models.source == "random":
        print("NOTE: using RANDOM, untrained models: the drafters accept almost nothing and the text is meaningless;")
        print("      the demo shows the mechanics and that every method reproduces the target's own output exactly.")
    for n in notes:
        print(f"NOTE: {n}")

    tok = models.tokenizer
    vocab = models.target.config.vocab_size
    if args.prompt is not None:
        if tok is None:
            raise ValueError("these models have no tokenizer, so --prompt text cannot be encoded; pass --prompt-ids instead")
        prompt = tok(args.prompt)["input_ids"]
    elif args.prompt_ids is not None:
        prompt = args.prompt_ids
    elif tok is not None:
        prompt = tok("def fibonacci(n):")["input_ids"]
    else:
        prompt = [(7 * i + 3) % vocab for i in range(6)]
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {bad[0]}")
    if tok is None:
        print("NOTE: no tokenizer: prompt and outputs are shown as token ids.")

    def show(ids: list[int]) -> str:
        return repr(tok.decode(ids)) if tok is not None else str(ids)

    greedy = args.temperature < 1e-5
    sampling = SamplingConfig(temperature=args.temperature)
    print(f"prompt: {show(prompt)}")
    print(f"settings: budget B = {args.budget}, max_new_tokens = {args.max_new_tokens}, "
          f"{'greedy' if greedy else f'sampling at temperature {args.temperature} (seed {args.seed}, {args.acceptance} acceptance)'}")

    target = models.target
    gc = getattr(target, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    with torch.no_grad():  # the target alone, greedy: the reference output and the timing baseline
        t0 = time.perf_counter()
        ar = target.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=0
        )[0, len(prompt):].tolist()
        ar_s = time.perf_counter() - t0
        if eos is not None:  # generate() pads after eos; keep up to the first eos
            stops = {eos} if isinstance(eos, int) else set(eos)
            cut = next((i + 1 for i, t in enumerate(ar) if t in stops), len(ar))
            ar = ar[:cut]

    order = [args.method] + [m for m in METHODS if m != args.method]
    rows = []
    for method in order:
        proposer = make_proposer(method, models.bundle, target, gamma=args.block_size)
        dec = SpeculativeDecoder(target, proposer, args.budget, acceptance=args.acceptance)
        gen = torch.Generator().manual_seed(args.seed)
        res = dec.generate(prompt, args.max_new_tokens, eos_token_id=eos, sampling=sampling, generator=gen)
        rows.append((method, res))
        if method == args.method:
            print(f"\n[{method}] output: {show(res.tokens)}")
            print(f"[{method}] {res.tokens_per_second:.1f} tokens/s, mean accepted length (MAL) {res.mean_accepted_length:.2f} "
                  f"tokens per target forward, {len(res.steps)} tree steps")
            print(f"[{method}] acceptance by depth d = 1..{res.max_depth} (fraction of steps reaching d): {_fmt_depths(res.acceptance_by_depth)}")
            stages = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in res.stage_seconds.items())
            print(f"[{method}] time per stage: {stages}")

    print("\nall methods (same prompt, same target):")
    print(f"{'method':<10} {'tokens/s':>9} {'MAL':>6} {'steps':>6}  {'same as target':<15} acceptance by depth d=1..")
    for method, res in rows:
        same = ("yes" if res.tokens == ar else "NO") if greedy else "n/a (sampled)"
        print(f"{method:<10} {res.tokens_per_second:>9.1f} {res.mean_accepted_length:>6.2f} {len(res.steps):>6}  {same:<15} "
              f"{_fmt_depths(res.acceptance_by_depth)}")
    print(f"{'target':<10} {len(ar) / ar_s:>9.1f} {1.0:>6.2f} {len(ar):>6}  {'(itself)':<15} transformers greedy generate(), no speculation")
    if greedy and any(res.tokens != ar for _, res in rows):
        print("WARNING: a method's greedy output differs from the target's own greedy output")
        return 1
    return 0


# ---------------------------------------------------------------------- eval


def _csv(kind):
    def parse(text: str):
        try:
            vals = [kind(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError("expected at least one value")
        return vals

    return parse


def _add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="acceptance (MAL, by depth) and drafter quality over held-out code prompts")
    src = ev.add_mutually_exclusive_group()
    src.add_argument("--zoo", help="toy zoo directory (default: search $VLLM_TFM_ZOO, ./zoo next to the package)")
    src.add_argument("--random-models", action="store_true", help="random tiny models and random token prompts")
    ev.add_argument("--methods", type=_csv(str), default=None, help="comma-separated (default chain,ddtree,treeflash,tfm)")
    ev.add_argument("--budgets", type=_csv(int), default=[16, 32, 64, 128], help="draft nodes per tree (default 16,32,64,128)")
    ev.add_argument("--temperatures", type=_csv(float), default=[0.0, 1.0], help="default 0,1 (0 = greedy)")
    ev.add_argument("--prompts", type=int, default=8, help="held-out prompts N (default 8)")
    ev.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt M (default 64)")
    ev.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    ev.add_argument("--block-size", type=int, default=None, help="DFlash block size gamma (default: the drafter's)")
    ev.add_argument("--width", type=int, default=None,
                    help="TfM Weaver nodes per scorer call (default: the drafter's tfm_config.json, else vllm_tfm.tree.default_weaver_width(B): 2 at B = 16, 4 at B = 32 and 64)")
    ev.add_argument("--seed", type=int, default=0, help="seed of prompt windows, sampling and random models")
    ev.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    ev.add_argument("--out", default="bench/results/acceptance.json", help="results JSON (default bench/results/acceptance.json)")
    ev.add_argument("--plots-dir", default="docs", help="where the MAL-vs-budget PNGs go (default docs)")
    ev.add_argument("--data-root", action="append", default=None,
                    help="corpus root(s) of the held-out files (repeatable; default: the zoo's recorded roots, else site-packages)")
    ev.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ev.add_argument("--per-step", action="store_true",
                    help="keep every step's accepted count and tree size in the JSON (default: histograms per cell)")
    ev.add_argument("--quality-anchors", type=int, default=32,
                    help="anchors per prompt for the drafter-quality analysis (default 32)")
    ev.add_argument("--deadline-minutes", type=float, default=None,
                    help="replay: run budget 64 first and skip the cells that would start after this many minutes")
    ev.add_argument("--drafter-fp8", action="store_true",
                    help="the DFlash drafter's linear layers rounded as vLLM's online FP8 runs them (per-tensor e4m3 "
                         "weights, per-token e4m3 activations; vllm_tfm.reference.fp8_sim): the acceptance of "
                         "'quantization': 'fp8' in the speculative config")
    ev.add_argument("--drafter-fp8-head", action="store_true",
                    help="the DFlash drafter's marginal logits through an FP8 copy of the target's lm_head (e4m3, "
                         "per-row scales; vllm_tfm.reference.fp8_sim.Fp8SimHead); the Weaver reads the lm_head as it is")
    ev.add_argument("--weaver-fp8", action="store_true",
                    help="the Weaver's linear weights rounded to e4m3 with per-tensor scales before its norms are "
                         "folded (vllm_tfm.reference.fp8_sim.simulate_fp8_linears; a coarser rounding than the "
                         "runtime's, kept for bench/NOTES.md section 64's result; see --weaver-weights)")
    ev.add_argument("--weaver-weights", choices=("model", "fp8"), default="model",
                    help="fp8: the Weaver rounded exactly as the tfm option weaver_weights 'fp8' rounds it (norms "
                         "folded into the projections, e4m3 with one scale per output row; "
                         "vllm_tfm.reference.fp8_sim.simulate_fp8_weaver_rows)")
    ev.add_argument("--draft-vocab", default=None, metavar="FILE",
                    help="the DFlash marginals over a draft vocabulary only (`vllm-tfm draft-vocab`; -inf at the other "
                         "tokens, vllm_tfm.models.draft_vocab): the acceptance of the tfm option draft_vocab")
    ev.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                    help="with --draft-vocab: its N most frequent tokens (default: all in the file)")
    ev.add_argument("--mode", choices=("replay", "decode"), default="replay",
                    help="replay (default): accepted paths read off the target's continuation, batched over prompts "
                         "(equal to the decoder's, tested); decode: run the speculative decoder with tree verify")
    ev.set_defaults(func=_eval)


def _add_draft_vocab_parser(sub: argparse._SubParsersAction) -> None:
    dv = sub.add_parser("draft-vocab", help="rank a tokenizer's vocabulary by frequency in a corpus: a draft-vocabulary "
                                            "file for the tfm option draft_vocab")
    dv.add_argument("--tokenizer", required=True, help="directory with tokenizer.json (the target's, or the zoo's)")
    dv.add_argument("--data-root", action="append", required=True,
                    help="corpus root (repeatable; 'site-packages' for this Python's)")
    dv.add_argument("--extensions", default=".py", help="comma list of file suffixes counted (default .py)")
    dv.add_argument("--split", choices=("train", "all"), default="train",
                    help="train (default): only the files the trainer's split keeps for training (not held out for "
                         "`vllm-tfm eval`); all: every file")
    dv.add_argument("--eval-modulus", type=int, default=20, help="the split's modulus (default 20, the trainer's)")
    dv.add_argument("--max-bytes", type=int, default=256_000_000, help="stop after this much text (default 256 MB)")
    dv.add_argument("--vocab-size", type=int, default=None,
                    help="the model's vocabulary (default: the tokenizer's; a model may pad it)")
    dv.add_argument("--out", required=True, help="the draft-vocabulary JSON to write")
    dv.set_defaults(func=_draft_vocab)


def _draft_vocab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vllm_tfm.models.draft_vocab import count_token_ids, write_draft_vocab
    from vllm_tfm.train.data import DataConfig, build_manifest, read_texts
    from vllm_tfm.train.tokenizer import data_tokenizer, load_tokenizer

    exts = tuple(e.strip() for e in args.extensions.split(",") if e.strip())
    if not exts:
        raise ValueError("--extensions must name at least one suffix")
    cfg = DataConfig(extensions=exts, eval_modulus=args.eval_modulus)
    manifest = build_manifest(args.data_root, cfg)
    files = manifest.train if args.split == "train" else manifest.train + manifest.eval
    full = load_tokenizer(args.tokenizer)
    tok = data_tokenizer(full)  # special-token strings in the text count as ordinary bytes, as in training
    vocab = args.vocab_size if args.vocab_size is not None else full.get_vocab_size()
    if vocab < full.get_vocab_size():
        raise ValueError(f"--vocab-size {vocab} is smaller than the tokenizer's {full.get_vocab_size()}")
    texts = read_texts(files, args.max_bytes)
    counts = count_token_ids((e.ids for e in tok.encode_batch(texts, add_special_tokens=False)), vocab)
    source = (f"{len(texts)} {args.split}-split files ({'/'.join(exts)}, eval_modulus {args.eval_modulus}) under "
              f"{', '.join(manifest.roots)}, at most {args.max_bytes} bytes")
    data = write_draft_vocab(args.out, counts, str(Path(args.tokenizer).resolve()), source)
    print(f"{args.out}: {vocab} token ids ranked over {data['tokens_counted']} tokens of {source}; "
          f"{int((counts > 0).sum())} occur")
    total = max(1, data["tokens_counted"])
    for n in (256, 1024, 2048, 4096, 16384, 32768, 65536):
        if n < vocab:
            print(f"  the first {n}: {sum(data['counts'][:n]) / total:.4f} of the tokens counted")
    return 0


def _eval_command(args: argparse.Namespace, methods: list[str]) -> str:
    """The command with every option explicit (defaults included): reruns this evaluation."""
    import shlex

    parts = ["vllm-tfm", "eval"]
    parts += ["--random-models"] if args.random_models else (["--zoo", args.zoo] if args.zoo else [])
    parts += ["--methods", ",".join(methods), "--budgets", ",".join(map(str, args.budgets)),
              "--temperatures", ",".join(f"{t:g}" for t in args.temperatures), "--prompts", str(args.prompts),
              "--max-new-tokens", str(args.max_new_tokens), "--prompt-len", str(args.prompt_len), "--seed", str(args.seed),
              "--device", args.device, "--out", args.out, "--plots-dir", args.plots_dir, "--threads", str(args.threads),
              "--mode", args.mode, "--quality-anchors", str(args.quality_anchors)]
    if args.deadline_minutes is not None:
        parts += ["--deadline-minutes", f"{args.deadline_minutes:g}"]
    if args.block_size is not None:
        parts += ["--block-size", str(args.block_size)]
    if args.width is not None:
        parts += ["--width", str(args.width)]
    for r in args.data_root or []:
        parts += ["--data-root", r]
    if args.drafter_fp8:
        parts.append("--drafter-fp8")
    if args.drafter_fp8_head:
        parts.append("--drafter-fp8-head")
    if args.weaver_fp8:
        parts.append("--weaver-fp8")
    if args.weaver_weights != "model":
        parts += ["--weaver-weights", args.weaver_weights]
    if args.draft_vocab is not None:
        parts += ["--draft-vocab", args.draft_vocab]
    if args.draft_vocab_size is not None:
        parts += ["--draft-vocab-size", str(args.draft_vocab_size)]
    return shlex.join(parts)


def _eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch
    import transformers

    from vllm_tfm.reference.drafters import METHODS
    from vllm_tfm.reference.evaluate import (
        EvalConfig,
        compact_cells,
        environment_info,
        evaluate,
        finite_or_none,
        held_out_prompts,
        markdown_tables,
        random_prompts,
        recorded_data_roots,
        write_plots,
    )
    from vllm_tfm.reference.zoo import (
        is_zoo,
        load_zoo,
        random_demo_models,
        zoo_search_paths,
    )

    methods = args.methods if args.methods is not None else list(METHODS)
    for name, v in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                    ("--prompt-len", args.prompt_len), ("--threads", args.threads)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    config = EvalConfig(tuple(methods), tuple(args.budgets), tuple(args.temperatures), args.max_new_tokens,
                        args.seed, args.block_size, mode=args.mode, quality_anchors=args.quality_anchors,
                        deadline_s=None if args.deadline_minutes is None else 60.0 * args.deadline_minutes,
                        width=args.width)
    config.validate()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.get_logger("transformers.integrations.hub_kernels").setLevel(40)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)

    notes = []
    zoo_dir = None
    if args.random_models:
        models = random_demo_models(args.seed)
        notes.append("--random-models given: the zoo is not used.")
    else:
        zoo_dir = Path(args.zoo) if args.zoo else next((p for p in zoo_search_paths() if is_zoo(p)), None)
        if zoo_dir is None:
            models = random_demo_models(args.seed)
            notes.append(f"no trained toy zoo found (looked in: {', '.join(str(p) for p in zoo_search_paths())}).")
        else:
            models = load_zoo(zoo_dir)
    random_models = models.source == "random"
    if args.drafter_fp8:
        from vllm_tfm.reference.fp8_sim import simulate_fp8_linears

        count = simulate_fp8_linears(models.bundle.dflash)
        notes.append(f"--drafter-fp8: the DFlash drafter's {count} linear layers run as vLLM's online FP8 "
                     "(vllm_tfm.reference.fp8_sim); the target, its lm_head and the Weaver as they are.")
    if args.draft_vocab_size is not None and args.draft_vocab is None:
        raise ValueError("--draft-vocab-size needs --draft-vocab")
    if args.drafter_fp8_head and args.draft_vocab is None:
        from vllm_tfm.reference.fp8_sim import Fp8SimHead

        models.bundle.dflash.logits_head = Fp8SimHead(models.target.get_output_embeddings())
        notes.append("--drafter-fp8-head: the DFlash marginals through an FP8 copy of the target's lm_head "
                     "(vllm_tfm.reference.fp8_sim.Fp8SimHead); the target and the Weaver read the lm_head as it is.")
    if args.draft_vocab is not None:
        from vllm_tfm.models.draft_vocab import DraftVocabHead, load_draft_vocab
        from vllm_tfm.reference.fp8_sim import Fp8SimHead

        lm_head = models.target.get_output_embeddings()
        ids = load_draft_vocab(args.draft_vocab, args.draft_vocab_size, int(lm_head.weight.shape[0]))
        models.bundle.dflash.logits_head = DraftVocabHead(lm_head, ids, Fp8SimHead if args.drafter_fp8_head else None)
        notes.append(f"--draft-vocab: the DFlash marginals over the {ids.numel()} tokens of {args.draft_vocab} only "
                     f"(-inf at the other {int(lm_head.weight.shape[0]) - ids.numel()}; vllm_tfm.models.draft_vocab)"
                     + (", through an FP8 copy of their lm_head rows (--drafter-fp8-head)" if args.drafter_fp8_head else "")
                     + "; the target and the Weaver read the lm_head as it is.")
    if args.weaver_fp8 and args.weaver_weights != "model":
        raise SystemExit("vllm-tfm eval: --weaver-fp8 and --weaver-weights fp8 are two roundings of the Weaver; pick one")
    if args.weaver_weights == "fp8":
        if models.bundle.weaver is None:
            raise SystemExit("vllm-tfm eval: --weaver-weights fp8 needs a drafter with a Weaver")
        from vllm_tfm.reference.fp8_sim import simulate_fp8_weaver_rows

        count = simulate_fp8_weaver_rows(models.bundle.weaver)
        notes.append(f"--weaver-weights fp8: the Weaver's {count} projections rounded as the tfm option weaver_weights "
                     "'fp8' rounds them (norms folded in, e4m3 with one scale per output row; "
                     "vllm_tfm.reference.fp8_sim.simulate_fp8_weaver_rows); activations, the lm_head and the embedding "
                     "rows as they are (weight-only FP8).")
    if args.weaver_fp8:
        if models.bundle.weaver is None:
            raise SystemExit("vllm-tfm eval: --weaver-fp8 needs a drafter with a Weaver")
        from vllm_tfm.reference.fp8_sim import simulate_fp8_linears

        count = simulate_fp8_linears(models.bundle.weaver)
        notes.append(f"--weaver-fp8: the Weaver's {count} linear weights rounded to e4m3 with per-tensor scales "
                     "(vllm_tfm.reference.fp8_sim); the batched scorer folds its norms into them and keeps its "
                     "activations, the lm_head and the embedding rows as they are (weight-only FP8).")
    print(f"vllm-tfm eval: reference decoder on {device} (torch {torch.__version__}, transformers {transformers.__version__})")
    print(f"models: {models.description}")
    if random_models:
        notes.insert(0, "RANDOM, untrained models and random token-id prompts: the numbers show the mechanics only.")
    for n in notes:
        print(f"NOTE: {n}")

    gamma = args.block_size or models.bundle.dflash.config.block_size
    window_len = args.prompt_len + args.max_new_tokens + gamma - 1
    if random_models:
        prompts = random_prompts(models.target.config.vocab_size, args.prompts, args.prompt_len, window_len, args.seed)
    else:
        tok_dir = next((d for d in (zoo_dir / "tokenizer", zoo_dir / "target") if (d / "tokenizer.json").is_file()), None)
        if tok_dir is None:
            raise ValueError(f"{zoo_dir}: no tokenizer.json in tokenizer/ or target/, so held-out files cannot be tokenized")
        recorded, modulus = recorded_data_roots(zoo_dir)
        roots = args.data_root or recorded or ["site-packages"]
        prompts = held_out_prompts(roots, tok_dir, args.prompts, args.prompt_len, window_len, args.seed, modulus)
        print(f"prompts: {args.prompts} windows of held-out files under {', '.join(prompts.info['data_roots'])}")

    models.target.to(device)
    for m in (models.bundle.dflash, models.bundle.weaver, models.bundle.treeflash):
        if m is not None:
            m.to(device)
    results = evaluate(models.target, models.bundle, prompts, config, progress=lambda s: print(f"  {s}", flush=True))
    command = _eval_command(args, methods)
    results = {
        "models": "random" if random_models else "zoo",
        "models_description": models.description,
        "model_dirs": "random" if random_models else {
            "zoo": str(zoo_dir.resolve()), "target": str((zoo_dir / "target").resolve()),
            "drafter": str((zoo_dir / "drafter").resolve()),
        },
        "notes": notes,
        "command": command,
        "machine": environment_info(device),
        **results,
    }
    if not args.per_step:
        results = compact_cells(results)
    plots = write_plots(results, args.plots_dir)
    results["plots"] = plots
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite_or_none(results), indent=1) + "\n")
    print()
    print(markdown_tables(results))
    print()
    print(f"results: {out}")
    print(f"plots: {', '.join(plots)}" if isinstance(plots, list) else f"NOTE: {plots}")
    if random_models:
        print("NOTE: these results come from RANDOM models (\"models\": \"random\" in the JSON).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
