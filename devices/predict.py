"""Roofline prediction of plain and speculative decoding speed on a device.

One forward call of T tokens at context length C costs
    t(T, C) = overhead + bytes(T, C) / bandwidth + flops(T, C) / compute
where bytes are the weights streamed from the bundle's own files (all but the embedding table,
of which only T rows are read), the KV cache read up to C and written for T, and the logits and
hidden activations; flops are 2 per matmul weight per token plus attention over C. (A sum, not
the textbook max: see `call_time`.) The larger term is the limit that binds.

Plain decoding emits one token per t(1, C). Speculative decoding emits tau tokens (measured on
the host, `--from-bench`) per verify call t(k+1, C) plus the drafter's proposal. On a
memory-bound chip t(k+1) is close to t(1), which is where the speedup comes from.

Device compute and bandwidth are peak figures; kernels reach a fraction of them. That fraction,
the per-call overhead, the loop's own work and the drafter's cost are measured on the host by
timing the bundle's programs (`calibrate_session`), and carried over to catalog devices.

The compute rate is the int8 rate at which a verification's extra rows are computed (a k+1-token
call against a one-token call), not a prefill's: on a CPU without an int8 dot product (x86 with
AVX2 only: XNNPACK widens the weights to 16 bits and multiplies with VPMADDWD) those rows cost
far more than the weight read they share, and verify(k+1) costs ~1.7 decoding steps where a
VNNI or SDOT/SMMLA core keeps it near 1.1. A catalog device's rate is its int8 peak times the
host's efficiency against its own int8 probe (XNNPACK's 8-bit GEMM, mtp_edge/machine.py).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mtp_edge.devices.catalog import Device, host_device, int8_path_label
from mtp_edge.devices.cost import BundleCost, bundle_cost
from mtp_edge.errors import UserError
from mtp_edge.machine import INT8_PATHS, int8_path
from mtp_edge.manifest import Manifest
from mtp_edge.platforms import OWN_KERNEL_HEADS, OWN_KERNEL_SCHEMES
from mtp_edge.runtime.assemble import k_for_int8_path, target_scheme

# CPU read streams on phone SoCs reach about this fraction of the LPDDR peak (assumption; the
# host's own bandwidth is measured, not scaled).
CATALOG_BANDWIDTH_EFFICIENCY = 0.6


@dataclass
class Calibration:
    """Measured on the host: what the roofline alone does not know."""

    bandwidth_gbs: float  # memory read bandwidth, probed at calibration time
    compute_gops: float  # int8 rate of a verification's extra rows (k+1 vs 1 token, same context)
    compute_efficiency: float  # compute_gops / the host's int8 matmul probe (XNNPACK 8da8w)
    target_overhead_ms: float  # a 1-token call minus its memory and compute time
    draft_overhead_ms: float  # one draft step (incl. the drafter's Python) minus its roofline
    plain_loop_ms: float  # the loop's own work per plain step (a session that costs nothing)
    spec_loop_ms: float  # the same per verify step of k+1 tokens
    measured_ms: dict  # the raw timings


def _median_ms(fn, runs: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


class _FreeSession:
    """A session whose calls cost nothing: timing the loop around it measures the loop alone."""

    name = "free"

    def __init__(self, vocab: int, hidden: int, max_chunk: int, token: int):
        import torch

        self.vocab_size, self.max_seq_len, self.max_chunk = vocab, 4096, max_chunk
        self.logits = torch.zeros(max_chunk, vocab)
        self.logits[:, token] = 1.0
        self.hidden = torch.zeros(max_chunk, hidden)

    def forward(self, tokens, start, return_hidden=False):
        from mtp_edge.runtime.session import Output

        n = len(tokens)
        return Output(self.logits[:n], self.hidden[:n] if return_hidden else None)


class _RepeatDrafter:
    """Drafts the free session's token k times, so every step verifies and accepts k+1."""

    name, needs_hidden = "repeat", True

    def __init__(self, token: int):
        self.token = token

    def propose(self, context, hidden, k, sampler):
        from mtp_edge.runtime.drafters import Draft

        return Draft([self.token] * k)

    def observe(self, context, hidden):
        pass


def loop_overheads(cost: BundleCost, steps: int = 64) -> tuple[float, float]:
    """Per-step cost of the draft-verify loop itself (ms), plain and speculative."""
    from mtp_edge.runtime.loop import GenerationConfig, generate

    token = 7
    session = _FreeSession(cost.vocab, cost.hidden, cost.k + 1, token)
    prompt = list(range(10, 42))
    out = []
    for drafter, tokens in ((None, steps), (_RepeatDrafter(token), steps * (cost.k + 1))):
        config = GenerationConfig(max_new_tokens=tokens + 1, k=cost.k)
        runs = []
        for _ in range(3):
            s = generate(session, prompt, drafter, config).stats
            runs.append((s.decode_seconds - s.draft_seconds) / max(s.verify_steps, 1) * 1e3)
        out.append(min(runs))
    return out[0], out[1]


def calibrate(
    bundle_dir: str | Path, cost: BundleCost, repeats: int = 3, context: int = 256
) -> Calibration:
    """Open the bundle and calibrate on it (see `calibrate_session`) a few times, at `context`
    positions; the least disturbed run (`best`)."""
    from mtp_edge.runtime.assemble import LoadOptions, assemble

    host_device()  # probe the matmul peak before ExecuTorch takes the cores
    # The bundle's own drafter alone, no lookup and no confidence floor: the cost of k steps.
    options = LoadOptions(bundle=str(bundle_dir), drafter=cost.drafter_kind, draft_confidence=0)
    gen = assemble(options)
    session, drafter = gen.session, gen.drafter
    return best([calibrate_session(session, drafter, cost, context) for _ in range(repeats)])


def calibrate_session(
    session, drafter, cost: BundleCost, context: int = 256, runs: int = 7
) -> Calibration:
    """Time the bundle's programs on this machine: a 1-token call (overhead), a k+1-token call
    right after it (the int8 rate of a verification's extra rows), a full prefill chunk (the
    rate where those rows cost nothing measurable), the drafter's proposals, the loop around a
    free session; and probe the memory bandwidth right then, since other load on the machine
    changes all of them.

    The session's cache slots from `context` on are written; a generation that starts at 0
    overwrites them before it reads them."""
    from mtp_edge.devices.catalog import measure_bandwidth_gbs
    from mtp_edge.runtime.sampling import Sampler, SamplingParams

    host = host_device()
    chunk = min(session.max_chunk, session.max_seq_len // 2)
    width = min(cost.k + 1, chunk)
    context = max(min(context, session.max_seq_len - chunk - 1), 8)
    bw = measure_bandwidth_gbs(megabytes=256, runs=3) * 1e9
    full = _median_ms(lambda: session.forward([5] * chunk, context), max(3, runs // 3))
    memory_full = call_time(*cost.target_call(chunk, context), bw, float("inf"), 0.0).ms
    prefill_compute = cost.target_call(chunk, context)[1] / max((full - memory_full) / 1e3, 1e-6)
    one, verify_ms = _alternating_ms(session, width, context, 3 * runs)
    b1, f1 = cost.target_call(1, context)
    bk, fk = cost.target_call(width, context)
    # The verification's extra rows: their arithmetic and the few extra bytes they move. Where
    # they cost no measurable time (a dot-product core, memory-bound), the prefill's rate. Not
    # capped at the prefill's rate: a prefill chunk's rows are slower per row than a
    # verification's few (on an AVX-512 VNNI host the cap predicted verify/decode 1.43 where
    # both the calibration's own calls and the loop measured 1.18).
    extra_s = (verify_ms - one) / 1e3 - (bk - b1) / bw
    compute = (fk - f1) / extra_s if extra_s > 0 and width > 1 else prefill_compute
    target_overhead = max(one - call_time(b1, f1, bw, compute, 0.0).ms, 0.0)
    plain_loop, spec_loop = loop_overheads(cost)
    # The drafter's whole proposal of k tokens, as the loop calls it: right after a target call,
    # which has pushed the drafter's weights out of the caches.
    draft_ms = draft_overhead = 0.0
    sampler = Sampler(SamplingParams())
    if drafter is not None:
        # ordinary token ids (past the first few, often special), inside any vocabulary: an
        # id past it would make an ExecuTorch program abort
        span = max(min(session.vocab_size, 510) - 10, 1)
        history = [(i * 7) % span + min(10, session.vocab_size - 1) for i in range(context)]
        hidden = None
        if drafter.needs_hidden:
            hidden = session.forward(history[-8:], context - 8, return_hidden=True).hidden
        times = []
        for _ in range(runs):
            session.forward([5], context)
            t = time.perf_counter()
            drafter.propose(history, hidden, cost.k, sampler)
            times.append(time.perf_counter() - t)
        draft_ms = statistics.median(times) * 1e3
        cold = draft_proposal(cost, cost.k, bw, compute, 0.0)
        draft_overhead = max((draft_ms - cold.ms) / cost.k, 0.0)
    return Calibration(
        bandwidth_gbs=round(bw / 1e9, 2),
        compute_gops=round(compute / 1e9, 2),
        compute_efficiency=round(min(compute / 1e9 / host.cpu_int8_gops, 1.0), 4),
        target_overhead_ms=round(target_overhead, 3),
        draft_overhead_ms=round(draft_overhead, 3),
        plain_loop_ms=round(plain_loop, 3),
        spec_loop_ms=round(spec_loop, 3),
        measured_ms={
            "target_1_token": round(one, 3),
            f"target_{width}_tokens_after_1": round(verify_ms, 3),
            "verify_over_decode": round(verify_ms / one, 3),
            f"target_{chunk}_tokens": round(full, 3),
            "prefill_compute_gops": round(prefill_compute / 1e9, 2),
            f"draft_proposal_k{cost.k}": round(draft_ms, 3),
            "context": context,
            "host_int8_probe_gops": host.cpu_int8_gops,
            "host_int8_path": host.int8_path,
        },
    )


def _alternating_ms(session, width: int, context: int, runs: int) -> tuple[float, float]:
    """Median ms of a one-token call and of a `width`-token call right after it, alternating
    as in the speculative loop (a call repeated alone is cheaper than in the loop)."""
    ones, wides = [], []
    for i in range(runs + 2):
        t = time.perf_counter()
        session.forward([5], context)
        middle = time.perf_counter()
        session.forward([5] * width, context + 1)
        if i >= 2:
            ones.append(middle - t)
            wides.append(time.perf_counter() - middle)
    return statistics.median(ones) * 1e3, statistics.median(wides) * 1e3


def best(calibrations: list[Calibration]) -> Calibration:
    """The calibration of the least disturbed run (its one-token call the fastest), every figure
    from that run. Taking the best of each figure from different runs paired one run's bandwidth
    with another's compute and overhead: on a noisy AVX2-class run the overhead came out 0 and
    plain decoding was predicted 36% too fast."""
    chosen = min(calibrations, key=lambda c: c.measured_ms["target_1_token"])
    fields = {name: getattr(chosen, name) for name in asdict(chosen) if name != "measured_ms"}
    return Calibration(**fields, measured_ms={"runs": [c.measured_ms for c in calibrations]})


def average(calibrations: list[Calibration]) -> Calibration:
    """The mean of calibrations taken before and after a measurement (machine drift)."""
    first = calibrations[0]
    fields = {
        name: round(statistics.mean(getattr(c, name) for c in calibrations), 4)
        for name in asdict(first)
        if name != "measured_ms"
    }
    return Calibration(**fields, measured_ms={"runs": [c.measured_ms for c in calibrations]})


@dataclass
class CallTime:
    ms: float
    memory_ms: float
    compute_ms: float
    overhead_ms: float

    @property
    def bound(self) -> str:
        parts = {
            "memory": self.memory_ms,
            "compute": self.compute_ms,
            "overhead": self.overhead_ms,
        }
        return max(parts, key=parts.get)


def call_time(nbytes, flops, bandwidth, compute, overhead_ms) -> CallTime:
    """Overhead + memory time + compute time. Not the max of the two: at these sizes a CPU's
    quantized matmul kernels hardly overlap streaming the weights with the arithmetic (on the
    host, a 5-token call costs what the sum predicts, the max underestimates it by a third)."""
    memory_ms = nbytes / bandwidth * 1e3
    compute_ms = flops / compute * 1e3
    return CallTime(overhead_ms + memory_ms + compute_ms, memory_ms, compute_ms, overhead_ms)


def draft_proposal(cost: BundleCost, steps: float, bandwidth, compute, overhead_ms) -> CallTime:
    """`steps` MTP drafter steps: its weights come from DRAM once (the target call before has
    evicted them), then from the cache; each step pays its arithmetic and its overhead."""
    nbytes, flops = cost.draft_step()
    return call_time(nbytes, flops * steps, bandwidth, compute, overhead_ms * steps)


def acceptance_from(bench: dict | None, manifest: Manifest, k: int) -> dict:
    """tau and drafted tokens per step: measured (`--from-bench`), else the bundle's own
    held-out estimate from training its drafter."""
    if bench is not None:
        s = bench["summary"]
        accepted = max(s["tau"] - 1, 0.0)
        rate = s["acceptance_rate"]
        drafted = accepted / rate if rate > 0 else float(k)
        rows = bench.get("prompts", [])
        context = (
            statistics.mean(r["prompt_tokens"] + r["ar_tokens"] / 2 for r in rows) if rows else 256
        )
        return {
            "tau": s["tau"],
            "drafted_per_step": round(min(drafted, k), 3),
            "context": round(context),
            "source": "measured on the host (--from-bench)",
        }
    recipe = manifest.drafter.recipe
    per_position = recipe.get("heldout_acceptance")
    if isinstance(per_position, list) and k <= len(per_position) and k != recipe.get("k"):
        # The share of steps whose i-th drafted token was accepted, measured at the heads' k:
        # tau at a smaller k is 1 + the first k of them.
        return {
            "tau": round(1 + sum(per_position[:k]), 4),
            "drafted_per_step": float(k),
            "context": 256,
            "source": f"the drafter's held-out acceptance from training (manifest), at k = {k}; "
            "pass --from-bench",
        }
    if "heldout_tau" in recipe:
        return {
            "tau": recipe["heldout_tau"],
            "drafted_per_step": float(k),
            "context": 256,
            "source": "the drafter's held-out tau from training (manifest); pass --from-bench",
        }
    return {"tau": None, "drafted_per_step": float(k), "context": 256, "source": "none"}


def predict(
    cost: BundleCost,
    device: Device,
    calibration: Calibration,
    acceptance: dict,
) -> dict:
    """Plain and speculative tokens/s on `device`, which limit binds, and the speedup.

    The host uses what calibration measured; a catalog device its peak figures scaled by the
    efficiencies the host reached (bandwidth: an assumed fraction, see above). Per-call overheads
    are carried over from the host unscaled."""
    if device.measured:
        bandwidth = calibration.bandwidth_gbs * 1e9
        compute = calibration.compute_gops * 1e9
    else:
        bandwidth = device.bandwidth_gbs * 1e9 * CATALOG_BANDWIDTH_EFFICIENCY
        compute = device.cpu_int8_gops * 1e9 * calibration.compute_efficiency
    context = acceptance["context"]
    k = cost.k
    plain = call_time(
        *cost.target_call(1, context),
        bandwidth,
        compute,
        calibration.target_overhead_ms + calibration.plain_loop_ms,
    )
    out = {
        "device": device.name,
        "bundle": cost.name,
        "k": k,
        "context": context,
        "int8_path": device.int8_path,
        "bandwidth_gbs_used": round(bandwidth / 1e9, 2),
        "compute_gops_used": round(compute / 1e9, 1),
        "plain": {**_show(plain), "tokens_per_s": round(1e3 / plain.ms, 2)},
        "acceptance": acceptance,
    }
    tau = acceptance["tau"]
    if tau is None or cost.drafter_kind == "none":
        return out
    # A verification checks what its step drafted, and one token more: k where the drafter
    # always proposes k, fewer on average where a confidence floor or a lookup stops it (then a
    # call of k + 1 rows overstated the loop's verifications where rows cost: AVX2's kernels).
    drafted = acceptance["drafted_per_step"]
    width = 1 + min(drafted, k)
    verify = call_time(
        *cost.target_call(width, context),
        bandwidth,
        compute,
        calibration.target_overhead_ms + calibration.spec_loop_ms,
    )
    if cost.drafter_kind == "mtp":
        step = draft_proposal(cost, drafted, bandwidth, compute, calibration.draft_overhead_ms)
        draft_ms = step.ms
    elif cost.drafter_kind == "draft-lm" and cost.drafter is not None:
        # A draft model: one call per drafted token plus one catch-up call (like plain decoding).
        draft_shape = BundleCost(
            cost.name,
            cost.drafter,
            cost.drafter_bits,
            cost.drafter_bits,
            cost.vocab,
            cost.hidden,
            "none",
            None,
            k,
        )
        calls = drafted + 1
        nbytes, flops = draft_shape.target_call(1, context)
        step = call_time(
            nbytes * calls,
            flops * calls,
            bandwidth,
            compute,
            calibration.target_overhead_ms * calls,
        )
        draft_ms = step.ms
    else:  # n-gram lookup: no model; its measured proposal time (Python) carried over
        step, draft_ms = None, calibration.draft_overhead_ms * k
    step_ms = verify.ms + draft_ms
    spec_tps = tau / step_ms * 1e3
    out["speculative"] = {
        "verify": _show(verify),
        "verify_tokens": round(width, 3),
        "verify_over_decode": round(verify.ms / plain.ms, 3),
        "draft": _show(step) if step else None,
        "draft_ms_per_verify": round(draft_ms, 3),
        "ms_per_verify": round(step_ms, 3),
        "tokens_per_s": round(spec_tps, 2),
    }
    out["speedup"] = round(spec_tps / out["plain"]["tokens_per_s"], 3)
    return out


def _show(t: CallTime) -> dict:
    d = {k: round(v, 3) for k, v in asdict(t).items()}
    d["bound"] = t.bound
    return d


def load_bench(path: str | Path) -> dict:
    """An mtp-bench JSON (one run; with --compare, its first run), checked for the figures the
    prediction reads, so that any other JSON is one line here rather than a crash later."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read bench report {path}: {e.strerror}") from None
    except ValueError as e:
        raise UserError(f"{path} is not JSON ({e}): pass the file mtp-bench --json wrote") from None

    def refuse(why: str) -> UserError:
        return UserError(
            f"{path} is not an mtp-bench --json report ({why}): pass the file mtp-bench --json "
            "wrote"
        )

    if not isinstance(data, dict):
        raise refuse(f"it holds a JSON {type(data).__name__}, not an object")
    if "runs" in data:  # mtp-bench --compare: the first run is the --bundle one
        runs = data["runs"]
        if not isinstance(runs, list) or not runs or not isinstance(runs[0], dict):
            raise refuse('its "runs" is not a list of reports')
        data = runs[0]
    summary = data.get("summary")
    if not isinstance(summary, dict) or "tau" not in summary:
        raise refuse("it has no summary with tau")
    for key in ("tau", "acceptance_rate", "ar_tokens_per_s", "spec_tokens_per_s", "speedup"):
        if not _is_number(summary.get(key)):
            raise refuse(f'its summary has no number "{key}"')
    rows = data.get("prompts", [])
    if not isinstance(rows, list) or not all(
        isinstance(r, dict)
        and _is_number(r.get("prompt_tokens"))
        and _is_number(r.get("ar_tokens"))
        for r in rows
    ):
        raise refuse('its "prompts" are not rows with prompt_tokens and ar_tokens')
    return data


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_bench_of(bench: dict, path: str | Path, bundle: str | Path, manifest: Manifest) -> None:
    """Refuse a bench report of another bundle, model, backend or drafter: its tau and tokens/s
    would be taken as this bundle's and the prediction would look right while being of
    something else. The target's sha256 decides where the report records it (a copied or moved
    bundle is the same bundle; one re-exported in place is not); else the bundle's path."""
    again = f"bench this bundle (mtp-bench --bundle {bundle} --json BENCH.json) and pass that"
    where = bench.get("bundle")
    if not isinstance(where, str) or not where:
        what = bench.get("model") or "a model"
        raise UserError(
            f"{path} is a bench of {what} on the {bench.get('backend')} backend, not of a "
            f"bundle: {again}"
        )
    target = manifest.models["target"].sha256
    recorded = bench.get("target_sha256")
    same_path = Path(where).resolve() == Path(bundle).resolve()
    if recorded is None and not same_path:
        try:  # a report from before target_sha256: the bundle it names, if it is still there
            recorded = Manifest.load(where, verify=False).models["target"].sha256
        except (UserError, OSError, KeyError, ValueError):
            raise UserError(
                f"{path} is a bench of the bundle {where}, not of {bundle} (and {where} is no "
                f"bundle to compare now): {again}"
            ) from None
    if recorded is not None and recorded != target:
        raise UserError(
            f"{path} is a bench of the bundle {where}, whose target differs from {bundle}'s "
            f"(sha256): {again}"
        )
    for key, ours in (("model", manifest.model_name), ("backend", manifest.backend)):
        if key in bench and bench[key] != ours:
            raise UserError(
                f"{path} is a bench of {key} {bench[key]}, and {bundle} is {ours}: {again}"
            )
    drafter = bench.get("drafter")
    if isinstance(drafter, str) and drafter.split("+")[0] != manifest.drafter.kind:
        raise UserError(
            f"{path} measured the {drafter} drafter, and {bundle} drafts with "
            f"{manifest.drafter.kind}: its tau is not this bundle's; {again}, without --drafter"
        )


# How close the host's prediction should come to the measurement (benchmarks/README.md goals).
PREDICTION_GOAL = 0.15


def compare_with_measured(prediction: dict, bench: dict) -> dict:
    """Predicted vs measured tokens/s, verify/decode and speedup on the host, and the relative
    error of each."""
    s = bench["summary"]
    out = {}
    pairs = [("plain", prediction["plain"]["tokens_per_s"], s["ar_tokens_per_s"])]
    if "speculative" in prediction:
        pairs.append(
            ("speculative", prediction["speculative"]["tokens_per_s"], s["spec_tokens_per_s"])
        )
        if _is_number(s.get("verify_over_decode")):
            spec = prediction["speculative"]
            pairs.append(("verify / decode", spec["verify_over_decode"], s["verify_over_decode"]))
        pairs.append(("speedup", prediction["speedup"], s["speedup"]))
    for name, predicted, measured in pairs:
        error = (predicted - measured) / measured if measured else None
        out[name] = {
            "predicted": predicted,
            "measured": measured,
            "error": None if error is None else round(error, 4),
            "within_goal": error is not None and abs(error) <= PREDICTION_GOAL,
        }
    return out


def to_markdown(predictions: list[dict], validation: dict | None = None) -> str:
    lines = [
        "| device | int8 path | plain tok/s | plain bound | spec tok/s | verify / decode "
        "| verify bound | speedup | tau |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        spec = p.get("speculative")
        lines.append(
            f"| {p['device']} | {int8_path_label(p.get('int8_path'))} | "
            f"{p['plain']['tokens_per_s']:.1f} | {p['plain']['bound']} | "
            + (
                f"{spec['tokens_per_s']:.1f} | {spec['verify_over_decode']:.2f} | "
                f"{spec['verify']['bound']} | {p['speedup']:.2f}x | {p['acceptance']['tau']:.2f} |"
                if spec
                else "— | — | — | — | — |"
            )
        )
    if predictions:
        a = predictions[0]["acceptance"]
        lines += ["", f"tau and acceptance: {a['source']}; context {a['context']} tokens."]
    if validation:
        lines += [
            "",
            "Host: predicted vs measured (mtp-bench)",
            "",
            f"| quantity | predicted | measured | error | within ±{PREDICTION_GOAL:.0%} |",
            "|---|---|---|---|---|",
        ]
        for name, v in validation.items():
            error = "—" if v["error"] is None else f"{v['error']:+.1%}"
            lines.append(
                f"| {name} | {v['predicted']:.2f} | {v['measured']:.2f} | {error} | "
                f"{'yes' if v['within_goal'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def predict_bundle(bundle, device_names, from_bench, command: str, progress) -> tuple[dict, str]:
    """`mtp-predict`: predictions for the named devices ("host" measured live, "all"), with the
    host's prediction checked against a bench JSON when one is given; (JSON body, Markdown)."""
    from mtp_edge.devices.catalog import catalog, find_device

    names = [d.name for d in catalog()] if "all" in device_names else list(device_names)
    if "all" in device_names:
        names.insert(0, "host")
    chosen = [find_device(name) for name in names]  # unknown names fail before measuring
    bench_report = None if from_bench is None else load_bench(from_bench)
    cost = bundle_cost(bundle)
    manifest = Manifest.load(bundle, verify=False)
    scheme = target_scheme(manifest)
    head = (
        ((manifest.models["target"].quant or {}).get("head"))
        if "target" in manifest.models
        else None
    )
    if head in OWN_KERNEL_HEADS:  # an XNNPACK scheme with its LM head in our kernel
        scheme = f"{scheme}, its LM head in {head}"
    if (scheme in OWN_KERNEL_SCHEMES or head in OWN_KERNEL_HEADS) and any(
        not d.measured for d in chosen
    ):
        # The catalog's int8 rates are of the CPUs' dot-product instructions, which XNNPACK's
        # kernels use; these schemes' kernels have AVX2 versions (VPMADDWD, VPMADDUBSW) and plain
        # C++ loops
        # for every other CPU, neither of which those rates describe.
        why = (
            f"{bundle} runs its layers in mtp-edge's own kernels ({scheme}), whose speed "
            "the catalog's int8 figures do not describe"
        )
        if "all" not in device_names:
            raise UserError(f"{why}: predict it with --device host, on the machine that runs it")
        progress(f"[predict] host only: {why}")
        chosen = [d for d in chosen if d.measured]
        names = [d.name for d in chosen]
    if bench_report is not None:
        check_bench_of(bench_report, from_bench, bundle, manifest)
    if bench_report is not None and isinstance(bench_report.get("k"), int):
        # Predict at the k the measurement ran: the runtime may have drafted fewer tokens than
        # the bundle's k (on a CPU without an int8 dot product, runtime/assemble.py), or --k.
        ks = {d.name: bench_report["k"] for d in chosen}
        host_k = bench_report["k"]
    else:
        # Each device at the k the runtime drafts there (the bundle's, or fewer where its CPU
        # has no int8 dot product); the host's programs are timed at this machine's.
        host_k = k_for_int8_path(cost.k, manifest, int8_path())
        ks = {
            d.name: host_k
            if d.measured
            else k_for_int8_path(cost.k, manifest, INT8_PATHS.get(d.int8_path))
            for d in chosen
        }
    progress("[calibrate] timing the bundle's programs on this machine")
    # At the context the measurement ran at (its prompts' mean, and half the answers): a
    # verification's attention grows with the context, and faster than a decoding step's.
    context = acceptance_from(bench_report, manifest, host_k)["context"] if bench_report else 256
    calibration = calibrate(bundle, replace(cost, k=host_k), context=max(int(context), 8))
    predictions = []
    for d in chosen:
        k = ks[d.name]
        acceptance = acceptance_from(bench_report, manifest, k)
        predictions.append(predict(replace(cost, k=k), d, calibration, acceptance))
    validation = None
    if bench_report is not None and "host" in names:
        validation = compare_with_measured(predictions[names.index("host")], bench_report)
    out = {
        "bundle": bundle,
        "command": command,
        "calibration": calibration.__dict__,
        "predictions": predictions,
        "host_validation": validation,
    }
    return out, to_markdown(predictions, validation)
