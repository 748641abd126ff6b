"""`kvflow demo`: parse and check the options, start Temporal (and vLLM), run the demo.

The run itself (fleet, workload, display, reports) is `kvflow.workers.demo.run_demo`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from kvflow.cli.url_options import fail_without_secrets, http_url_or_exit, url_list_option
from kvflow.workers.codec_server import local_codec_server
from kvflow.workers.config import EXAMPLE_FLEET
from kvflow.workers.console import (
    PortOption,
    StateDirOption,
    UiPortOption,
    fail,
    load_fleet_or_exit,
    out,
)
from kvflow.workers.devserver import DEFAULT_STATE_DIR, DevServerError, EmbeddedTemporal
from kvflow.workers.vllm_server import Engine


class StopOnSigterm:
    """A SIGTERM handler that stops `kvflow demo` (or `kvflow dev`) in order, as Ctrl-C does.

    While the demo's event loop runs, it cancels the loop's main task (what asyncio does on
    Ctrl-C), so the workers and the simulators shut down in order; before and after, it
    raises KeyboardInterrupt. It does not go through SIGINT: a shell starts a background job
    with SIGINT ignored, and a SIGINT sent to itself would then do nothing.
    Only the first SIGTERM acts; later ones would cut the shutdown short.
    """

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        """Stop the running loop's main task, or interrupt when no loop runs."""
        if self.received:
            return
        self.received = True
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            # Wake the loop up if it sleeps in select(), as asyncio's own Ctrl-C handler does.
            task.get_loop().call_soon_threadsafe(lambda: None)
        else:
            raise KeyboardInterrupt

    def run(self, main: Coroutine[Any, Any, None]) -> None:
        """`asyncio.run(main)`, with a SIGTERM during it ending it as Ctrl-C does."""

        async def main_task() -> None:
            self.task = asyncio.current_task()
            await main

        try:
            asyncio.run(main_task())
        except asyncio.CancelledError:
            if not self.received:
                raise
            raise KeyboardInterrupt from None


def demo(
    fleet: Annotated[
        Path | None,
        typer.Option("--fleet", help="fleet file (default: kvflow's example fleet)"),
    ] = None,
    tasks: Annotated[int, typer.Option("--tasks", min=1, max=10_000, help="tasks to run")] = 60,
    seed: Annotated[
        int, typer.Option("--seed", help="seed of the workload and the simulators")
    ] = 7,
    keep_running: Annotated[
        bool, typer.Option("--keep-running", help="leave the stack up after the report")
    ] = False,
    engine: Annotated[
        Engine,
        typer.Option(
            "--engine",
            help="sim: a simulated replica per replica of the fleet; vllm: start real vLLM "
            "servers on --model (from `make vllm-env`)",
        ),
    ] = Engine.SIM,
    model: Annotated[
        Path | None,
        typer.Option("--model", help="model folder the vLLM servers serve (--engine vllm)"),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas", min=1, max=16, help="vLLM servers to start (--engine vllm; default 2)"
        ),
    ] = None,
    endpoints: Annotated[
        str | None,
        typer.Option(
            "--endpoints",
            callback=url_list_option,
            help="URL\\[,URL...]: vLLM servers that already run, one replica each",
        ),
    ] = None,
    samples: Annotated[
        str | None,
        typer.Option(
            "--samples",
            help="NAME\\[,NAME...] or all: the samples whose tasks the workload mixes "
            "(research_assistant, support_triage, code_review, openai_agents_travel, "
            "pydantic_ai_support; default: the first three)",
        ),
    ] = None,
    port: PortOption = 7233,
    ui_port: UiPortOption = 8233,
    state_dir: StateDirOption = DEFAULT_STATE_DIR,
) -> None:
    """Run agent tasks of three tenants on a simulated fleet, then show what they cost.

    With --endpoints or --engine vllm they run on real vLLM servers (one pool, `vllm`).
    --samples adds the OpenAI Agents SDK and Pydantic AI samples (their extras installed).
    Ctrl-C or SIGTERM stops the whole stack in order (exit status 0), --keep-running too.
    """
    from kvflow.workers.demo import (
        DEFAULT_SAMPLES,
        DemoOptions,
        EndpointError,
        SampleError,
        check_endpoints,
        connect_local,
        fleet_on_endpoints,
        load_samples,
        local_vllm_servers,
        log_to_file,
        parse_endpoints,
        parse_samples,
        run_demo,
        sample_models,
    )
    from kvflow.workers.vllm_server import VllmServerError, model_max_positions, vllm_install

    if engine is Engine.VLLM and endpoints is not None:
        fail(
            "--endpoints uses vLLM servers that already run, --engine vllm starts its own: "
            "give one of them"
        )
    if engine is Engine.VLLM and model is None:
        fail(
            "--engine vllm needs --model DIR, the model folder the vLLM servers serve "
            f"(after `make vllm-env`: --model {vllm_install().model_dir})"
        )
    if engine is Engine.SIM and (model is not None or replicas is not None):
        fail(
            "--model and --replicas are for --engine vllm; the simulated fleet's replicas "
            "come from --fleet"
        )
    try:
        chosen = parse_samples(samples) if samples is not None else DEFAULT_SAMPLES
        loaded = load_samples(chosen)
    except SampleError as exc:
        fail(str(exc))
    fleet = fleet or EXAMPLE_FLEET
    config = load_fleet_or_exit(fleet)
    urls: list[str] = []
    if endpoints is not None:
        try:
            urls = parse_endpoints(endpoints)
            for url in urls:
                http_url_or_exit("--endpoints", url)
            names = [m.name for m in config.models]
            served = check_endpoints(urls, sample_models(loaded), names_to_serve=names)
            config = fleet_on_endpoints(config, served)
        except EndpointError as exc:
            fail_without_secrets(str(exc), *urls, *endpoints.split(","))
    install = vllm_install()
    if engine is Engine.VLLM:
        assert model is not None
        missing = install.missing()
        if missing is not None:
            fail(missing)
        if model_max_positions(model) is None:
            fail(
                f"--model {model}: no Hugging Face model there (its config.json is missing "
                "or unreadable); give the folder that holds config.json and the weights"
            )
    log_file = log_to_file(state_dir / "demo.log")
    # The UI decodes claim-checked payloads (prompts, answers) through it: text, not references.
    codec = local_codec_server(state_dir / "context", ui_port)
    temporal = EmbeddedTemporal(
        port=port, ui_port=ui_port, state_dir=state_dir, codec_endpoint=codec.url
    )
    if engine is Engine.SIM and not urls:
        where = (
            f"fleet {fleet}: {len(config.pools)} pools, "
            f"{sum(p.replicas for p in config.pools)} replicas"
        )
    else:
        where = f"{len(urls) or replicas or 2} vLLM server(s), prices of fleet {fleet}"
    # SIGTERM stops the stack as Ctrl-C does, so no vLLM or Temporal process is left behind.
    sigterm = StopOnSigterm()
    signal.signal(signal.SIGTERM, sigterm)

    async def run() -> None:
        client = await connect_local(temporal.address, state_dir / "context")
        await run_demo(
            client,
            config,
            state_dir=state_dir,
            options=DemoOptions(tasks=tasks, seed=seed, samples=chosen),
            console=out,
            ui_url=temporal.ui_url,
            keep_running=keep_running,
            # Simulators in processes of their own (their file is the fleet's own file).
            fleet_file=fleet if engine is Engine.SIM and not urls else None,
        )

    with contextlib.ExitStack() as stack:
        try:
            if engine is Engine.VLLM:
                assert model is not None
                names = [m.name for m in config.models]
                started = time.monotonic()
                servers = stack.enter_context(
                    local_vllm_servers(
                        install,
                        model,
                        served_model_names=names,
                        replicas=replicas or 2,
                        log_dir=state_dir,
                    )
                )
                out.print(
                    f"Starting {len(servers)} vLLM server(s) on {model} serving "
                    f"{', '.join(names)} (logs: {state_dir}/vllm-*.log)",
                    highlight=False,
                    soft_wrap=True,
                )
            stack.callback(codec.stop)
            stack.callback(temporal.stop)
            temporal.start()
            if engine is Engine.VLLM:
                for server in servers:
                    server.wait_ready()
                urls = [server.base_url for server in servers]
                config = fleet_on_endpoints(
                    config,
                    check_endpoints(urls, sample_models(loaded)),
                    task_end_release=True,
                )
                out.print(
                    f"vLLM servers ready at {', '.join(urls)} after "
                    f"{time.monotonic() - started:.0f} s",
                    highlight=False,
                )
                if model is not None and model.resolve() == install.model_dir.resolve():
                    out.print(
                        "Note: the tiny test model writes random text, so steps that ask "
                        "for JSON (plans, triage, critiques) often fail validation, and their "
                        "tasks with them.",
                        highlight=False,
                    )
            out.print(
                f"Temporal dev server at {temporal.address}, UI {temporal.ui_url}; {where}, "
                f"{len(config.tenants)} tenants; {tasks} tasks. Logs: {log_file}",
                highlight=False,
                soft_wrap=True,
            )
            sigterm.run(run())
        except KeyboardInterrupt:
            out.print("Interrupted." if not sigterm.received else "Stopped by SIGTERM.")
        except DevServerError as exc:
            fail(str(exc))
        except (VllmServerError, EndpointError) as exc:
            fail(str(exc), code=1)
    out.print("Embedded stack stopped.")
