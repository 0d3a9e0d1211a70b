"""Same seeds, same heads: six short training runs on a tiny random model (each kind of head,
the feature loss, text the target writes in int8 and in fp32), their heads files' sha256 and
held-out history, written as JSON. Run it before and after a change to the training code and
compare the two files: a change that keeps behaviour keeps every hash.

    python benchmarks/train_same_heads.py /tmp/run-dir results.json
"""

import hashlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import hf_reference, save_hf_dir

from mtp_edge.train import TrainOptions, train_heads

root = Path(sys.argv[1])
root.mkdir(parents=True, exist_ok=True)
WORDS = "the cat sat on a mat and then the dog ran to the park while birds sang in trees".split()
if not (root / "model").exists():
    ref = hf_reference(
        "llama", hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    save_hf_dir(ref, root / "model")
    rng = random.Random(0)
    (root / "words.txt").write_text(
        "\n".join(" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(300))
    )
base = dict(
    model=str(root / "model"),
    writer="int8",
    labeller="int8",
    data=(str(root / "words.txt"),),
    steps=60,
    batch_size=64,
    seq_len=64,
    draft_vocab=48,
    lr=3e-3,
    warmup=10,
    eval_every=20,
    log_every=20,
    checkpoint_every=20,
)
runs = {
    "none": {},
    "target_cache_soft": dict(attention="target_cache", labels="soft"),
    "self": dict(attention="self"),
    "feature_frozen": dict(train_lm_head=False, feature_loss=1.0),
    "written_int8": dict(
        data=(),
        writer="int8",
        labeller="int8",
        gen_tokens=60,
        gen_max_new=12,
        gen_batch=3,
        raw_tokens=300,
        self_prompt_tokens=0,
    ),
    "written_fp32": dict(
        data=(),
        gen_tokens=60,
        gen_max_new=12,
        gen_batch=3,
        raw_tokens=300,
        self_prompt_tokens=0,
        writer="fp32",
        labeller="fp32",
    ),
}
result = {}
for name, extra in runs.items():
    out = root / name / "heads.safetensors"
    opts = TrainOptions(out=str(out), **{**base, **extra})
    lines = []
    s = train_heads(opts, lines.append)
    result[name] = {
        "sha256": hashlib.sha256(out.read_bytes()).hexdigest()[:16],
        "history": [(h["step"], round(h["loss"], 6), h["tau"]) for h in s["history"]],
        "lines": [line for line in lines if not line.startswith("wrote ")],
    }
    print(name, result[name]["sha256"], result[name]["history"][-1], flush=True)
Path(sys.argv[2]).write_text(json.dumps(result, indent=1))
