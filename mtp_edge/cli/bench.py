"""mtp-bench, mtp-devices, mtp-predict and mtp-profile: measuring and predicting speed."""

from __future__ import annotations

import sys

import click

from mtp_edge.cli.common import (
    OneLineErrors,
    drafter_options,
    json_option,
    load_options,
    say,
    write_json,
)
from mtp_edge.errors import Fault, UserError, require
from mtp_edge.files import check_output, write_atomic


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "--prompts",
    "prompts_path",
    default=None,
    help="JSONL prompts file, or a request log (mtp-serve/mtp-chat --log DIR) to bench a model on "
    "its own traffic (default: the built-in suite).",
)
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Passes over the suite (medians and spread).",
)
@click.option(
    "-n",
    "--max-new-tokens",
    default=None,
    type=click.IntRange(1),
    help="Override every prompt's max_new_tokens.",
)
@json_option("the report")
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
    "interleaved). DIR[,k=N][,drafter=NAME][,draft_confidence=P][,fallback=on|off] also "
    "compares k values, drafters, --draft-confidence floors or the fallback of one bundle.",
)
@click.option(
    "--llama-cpp",
    "llama_cpp",
    default=None,
    help="A llama.cpp build (a directory with llama-bench, or its bin/ or build/bin/): llama.cpp "
    "decodes the bundle's GGUF (or -m's) as a peer baseline, timed after each prompt. Default: "
    "llama-bench on PATH for a bundle, else skipped with a note.",
)
@click.option(
    "--gguf",
    default=None,
    help="The GGUF for the llama.cpp peer (default: the file the bundle was exported from, or "
    "-m's GGUF).",
)
def bench(
    prompts_path,
    repeat,
    max_new_tokens,
    json_out,
    markdown_out,
    report_dir,
    compare,
    llama_cpp,
    gguf,
    **opts,
):
    """Plain vs speculative greedy decoding on the same backend, over a prompt suite."""
    import dataclasses

    from mtp_edge.devices.bench_setups import Stopped, partial_markdown
    from mtp_edge.devices.bench_setups import bench as measure
    from mtp_edge.devices.harness import load_prompts, to_markdown
    from mtp_edge.devices.workers import compare_spec

    if compare and opts["bundle"] is None:
        raise UserError("--compare puts bundles side by side: give the first one with --bundle")
    check_output(json_out, "--json")
    check_output(markdown_out, "--markdown")
    check_output(report_dir, "--report", directory=True)
    if report_dir is not None:
        require("matplotlib", "report", "mtp-bench --report")
    prompts = load_prompts(prompts_path)
    first = load_options(opts)
    setups = [first] + [dataclasses.replace(first, **compare_spec(c)) for c in compare]
    machine = None
    if report_dir is not None:
        from mtp_edge.devices.report import machine_description

        say("[machine] measuring memory bandwidth and matmul throughput")
        machine = machine_description()  # before ExecuTorch takes the cores
    command = " ".join(["mtp-bench", *sys.argv[1:]])
    rounds, llama_note = None, None
    if llama_cpp is not None or first.bundle is not None or gguf is not None:
        from mtp_edge.devices.peer import LlamaCppRounds, find_llama_bench, llama_cpp_source

        find_llama_bench(llama_cpp)  # a wrong directory fails now, not after the measurement
        source = llama_cpp_source(first.bundle, llama_cpp, gguf, first.model)
        if source is None and llama_cpp is not None:
            llama_note = {"note": f"llama.cpp not measured: {first.model} is not a GGUF file: "
                          "give --gguf"}  # fmt: skip
        if isinstance(source, dict):
            llama_note = source
        elif source is not None:
            import torch

            threads = first.threads or torch.get_num_threads()
            rounds = LlamaCppRounds(*source, threads, repeat)
            say(f"[peer] llama.cpp ({threads} threads) decodes each prompt's shape after ours")

    def peer_round(row: dict) -> None:
        run = rounds.after(row)
        if run is not None:
            say(f"  llama.cpp: {run['tokens'] / run['seconds']:.1f} tok/s")

    try:
        reports = measure(
            setups, prompts, repeat, max_new_tokens, command, say,
            after_prompt=peer_round if rounds is not None else None,
        )  # fmt: skip
    except Stopped as stop:  # Ctrl-C or SIGTERM after some prompts: keep what was measured
        runs = stop.reports
        write_json(json_out, runs[0] if len(runs) == 1 else {"command": command, "runs": runs})
        write_atomic(markdown_out, "\n".join(partial_markdown(r) for r in stop.reports))
        done = stop.reports[0]["partial"]
        say(f"[partial] {done['prompts_done']} of {done['prompts']} prompts measured and written")
        raise stop.cause from None
    if rounds is not None:
        peer = rounds.result()
        if "error" not in peer and peer["threads"] != reports[0]["threads"]:
            peer["note"] = (
                f"llama.cpp ran {peer['threads']} threads, the first setup {reports[0]['threads']}"
            )
        reports[0]["peer_llama_cpp"] = peer
    elif llama_note is not None:
        reports[0]["peer_llama_cpp"] = llama_note
    markdown = "\n".join(to_markdown(r) for r in reports)
    body = reports[0] if len(reports) == 1 else {"command": command, "runs": reports}
    write_json(json_out, body)
    write_atomic(markdown_out, markdown)
    if report_dir is not None:
        from mtp_edge.devices.report import write_report

        say(f"[report] {write_report(report_dir, reports, command, machine)}")
    if json_out != "-":
        click.echo(markdown)
    if not all(r["summary"]["lossless"] for r in reports):
        raise Fault(
            "speculative output diverged from plain output beyond a near-tie: a bug in "
            "mtp-edge; please report it with the JSON report"
        )


@click.command(cls=OneLineErrors)
@json_option("the devices (with every figure's source)")
@click.option("--sources", is_flag=True, help="List where each figure comes from.")
def devices(json_out, sources):
    """The device catalog, and this machine measured live."""
    from dataclasses import asdict

    from mtp_edge.devices.catalog import catalog, devices_table, host_device

    check_output(json_out, "--json")
    say("[host] measuring memory bandwidth and matmul throughput")
    entries = [host_device(), *catalog()]
    write_json(json_out, [asdict(d) for d in entries])
    if json_out == "-":
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
@json_option("the predictions")
@click.option("--markdown", "markdown_out", default=None, help="Write the table here.")
def predict(bundle, device_names, from_bench, json_out, markdown_out):
    """Roofline prediction of plain and speculative tokens/s and the speedup on a device."""
    from mtp_edge.devices.predict import predict_bundle

    check_output(json_out, "--json")
    check_output(markdown_out, "--markdown")
    command = " ".join(["mtp-predict", *sys.argv[1:]])
    out, markdown = predict_bundle(bundle, device_names, from_bench, command, say)
    write_json(json_out, out)
    write_atomic(markdown_out, markdown)
    if json_out != "-":
        click.echo(markdown)


@click.command(cls=OneLineErrors)
@click.option("--device", required=True, help="host, or the serial of an adb device.")
@click.option("--bundle", required=True, help="The bundle to measure.")
@click.option("--prompts", "prompts_path", default=None, help="JSONL prompts (default: built in).")
@click.option(
    "-n",
    "--max-new-tokens",
    default=None,
    type=click.IntRange(1),
    help="Override every prompt's max_new_tokens.",
)
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Runs per prompt (medians).",
)
@json_option("the report (mtp-bench format)")
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

    check_output(json_out, "--json")
    prompts = load_prompts(prompts_path)
    if any(p.messages for p in prompts):
        raise UserError(
            "mtp-profile's runner takes one user message per prompt, and these prompts hold "
            "conversations: measure them with mtp-bench --prompts, or give single-turn prompts"
        )
    if any(p.raw for p in prompts):
        raise UserError(
            "mtp-profile's runner wraps each prompt in the chat template, and this request log "
            "holds raw completions: measure them with mtp-bench --prompts, or give prompts for "
            "the chat template"
        )
    report = profile_device(
        device,
        bundle,
        prompts,
        max_new_tokens,
        repeat,
        runner,
        catalog_name,
        None if json_out == "-" else json_out,
        progress=say,
    )
    if json_out == "-":
        write_json("-", {k: v for k, v in report.items() if k != "markdown"})
    else:
        click.echo(report["markdown"])
