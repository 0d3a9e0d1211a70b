"""What a training run is told (TrainOptions) and the files it keeps next to --out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mtp_edge.errors import UserError


@dataclass
class TrainOptions:
    out: str = "heads.safetensors"
    model: str = "default"
    data: tuple[str, ...] = ()  # text files; empty: offline text + the target's own responses
    k: int = 4  # unrolled draft steps
    # Wall-clock minutes for writing, labelling and training together (budget.py splits them);
    # None: the fixed amounts below (--steps, --gen-tokens).
    minutes: float | None = None
    steps: int | None = None  # None: 3000, or as many as --minutes allows
    # Draft origins per step (per rank): drawn from anywhere in the text for heads without
    # attention, in whole sequences for heads with attention.
    batch_size: int = 512
    lr: float = 1e-3
    seed: int = 0
    resume: bool = False
    # Draft vocabulary size, or "auto": the smallest that covers COVERAGE_GOAL of the target's
    # predictions on the training text (labels.py, coverage_vocabulary_size)
    draft_vocab: int | str = "auto"
    num_blocks: int = 1
    intermediate_size: int = 0  # 0: the target's
    # "none", "target_cache" or "self" (mtp.py; measured in README.md, "The MTP drafter")
    attention: str = "none"
    labels: str = "hard"  # hard: the target's argmax; soft: its distribution over the draft vocab
    # Weight of the hidden-state loss: each step's output hidden state regressed onto the
    # target's own hidden state at the position it stands in for (EAGLE's feature loss), meant
    # to keep step j+1's input like the target's. Off by default: with it (and the LM head
    # frozen) the head stopped memorising its text but learned the target's choices more slowly
    # (benchmarks/README.md, "MTP head training").
    feature_loss: float = 0.0
    train_lm_head: bool = True  # False: the draft LM head stays the target's rows, frozen
    # Response tokens the target writes (default corpus only); None: 100k, or as many as
    # --minutes allows
    gen_tokens: int | None = None
    # More response tokens, to requests the target writes itself (Magpie: sampled from the
    # start of a user turn of its own chat template): requests as varied as the model's own
    # idea of what users ask, beyond the templates over offline material. None: a quarter of
    # gen_tokens, or under --minutes 40% of the writing time (none for a model without a chat
    # template or one that writes no usable request).
    self_prompt_tokens: int | None = None
    init: str | None = None  # heads to start from (their draft vocabulary and design too)
    gen_max_new: int = 256  # longest response
    gen_batch: int = 64  # prompts (and self-written requests) decoded together
    write_only: bool = False  # write the text (cached next to --out), then stop
    # Who writes the text: "int8" (the target with int8 linears, batched: the fastest where the
    # CPU multiplies int8 in hardware), "fp32" (the target as loaded, batched), "bundle" (the
    # exported target of --bundle, one sequence at a time: exactly what will run, ~1.4x slower
    # than int8), "auto" (int8 or fp32, whichever this machine runs faster: engines.py
    # measures). Default: the bundle when one is given, else auto. Measured agreement with
    # the bundle's own greedy choices: benchmarks/README.md, "Writing the text".
    writer: str = ""
    # Who labels the text (the hidden state and argmax at every position): "int8" (the int8
    # target, ~3.7x faster than fp32 on a 2-core x86 CPU with VNNI, 10-50x slower on one with
    # AVX2 only), "fp32" (the target as loaded), "bundle" (--bundle's exported target, ~10x
    # faster than fp32 and what the heads will draft for), "auto" (as for the writer).
    # Default: the bundle when one is given, else auto. Measured against each other:
    # benchmarks/README.md, "Who labels the text".
    labeller: str = ""
    # The user's requests (a .txt file, one per line; a .jsonl file of "prompt" strings or
    # "messages" lists; or a folder of them or of request logs): the target answers them and
    # the heads train on the answers, beside the default text (prompts.py).
    prompts: str | None = None
    # The share of the written response tokens that answer the user's requests (the rest: the
    # default text's template and self-written requests). 0.75: the requests are what the
    # heads will draft for, and the default quarter keeps them drafting for what a stream of
    # a few hundred requests never asks (its test part is unlike it too).
    prompts_share: float = 0.75
    # Answers the target writes to each of the user's requests: the greedy one, then sampled
    # ones (ANSWER_TEMPERATURE), while the share above has room: more of the requests' own
    # kind of text from a few hundred of them, whose greedy answers alone the heads memorise.
    answers_per_request: int = 1
    raw_tokens: int = 50_000  # tokens of offline text (default corpus only)
    seq_len: int = 512  # longest text sequence
    heldout: float = 0.05  # fraction of sequences held out for evaluation
    step_decay: float = 0.8  # loss weight of draft step j is step_decay ** (j - 1)
    weight_decay: float = 0.0
    warmup: int = 100
    log_every: int = 50
    eval_every: int = 500
    checkpoint_every: int = 500
    threads: int = 0  # 0: torch's default
    # An ExecuTorch bundle of the same target (exported with --drafter mtp, so that it returns
    # hidden states): it writes and labels the text instead of the eager model, so the heads
    # learn the exported (quantized) target's states and choices — what they will be run on.
    bundle: str | None = None
    device: str = "cpu"  # where training runs ("cuda": the head, its batches and the labels)
    # read from `prompts` when the run starts (prompts.py); a field, so that options rebuilt
    # from their fields (torchrun's processes) keep them
    requests: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        self.data = tuple(self.data)
        self.writer = self.writer or ("bundle" if self.bundle else "auto")
        self.labeller = self.labeller or ("bundle" if self.bundle else "auto")
        if self.minutes is not None and self.steps is not None:
            raise UserError(
                "--minutes sets how long training runs and --steps how many steps: give one"
            )
        if self.minutes is None:
            self.steps = 3000 if self.steps is None else self.steps
            self.gen_tokens = 100_000 if self.gen_tokens is None else self.gen_tokens
        if isinstance(self.draft_vocab, str) and self.draft_vocab != "auto":
            try:
                self.draft_vocab = int(self.draft_vocab)
            except ValueError:
                raise UserError(
                    f"--draft-vocab must be a number of tokens or auto, got {self.draft_vocab}"
                ) from None
        checks = [
            (self.k >= 1, f"--k must be >= 1, got {self.k}"),
            (
                self.minutes is None or self.minutes > 0,
                f"--minutes must be > 0, got {self.minutes}",
            ),
            (self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (
                self.draft_vocab == "auto" or self.draft_vocab >= 1,
                f"--draft-vocab must be >= 1 or auto, got {self.draft_vocab}",
            ),
            (self.num_blocks >= 1, f"--num-blocks must be >= 1, got {self.num_blocks}"),
            (0 < self.heldout < 1, f"--heldout must be in (0, 1), got {self.heldout}"),
            (self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}"),
            (self.gen_batch >= 1, f"--gen-batch must be >= 1, got {self.gen_batch}"),
            (
                self.writer in ("auto", "int8", "fp32", "bundle"),
                f"--writer must be auto, int8, fp32 or bundle, got {self.writer}",
            ),
            (
                self.writer != "bundle" or self.bundle is not None,
                "--writer bundle writes with the exported target: give it with --bundle",
            ),
            (
                self.labeller in ("auto", "int8", "fp32", "bundle"),
                f"--labeller must be auto, int8, fp32 or bundle, got {self.labeller}",
            ),
            (
                0 < self.prompts_share <= 1,
                f"--prompts-share must be in (0, 1], got {self.prompts_share}",
            ),
            (
                self.answers_per_request >= 1,
                f"--answers-per-request must be >= 1, got {self.answers_per_request}",
            ),
            (
                self.answers_per_request == 1 or self.writer != "bundle",
                "--answers-per-request above 1 samples answers, which the exported target's "
                "writer does not: give --writer fp32 or int8",
            ),
            (
                not (self.prompts and self.data),
                "--data gives the training text itself and --prompts asks the target to write "
                "it: give one",
            ),
            (
                self.labeller != "bundle" or self.bundle is not None,
                "--labeller bundle labels with the exported target: give it with --bundle",
            ),
            (
                min(self.gen_tokens or 0, self.raw_tokens, self.self_prompt_tokens or 0) >= 0,
                "token budgets must be >= 0",
            ),
            (
                self.attention in ("none", "target_cache", "self"),
                f"--attention must be none, target_cache or self, got {self.attention}",
            ),
            (self.labels in ("soft", "hard"), f"--labels must be soft or hard, got {self.labels}"),
            (self.feature_loss >= 0, f"--feature-loss must be >= 0, got {self.feature_loss}"),
            (
                self.device == "cpu" or self.device.startswith("cuda"),
                f"--device must be cpu or cuda, got {self.device}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {self.device}: no CUDA device here; train with --device cpu")

    def response_tokens(self) -> int | None:
        """Response tokens to write: --gen-tokens (None under --minutes: until its deadline)."""
        return self.gen_tokens

    def recipe(self) -> dict:
        """What the heads file records about how it was made (file names, not local paths)."""
        values = asdict(self)
        for key in (
            "out",
            "resume",
            "threads",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "write_only",
            "device",
            "requests",
        ):
            values.pop(key)
        values["model"] = Path(self.model).name
        values["bundle"] = Path(self.bundle).name if self.bundle else None
        values["data"] = [Path(p).name for p in self.data]
        values["init"] = Path(self.init).name if self.init else None
        values["prompts"] = Path(self.prompts).name if self.prompts else None
        if self.answers_per_request == 1:  # recipes from before it compare equal
            values.pop("answers_per_request")
        if not self.prompts:  # recipes from before --prompts compare equal
            values.pop("prompts")
            values.pop("prompts_share")
        return values


def artifact_paths(out: str | Path) -> dict[str, Path]:
    out = Path(out)
    return {
        "generated": out.with_name(out.stem + ".gen.jsonl"),
        "requests": out.with_name(out.stem + ".requests.jsonl"),  # the target's own requests
        "checkpoint": out.with_name(out.stem + ".ckpt.safetensors"),
        "labels": out.with_name(out.stem + ".labels"),  # + .<part><rank>.safetensors
        "checkpoint_json": out.with_name(out.stem + ".ckpt.json"),
    }
