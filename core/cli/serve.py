"""`tensorfold serve`: the OpenAI-compatible HTTP server.

Prints the memory plan and the address, serves until SIGINT or SIGTERM, then stops admitting
(new requests get 503), lets in-flight requests end for up to --shutdown-timeout and aborts the
rest (shutdown.py), kills the prompt workers (prompt_workers.py, whatever they are doing), stops
the engine and prints the pool's census. Exit status 0, or 1 when the census is UNEVEN.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from tensorfold.config.settings import Settings

if TYPE_CHECKING:
    from tensorfold.engine.start import Served
    from tensorfold.server.prompt_workers import PromptWorkers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorfold.cli.commands import (
        add_engine_arguments,
        add_family_arguments,
        add_reasoning_argument,
    )

    add_family_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1/ routes (TF_API_KEY)",
    )
    parser.add_argument(
        "--api-key-file", metavar="PATH", help="as --api-key, the key being the file's first line"
    )
    parser.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        help="origins whose web pages may call the server (CORS): a comma "
        "list such as https://app.example.com, or * (TF_ALLOWED_ORIGINS; "
        "default: none)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        metavar="HOSTS",
        help="hosts whose http(s) image URLs chat requests may name, a comma list such as "
        "images.example.com; each is fetched within TF_MAX_IMAGE_MIB and "
        "TF_MEDIA_FETCH_TIMEOUT_S (TF_ALLOWED_MEDIA_DOMAINS; default: none, data: URLs only)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the API (default: --model, or FAMILY-demo)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        metavar="N",
        help="requests that may wait for a lane before new ones get 503",
    )
    parser.add_argument(
        "--max-body-mib",
        type=float,
        metavar="MIB",
        help="largest request body accepted, larger ones get 413 (TF_MAX_BODY_MIB, default 8)",
    )
    add_reasoning_argument(parser)
    parser.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        default=None,
        help="log no line per request (TF_ACCESS_LOG=0; default: one info line each)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long in-flight requests may run on after SIGINT/SIGTERM",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from tensorfold.cli.commands import CommandError

    if not 0 <= args.port <= 65535:
        raise CommandError(f"--port must be in 0..65535, got {args.port}")
    if args.max_waiting < 0:
        raise CommandError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if not args.shutdown_timeout >= 0:
        raise CommandError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    from tensorfold.engine.start import open_served, parallel_launch, pick_device
    from tensorfold.server.api_key import resolve_api_key
    from tensorfold.server.image_decode import MediaSource, media_processor
    from tensorfold.server.prompt_workers import PromptWorkers

    api_key = resolve_api_key(args.api_key, args.api_key_file, settings.api_key)
    launch = parallel_launch(settings)
    # The port is taken before the weights load, so that a busy one is said at once.
    sock = listen(args.host, args.port) if launch is None or launch.rank == 0 else None
    try:
        served = open_served(settings, args.family, args.model)  # checks the TF_* environment
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    assert sock is not None  # ranks past 0 follow rank 0 in open_served and exit there
    try:
        if args.served_model_name:
            served.model_name = args.served_model_name
        served.engine.max_waiting = args.max_waiting
        args.origins = settings.origins
        media = MediaSource.of(served.spec, served.checkpoint)
        takes = media_processor(media) is not None  # built here once, and in each worker
        prompts = PromptWorkers(
            served.tokenizer, settings.prepare_workers, media if takes else None
        )
        prompts.start()
        try:
            asyncio.run(
                _serve(served, args, settings, api_key, pick_device(settings), sock, prompts)
            )
        finally:
            prompts.close()  # kills them: a stop never waits on a prompt's work
        for sig in (signal.SIGINT, signal.SIGTERM):  # repeats while the engine winds down
            signal.signal(sig, signal.SIG_IGN)
    finally:
        served.close()
    if served.engine.fatal is not None:  # a tensor-parallel rank was lost: the server stopped
        print(
            f"tensorfold: error: {served.engine.fatal}; the server stopped",
            file=sys.stderr,
            flush=True,
        )
        if served.engine.alive:  # stuck in a collective with the lost rank (NCCL): leave now
            sys.stdout.flush()
            os._exit(1)
        return 1
    census = served.engine.lanes.pool.census()
    if not census.idle_even:
        print("UNEVEN " + census.line(), flush=True)
        return 1
    print(census.line(), flush=True)
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: any free port); CommandError when it cannot be had."""
    from tensorfold.cli.commands import CommandError

    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        return socket.create_server(address, family=family, backlog=1024)
    except OSError as exc:
        # create_server's own message repeats the address; a name lookup's errno is its own
        why = (
            exc.strerror
            if isinstance(exc, socket.gaierror) or not exc.errno
            else os.strerror(exc.errno)
        ) or str(exc)
        hint = (
            "; is another server there? choose another with --port"
            if (exc.errno == errno.EADDRINUSE)
            else ""
        )
        raise CommandError(f"cannot listen on {host}:{port}: {why}{hint}") from None


def _url(host: str, port: int, path: str = "/v1") -> str:
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


def start_line(served: Served, host: str, port: int) -> str:
    """What `serve` prints once it listens: the model, its status page, and (last, where
    scripts read it) the API's address."""
    return (
        f"serving {served.model_name} ({served.family_note}): status page "
        f"{_url(host, port, '/status')}, API at {_url(host, port)}"
    )


async def _serve(
    served: Served,
    args: argparse.Namespace,
    settings: Settings,
    api_key: str | None,
    device: str,
    sock: socket.socket,
    prompts: PromptWorkers,
) -> None:
    from aiohttp import web

    from tensorfold.config.logs import get_logger
    from tensorfold.server.api_key import exposure_warning
    from tensorfold.server.app import create_app
    from tensorfold.server.connections import ConnectionCaps, handler_args, serve_on
    from tensorfold.server.media_limits import MediaLimits
    from tensorfold.server.request_limits import MIB, Limits
    from tensorfold.server.shutdown import RUNNER_GRACE_S, drain
    from tensorfold.server.state import STATE

    log = get_logger("tensorfold.serve")
    limits = Limits(
        max_body=int(settings.max_body_mib * MIB),
        read_timeout_s=settings.read_timeout_s,
        max_messages=settings.max_messages,
        prepare_timeout_s=settings.prepare_timeout_s,
        prompts=prompts,
        media=MediaLimits.from_settings(settings),
    )
    caps = ConnectionCaps(
        total=settings.max_connections,
        per_client=settings.max_client_connections,
        first_byte_s=settings.first_byte_timeout_s,
    )
    app = create_app(
        served,
        device=device,
        api_key=api_key,
        limits=limits,
        allowed_origins=args.origins,
        responses_store=settings.responses_store,
        access_log=settings.access_log,
    )
    state = app[STATE]
    # Draining is drain()'s, bounded by --shutdown-timeout; the runner then waits only briefly.
    connection_args = handler_args(limits)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=RUNNER_GRACE_S, **connection_args
    )
    await runner.setup()
    listening = await serve_on(
        runner, sock, caps, connection_args, state.metrics.errors.labels("503").inc
    )
    host, port = listening.sockets[0].getsockname()[:2]
    # The start lines, once, on stdout (not as log lines too).
    print(served.plan.startup_line(), flush=True)
    print(start_line(served, host, port), flush=True)
    if (warning := exposure_warning(args.host, api_key)) is not None:
        log.warning(warning)
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    served.engine.on_fatal.append(lambda why: loop.call_soon_threadsafe(signals.put_nowait, 0))
    if served.engine.fatal is None:
        await signals.get()
    state.draining = True
    if served.engine.fatal is not None:  # requests in flight have ended with the error
        log.error("stopping: " + served.engine.fatal)
    else:
        await drain(state, signals, args.shutdown_timeout)
    listening.close()
    await runner.cleanup()  # closes idle connections; cancels a handler still stuck after 1 s
