"""`ling-train` (and `python scripts/train.py`): train a Ling model on a UTF-8 text file, then export it as a
block-FP8 HF checkpoint.

    ling-train --corpus austen.txt --out runs/demo                # ling-demo, new tokenizer
    ling-train --corpus austen.txt --out runs/demo --resume       # continue from the last checkpoint
    ling-train --corpus notes.txt --config my/config.json --tokenizer runs/demo/tokenizer --out runs/x

Without --tokenizer a byte-level BPE is trained on the corpus (OUT/tokenizer). The file is tokenised line by
line, ended with EOS and cut into a training stream and a held-out tail (--eval-fraction). Each epoch reads
the training stream as windows of --seq-len tokens, shifted by a random offset and shuffled (seeded, so a
resumed run sees the same batches). OUT receives Orbax checkpoints (checkpoints/, every --save-every steps),
log.json, loss_curve.png and, at the end, the HF export (hf/: config.json, safetensors shards, tokenizer.json,
tokenizer_config.json), which is loaded back with `load_hf_checkpoint` to report its held-out loss and print
a sample. docs/demo_model.md has the corpus commands and the recommended GPU run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

from convert.hf_writer import TensorEntry, write_sharded
from convert.synthetic import config_dict, write_quantized_copy
from ling_jax import LingConfig, LingForCausalLM, load_hf_checkpoint
from ling_jax.checkpoints.names import source_for
from ling_jax.generation import cli_checks, cli_runtime, flags
from ling_jax.generation.generator import Generator
from ling_jax.generation.sampling import SamplingParams
from ling_jax.presets import PRESETS
from ling_jax.training.train import (
    EXPERT_BIAS,
    TRAINABLE,
    Batch,
    TrainConfig,
    TrainState,
    init_train_state,
    jit_eval_step,
    jit_train_step,
    merge_model,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DEMO_MTP_LOSS_SCALE = 0.1  # the weight of the MTP draft loss the demo model (docs/demo_model.md) trained with
MIN_VOCAB = 258  # a trained byte-level BPE: the 256 byte tokens, PAD_TOKEN and EOS_TOKEN
EXPORT_DIR = "hf"  # OUT's HF export
EXPORT_INDEX = "model.safetensors.index.json"
EXIT_USAGE = 2
NUMBER_FLAGS = (  # flag, type, default, metavar, meaning: the help says the default
    ("--steps", int, 1000, "N", "training steps"),
    ("--batch-size", int, 32, "N", "sequences per step"),
    ("--seq-len", int, 512, "N", "tokens per sequence"),
    ("--lr", float, 3e-3, "LR", "peak learning rate"),
    ("--warmup", int, 100, "N", "linear warmup steps"),
    ("--weight-decay", float, 0.1, "W", "AdamW weight decay"),
    ("--grad-clip", float, 1.0, "NORM", "global gradient norm limit"),
    (
        "--expert-bias-rate",
        float,
        1e-2,
        "R",
        "router balancing step per training step (DeepSeek-V3 uses 1e-3 over far longer runs; short runs need "
        "faster balancing)",
    ),
    ("--seed", int, 0, "S", "initialisation and data order"),
    ("--eval-fraction", float, 0.02, "F", "held-out tail of the corpus"),
    ("--eval-every", int, 100, "N", "held-out evaluation interval in steps"),
    ("--eval-batches", int, 8, "N", "held-out batches per evaluation, at most"),
    ("--log-every", int, 10, "N", "log interval in steps"),
    ("--save-every", int, 200, "N", "checkpoint interval in steps"),
    ("--keep-checkpoints", int, 2, "N", "checkpoints kept, the latest"),
    ("--shards", int, 1, "N", "safetensors shards of the export"),
    ("--sample-tokens", int, 80, "N", "tokens sampled from the export, 0 = none"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(
        prog="ling-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", required=True, metavar="FILE", help="UTF-8 text file")
    parser.add_argument("--out", required=True, metavar="DIR", help="run directory (checkpoints, logs, export)")
    parser.add_argument(
        "--config", default="ling-demo", metavar="NAME|PATH", help="a preset name or a config.json (default ling-demo)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory with tokenizer.json + tokenizer_config.json (default: train one)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help=f"BPE vocab when training a tokenizer, {MIN_VOCAB} to the config's (default: the config's)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    for flag, kind, default, metavar, meaning in NUMBER_FLAGS:
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=f"{meaning} (default {default})")
    parser.add_argument(
        "--mtp-loss-scale",
        type=float,
        metavar="S",
        help=f"weight of the MTP draft loss (default: {DEMO_MTP_LOSS_SCALE}, the demo's, when the config has an "
        "MTP layer, else 0 = off)",
    )
    parser.add_argument("--remat", action="store_true", help="recompute activations in the backward pass")
    parser.add_argument(
        "--prompt", default="It is a truth universally acknowledged", help="sample prompt (default: %(default)r)"
    )
    flags.add_compile_cache_flag(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each bound checked (argparse's usage error, status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    counts = ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "save_every")
    counts += ("keep_checkpoints", "shards")
    rates = ("warmup", "weight_decay", "expert_bias_rate", "sample_tokens")
    bounds = [(f"--{name.replace('_', '-')}", getattr(args, name), 1) for name in counts]
    bounds += [(f"--{name.replace('_', '-')}", getattr(args, name), 0) for name in rates]
    if args.mtp_loss_scale is not None:
        bounds.append(("--mtp-loss-scale", args.mtp_loss_scale, 0))
    try:
        flags.check_at_least(bounds)
    except ValueError as e:
        parser.error(str(e))
    for flag, value in (("--lr", args.lr), ("--grad-clip", args.grad_clip)):
        if not value > 0:  # NaN too
            parser.error(f"{flag} must be > 0, got {value}")
    if not 0 < args.eval_fraction < 1:
        parser.error("--eval-fraction must be in (0, 1)")
    return args


# ---------------------------------------------------------------- tokenizer and data
def train_tokenizer(lines: list[str], vocab_size: int, directory: str, max_length: int) -> None:
    """A byte-level BPE with PAD_TOKEN (id 0) and EOS_TOKEN (id 1), saved as tokenizer_config.json, then
    tokenizer.json renamed into place: a run finds tokenizer.json (and reuses the pair) only once both are whole."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    os.makedirs(directory, exist_ok=True)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    write_json(os.path.join(directory, "tokenizer_config.json"), settings)
    partial = os.path.join(directory, "tokenizer.json.partial")
    tokenizer.save(partial)
    os.replace(partial, os.path.join(directory, "tokenizer.json"))


def load_tokenizer(directory: str) -> tuple[Tokenizer, int, int | None]:
    """-> (tokenizer, EOS id, PAD id or None) from tokenizer.json and tokenizer_config.json."""
    tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        settings = json.load(f)

    def special_id(key: str) -> int | None:
        token = settings.get(key)
        if isinstance(token, dict):
            token = token["content"]
        if token is None:
            return None
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise SystemExit(f"error: {directory}: {key} {token!r} is not in tokenizer.json")
        return token_id

    eos = special_id("eos_token")
    if eos is None:
        raise SystemExit(f"error: {directory}/tokenizer_config.json names no eos_token")
    return tokenizer, eos, special_id("pad_token")


def tokenize(lines: list[str], tokenizer: Tokenizer, eos_id: int) -> np.ndarray:
    """The file as one document: every line's ids, then EOS."""
    ids = [encoding.ids for encoding in tokenizer.encode_batch(lines, add_special_tokens=False)]
    return np.array([token for line in ids for token in line] + [eos_id], np.int32)


def training_starts(step: int, batch_size: int, num_tokens: int, seq_len: int, seed: int) -> np.ndarray:
    """Window starts of the batch at `step`: each epoch shifts the window grid by a random offset and
    shuffles it, both drawn from (seed, epoch), so a batch depends only on its step."""
    per_epoch = (num_tokens - seq_len) // seq_len  # one window's room is left for the shift
    positions = step * batch_size + np.arange(batch_size)
    starts = np.empty(batch_size, np.int64)
    for epoch in np.unique(positions // per_epoch):
        rng = np.random.default_rng([seed, int(epoch)])
        shift, order = rng.integers(seq_len), rng.permutation(per_epoch)
        rows = positions // per_epoch == epoch
        starts[rows] = shift + order[positions[rows] % per_epoch] * seq_len
    return starts


def make_batch(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    tokens = np.stack([stream[start : start + seq_len] for start in starts])
    return Batch(tokens=jnp.asarray(tokens), mask=jnp.ones(tokens.shape, bool))


def evaluate(graphdef, state: TrainState, batches: list[Batch], config: TrainConfig) -> dict[str, float]:
    """Token-weighted mean of each loss over the held-out batches."""
    results = [jax.device_get(jit_eval_step(graphdef, state, batch, config)) for batch in batches]
    tokens = sum(float(r["tokens"]) for r in results)
    return {
        key: sum(float(r[key]) * float(r["tokens"]) for r in results) / tokens for key in results[0] if key != "tokens"
    }


# ---------------------------------------------------------------- logging
def write_json(path: str, value) -> None:
    """Atomic: a reader never sees a half-written file."""
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(partial, path)


def plot_losses(log: list[dict], path: str) -> None:
    train = [entry for entry in log if "loss" in entry]
    held_out = [entry for entry in log if "eval_lm_loss" in entry]
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot([e["step"] for e in train], [e["lm_loss"] for e in train], label="train next-token loss", lw=1)
    if train and "mtp_loss" in train[0]:
        axes.plot([e["step"] for e in train], [e["mtp_loss"] for e in train], label="train MTP loss", lw=1)
    axes.plot(
        [e["step"] for e in held_out], [e["eval_lm_loss"] for e in held_out], "o-", label="held-out next-token loss"
    )
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats / token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path + ".partial", dpi=120, format="png")
    os.replace(path + ".partial", path)
    plt.close(figure)


# ---------------------------------------------------------------- export
def export_hf_checkpoint(model: LingForCausalLM, directory: str, tokenizer_dir: str, num_shards: int) -> None:
    """The model in the original HF layout, block-FP8 like the published checkpoints (spec §6.2): written
    unquantised to a temporary directory, then quantised by `convert.synthetic.write_quantized_copy`."""
    config = model.config
    params = [(path, variable.get_value()) for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    entries = []
    for path, value in params:
        source = source_for(path, value.shape, config)
        entries += [TensorEntry(name, np.dtype(np.float32), tuple(source.shape)) for name in source.names]

    def arrays():
        for path, value in params:
            host = np.asarray(value, np.float32)
            source = source_for(path, host.shape, config)
            for index, name in enumerate(source.names):
                yield name, (host[index] if source.stacked else host).reshape(source.shape)

    with tempfile.TemporaryDirectory() as unquantised:
        write_sharded(unquantised, config_dict(config), entries, arrays(), num_shards=1)
        write_quantized_copy(unquantised, directory, num_shards=num_shards)
    for file in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, file), os.path.join(directory, file))


# ---------------------------------------------------------------- main
def load_config(name_or_path: str) -> LingConfig:
    return PRESETS[name_or_path] if name_or_path in PRESETS else LingConfig.from_pretrained(name_or_path)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What a run reads, checked before anything is written, tokenised or compiled (`check_inputs`)."""

    config: LingConfig
    lines: list[str]  # the corpus, line by line, line ends kept
    tokenizer_dir: str
    train_tokenizer: bool  # no --tokenizer and none in OUT yet: one is trained on the corpus
    mtp_loss_scale: float


def check_inputs(args: argparse.Namespace) -> Inputs:
    """Every file and flag a run needs, checked before OUT is touched: a refusal is a ValueError naming the flag
    or file, printed as one `error: ...` line (exit status 2)."""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out}: exists and is not a directory")
    checkpoint_dir = os.path.join(args.out, "checkpoints")
    if os.path.isdir(checkpoint_dir) and os.listdir(checkpoint_dir) and not args.resume:
        raise ValueError(
            f"--out {args.out}: {checkpoint_dir} already holds checkpoints: pass --resume, or choose another --out"
        )
    export_dir = os.path.join(args.out, EXPORT_DIR)
    if os.path.exists(export_dir) and not is_export(export_dir):
        raise ValueError(
            f"--out {args.out}: {export_dir} is not a ling-train export (no config.json and {EXPORT_INDEX}), and the "
            "export would replace it: move it away or choose another --out"
        )
    if args.config not in PRESETS and not os.path.exists(args.config):
        raise ValueError(
            f"--config {args.config}: not a preset ({', '.join(sorted(PRESETS))}) nor a config.json or checkpoint "
            "directory"
        )
    try:
        config = load_config(args.config)
    except (OSError, ValueError) as e:
        raise ValueError(f"--config: {e}") from e
    mtp_loss_scale = args.mtp_loss_scale
    if mtp_loss_scale is None:
        mtp_loss_scale = DEMO_MTP_LOSS_SCALE if config.num_nextn_predict_layers else 0.0
    if mtp_loss_scale and not config.num_nextn_predict_layers:
        raise ValueError(
            f"--mtp-loss-scale {mtp_loss_scale}: {args.config} has no MTP layer (num_nextn_predict_layers = 0)"
        )
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the config's max_position_embeddings {config.max_position_embeddings}"
        )
    tokenizer_dir = args.tokenizer or os.path.join(args.out, "tokenizer")
    if args.tokenizer is not None:
        missing = [name for name in TOKENIZER_FILES if not os.path.isfile(os.path.join(tokenizer_dir, name))]
        if missing:
            raise ValueError(
                f"--tokenizer {tokenizer_dir}: {' and '.join(missing)} missing (expected a directory holding "
                f"{' and '.join(TOKENIZER_FILES)})"
            )
    trains_tokenizer = args.tokenizer is None and not os.path.isfile(os.path.join(tokenizer_dir, TOKENIZER_FILES[0]))
    vocab_size = args.vocab_size or config.vocab_size
    if trains_tokenizer and not MIN_VOCAB <= vocab_size <= config.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size}: a trained byte-level BPE needs {MIN_VOCAB} tokens at least (256 bytes, "
            f"{PAD_TOKEN} and {EOS_TOKEN}) and {args.config}'s vocab_size ({config.vocab_size}) at most"
        )
    try:
        text = cli_checks.read_text_file(args.corpus, f"--corpus {args.corpus}")
    except OSError as e:
        raise ValueError(f"--corpus {args.corpus}: {e.strerror or e}") from e
    if not text.strip():
        raise ValueError(f"--corpus {args.corpus}: empty (no text to train on)")
    return Inputs(config, text.splitlines(keepends=True), tokenizer_dir, trains_tokenizer, mtp_loss_scale)


def is_export(directory: str) -> bool:
    """Whether `directory` looks like what `export_hf_checkpoint` writes (the only directory it replaces)."""
    return all(os.path.isfile(os.path.join(directory, name)) for name in ("config.json", EXPORT_INDEX))


def publish_export(model: LingForCausalLM, export_dir: str, tokenizer_dir: str, num_shards: int) -> None:
    """The export, written beside `export_dir` and renamed into place once whole: an interrupted export leaves the
    previous one (or none) at `export_dir`, never a part of one."""
    partial = tempfile.mkdtemp(prefix=f".{EXPORT_DIR}.partial-", dir=os.path.dirname(export_dir))
    try:
        export_hf_checkpoint(model, partial, tokenizer_dir, num_shards)
    except BaseException:
        shutil.rmtree(partial)
        raise
    if os.path.isdir(export_dir):  # an earlier export (`check_inputs` refused anything else)
        previous = f"{partial}.previous"
        os.rename(export_dir, previous)
        os.rename(partial, export_dir)
        shutil.rmtree(previous)
    else:
        os.rename(partial, export_dir)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        inputs = check_inputs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    cli_runtime.enable_compile_cache(args.no_compile_cache)
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    checkpoint_dir = os.path.join(os.path.abspath(args.out), "checkpoints")
    config, lines, tokenizer_dir = inputs.config, inputs.lines, inputs.tokenizer_dir
    if inputs.train_tokenizer:
        print(f"training a {args.vocab_size or config.vocab_size}-token byte-level BPE on {args.corpus}")
        train_tokenizer(lines, args.vocab_size or config.vocab_size, tokenizer_dir, config.max_position_embeddings)
    tokenizer, eos_id, pad_id = load_tokenizer(tokenizer_dir)
    if tokenizer.get_vocab_size() > config.vocab_size:
        sys.exit(
            f"error: the tokenizer has {tokenizer.get_vocab_size()} tokens, the model's vocab_size is "
            f"{config.vocab_size}"
        )
    config = config.replace(eos_token_ids=(eos_id,), pad_token_id=config.pad_token_id if pad_id is None else pad_id)

    stream = tokenize(lines, tokenizer, eos_id)
    split = int(len(stream) * (1 - args.eval_fraction))
    train_stream, held_out = stream[:split], stream[split:]
    if len(train_stream) < 2 * args.seq_len or len(held_out) < args.seq_len:
        sys.exit(
            f"error: {len(stream)} tokens are too few for --seq-len {args.seq_len} with --eval-fraction "
            f"{args.eval_fraction}: the training part needs 2 windows and the held-out part one"
        )
    eval_starts = np.arange(0, len(held_out) - args.seq_len + 1, args.seq_len)
    eval_rows = min(args.batch_size, len(eval_starts))  # equal batches: one compiled eval step
    eval_batches = [
        make_batch(held_out, eval_starts[i : i + eval_rows], args.seq_len)
        for i in range(0, len(eval_starts) - eval_rows + 1, eval_rows)
    ][: args.eval_batches]
    print(
        f"{len(stream):,} tokens ({len(train_stream):,} train, {len(held_out):,} held out), vocab "
        f"{tokenizer.get_vocab_size()}; {args.batch_size * args.seq_len:,} tokens per step, "
        f"{args.steps * args.batch_size * args.seq_len / len(train_stream):.2f} epochs"
    )

    train_config = TrainConfig(
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        total_steps=args.steps,
        weight_decay=args.weight_decay,
        grad_clip_norm=args.grad_clip,
        expert_bias_rate=args.expert_bias_rate,
        remat=args.remat,
        mtp_loss_scale=inputs.mtp_loss_scale,
    )
    model = LingForCausalLM(config, rngs=nnx.Rngs(args.seed), dtype=jnp.float32)
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"model: {parameters / 1e6:.1f}M parameters, {config.num_hidden_layers} layers "
        f"({config.layer_types.count('kda')} KDA, {config.layer_types.count('mla')} MLA), "
        f"{config.num_experts} experts, MTP loss x {train_config.mtp_loss_scale}; {jax.devices()[0].platform}"
    )
    graphdef, state = init_train_state(model, train_config)
    del model

    log_path = os.path.join(args.out, "log.json")
    log: list[dict] = []
    options = ocp.CheckpointManagerOptions(
        max_to_keep=args.keep_checkpoints, create=True, enable_async_checkpointing=False
    )
    with ocp.CheckpointManager(checkpoint_dir, options=options) as manager:
        if args.resume and manager.latest_step() is not None:
            state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
            if os.path.isfile(log_path):
                with open(log_path) as f:
                    log = [entry for entry in json.load(f) if entry["step"] <= manager.latest_step()]
            print(f"resumed from step {manager.latest_step()}")
        first_step = int(state.step)

        pending: list[tuple[int, dict]] = []  # metrics still on the device: fetching them every step would sync

        def flush() -> None:
            for logged_step, values in jax.device_get(pending):
                log.append({"step": logged_step, **{k: float(v) for k, v in values.items() if k != "tokens"}})
                if not (np.isfinite(log[-1]["loss"]) and np.isfinite(log[-1]["grad_norm"])):
                    write_json(log_path, log)
                    progress.close()
                    last = manager.latest_step()
                    sys.exit(
                        f"error: step {logged_step}: loss {log[-1]['loss']}, gradient norm "
                        f"{log[-1]['grad_norm']}: training diverged. {log_path} has the steps so far; the last "
                        f"checkpoint is "
                        + (f"step {last} (--resume continues from it)" if last is not None else "none")
                        + ". Try a lower --lr or a longer --warmup."
                    )
            pending.clear()

        def save(step: int) -> None:
            flush()
            manager.save(step, args=ocp.args.StandardSave(state))
            write_json(log_path, log)

        progress = tqdm(
            range(first_step, args.steps),
            initial=first_step,
            total=args.steps,
            desc="training",
            unit="step",
            dynamic_ncols=True,
        )
        for step in progress:
            starts = training_starts(step, args.batch_size, len(train_stream), args.seq_len, args.seed)
            state, metrics = jit_train_step(
                graphdef, state, make_batch(train_stream, starts, args.seq_len), train_config
            )
            done = step + 1
            pending.append((done, metrics))
            if done % args.log_every == 0 or done == args.steps:
                flush()
                progress.set_postfix(loss=f"{log[-1]['lm_loss']:.3f}", lr=f"{log[-1]['learning_rate']:.1e}")
            if done % args.eval_every == 0 or done == args.steps:
                held_out_losses = evaluate(graphdef, state, eval_batches, train_config)
                log.append({"step": done, **{f"eval_{k}": v for k, v in held_out_losses.items()}})
                progress.write(f"step {done}: held-out loss {held_out_losses['lm_loss']:.4f}")
            if done % args.save_every == 0 or done == args.steps:
                save(done)
        progress.close()

    plot_losses(log, os.path.join(args.out, "loss_curve.png"))
    train_entries = [entry for entry in log if "lm_loss" in entry]
    final_eval = [entry for entry in log if "eval_lm_loss" in entry][-1]
    export_dir = os.path.join(args.out, EXPORT_DIR)
    print(f"exporting the block-FP8 HF checkpoint to {export_dir}, then its held-out loss", flush=True)
    publish_export(merge_model(graphdef, state), export_dir, tokenizer_dir, args.shards)
    exported = load_hf_checkpoint(export_dir, dtype=jnp.float32, progress=False)
    _, exported_bias, exported_params = nnx.split(exported, EXPERT_BIAS, TRAINABLE)
    export_loss = evaluate(
        graphdef, state.replace(params=exported_params, expert_bias=exported_bias), eval_batches, train_config
    )["lm_loss"]
    wall = time.perf_counter() - started
    recent = train_entries[-min(len(train_entries), args.log_every) :]
    print(
        f"final train loss {np.mean([e['lm_loss'] for e in recent]):.4f} (mean of the last {len(recent)} steps), "
        f"held-out loss {final_eval['eval_lm_loss']:.4f}, FP8 export held-out loss {export_loss:.4f}; "
        f"wall time {wall:.0f} s"
    )
    print(f"wrote {log_path}, {os.path.join(args.out, 'loss_curve.png')} and {export_dir}")
    if args.sample_tokens:
        generator = Generator(exported)
        prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
        new, _ = generator.generate(
            [prompt],
            [SamplingParams(temperature=0.8, top_p=0.95, seed=args.seed)],
            args.sample_tokens,
            eos_ids=(eos_id,),
        )
        print(f"sample (temperature 0.8, top-p 0.95):\n{tokenizer.decode(prompt + new[0])}")
    return 0


def script_main() -> int:
    """`ling-train` and `scripts/train.py`."""
    return main()
