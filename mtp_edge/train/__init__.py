"""mtp-train: MTP heads for a target that has none, by self-distillation from the frozen target.

Four stages, each a plain function:
1. corpus: the user's text files; or offline text (the Python docs that ship with the interpreter
   and stdlib sources) plus responses the target writes itself to instruction prompts built from
   that material. What the head must predict is what the target says, so the target's own
   writing is the best data; the responses are cached next to --out and never regenerated.
2. labels: the frozen target, teacher-forced over each sequence: per position its final hidden
   state and its argmax next token.
3. draft vocabulary: the tokens the target predicts most often (the head's LM head covers only
   these, which keeps a draft step cheap); by default the fewest that cover 99% of its
   predictions on the training text.
4. training-time test (EAGLE-3): whole sequences at once; from every position, k unrolled steps
   on the head's own hidden state (and, for heads that read the target's cache, attention over
   the target's last-layer K/V plus the head's own K/V of the earlier steps, as drafting writes
   them), each scored against the target's distribution over the draft vocabulary (soft labels;
   `--labels hard`: its argmax); early steps weigh more, as a later draft only counts when the
   earlier ones were accepted.

`--minutes N` gives the stages one wall-clock budget (budget.py: how it is split, measured on
this machine as the run goes); the output is the best held-out heads of the run, and the run
ends with a one-screen report (final_report.py).

Runs under `torchrun --nproc_per_node=N` (gloo): ranks share the generation, label and train on
their own shard of sequences, and DistributedDataParallel averages the gradients. Only rank 0
writes files.

Modules, each importing only those above it:
- options: TrainOptions, and the files a run keeps next to --out (artifact_paths).
- corpus: text without the target: the user's files (plain or prompt/response pairs), offline
  text, and the instruction prompts built from that material (stage 1's input).
- prompts: the user's requests (--prompts: .txt, .jsonl, folders, request logs), checked.
- budget: --minutes: the stages' deadlines, the rule that splits the time.
- int8: the target with int8 linears (an int8 writer and labeller).
- generate: batched generation on the eager target, one-at-a-time through an exported one.
- own_requests: the requests the target writes itself.
- writer: stage 1's text: the target's answers (templates, its own requests, the user's),
  the cache of what it wrote.
- labels: stages 2 and 3: Labels from the eager or exported target (cached), the draft
  vocabulary.
- engines: who writes and who labels (int8, fp32 or the exported target), measured on this
  machine when not forced.
- state: what the stages share (Run) and hand each other (Labelled, Trainer, Scores).
- context: the attention of heads that attend, for all origins at once (TrainContext).
- losses: stage 4's test: batches, losses, held-out evaluation.
- resume: checkpoints and the checks a resumed run makes.
- step_loop: the step loop and the learning-rate schedule.
- rates: what the run measures (labelling and training-step rates; a draft step's cost).
- final_report: the report a run ends with.
- stages: the run (train_heads): the stages in order, DDP, the best held-out heads.
"""

from mtp_edge.train.corpus import Sequence, doc_topics
from mtp_edge.train.engines import open_target_bundle
from mtp_edge.train.generate import generate_batch, generate_with_session
from mtp_edge.train.int8 import Int8Linear, int8_writer
from mtp_edge.train.labels import Labels, draft_vocabulary, label_sequences, label_with_session
from mtp_edge.train.losses import rope_tables, sequence_batch
from mtp_edge.train.options import TrainOptions
from mtp_edge.train.stages import train_heads
from mtp_edge.train.writer import build_corpus

__all__ = [
    "Int8Linear",
    "Labels",
    "Sequence",
    "TrainOptions",
    "build_corpus",
    "doc_topics",
    "draft_vocabulary",
    "generate_batch",
    "generate_with_session",
    "int8_writer",
    "label_sequences",
    "label_with_session",
    "open_target_bundle",
    "rope_tables",
    "sequence_batch",
    "train_heads",
]
