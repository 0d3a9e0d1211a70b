"""mtp-serve: a model behind a local OpenAI-compatible HTTP server (as llama-server and
mlx_lm.server), for the tools that speak OpenAI's API."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import signal
import socket

import click

from mtp_edge.cli.common import (
    OneLineErrors,
    adapt_option,
    check_adapt,
    drafter_options,
    load_options,
    log_option,
    sampling_options,
    say,
)
from mtp_edge.errors import UserError
from mtp_edge.request_log import RequestLog
from mtp_edge.tokenizer import _check_utf8 as check_utf8


@click.command(cls=OneLineErrors)
@drafter_options
@sampling_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (the default, loopback, is this machine only).",
)
@click.option(
    "--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="0: any free."
)
@click.option(
    "--max-queue",
    default=8,
    show_default=True,
    type=click.IntRange(0),
    help="Requests that may wait while one is generated; more are answered 503 at once.",
)
@click.option("--model-name", default=None, help="The model's id for clients (default: its name).")
@log_option
@adapt_option
def serve(
    host,
    log,
    save_heads,
    port,
    max_queue,
    model_name,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    stop_strings,
    **opts,
):
    """Serve a model with OpenAI's chat and completions API, one request at a time.

    The sampling flags are the defaults of requests that do not set them (-n: max_tokens).
    With --adapt the heads learn after each request; --save-heads writes them at shutdown.
    """
    try:
        from mtp_edge.server import Defaults, Server, create_app
    except ImportError as e:  # fastapi and uvicorn are an extra
        raise UserError(f"mtp-serve needs {e.name}: pip install 'mtp-edge[serve]'") from None

    for stop in stop_strings:
        check_utf8(stop, "--stop")
    check_adapt(opts["adapt"], save_heads)
    listener = _listen(host, port)  # a taken port fails before the model loads
    try:
        if log:  # an unwritable folder fails before the load; a taken port made no folder
            RequestLog(log)
        from mtp_edge.api import load

        if not _is_loopback(host):
            click.echo(
                f"warning: listening on {host}: other machines can reach this server, which has "
                "no authentication",
                err=True,
            )
        options = dataclasses.asdict(load_options(opts))
        llm = load(options.pop("model"), log=log, **options)
        defaults = Defaults(max_new_tokens, temperature, top_k, top_p, seed, stop_strings)
        app = create_app(llm, max_queue, model_name, defaults)
        address = listener.getsockname()
        url = f"http://{_url_host(address[0])}:{address[1]}/v1"
        ready = f"mtp-serve: {model_name or llm.name} at {url} (Ctrl-C stops)"
        server = Server(app, on_ready=lambda: say(ready))
        server.run(sockets=[listener])
    finally:
        listener.close()
    if save_heads:  # after a clean shutdown, a signal's included
        say(f"mtp-serve: adapted heads written to {llm.save_heads(save_heads)}")
    # A signal stopped it, after a clean shutdown: exit as every command does, 128 + its number
    # (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
    if server.stopped_by is None:
        say("mtp-serve: stopped")
        return
    say(f"mtp-serve: stopped by {signal.Signals(server.stopped_by).name}")
    raise click.exceptions.Exit(128 + server.stopped_by)


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a UserError that says why not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}; give an address such as 127.0.0.1") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        # Listening now holds the port while the model loads (a second server started
        # meanwhile is refused here, not after its own load); connections made meanwhile
        # wait in the backlog until uvicorn accepts them.
        listener.listen(128)
    except OSError as e:
        listener.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is in use (another server?): stop it or choose another "
                "port with --port"
            ) from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return listener


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
