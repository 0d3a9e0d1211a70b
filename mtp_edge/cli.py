"""Command-line entry points. User errors print one line and exit 2; nothing prints a traceback."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import click
import torch

from mtp_edge.errors import UserError


class OneLineErrors(click.Command):
    """A click command whose usage errors and UserErrors print as one `error: ...` line."""

    def main(self, *args, **kwargs):
        quiet_library_noise()
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {e.format_message()} (see --help)", err=True)
            sys.exit(2)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except (KeyboardInterrupt, click.exceptions.Abort):
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def quiet_library_noise() -> None:
    """Keep the terminal for our progress and errors: torch/torchao/ExecuTorch deprecation notes
    and optional-kernel load failures say nothing a user of these commands can act on."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*[Mm]utation on a buffer.*")
    for name in ("torchao", "torch.utils._pytree", "torch._export", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build_drafter(spec: str, target, bundle, max_seq_len: int, opts: dict):
    """The drafter named by `spec`: none | ngram | mtp | a draft model path | the bundle's own.

    `target` is the LoadedModel on the eager backend (None with a bundle), `bundle` the opened
    bundle (None with a model).
    """
    from mtp_edge.checkpoints import load_model
    from mtp_edge.runtime.drafters import DraftModelDrafter, NgramDrafter, check_same_vocabulary
    from mtp_edge.runtime.session import EagerSession

    confidence = opts["draft_confidence"]
    if spec == "none":
        return None
    if spec.endswith("+ngram"):  # e.g. mtp+ngram: lookup where the context repeats, else mtp
        from mtp_edge.runtime.drafters import HybridDrafter

        model = build_drafter(spec.removesuffix("+ngram"), target, bundle, max_seq_len, opts)
        if model is None:
            raise UserError(f"--drafter {spec}: name a model drafter before +ngram, e.g. mtp+ngram")
        low, high = parse_ngram_sizes(opts["ngram_sizes"])
        return HybridDrafter(model, max_n=high, min_match=low)
    if spec == "ngram":
        low, high = parse_ngram_sizes(opts["ngram_sizes"])
        return NgramDrafter(max_n=high, min_n=low)
    if bundle is not None:
        from mtp_edge.runtime.bundle import bundle_drafter

        if spec != bundle.manifest.drafter.get("kind"):
            raise UserError(
                f"--drafter {spec}: this bundle carries a '{bundle.manifest.drafter.get('kind')}'"
                " drafter; use it, none or ngram (or export another bundle)"
            )
        return bundle_drafter(bundle, confidence)
    if spec == "mtp":
        from mtp_edge.mtp import load_heads, shipped_heads
        from mtp_edge.runtime.mtp_drafter import mtp_drafter

        heads = opts.get("heads") or shipped_heads(target.name)
        if heads is None:
            raise UserError(
                f"no MTP heads ship for {target.name}: pass --heads (train them with mtp-train)"
            )
        head = load_heads(heads, target.model, target.name).to(target.model.dtype)
        return mtp_drafter(head, target.model, confidence)
    draft = load_model(spec)
    check_same_vocabulary(
        target.tokenizer.backend.get_vocab(),
        draft.tokenizer.backend.get_vocab(),
        target.config.vocab_size,
        draft.config.vocab_size,
    )
    return DraftModelDrafter(EagerSession(draft.model, max_seq_len), min_confidence=confidence)


def parse_ngram_sizes(text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition("-")
        sizes = (int(low), int(high or low))
    except ValueError:
        raise UserError(f"--ngram-sizes takes MIN-MAX such as 1-3, got {text!r}") from None
    return sizes


def drafter_options(f):
    """Options shared by the commands that decode: target model, drafter and its settings."""
    options = [
        click.option(
            "--model",
            "model_spec",
            default="default",
            show_default=True,
            help="HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct).",
        ),
        click.option(
            "--bundle", default=None, help="Run an exported bundle (mtp-export) instead of --model."
        ),
        click.option(
            "--drafter",
            default=None,
            help="none | ngram | mtp | path to a draft model with the target's vocabulary | "
            "any of these +ngram (e.g. mtp+ngram: prompt lookup where the context repeats "
            "itself, the model elsewhere) (default: the bundle's drafter, else ngram).",
        ),
        click.option(
            "--k", default=None, type=int, help="Most tokens drafted per step (default: 4)."
        ),
        click.option(
            "--heads", default=None, help="MTP heads file for --drafter mtp (default: shipped)."
        ),
        click.option(
            "--adaptive-k",
            is_flag=True,
            help="Grow k after a fully accepted step, shrink it after a miss.",
        ),
        click.option(
            "--ngram-sizes",
            default=None,
            help="n-gram drafter (and the lookup of X+ngram): MIN-MAX n (default 1-3, or the "
            "bundle's lookup sizes).",
        ),
        click.option(
            "--draft-confidence",
            default=None,
            type=float,
            help="Model drafters: stop drafting when the best probability falls below (default "
            "0, or the bundle's).",
        ),
        click.option(
            "--max-seq-len", default=2048, show_default=True, help="Static KV cache length."
        ),
        click.option("--no-chat-template", is_flag=True, help="Feed prompts as raw text."),
        click.option("--threads", default=0, help="CPU threads (0 = all cores)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@dataclass
class Setup:
    """A loaded target, its session and drafter: what `run` and `bench` decode with."""

    name: str
    tokenizer: object
    session: object
    drafter: object
    config: object  # GenerationConfig
    chat: bool
    bundle: str | None
    draft_confidence: float = 0.0

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, chat=self.chat)

    @property
    def label(self) -> str:
        """How progress lines name this setup when several are compared."""
        from pathlib import Path

        label = f"{Path(self.bundle or self.name).name} k={self.config.k}"
        if self.drafter is not None and self.draft_confidence:
            label += f" confidence={self.draft_confidence:g}"
        return label

    def render(self, prompt: str) -> str:
        """The prompt as text, as a runner that tokenizes by itself must receive it."""
        if self.chat and self.tokenizer.chat_template is not None:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return prompt


def setup(opts: dict, sampling=None, max_new_tokens: int = 128, stop_strings=()) -> Setup:
    """Load the target (a model on the eager backend, or a bundle) and its drafter.

    `opts` holds the values of the `drafter_options` flags.
    """
    from mtp_edge.checkpoints import load_model
    from mtp_edge.runtime.loop import GenerationConfig
    from mtp_edge.runtime.sampling import SamplingParams
    from mtp_edge.runtime.session import EagerSession

    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    if opts["ngram_sizes"] is not None:
        parse_ngram_sizes(opts["ngram_sizes"])  # bad sizes fail before anything loads
    max_seq_len, drafter, k = opts["max_seq_len"], opts["drafter"], opts["k"]
    if max_seq_len < 2:
        raise UserError(f"--max-seq-len must be >= 2, got {max_seq_len}")
    if opts["bundle"] is not None:
        from mtp_edge.runtime.bundle import open_bundle, target_session

        if opts["model_spec"] != "default":
            raise UserError("give either --model or --bundle, not both")
        bundle = open_bundle(opts["bundle"])
        m = bundle.manifest
        session = target_session(bundle)
        tokenizer, name, target = bundle.tokenizer, m.model_name, None
        if drafter is None:  # the bundle's drafter, as its exporter set it to run
            drafter = m.drafter.get("kind", "none")
            if "lookup" in m.drafter:
                drafter += "+ngram"
                if opts["ngram_sizes"] is None:
                    opts = dict(opts, ngram_sizes=m.drafter["lookup"])
        if opts["draft_confidence"] is None:
            opts = dict(opts, draft_confidence=m.drafter.get("draft_confidence", 0.0))
        k = m.drafter.get("k") if k is None else k
    else:
        bundle = None
        target = load_model(opts["model_spec"])
        tokenizer, name = target.tokenizer, target.name
        max_seq_len = min(max_seq_len, target.config.max_position_embeddings)
        session = EagerSession(target.model, max_seq_len)
        drafter = drafter or "ngram"
    opts = dict(opts, ngram_sizes=opts["ngram_sizes"] or "1-3")
    if opts["draft_confidence"] is None:
        opts["draft_confidence"] = 0.0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        k=4 if k is None else k,
        adaptive_k=opts["adaptive_k"],
        sampling=sampling or SamplingParams(),
        stop_strings=tuple(stop_strings),
        eos_ids=tuple(tokenizer.eos_ids),
    )
    draft = build_drafter(drafter, target, bundle, session.max_seq_len, opts)
    chat = not opts["no_chat_template"]
    confidence = opts["draft_confidence"]
    return Setup(name, tokenizer, session, draft, config, chat, opts["bundle"], confidence)


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "--prompt", required=True, help="The user message (raw text with --no-chat-template)."
)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, help="1 = off.")
@click.option("--seed", default=0, show_default=True)
@click.option("--stop", "stop_strings", multiple=True, help="Stop at this text (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def run(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_strings, as_json, **opts):
    """Generate text with speculative decoding."""
    from mtp_edge.runtime.loop import generate
    from mtp_edge.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    ctx = setup(opts, sampling, max_new_tokens, stop_strings)
    tokenizer = ctx.tokenizer
    prompt_ids = ctx.encode(prompt)

    stream = None
    if not as_json:
        printed = [0]
        streamed: list[int] = []

        def stream(tokens):
            streamed.extend(tokens)
            text = tokenizer.decode(streamed)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                click.echo(text[printed[0] :], nl=False)
                printed[0] = len(text)

    result = generate(ctx.session, prompt_ids, ctx.drafter, ctx.config, tokenizer.decode, stream)
    text = tokenizer.decode(result.token_ids)
    for s in stop_strings:
        if s in text:
            text = text[: text.index(s)]
    if as_json:
        out = {
            "text": text,
            "token_ids": result.token_ids,
            "stop_reason": result.stop_reason,
            "stats": result.stats.to_dict(),
        }
        click.echo(json.dumps(out))
    else:
        s = result.stats
        click.echo("")
        click.echo(
            f"[{result.stop_reason}] {s.generated_tokens} tokens, "
            f"{s.decode_tokens_per_s:.1f} tok/s, "
            f"tau {s.tau:.2f}, acceptance {s.acceptance_rate:.2f}, ttft {s.ttft_ms:.0f} ms",
            err=True,
        )


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "--prompts",
    "prompts_path",
    default=None,
    help="JSONL prompts file (default: the built-in suite).",
)
@click.option(
    "--repeat", default=1, show_default=True, help="Passes over the suite (medians and spread)."
)
@click.option(
    "--max-new-tokens", default=None, type=int, help="Override every prompt's max_new_tokens."
)
@click.option("--json", "json_out", default=None, help="Write the JSON report here.")
@click.option("--markdown", "markdown_out", default=None, help="Write a Markdown summary here.")
@click.option(
    "--report",
    "report_dir",
    default=None,
    help="Write a Markdown report with PNG plots and the machine's description here.",
)
@click.option(
    "--compare",
    multiple=True,
    help="Another bundle to measure side by side with --bundle (repeatable; prompts "
    "interleaved). DIR[,k=N][,drafter=NAME][,confidence=P] also compares k values, drafters "
    "or --draft-confidence floors of one bundle.",
)
def bench(
    prompts_path, repeat, max_new_tokens, json_out, markdown_out, report_dir, compare, **opts
):
    """Plain vs speculative greedy decoding on the same backend, over a prompt suite."""

    from mtp_edge.devices.harness import Suite, load_prompts, progress_line, to_markdown

    if repeat < 1:
        raise UserError(f"--repeat must be >= 1, got {repeat}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if compare and opts["bundle"] is None:
        raise UserError("--compare puts bundles side by side: give the first one with --bundle")
    prompts = load_prompts(prompts_path)
    machine = None
    if report_dir is not None:
        from mtp_edge.devices.report import machine_description

        click.echo("[machine] measuring memory bandwidth and matmul throughput", err=True)
        machine = machine_description()  # before ExecuTorch takes the cores
    command = " ".join(["mtp-bench", *sys.argv[1:]])
    if compare:
        from mtp_edge.devices.isolated import IsolatedSetup

        # One process per setup: runtimes in one process slow each other down (isolated.py).
        runs = []
        try:
            for o in [opts] + [{**opts, **compare_spec(b)} for b in compare]:
                runs.append(IsolatedSetup(o, repeat, max_new_tokens))
            for i, p in enumerate(prompts):
                # Every setup in turn on the same prompt, so that machine drift affects all alike.
                for run in runs:
                    row = run.run_prompt(p)
                    click.echo(
                        f"[{i + 1}/{len(prompts)}] {run.label}: {progress_line(row)}", err=True
                    )
            reports = [run.report(command, prompts) for run in runs]
        finally:
            for run in runs:
                run.close()
    else:
        ctx = setup(opts)
        suite = Suite(ctx.config.k, repeat)
        for i, p in enumerate(prompts):
            row = suite.run_prompt(
                ctx.session, ctx.encode, ctx.drafter, p, ctx.config, max_new_tokens
            )
            click.echo(f"[{i + 1}/{len(prompts)}] {progress_line(row)}", err=True)
        reports = [setup_report(ctx, suite, command, prompts, max_new_tokens)]
    markdown = "\n".join(to_markdown(r) for r in reports)
    body = reports[0] if len(reports) == 1 else {"command": command, "runs": reports}
    write_atomic(json_out, json.dumps(body, indent=2) + "\n")
    write_atomic(markdown_out, markdown)
    if report_dir is not None:
        from mtp_edge.devices.report import write_report

        path = write_report(report_dir, reports, command, machine)
        click.echo(f"[report] {path}", err=True)
    click.echo(markdown)
    if not all(r["summary"]["lossless"] for r in reports):
        raise UserError("speculative output diverged from plain output beyond a near-tie: a bug")


def setup_report(ctx: Setup, suite, command: str, prompts, max_new_tokens) -> dict:
    """One setup's mtp-bench report; for an ExecuTorch bundle with ExecuTorch's TextLLMRunner
    decoding the same .pte as the peer baseline."""
    from pathlib import Path

    report = {
        "bundle": ctx.bundle,
        "model": ctx.name,
        "backend": ctx.session.name,
        "drafter": "none" if ctx.drafter is None else ctx.drafter.name,
        "k": ctx.config.k,
        "draft_confidence": ctx.draft_confidence,
        "threads": torch.get_num_threads(),
        "command": command,
        **suite.body(),
    }
    if ctx.bundle is not None and ctx.session.name == "executorch":
        from mtp_edge.devices.peer import textllmrunner_baseline

        click.echo(
            "[peer] ExecuTorch TextLLMRunner, plain decoding of the same target .pte", err=True
        )
        bundle_dir = Path(ctx.bundle)
        runs = [(ctx.render(p.prompt), max_new_tokens or p.max_new_tokens) for p in prompts]
        report["peer_textllmrunner"] = textllmrunner_baseline(
            bundle_dir / "target.pte", bundle_dir / "tokenizer.json", runs
        )
    return report


def compare_spec(spec: str) -> dict:
    """`DIR[,k=N][,drafter=NAME][,confidence=P]` -> the bench options it overrides."""
    path, *settings = spec.split(",")
    out: dict = {"bundle": path}
    for setting in settings:
        key, _, value = setting.partition("=")
        if key == "k" and value.isdigit():
            out["k"] = int(value)
        elif key == "drafter" and value:
            out["drafter"] = value
        elif key == "confidence" and _is_probability(value):
            out["draft_confidence"] = float(value)
        else:
            raise UserError(
                f"--compare {spec}: expected DIR[,k=N][,drafter=NAME][,confidence=P], "
                f"not {setting!r}"
            )
    return out


def _is_probability(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


def write_atomic(path: str | None, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a report."""
    if path is None:
        return
    from pathlib import Path

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    tmp.replace(target)


@click.command(cls=OneLineErrors)
@click.option(
    "--target",
    "target_name",
    default="android",
    show_default=True,
    help="android (ExecuTorch .pte, XNNPACK) | onnx (ONNX Runtime) | coreml (.mlpackage).",
)
@click.option(
    "--model",
    "model_spec",
    default="default",
    show_default=True,
    help="HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct).",
)
@click.option(
    "--drafter",
    default="auto",
    show_default=True,
    help="auto (MTP heads if they ship for the model, else ngram) | none | ngram | mtp | "
    "path to a draft model with the target's vocabulary.",
)
@click.option("--heads", default=None, help="MTP heads for --drafter mtp (default: shipped).")
@click.option("--k", default=4, show_default=True, help="Tokens drafted per step.")
@click.option(
    "--quant",
    default=None,
    help="Target weights. android: 8da8w | 8da4w | fp32 (default 8da8w); onnx: int4 | int8 | "
    "fp32 (default int4); coreml: int4 | int8 | fp16 (default int4).",
)
@click.option(
    "--group-size",
    default=None,
    type=int,
    help="Quantization group size (0 = one scale per output channel).",
)
@click.option(
    "--embedding-quant", default="8w", show_default=True, help="8w | 4w | none (android only)."
)
@click.option("--draft-quant", default=None, help="Drafter weights (default: as --quant).")
@click.option(
    "--lookup",
    default="2-3",
    show_default=True,
    help="Runtime default for a model drafter: prompt lookup first where the context's last "
    "MIN-MAX tokens occurred before (none: the model alone).",
)
@click.option(
    "--draft-confidence",
    default=0.5,
    show_default=True,
    help="Runtime default for a model drafter: no draft below this first-token probability.",
)
@click.option(
    "--attention-kernel",
    type=click.Choice(["mtp", "executorch"]),
    default="mtp",
    show_default=True,
    help="android: attention op of the programs. mtp: ours, row-exact, so a k+1-token "
    "verification is one call (mtp-edge's runtimes carry it); executorch: llama.custom_sdpa, "
    "which ExecuTorch's stock runners carry (verification then calls it once per row).",
)
@click.option("--max-seq-len", default=2048, show_default=True, help="Static KV cache length.")
@click.option("--out", default=None, help="Bundle directory (default: bundles/<model>-<target>).")
@click.option(
    "--quality-tokens",
    default=1024,
    show_default=True,
    help="Held-out tokens for the perplexity check (0 = skip).",
)
def export(
    target_name,
    model_spec,
    drafter,
    heads,
    k,
    quant,
    group_size,
    embedding_quant,
    draft_quant,
    lookup,
    draft_confidence,
    attention_kernel,
    max_seq_len,
    out,
    quality_tokens,
):
    """Quantize a target (and its drafter) and export them as one bundle."""
    from pathlib import Path

    from mtp_edge.exporter.export import ExportOptions, export_bundle
    from mtp_edge.quantize.schemes import DEFAULT_SCHEME, default_group_size

    quant = quant or DEFAULT_SCHEME.get(target_name, DEFAULT_SCHEME["android"])
    options = ExportOptions(
        target=target_name,
        model=model_spec,
        drafter=drafter,
        heads=heads,
        k=k,
        quant=quant,
        group_size=default_group_size(quant, target_name) if group_size is None else group_size,
        embedding_quant=embedding_quant,
        draft_quant=draft_quant or quant,
        max_seq_len=max_seq_len,
        quality_tokens=quality_tokens,
        lookup=lookup,
        draft_confidence=draft_confidence,
        attention_kernel=attention_kernel,
    )

    def open_program(path: Path, seq_len: int):
        """The exported target's forward, for the quality report (None: cannot run here)."""
        if target_name == "onnx":
            from mtp_edge.runtime.onnx_session import OnnxSession

            return OnnxSession(path, None, seq_len, 0, options.max_chunk).forward
        if target_name == "coreml":
            from mtp_edge.runtime.coreml_session import coreml_available

            if not coreml_available():
                return None
            from mtp_edge.runtime.coreml_session import CoreMLSession

            return CoreMLSession(path, None, seq_len, 0, options.max_chunk).forward
        from mtp_edge.runtime.executorch_session import ExecuTorchSession

        return ExecuTorchSession(path, seq_len, 0, options.max_chunk).forward

    bundle, manifest = export_bundle(
        options,
        Path(out) if out else None,
        open_program,
        progress=lambda line: click.echo(line, err=True),
        measure=measure_drafter_acceptance,
    )
    click.echo(json.dumps({"bundle": str(bundle), "quality": manifest.quality}))


ACCEPTANCE_PROMPTS, ACCEPTANCE_TOKENS = 6, 48  # held-out snippets x tokens each


def measure_drafter_acceptance(directory, target, draft) -> dict:
    """The quality report's drafter entry: acceptance when the eager fp32 target and drafter
    decode held-out text greedily, and when the exported bundle does (same prompts, same k)."""
    from mtp_edge.devices.acceptance import measure_acceptance
    from mtp_edge.quantize.quality import heldout_text
    from mtp_edge.runtime.bundle import bundle_drafter, open_bundle, target_session
    from mtp_edge.runtime.drafters import DraftModelDrafter, NgramDrafter
    from mtp_edge.runtime.mtp_drafter import mtp_drafter
    from mtp_edge.runtime.session import EagerSession

    bundle = open_bundle(directory)
    m = bundle.manifest
    kind, k = m.drafter["kind"], m.drafter["k"]
    if kind == "none" or (m.backend == "coreml" and sys.platform != "darwin"):
        return {}
    click.echo(f"[quality] {kind} drafter acceptance, fp32 eager vs exported", err=True)
    tokens = target.tokenizer.encode(heldout_text())
    prompts = [tokens[i * 256 : i * 256 + 64] for i in range(ACCEPTANCE_PROMPTS)]
    seq_len = 64 + ACCEPTANCE_TOKENS + k + 1
    if kind == "mtp":
        before = mtp_drafter(draft.to(target.model.dtype), target.model)
    elif kind == "draft-lm":
        before = DraftModelDrafter(EagerSession(draft.model, seq_len))
    else:
        before = NgramDrafter()
    after = bundle_drafter(bundle) or NgramDrafter()
    eager = EagerSession(target.model, seq_len)
    return {
        "drafter_acceptance": {
            "prompts": f"{ACCEPTANCE_PROMPTS} held-out snippets of 64 tokens, "
            f"{ACCEPTANCE_TOKENS} greedy tokens each, k={k}",
            "fp32": measure_acceptance(eager, before, prompts, k, ACCEPTANCE_TOKENS),
            "exported": measure_acceptance(
                target_session(bundle), after, prompts, k, ACCEPTANCE_TOKENS
            ),
        }
    }


@click.command(cls=OneLineErrors)
@click.option(
    "--model",
    default="default",
    show_default=True,
    help="The frozen target: HF directory, .gguf file, or 'default'.",
)
@click.option(
    "--data",
    multiple=True,
    help='Text files to train on, or .jsonl[.gz] files of {"prompt", "response"} chat pairs '
    "(repeatable; default: offline text + the target's own responses).",
)
@click.option("--k", default=4, show_default=True, help="Draft steps unrolled in training.")
@click.option("--steps", default=3000, show_default=True)
@click.option(
    "--batch-size",
    default=512,
    show_default=True,
    help="Draft origins per step (per process): drawn at random from the whole text, or in "
    "whole sequences for heads with attention.",
)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint next to --out.")
@click.option(
    "--draft-vocab", default=8192, show_default=True, help="Size of the reduced draft vocabulary."
)
@click.option(
    "--gen-tokens",
    default=100_000,
    show_default=True,
    help="Response tokens the target writes for the default corpus.",
)
@click.option(
    "--self-prompt-tokens",
    default=0,
    show_default=True,
    help="More response tokens, to requests the target writes itself (sampled from the start "
    "of a user turn of its chat template): more varied requests than the templates.",
)
@click.option(
    "--init",
    "init_heads",
    default=None,
    help="Continue training these heads (their design carries over; the draft vocabulary "
    "is chosen on the new text, shared tokens keep their trained rows).",
)
@click.option(
    "--raw-tokens",
    default=50_000,
    show_default=True,
    help="Tokens of offline text for the default corpus.",
)
@click.option(
    "--attention",
    type=click.Choice(["none", "target_cache", "self"]),
    default="none",
    show_default=True,
    help="none: an MLP head reading the target's hidden state; target_cache: its first block "
    "also attends to the target's last-layer KV cache; self (EAGLE): to a KV cache of its own "
    "features of the whole context.",
)
@click.option(
    "--labels",
    type=click.Choice(["hard", "soft"]),
    default="hard",
    show_default=True,
    help="Train on the target's distribution over the draft vocabulary, or on its argmax.",
)
@click.option(
    "--feature-loss",
    default=0.0,
    show_default=True,
    help="Weight of a loss that pulls each step's hidden state onto the target's (0: off).",
)
@click.option(
    "--freeze-lm-head",
    is_flag=True,
    help="Keep the draft LM head at the target's rows instead of training it.",
)
@click.option("--weight-decay", default=0.0, show_default=True, help="AdamW weight decay.")
@click.option("--threads", default=0, help="CPU threads (0 = torch's default).")
@click.option(
    "--bundle",
    default=None,
    help="An ExecuTorch bundle of the target (exported with --drafter mtp): it writes and labels "
    "the text, so the heads learn the exported, quantized target they will draft for.",
)
@click.option(
    "--writer",
    type=click.Choice(["int8", "fp32", "bundle"]),
    default=None,
    help="Who writes the training text: the target with int8 linears, batched (fastest on a "
    "CPU), the target as loaded, batched, or --bundle's exported target one sequence at a time "
    "(default: the bundle when given, else int8). Labels always come from the target "
    "(--bundle's when given).",
)
@click.option(
    "--gen-batch",
    default=64,
    show_default=True,
    help="Responses (and requests) written together by an eager writer.",
)
@click.option(
    "--write-only",
    is_flag=True,
    help="Write (or extend) the cached training text next to --out, then stop.",
)
@click.option("--out", required=True, help="Output heads file (.safetensors).")
def train(
    model,
    data,
    k,
    steps,
    batch_size,
    lr,
    seed,
    resume,
    draft_vocab,
    gen_tokens,
    self_prompt_tokens,
    init_heads,
    raw_tokens,
    attention,
    labels,
    feature_loss,
    freeze_lm_head,
    weight_decay,
    threads,
    bundle,
    writer,
    gen_batch,
    write_only,
    out,
):
    """Train MTP draft heads for a target by self-distillation (runs under torchrun too)."""
    from mtp_edge.train import TrainOptions, train_heads

    options = TrainOptions(
        out=out,
        model=model,
        data=tuple(data),
        k=k,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        resume=resume,
        draft_vocab=draft_vocab,
        gen_tokens=gen_tokens,
        self_prompt_tokens=self_prompt_tokens,
        init=init_heads,
        raw_tokens=raw_tokens,
        attention=attention,
        labels=labels,
        feature_loss=feature_loss,
        train_lm_head=not freeze_lm_head,
        weight_decay=weight_decay,
        threads=threads,
        bundle=bundle,
        writer=writer or "",
        gen_batch=gen_batch,
        write_only=write_only,
    )
    summary = train_heads(options, progress=lambda line: click.echo(line, err=True))
    if summary:
        click.echo(json.dumps(summary))


@click.command(cls=OneLineErrors)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with every figure's source).")
@click.option("--sources", is_flag=True, help="List where each figure comes from.")
def devices(as_json, sources):
    """The device catalog, and this machine measured live."""
    from dataclasses import asdict

    from mtp_edge.devices.catalog import catalog, devices_table, host_device

    click.echo("[host] measuring memory bandwidth and matmul throughput", err=True)
    entries = [host_device(), *catalog()]
    if as_json:
        click.echo(json.dumps([asdict(d) for d in entries], indent=2))
        return
    click.echo(devices_table(entries))
    if sources:
        for d in entries:
            click.echo(f"{d.name}:")
            for figure, source in d.sources.items():
                click.echo(f"  {figure}: {source}")


@click.command(cls=OneLineErrors)
@click.option("--bundle", required=True, help="The bundle to predict for (ExecuTorch).")
@click.option(
    "--device",
    "device_names",
    multiple=True,
    default=("host",),
    show_default=True,
    help="host (measured live) | a catalog name (mtp-devices) | all (repeatable).",
)
@click.option(
    "--from-bench",
    default=None,
    help="mtp-bench JSON of this bundle: its tau and acceptance (and, for host, the measured "
    "tokens/s to compare with).",
)
@click.option("--json", "json_out", default=None, help="Write the predictions as JSON here.")
@click.option("--markdown", "markdown_out", default=None, help="Write the table here.")
def predict(bundle, device_names, from_bench, json_out, markdown_out):
    """Roofline prediction of plain and speculative tokens/s and the speedup on a device."""
    from mtp_edge.devices import predict as roofline
    from mtp_edge.devices.catalog import catalog, find_device
    from mtp_edge.manifest import Manifest

    names = [d.name for d in catalog()] if "all" in device_names else list(device_names)
    if "all" in device_names:
        names.insert(0, "host")
    chosen = [find_device(name) for name in names]  # unknown names fail before measuring
    bench_report = None
    if from_bench is not None:
        bench_report = roofline.load_bench(from_bench)
    cost = roofline.bundle_cost(bundle)
    click.echo("[calibrate] timing the bundle's programs on this machine", err=True)
    calibration = roofline.calibrate(bundle, cost)
    acceptance = roofline.acceptance_from(bench_report, Manifest.load(bundle, verify=False), cost.k)
    predictions = [roofline.predict(cost, d, calibration, acceptance) for d in chosen]
    validation = None
    if bench_report is not None and "host" in names:
        validation = roofline.compare_with_measured(predictions[names.index("host")], bench_report)
    out = {
        "bundle": bundle,
        "command": " ".join(["mtp-predict", *sys.argv[1:]]),
        "calibration": calibration.__dict__,
        "predictions": predictions,
        "host_validation": validation,
    }
    markdown = roofline.to_markdown(predictions, validation)
    write_atomic(json_out, json.dumps(out, indent=2) + "\n")
    write_atomic(markdown_out, markdown)
    click.echo(markdown)


@click.command(cls=OneLineErrors)
@click.option("--device", required=True, help="host, or the serial of an adb device.")
@click.option("--bundle", required=True, help="The bundle to measure.")
@click.option("--prompts", "prompts_path", default=None, help="JSONL prompts (default: built in).")
@click.option(
    "--max-new-tokens", default=None, type=int, help="Override every prompt's max_new_tokens."
)
@click.option("--repeat", default=1, show_default=True, help="Runs per prompt (medians).")
@click.option("--json", "json_out", default=None, help="Write the report (mtp-bench format).")
@click.option(
    "--runner",
    default=None,
    help="The native mtp-runner for the device (default: runtime/native/build-android/mtp-runner).",
)
@click.option(
    "--as",
    "catalog_name",
    default=None,
    help="Catalog device to predict with (default: matched from the device's SoC).",
)
def profile(device, bundle, prompts_path, max_new_tokens, repeat, json_out, runner, catalog_name):
    """Measure plain vs speculative decoding on the host or an adb device, next to the
    roofline prediction for that device."""
    from mtp_edge.devices.harness import load_prompts
    from mtp_edge.devices.profile import profile_device

    if repeat < 1:
        raise UserError(f"--repeat must be >= 1, got {repeat}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    report = profile_device(
        device,
        bundle,
        load_prompts(prompts_path),
        max_new_tokens,
        repeat,
        runner,
        catalog_name,
        json_out,
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(report["markdown"])
