"""`specair train {eagle,eagle3,medusa,draft}`: distil the target on the shipped prompt set (cached, resumable),
train a draft head or draft model on it, and write it where `--speculative-config` can load it.
`specair train prompts` and `specair train distill` make (and ship) the data alone."""

from __future__ import annotations

import argparse
from pathlib import Path

from specair.models.errors import InputError
from specair.training.trainer import TrainConfig

RECIPES = ("eagle", "eagle3", "medusa", "draft")
# Per-recipe defaults: batch sizes are sequences for eagle/draft and single positions for medusa.
DEFAULTS = {
    "eagle": {"epochs": 6.0, "lr": 1e-3, "batch_size": 8, "eval_every": 100, "save_every": 50},
    "eagle3": {"epochs": 2.0, "lr": 1e-3, "batch_size": 8, "eval_every": 500, "save_every": 100, "magpie": 20000},
    "medusa": {"epochs": 3.0, "lr": 5e-3, "batch_size": 512, "eval_every": 200, "save_every": 100},
    "draft": {"epochs": 1.0, "lr": 1e-4, "batch_size": 4, "eval_every": 100, "save_every": 50},
}


def _common(p: argparse.ArgumentParser, recipe: str) -> None:
    d = DEFAULTS[recipe]
    p.add_argument("--target", help="target checkpoint: HF dir, GGUF or llama2.c .bin (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (the loader's layout plus training.json)")
    p.add_argument("--epochs", type=float, default=d["epochs"], help="passes over the training split")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help="sequences per step" if recipe != "medusa" else "token positions per step")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="held-out eval every N steps")
    p.add_argument("--save-every", type=int, default=d["save_every"], help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/checkpoint")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep OUT/checkpoint after training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: the training forward under autocast (fp32 weights and optimizer); about twice as "
                        "fast on CPUs with AVX-512 BF16 or AMX")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    _data_args(p, d.get("magpie", 0))


def _data_args(p: argparse.ArgumentParser, magpie: int) -> None:
    g = p.add_argument_group("distillation (cached under $SPECAIR_CACHE/train/<target fingerprint>)")
    g.add_argument("--prompts", help="prompt set JSONL (default: the shipped specair/training/prompts.jsonl)")
    g.add_argument("--max-prompts", type=int, help="use the first N prompts of the set (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="longest distilled answer")
    g.add_argument("--cache-dir", help="distillation cache directory")
    g.add_argument("--gen-batch", type=int, default=32, help="sequences the engine decodes at once while distilling")
    g.add_argument("--magpie", type=int, default=magpie,
                   help="add N self-generated prompts (Magpie: the target writes user turns; `specair train "
                        "prompts`, cached) to the prompt set")
    g.add_argument("--magpie-seed", type=int, default=0, help="seed of the self-generated prompt set")
    g.add_argument("--eval-sequences", type=int, default=512,
                   help="held-out sequences the evaluations read (the first N; 0 = all)")


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `train {eagle,medusa,draft}` on the `specair` command's subparsers."""
    from specair.training import draft, eagle, eagle3, medusa

    train = subparsers.add_parser("train", help="train an EAGLE head, Medusa heads or a draft model for a target")
    recipes = train.add_subparsers(dest="recipe", required=True,
                                   metavar="{eagle,eagle3,medusa,draft,prompts,distill}")
    helps = {"eagle": "EAGLE-1/2 head (fc + one decoder layer) with training-time test",
             "eagle3": "EAGLE-3 head (three target layers fused, own decoder layer and draft-vocabulary LM head), "
                       "training-time test, self-generated prompts",
             "medusa": "Medusa-1 heads (ResBlocks, tied to the target's LM head)",
             "draft": "a draft model: the target's first N layers fine-tuned by KL to the target"}
    for name, module in (("eagle", eagle), ("eagle3", eagle3), ("medusa", medusa), ("draft", draft)):
        p = recipes.add_parser(name, help=helps[name], description=helps[name])
        _common(p, name)
        module.add_arguments(p)
        p.set_defaults(func=cmd_train, recipe=name)
    _prompts_parser(recipes)
    h = "the distilled set alone: the target's greedy answers and features, cached (and, with --ship, the answers "\
        "copied into the package, where training starts from them)"
    p = recipes.add_parser("distill", help=h, description=h)
    p.add_argument("--target", help="target checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--ship", action="store_true",
                   help="then copy the answers into the package (specair/training/distilled/)")
    _data_args(p, DEFAULTS["eagle3"]["magpie"])
    p.set_defaults(func=cmd_distill)


def _prompts_parser(recipes: argparse._SubParsersAction) -> None:
    from specair.training import magpie

    d = magpie.MagpieSettings()
    h = "self-generated user prompts (Magpie): the target writes user turns from its chat template"
    p = recipes.add_parser("prompts", help=h, description=h)
    p.add_argument("--target", help="target checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--count", type=int, default=d.count, help="prompts to keep")
    p.add_argument("--seed", type=int, default=d.seed, help="fixes the set: topics, task kinds and samples")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="longest user turn (longer ones are dropped)")
    p.add_argument("--out", help="directory of the set (default: $SPECAIR_CACHE/train/<target>/magpie-s<seed>)")
    p.add_argument("--gen-batch", type=int, default=magpie.GEN_BATCH, help="sequences the engine decodes at once")
    p.add_argument("--engine", choices=magpie.ENGINES, default=d.engine,
                   help="backend-dtype that samples the turns (part of the set's settings)")
    p.add_argument("--threads", type=int, help="CPU threads")
    p.add_argument("--ship", action="store_true",
                   help="then copy the set into the package (specair/training/magpie/), where training starts from it")
    p.set_defaults(func=cmd_prompts)


def cmd_prompts(args: argparse.Namespace) -> None:
    """Generate (or resume) a Magpie prompt set and print where it is and how fast it was made."""
    import json

    from specair.models.checkpoint import load_checkpoint
    from specair.training import magpie

    if args.count <= 0 or args.gen_batch <= 0 or args.max_tokens <= 0:
        raise InputError("--count, --gen-batch and --max-tokens must be positive")
    settings = magpie.MagpieSettings(count=args.count, seed=args.seed, temperature=args.temperature,
                                     top_p=args.top_p, max_tokens=args.max_tokens, engine=args.engine)
    fingerprint = load_checkpoint(args.target).fingerprint
    out = Path(args.out) if args.out else magpie.default_dir(fingerprint, args.seed)
    llm = magpie.open_llm(args.target, settings, args.gen_batch, args.threads)
    records = magpie.generate_prompts(llm, out, settings, fingerprint, batch=8 * args.gen_batch)
    rep = magpie.report(out)
    print(f"prompts: {len(records)} in {out / 'prompts.jsonl'} | " + json.dumps(
        {k: rep[k] for k in ("tried", "kept", "rejected", "prompts_per_s", "generated_tokens_per_s")}), flush=True)
    if args.ship:
        print(f"shipped: {magpie.ship(out, args.seed)}", flush=True)


def _data_options(args: argparse.Namespace) -> "DataOptions":  # noqa: F821 (imported lazily)
    from specair.training.setup import DataOptions

    if args.max_new_tokens <= 0 or args.gen_batch <= 0 or args.magpie < 0 or args.eval_sequences < 0:
        raise InputError("--max-new-tokens and --gen-batch must be positive, --magpie and --eval-sequences not "
                         "negative")
    return DataOptions(target=args.target, cache_dir=args.cache_dir, prompts=args.prompts,
                       max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
                       magpie=args.magpie, magpie_seed=args.magpie_seed, eval_sequences=args.eval_sequences)


def cmd_distill(args: argparse.Namespace) -> None:
    """Build (or resume) the distilled set and print its size and cost; with --ship, ship its answers."""
    import json

    from specair.training.distill import ship_answers
    from specair.training.setup import prepare

    setup = prepare(_data_options(args), threads=args.threads)
    data = setup.data
    print(f"distilled: {len(data.sequences)} sequences in {data.cache_dir} | " + json.dumps(
        {**data.summary(), "shipped_answers_taken": data.meta["shipped_answers_taken"],
         "progress": data.meta["progress"]}), flush=True)
    if args.ship:
        print(f"shipped: {ship_answers(data.cache_dir)}", flush=True)


def cmd_train(args: argparse.Namespace) -> None:
    """Run one recipe from parsed arguments."""
    from specair.training import draft, eagle, eagle3, medusa
    from specair.training.setup import prepare
    from specair.training.trainer import format_eval

    for name in ("epochs", "lr", "batch_size", "eval_every", "save_every"):
        if getattr(args, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a directory")
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                      batch_size=args.batch_size, grad_clip=args.grad_clip, eval_every=args.eval_every,
                      save_every=args.save_every, max_steps=args.max_steps, seed=args.seed,
                      precision=args.precision)
    module = {"eagle": eagle, "eagle3": eagle3, "medusa": medusa, "draft": draft}[args.recipe]
    settings = module.settings_from_args(args)  # validate recipe options before the (long) distillation
    setup = prepare(_data_options(args), threads=args.threads)
    recipe = {"eagle": eagle.EagleRecipe, "eagle3": eagle3.Eagle3Recipe, "medusa": medusa.MedusaRecipe,
              "draft": draft.DraftRecipe}[args.recipe]
    final = recipe(setup, settings).fit(cfg, out, resume=args.resume, keep_checkpoint=args.keep_checkpoint)
    print(f"{args.recipe}: wrote {out} | held-out: {format_eval(final)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m specair.training.cli train eagle ...` (the same as `specair train ...`)."""
    parser = argparse.ArgumentParser(prog="specair")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
