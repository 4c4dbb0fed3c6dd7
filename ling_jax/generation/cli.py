"""The `scripts/generate.py` command: text in, text out, over `ling_jax.generation.generator.Generator`.

The model is a HF-format checkpoint, a ling-convert Orbax directory, the embedded demo checkpoint (the
default) or a randomly initialised preset. Prompts come from the command line, a file or stdin; each is
tokenised (through the chat template with --chat), the batch is generated in one call, and the completions
are printed: streamed as tokens arrive when there is one prompt, each whole once the batch is done when
there are several (or with --no-stream), or as one JSON object per prompt with --json. Stop strings cut a
completion before the stop string, which is never printed, not even in part. The stats line goes to stderr.

User errors (a bad flag value, a missing path or tokenizer.json, a prompt too long, a damaged checkpoint, NaN
weights, a mesh that does not fit) print one `error: ...` line on stderr and exit with status 2. Everything
that can be checked without the weights (`ling_jax.generation.cli_checks`: flags, prompts, config, tokenizer, the
checkpoint's index and layout files) is checked before they load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence

import jax
import jinja2

from ling_jax import distributed, xla_flags
from ling_jax.checkpoints.hf import load_hf_checkpoint
from ling_jax.checkpoints.orbax import load_checkpoint
from ling_jax.config import LingConfig
from ling_jax.generation import cli_checks, cli_runtime, flags, interactive
from ling_jax.generation.cli_checks import ModelSource
from ling_jax.generation.completion import Completion
from ling_jax.generation.flags import DEMO_DIR
from ling_jax.generation.generator import (
    MIN_CHUNK,
    GenerationStats,
    Generator,
    MediaInputs,
    cache_length,
    default_prefill_chunk,
    prefill_chunks,
)
from ling_jax.generation.random_init import random_model
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import StopChecker, Tokenizer
from ling_jax.model import LingForCausalLM
from ling_jax.policy import ExecutionPolicy
from ling_jax.sharding import ShardingError
from ling_jax.vl.config import LingVLConfig
from ling_jax.vl.image_processing import ProcessorConfig
from ling_jax.vl.prompt import PromptMedia, encode_with_media, load_media, media_inputs, with_placeholders

FALLBACK_PRESET = "tiny"  # what runs when the demo checkpoint is not installed
DEFAULT_PROMPT = "It is a truth universally acknowledged"
EXIT_USAGE = 2


class CLIError(Exception):
    """A mistake in the command line or its inputs: printed as one `error: ...` line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(
        prog="generate.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text with a Ling 3.x model (greedy by default).",
        epilog="examples:\n"
        '  python scripts/generate.py "Mr. Darcy"\n'
        '  python scripts/generate.py --model /ckpt/Ling-3.1-flash --chat --temperature 0.7 "Hi!"\n'
        "  python scripts/generate.py --prompt-file prompts.txt --json --stop $'\\n\\n' > out.jsonl\n"
        '  python scripts/generate.py --model /ckpt/Ling-3.1-flash-orbax --tp 2 --ep 4 --mtp 1 "..."',
    )
    parser.add_argument(
        "prompts",
        nargs="*",
        metavar="PROMPT",
        help="prompts to complete (default: --prompt-file, else stdin when it is not a terminal, "
        f"else {DEFAULT_PROMPT!r})",
    )

    model = flags.add_model_flags(parser, default=None, presets=True)
    model.add_argument(
        "--byte-tokenizer",
        action="store_true",
        help="accept a checkpoint without tokenizer.json: text is tokenised as UTF-8 bytes (token id "
        "= byte value), which only a model trained on bytes understands",
    )

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt at most (default 64)"
    )
    sampling.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 = greedy (default 0)"
    )
    sampling.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens only; 0 = off (default)"
    )
    sampling.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: the smallest set of tokens with probability >= P; 1 = off (default)",
    )
    sampling.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens less likely than P times the most likely one; 0 = off (default)",
    )
    sampling.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="penalise tokens already in the prompt or output (CTRL rule); 1 = off (default)",
    )
    sampling.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        metavar="P",
        help="subtract P from the logit of every token already generated (OpenAI's), in [-2, 2]; 0 = off (default)",
    )
    sampling.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="F",
        help="subtract F times its count from each generated token's logit (OpenAI's), in [-2, 2]; 0 = off (default)",
    )
    sampling.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every prompt (default 0)")
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop a completion where this string appears, without printing it (repeatable)",
    )
    prompting = parser.add_argument_group("prompts")
    prompting.add_argument(
        "--chat", action="store_true", help="format each prompt as one user message with the tokenizer's chat template"
    )
    prompting.add_argument(
        "--system",
        metavar="TEXT",
        help="a system message before each prompt (with --chat) or the conversation (with --interactive)",
    )
    prompting.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for every prompt (VL checkpoints); repeatable. It goes where the prompt "
        "says <image>, else before the text",
    )
    prompting.add_argument(
        "--video",
        action="append",
        default=[],
        nargs="+",
        metavar="FRAME",
        help="a video for every prompt, given as its frame image files (VL checkpoints); "
        "repeatable. It goes where the prompt says <video>, else before the text",
    )
    prompting.add_argument(
        "--prompt-file", metavar="PATH", help="read prompts from PATH, one per line (blank lines skipped); '-' = stdin"
    )
    prompting.add_argument(
        "--interactive",
        action="store_true",
        help="a prompt loop: each line on stdin is a turn of one conversation (through the chat "
        "template when the tokenizer has one); ends at end of input or 'exit'",
    )

    flags.add_execution_flags(parser, prefill_chunk=None, kernel_backend=True, mesh_shorthands=True)

    distributed.add_arguments(
        parser,
        "multi-process (TPU pod, several GPU hosts): join the jax.distributed job first; every process runs the "
        "same command and reads only its own devices' slices of the weights; only process 0 prints "
        "(docs/multihost.md)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--no-stream", action="store_true", help="print the completion once it is done instead of token by token"
    )
    output.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt (prompt, completion, ids, token counts, "
        "finish_reason, stats) instead of text",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    xla_flags.set_gpu_flags()
    cached = cli_runtime.enable_compile_cache(args.no_compile_cache) is not None
    with cli_runtime.CompileNotice(cached) as notice:
        try:
            run = _prepare(args)
        except (CLIError, ValueError, OSError) as e:  # ShardingError, CheckpointError, config errors: ValueErrors
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        notice.quiet = not run.is_main
        if args.interactive:  # everything a user can get wrong was refused above: errors below are bugs
            run.converse()
        else:
            run.generate_and_print()
    return 0


def script_main() -> int:
    """`scripts/generate.py` and `ling-generate`: main() with Ctrl-C ending the run cleanly."""
    cli_runtime.handle_interrupts("interrupted (Ctrl-C): generation stopped")
    return main()


@dataclasses.dataclass
class Run:
    """A checked command: the generator, the encoded prompts and how to print their completions."""

    args: argparse.Namespace
    generator: Generator
    tokenizer: Tokenizer
    texts: list[str]  # the prompts as given
    prompts: list[list[int]]  # their token ids (chat-formatted with --chat)
    sampling: SamplingParams
    stops: StopChecker | None
    is_main: bool  # process 0 prints
    media: MediaInputs | None = None  # --image / --video, the same for every prompt

    def generate_and_print(self) -> GenerationStats:
        args = self.args
        stream = self.is_main and len(self.prompts) == 1 and not (args.no_stream or args.json)
        completions = [Completion(self.tokenizer, self.stops, streamed=stream) for _ in self.prompts]

        def on_tokens(row: int, new_ids: list[int]) -> bool:
            stopped = completions[row].add(new_ids)
            if stream:
                _write(completions[row].unshown())
            return stopped

        if stream:
            _write(f"> {self.texts[0]}\n")
        outputs, stats = self.generator.generate(
            self.prompts,
            [self.sampling] * len(self.prompts),
            args.max_new_tokens,
            eos_ids=self.tokenizer.eos_ids,
            on_tokens=on_tokens,
            media=self.media,
        )
        for completion, ids in zip(completions, outputs):
            completion.finish(ids)
        if not self.is_main:
            return stats
        if stream:
            _write(completions[0].unshown() + "\n")
        elif args.json:
            for text, ids, completion in zip(self.texts, self.prompts, completions):
                record = _record(text, ids, completion, args.max_new_tokens, stats)
                _write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            _write("\n".join(f"> {text}\n{completion.text}\n" for text, completion in zip(self.texts, completions)))
        print(stats.summary(), file=sys.stderr)
        return stats

    def converse(self) -> None:
        """--interactive: the prompt loop, each reply streamed."""
        conversation = interactive.Conversation(self.tokenizer, self.args.system)
        budget = self.generator.config.max_position_embeddings - self.args.max_new_tokens
        interactive.run_loop(conversation, budget, self.reply)

    def reply(self, prompt_ids: list[int]) -> str:
        """Stream one completion of `prompt_ids` on stdout; return its text."""
        completion = Completion(self.tokenizer, self.stops)

        def on_tokens(_row: int, new_ids: list[int]) -> bool:
            stopped = completion.add(new_ids)
            _write(completion.unshown())
            return stopped

        outputs, _ = self.generator.generate(
            [prompt_ids], [self.sampling], self.args.max_new_tokens, eos_ids=self.tokenizer.eos_ids, on_tokens=on_tokens
        )
        completion.finish(outputs[0])
        _write(completion.unshown() + "\n")
        return completion.text


def _prepare(args: argparse.Namespace) -> Run:
    """Check the flags, load the model and tokenizer, encode the prompts: every user error surfaces here. With
    --distributed, every process's checks are compared before any weight is read (`distributed.agreement`)."""
    distributed.check_arguments(args)
    if args.distributed:
        distributed.join(args)
        model_path = None if args.model is None else os.path.abspath(args.model)
        job = distributed.job_of(args, model=model_path)
        checks = distributed.agreement("generate", job, args.distributed_timeout)
    else:
        checks = contextlib.nullcontext({})
    with checks as job:
        _check_flags(args)
        is_main = jax.process_index() == 0
        sampling = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
        )
        stops = StopChecker(args.stop) if args.stop else None
        mesh = flags.build_mesh(args)
        if args.interactive:
            interactive.check_flags(args)
        texts = [] if args.interactive else _read_prompts(args)
        if args.prefill_chunk is None:
            args.prefill_chunk = default_prefill_chunk(len(texts))
        source = _model_source(args, verbose=is_main)  # config and tokenizer: checked before any weight is read
        config = source.text_config
        if args.interactive and args.system is not None and source.tokenizer.chat_template is None:
            raise CLIError(
                f"--system: {source.name} has no chat template, so --interactive runs the conversation as plain "
                "text, with no place for a system message"
            )
        if args.mtp and not config.num_nextn_predict_layers:
            raise CLIError(
                f"--mtp {args.mtp} needs a model with an MTP layer; {source.name} has none "
                "(num_nextn_predict_layers = 0)"
            )
        media = _load_media(args, source) if (args.image or args.video) else None
        prompts = [_encode(source.tokenizer, text, args, media, source.vl_config) for text in texts]
        job["prompts"] = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()  # from stdin or a file, too
        _check_lengths(prompts, args.max_new_tokens, config)
        dtype = flags.dtype_of(args)
        policy = ExecutionPolicy(kernel_backend=args.kernel_backend, fp8_matmul=args.fp8_matmul)
        if not args.no_memory_check:
            try:
                _check_memory(args, source, mesh, dtype, prompts)
            except ShardingError as e:
                raise _unfit(args, e) from e
    try:
        model = load_model(source, dtype, mesh, policy, args.weights, verbose=is_main)
        generator = Generator(model, mesh=mesh, prefill_chunk=args.prefill_chunk, mtp=args.mtp)
    except ShardingError as e:
        raise _unfit(args, e) from e
    return Run(
        args,
        generator,
        source.tokenizer,
        texts,
        prompts,
        sampling,
        stops,
        is_main,
        None if media is None else media_inputs(media, len(prompts)),
    )


def _unfit(args: argparse.Namespace, error: ShardingError) -> CLIError:
    return CLIError(f"{flags.mesh_flags(args)}: the model does not fit this mesh: {error}")


def _check_flags(args: argparse.Namespace) -> None:
    flags.check_at_least(
        (
            ("--max-new-tokens", args.max_new_tokens, 1),
            *((("--prefill-chunk", args.prefill_chunk, MIN_CHUNK),) if args.prefill_chunk is not None else ()),
            ("--mtp", args.mtp, 0),
        )
    )
    cli_checks.check_mtp(args.mtp)
    flags.check_kernel_backend(args.kernel_backend)
    if args.system is not None and not (args.chat or args.interactive):
        raise CLIError("--system needs --chat or --interactive (the system message goes through the chat template)")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    texts = list(args.prompts)
    if args.prompt_file is not None:
        texts += _read_prompt_file(args.prompt_file)
    elif not texts and cli_checks.stdin_is_input():
        texts = _lines(cli_checks.read_stdin("stdin"))
        if not texts:
            raise CLIError(
                "no prompt on stdin (it is empty or every line is blank): pipe some text, or give "
                "PROMPT arguments or --prompt-file"
            )
    return texts or [DEFAULT_PROMPT]


def _read_prompt_file(name: str) -> list[str]:
    if name == "-":
        prompts = _lines(cli_checks.read_stdin("--prompt-file -"))
    else:
        try:
            prompts = _lines(cli_checks.read_text_file(name, f"--prompt-file {name}"))
        except OSError as e:
            raise CLIError(f"--prompt-file {name}: {e.strerror or e}") from e
    if not prompts:
        raise CLIError(f"--prompt-file {name}: no prompts (it is empty or every line is blank)")
    return prompts


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _model_source(args: argparse.Namespace, *, verbose: bool) -> ModelSource:
    if args.preset is not None:
        if verbose:
            print(f"NOTE: --preset {args.preset}: a RANDOMLY INITIALISED model; its output is noise.", file=sys.stderr)
        return cli_checks.preset_source(args.preset)
    if args.model is not None:
        return cli_checks.checkpoint_source(args.model, "--model", byte_tokenizer=args.byte_tokenizer)
    if DEMO_DIR.is_dir():
        return cli_checks.checkpoint_source(DEMO_DIR, "the demo checkpoint", byte_tokenizer=args.byte_tokenizer)
    if verbose:
        print(
            f"NOTE: the demo checkpoint ({DEMO_DIR}) is not installed and no --model was given: using a RANDOMLY "
            f"INITIALISED '{FALLBACK_PRESET}' model. Its output is noise.",
            file=sys.stderr,
        )
    return cli_checks.preset_source(FALLBACK_PRESET)


def _check_memory(args: argparse.Namespace, source: ModelSource, mesh, dtype, prompts: list[list[int]]) -> None:
    """The parameters and the cache of this run against the device's memory, before any weight is read (the
    cache of --max-new-tokens tokens for --interactive, whose prompts are not known yet)."""
    longest = max((len(p) for p in prompts), default=0)
    padded = sum(prefill_chunks(longest, args.prefill_chunk)) if longest else 0
    cli_checks.check_memory(
        source,
        {} if mesh is None else dict(mesh.shape),
        args.weights,
        dtype,
        batch=max(len(prompts), 1),
        context=cache_length(padded, args.max_new_tokens, args.mtp),
        mtp=bool(args.mtp),
        devices=jax.device_count(),
    )


def load_model(
    source: ModelSource, dtype, mesh, policy: ExecutionPolicy, weights: str, *, verbose: bool
) -> LingForCausalLM:
    """The model, every parameter straight into its sharding over `mesh` (or on one device): a preset initialised
    at random there, a checkpoint read slice by slice."""
    if source.path is None:
        return random_model(source.config, mesh=mesh, weights=weights, dtype=dtype, policy=policy, progress=verbose)
    if source.orbax:
        return load_checkpoint(source.path, mesh=mesh, dtype=dtype, weights=weights, progress=verbose, policy=policy)
    return load_hf_checkpoint(source.path, mesh=mesh, dtype=dtype, weights=weights, progress=verbose, policy=policy)


def _encode(
    tokenizer: Tokenizer,
    text: str,
    args: argparse.Namespace,
    media: PromptMedia | None = None,
    vl_config: LingVLConfig | None = None,
) -> list[int]:
    if media is not None:
        try:
            text = with_placeholders(text, media)
        except ValueError as e:
            raise CLIError(f"--image / --video: {e}") from e
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        try:
            text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": text}])
        except jinja2.TemplateError as e:
            raise CLIError(f"--chat: the chat template of {tokenizer.name} failed: {e}") from e
    if media is None:
        return tokenizer.encode(text, add_special_tokens=not args.chat)
    return encode_with_media(
        lambda piece, first: tokenizer.encode(piece, add_special_tokens=first and not args.chat), text, media, vl_config
    )


def _load_media(args: argparse.Namespace, source: ModelSource) -> PromptMedia:
    """--image / --video, preprocessed as the checkpoint's preprocessor_config.json (or the defaults) says."""
    vl_config = source.vl_config
    if vl_config is None:
        what = "a text model" if source.path else "a text model (every preset is, a -vl one too: the VL's text part)"
        raise CLIError(
            f"--image / --video need a VL checkpoint (config.json with a vision_config); {source.name} is {what}"
        )
    if args.mtp:
        raise CLIError("--mtp is not supported with --image / --video (the VL model's MTP layer is not wired up)")
    processor = ProcessorConfig.for_vision(vl_config.vision)
    if args.model is not None:
        processor = ProcessorConfig.from_pretrained(args.model, vl_config.vision)
    try:
        return load_media(args.image, args.video, processor)
    except (OSError, ValueError) as e:
        raise CLIError(f"--image / --video: {e}") from e


def _check_lengths(prompts: list[list[int]], max_new_tokens: int, config: LingConfig) -> None:
    for number, ids in enumerate(prompts, 1):
        if not ids:
            raise CLIError(f"prompt {number} is empty (it has no tokens)")
        if len(ids) + max_new_tokens > config.max_position_embeddings:
            raise CLIError(
                f"prompt {number} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that "
                f"exceeds the model's context of {config.max_position_embeddings} tokens "
                "(max_position_embeddings)"
            )


def _record(
    prompt: str, prompt_ids: list[int], completion: Completion, max_new_tokens: int, stats: GenerationStats
) -> dict:
    if completion.stopped:
        finish_reason = "stop"
    elif len(completion.ids) >= max_new_tokens:
        finish_reason = "length"
    else:
        finish_reason = "eos"
    return {
        "prompt": prompt,
        "completion": completion.text,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(completion.ids),
        "completion_ids": completion.ids,
        "finish_reason": finish_reason,
        "stats": _stats_dict(stats),
    }


def _stats_dict(stats: GenerationStats) -> dict:
    """The batch's stats; a rate with no time to divide by is null (JSON has no infinity)."""
    rates = {
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "acceptance_rate": stats.acceptance_rate,
    }
    return {
        **dataclasses.asdict(stats),
        **{name: rate if rate is not None and math.isfinite(rate) else None for name, rate in rates.items()},
    }


def _write(text: str) -> None:
    cli_runtime.write_stdout(text)


if __name__ == "__main__":
    sys.exit(script_main())
