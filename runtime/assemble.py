"""Assembly: from (a bundle or a model, a drafter choice, options) to a ready generator.

Everything that decodes gets its target session, drafter, tokenizer and generation settings
here: the CLI's commands, the benchmark harness and its worker processes, `mtp-profile`,
`mtp-predict`, the benchmark scripts. The drafting policy (which drafter, the prompt-lookup
sizes tried before a model drafter, its confidence floor, k) is decided here and only here:
what the options say, else what the bundle's exporter stored, else the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_edge.errors import UserError
from mtp_edge.runtime.adapt import adapting, bundle_heads, check_can_adapt
from mtp_edge.runtime.drafters import (
    Drafter,
    DraftModelDrafter,
    HybridDrafter,
    NgramDrafter,
    check_same_vocabulary,
)
from mtp_edge.runtime.loop import GenerationConfig
from mtp_edge.runtime.sampling import SamplingParams
from mtp_edge.runtime.session import EagerSession, Session

DEFAULT_K = 4
DEFAULT_NGRAM_SIZES = "1-3"


def k_for_this_cpu(k: int, manifest) -> int:
    """The bundle's k on this CPU: lowered to fit one pass of the int8 GEMM's tile where the
    CPU has no int8 dot product and the target's scheme runs that GEMM (the platform table's
    int8_tile_schemes; for 4-bit weights in groups, int4_tile_schemes, the groupwise GEMM's
    3-row tile on AVX2: xnnpack_tile_rows). There k + 1 rows beyond the tile's make a second
    pass over the weights: on an AVX2 host (4-row tile) k = 3 ran 1.10-1.11x against k = 4's
    0.98-1.02x, side by side on the default model (benchmarks/README.md, "CPUs without an int8
    dot product"). Where the CPU has a dot product (VNNI: 5 rows; the phones' SDOT/SMMLA) the
    bundle's k stands. An 8da8w-avx2 or 8da4w-mix-avx2 target (our kernels) keeps k + 1 within
    their 6 rows on every CPU. An explicit k (--k) is never changed; the native runtime applies the
    same rule."""
    from mtp_edge.machine import int8_path
    from mtp_edge.ops import LINEAR_I8_ROWS
    from mtp_edge.platforms import OWN_KERNEL_SCHEMES

    path = int8_path()
    fitted = k_for_int8_path(k, manifest, path)
    if fitted != k:
        from mtp_edge import logs

        if target_scheme(manifest) in OWN_KERNEL_SCHEMES:
            why = f"its {target_scheme(manifest)} layers verify up to {LINEAR_I8_ROWS} tokens"
        else:
            why = (
                f"this CPU ({path.name}) has no int8 dot product and verifies up to "
                f"{xnnpack_tile_rows(manifest, path)} tokens"
            )
        logs.say(
            f"[k] {fitted} tokens drafted per step, not the bundle's {k}: {why} in one pass "
            f"over the weights (--k {k} to draft {k})"
        )
    return fitted


def target_scheme(manifest) -> str | None:
    """The target model's weight scheme as the manifest records it (None without one)."""
    target = manifest.models.get("target")
    return (target.quant or {}).get("scheme") if target is not None else None


def k_for_int8_path(k: int, manifest, path) -> int:
    """k_for_this_cpu's rule for a CPU whose int8 path (mtp_edge/machine.py Int8Path, or None
    where unknown) is `path`: what the runtime drafts per step there (mtp-predict for a catalog
    device)."""
    from mtp_edge.ops import LINEAR_I8_ROWS
    from mtp_edge.platforms import OWN_KERNEL_SCHEMES, by_backend

    row = by_backend(manifest.backend)
    scheme = target_scheme(manifest)
    if scheme in OWN_KERNEL_SCHEMES and row is not None and row.backend == "executorch":
        return min(k, LINEAR_I8_ROWS - 1)  # our kernel's tile, the same on every CPU
    rows = xnnpack_tile_rows(manifest, path)
    if rows is None or k + 1 <= rows:
        return k
    return max(1, rows - 1)


def xnnpack_tile_rows(manifest, path) -> int | None:
    """Rows of the XNNPACK GEMM tile that bounds a verification of the bundle's target on a CPU
    of int8 path `path` without an int8 dot product (None where none does, or not known): the
    per-channel 8-bit GEMM's for the platform's int8_tile_schemes and per-channel 4-bit weights,
    the groupwise 4-bit GEMM's for its int4_tile_schemes in groups (8da4w, 8da4w-mix: 3 rows
    on AVX2, so k = 2)."""
    from mtp_edge.platforms import by_backend

    row = by_backend(manifest.backend)
    if row is None or path is None or path.dot_product:
        return None
    target = manifest.models.get("target")
    quant = (target.quant or {}) if target is not None else {}
    scheme = quant.get("scheme")
    if scheme in row.int8_tile_schemes:
        return path.xnnpack_rows
    if scheme in row.int4_tile_schemes:
        return path.blockwise_rows if quant.get("group_size") else path.xnnpack_rows
    return None


@dataclass
class LoadOptions:
    """What to decode with; None means "the bundle's choice, else the default"."""

    model: str = "default"  # HF directory, .gguf file or "default", on the eager backend
    bundle: str | None = None  # an exported bundle instead of `model`
    # none | ngram | mtp | a draft model's path | any of these +ngram; None: the bundle's drafter
    # with its lookup (mtp+ngram), or ngram for a model
    drafter: str | None = None
    k: int | None = None  # most tokens drafted per step
    heads: str | None = None  # MTP heads file for a model (default: the shipped heads)
    adaptive_k: bool = False
    # draft each step only as many tokens as measured acceptance and costs say pay, none when
    # drafting does not (runtime/fallback.py): True always (sampling: one seed may then give
    # other samples from run to run); None when greedy; False never. Off by default: measured
    # on the default bundle it lifted qa 0.92x -> 0.98x of plain but the suite 1.22x -> 1.14x
    # (benchmarks/README.md, "The fallback").
    fallback: bool | None = False
    ngram_sizes: str | None = None  # "MIN-MAX" for ngram and the lookup of X+ngram
    draft_confidence: float | None = None  # model drafters' floor on the best probability
    max_seq_len: int = 2048  # static KV cache length (a model; a bundle has its own)
    chat: bool = True  # wrap prompts in the chat template
    threads: int = 0  # CPU threads (0: torch's default)
    # recognise special tokens (<|im_end|>...) typed in prompts; by default they are plain text,
    # so that user text cannot close its turn or speak as another role
    parse_special: bool = False
    # MTP heads learn from verification while serving (runtime/adapt.py): drafts change, the
    # output does not
    adapt: bool = False


@dataclass
class Generator:
    """A loaded target, its session and drafter, and the settings to generate with."""

    name: str
    tokenizer: object
    session: Session
    drafter: Drafter | None
    config: GenerationConfig
    chat: bool
    bundle: str | None
    draft_confidence: float = 0.0
    parse_special: bool = False
    adapter: object | None = None  # runtime/adapt.py's Adapter, when the heads adapt

    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """A prompt's ids (one user turn in the chat template), or a conversation's; `raw`: the
        text as it stands, no chat template, special tokens in it read as text (a logged raw
        completion, mtp_edge/request_log.py)."""
        if raw:
            return self.tokenizer.encode_prompt(prompt, chat=False)
        if isinstance(prompt, list):
            return self.tokenizer.encode_messages(prompt, self.parse_special)
        return self.tokenizer.encode_prompt(
            prompt, chat=self.chat, parse_special=self.parse_special
        )

    @property
    def label(self) -> str:
        """How progress lines name this setup when several are compared."""
        label = f"{Path(self.bundle or self.name).name} k={self.config.k}"
        if self.drafter is not None and self.draft_confidence:
            label += f" confidence={self.draft_confidence:g}"
        if self.drafter is not None and self.config.fallback is False:
            label += " no-fallback"
        return label

    def render(self, prompt: str | list[dict]) -> str:
        """The prompt as text, as a runner that tokenizes by itself must receive it."""
        if isinstance(prompt, list):
            return self.tokenizer.render_messages(prompt)
        if self.chat and self.tokenizer.chat_template is not None:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return prompt


def parse_ngram_sizes(text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition("-")
        sizes = (int(low), int(high or low))
    except ValueError:
        raise UserError(f"--ngram-sizes takes MIN-MAX such as 1-3, got {text!r}") from None
    return sizes


def assemble(
    options: LoadOptions,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 128,
    stop_strings=(),
) -> Generator:
    """Load the target (a model on the eager backend, or a bundle) and its drafter."""
    from mtp_edge.checkpoints import load_model

    if options.threads:
        torch.set_num_threads(options.threads)
    if options.ngram_sizes is not None:
        parse_ngram_sizes(options.ngram_sizes)  # bad sizes fail before anything loads
    if options.max_seq_len < 2:
        raise UserError(f"--max-seq-len must be >= 2, got {options.max_seq_len}")
    drafter, k = options.drafter, options.k
    ngram_sizes, confidence = options.ngram_sizes, options.draft_confidence
    if options.bundle is not None:
        from mtp_edge.runtime.bundle import open_bundle, target_session

        if options.model != "default":
            raise UserError("give either --model or --bundle, not both")
        bundle = open_bundle(options.bundle)
        spec = bundle.manifest.drafter
        if options.adapt:  # before the programs load
            own = spec.kind + ("+ngram" if spec.lookup is not None else "")
            check_can_adapt(drafter or own)
            head, source = bundle_heads(bundle, options.heads)
        session = target_session(bundle)
        tokenizer, name, target = bundle.tokenizer, bundle.manifest.model_name, None
        if drafter is None:  # the bundle's drafter, as its exporter set it to run
            drafter = spec.kind
            if spec.lookup is not None:
                drafter += "+ngram"
                ngram_sizes = ngram_sizes or spec.lookup
        confidence = spec.draft_confidence if confidence is None else confidence
        k = k_for_this_cpu(spec.k, bundle.manifest) if k is None else k
    else:
        bundle = None
        if options.adapt:
            check_can_adapt(drafter or "ngram")
        target = load_model(options.model)
        tokenizer, name = target.tokenizer, target.name
        max_seq_len = min(options.max_seq_len, target.config.max_position_embeddings)
        session = EagerSession(target.model, max_seq_len)
        drafter = drafter or "ngram"
    ngram_sizes = ngram_sizes or DEFAULT_NGRAM_SIZES
    confidence = 0.0 if confidence is None else confidence
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        k=DEFAULT_K if k is None else k,
        adaptive_k=options.adaptive_k,
        fallback=options.fallback,
        sampling=sampling or SamplingParams(),
        stop_strings=tuple(stop_strings),
        eos_ids=tuple(tokenizer.eos_ids),
    )
    if options.adapt and bundle is None:
        head, source = _heads_to_adapt(target, options.heads)
    draft = build_drafter(
        drafter,
        target,
        bundle,
        session.max_seq_len,
        ngram_sizes,
        confidence,
        options.heads,
        loaded=head if options.adapt and bundle is None else None,
    )
    adapter = None
    if options.adapt:
        draft, adapter = adapting(draft, head, source)
    return Generator(
        name,
        tokenizer,
        session,
        draft,
        config,
        options.chat,
        options.bundle,
        confidence,
        options.parse_special,
        adapter,
    )


def _heads_to_adapt(target, heads: str | None):
    """The heads an adapting drafter on a model starts from (their output layer scores the
    correction), and where they came from."""
    from mtp_edge.mtp import heads_file, load_heads

    path = heads_file(target.name, heads)
    if path is None:
        raise UserError(
            f"no MTP heads ship for {target.name}: pass --heads (train them with mtp-train)"
        )
    return load_heads(path, target.model, target.name), str(path)


def build_drafter(
    spec: str,
    target,
    bundle,
    max_seq_len: int,
    ngram_sizes: str = DEFAULT_NGRAM_SIZES,
    confidence: float = 0.0,
    heads: str | None = None,
    loaded=None,
) -> Drafter | None:
    """The drafter named by `spec`: none | ngram | mtp | a draft model path | X+ngram.

    `target` is the LoadedModel on the eager backend (None with a bundle), `bundle` the opened
    bundle (None with a model), whose own drafter `spec` must then name. `loaded`: what a model
    drafter is made from when it is already in memory (mtp: the MTPHead; a draft model: its
    LoadedModel), instead of reading `heads` or the path (the export's quality report).
    """
    if spec == "none":
        return None
    if spec.endswith("+ngram"):  # e.g. mtp+ngram: lookup where the context repeats, else mtp
        model = build_drafter(
            spec.removesuffix("+ngram"),
            target,
            bundle,
            max_seq_len,
            ngram_sizes,
            confidence,
            heads,
            loaded,
        )
        if model is None:
            raise UserError(f"--drafter {spec}: name a model drafter before +ngram, e.g. mtp+ngram")
        low, high = parse_ngram_sizes(ngram_sizes)
        return HybridDrafter(model, max_n=high, min_match=low)
    if spec == "ngram":
        low, high = parse_ngram_sizes(ngram_sizes)
        return NgramDrafter(max_n=high, min_n=low)
    if bundle is not None:
        from mtp_edge.runtime.bundle import bundle_drafter

        own = bundle.manifest.drafter.kind
        if spec != own:
            raise UserError(
                f"--drafter {spec}: this bundle carries a '{own}' drafter; use it, none or "
                "ngram (or export another bundle)"
            )
        return bundle_drafter(bundle, confidence)
    if spec == "mtp":
        from mtp_edge.mtp import heads_file, load_heads
        from mtp_edge.runtime.mtp_drafter import mtp_drafter

        if loaded is None:
            heads = heads_file(target.name, heads)
            if heads is None:
                raise UserError(
                    f"no MTP heads ship for {target.name}: pass --heads (train them with mtp-train)"
                )
            loaded = load_heads(heads, target.model, target.name)
        return mtp_drafter(loaded.to(target.model.dtype), target.model, confidence)
    if loaded is not None:  # a draft model already loaded (and its vocabulary checked)
        return DraftModelDrafter(EagerSession(loaded.model, max_seq_len), min_confidence=confidence)
    from mtp_edge.checkpoints import load_model, model_vocabulary

    # Compare vocabularies from the draft's tokenizer and config alone: its weights can take
    # gigabytes and most of a minute to load.
    draft_tokenizer, draft_vocab_size = model_vocabulary(spec)
    check_same_vocabulary(
        target.tokenizer.backend.get_vocab(),
        draft_tokenizer.backend.get_vocab(),
        target.config.vocab_size,
        draft_vocab_size,
    )
    draft = load_model(spec)
    return DraftModelDrafter(EagerSession(draft.model, max_seq_len), min_confidence=confidence)
