"""``transformers serve`` with the attention tap: the few places where transformers' own
server is reached, all in this module, checked against the installed version at start.

Supported: transformers :data:`SUPPORTED` (5.25). No file of transformers changes. What is
relied on, and nothing else:

1. :class:`transformers.cli.serve.Serve`, the class behind ``transformers serve``, whose
   options ``attention-monitor serve`` takes as they are. :class:`TappedServe` subclasses
   it: before the server starts (its ``run``, which every API process runs, and
   ``run_api_servers``), the ``loader`` it made is wrapped in a
   :class:`~monitor.integrations.serving.TappedLoader`, which the model's process gets a
   copy of, as it gets the server's own.
2. ``ModelLoader.load_model_and_processor(model_id, on_progress)``, called in the model's
   process: the tap starts right after it returns.
3. ``transformers.cli.serving.server.build_server``, the app factory ``Serve.run`` calls:
   while ``run`` runs, the app it returns gets
   :class:`~monitor.integrations.serving_ids.RequestIds` as its outermost middleware.
4. Two things of the HTTP API: the ``X-Request-ID`` header a request brings is the
   response's id, and a request's ``generation_config`` reaches the generation's settings.
5. With continuous batching only: ``CBGenerateRunner.generate(request_id, inputs,
   generation_kwargs, stream)``, in the model's process, the last place where the
   request's settings and the engine's id for it (``str(request_id)``) meet: wrapped to
   hand both to the tap before the request joins the batch.

Another version of transformers is refused by :func:`unsupported` with the reason, before
anything starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers.cli.serve import Serve

from monitor.integrations.serving import ServedModel, ServeTap, TappedLoader, log_to_stderr
from monitor.integrations.serving_ids import REQUEST_ID_KEY, RequestIds

#: the transformers versions whose server this module was written against and tested with
SUPPORTED = SpecifierSet(">=5.25,<5.26")


def unsupported() -> str | None:
    """Why ``attention-monitor serve`` cannot run with the installed transformers, or None."""
    from transformers.utils.import_utils import is_serve_available

    installed = Version(transformers.__version__)
    if installed not in SUPPORTED:
        return (f"transformers {installed} is installed; attention-monitor serve supports transformers {SUPPORTED} "
                "(it reaches a few places of transformers' server that may change between releases: see "
                "docs/serving.md); install a supported version, e.g. pip install 'transformers[serving]"
                f"{SUPPORTED}'")
    if not is_serve_available():
        return "transformers' server needs its serving extra: pip install 'attention-monitor[serving]'"
    from transformers.cli.serving import server
    from transformers.cli.serving.model_manager import ModelLoader
    from transformers.cli.serving.utils import CBGenerateRunner

    needed = {"Serve.run": inspect.signature(Serve.run).parameters.keys() >= {"socket", "engine_connection"},
              "Serve.run_api_servers": hasattr(Serve, "run_api_servers"),
              "ModelLoader.load_model_and_processor": "on_progress" in inspect.signature(
                  ModelLoader.load_model_and_processor).parameters,
              "server.build_server": callable(getattr(server, "build_server", None)),
              "CBGenerateRunner.generate": list(inspect.signature(CBGenerateRunner.generate).parameters)
              == ["self", "request_id", "inputs", "generation_kwargs", "stream"]}
    missing = [name for name, found in needed.items() if not found]
    if missing:
        return f"transformers {installed}'s server lacks what attention-monitor serve relies on: {', '.join(missing)}"
    return None


class TappedServe(Serve):
    """``transformers serve`` (every option of :class:`~transformers.cli.serve.Serve`,
    given as keywords) with the tap: constructing it runs the server until it stops."""

    def __init__(self, tap: ServeTap, **options: Any):
        self.tap = tap  # before Serve.__init__, which builds the loader and then runs the server
        super().__init__(**options)

    def run(self, socket: Any = None, engine_connection: tuple[Any, ...] | None = None) -> None:
        log_to_stderr()  # an API process of several is spawned: the middleware's warnings need a handler
        self._tap_loader()
        with _outermost_middleware(RequestIds):
            super().run(socket, engine_connection)

    def run_api_servers(self, count: int) -> None:
        self._tap_loader()
        super().run_api_servers(count)

    def _tap_loader(self) -> None:
        if not isinstance(self.loader, TappedLoader):
            self.loader = _Loader(self.loader, self.tap)  # type: ignore[assignment]  # it stands in for one


class _Loader(TappedLoader):
    """The model's process of a server that batches continuously hands each request's
    trace id to the tap as the request joins the batch (5. in the module documentation)."""

    def started(self, served: ServedModel) -> None:
        if served.settings.continuous_batching:
            _trace_engine_requests(served)


def _trace_engine_requests(served: ServedModel) -> None:
    from transformers.cli.serving.utils import CBGenerateRunner

    original = CBGenerateRunner.generate

    def generate(runner: Any, request_id: int, inputs: dict[str, Any], generation_kwargs: dict[str, Any],
                 stream: bool) -> None:
        served.identify(str(request_id), generation_kwargs.pop(REQUEST_ID_KEY, None))
        original(runner, request_id, inputs, generation_kwargs, stream)

    CBGenerateRunner.generate = generate  # type: ignore[method-assign,assignment]


@contextlib.contextmanager
def _outermost_middleware(middleware: type[RequestIds]) -> Iterator[None]:
    """While inside, apps built by transformers' ``build_server`` get ``middleware``
    outermost (3. in the module documentation)."""
    from transformers.cli.serving import server

    build = server.build_server

    def build_server(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)
        app.add_middleware(middleware)
        return app

    server.build_server = build_server
    try:
        yield
    finally:
        server.build_server = build


def serve_command(tap: ServeTap) -> Any:
    """The click command of ``transformers serve``'s own options (its parser, defaults
    and checks) that runs :class:`TappedServe` with ``tap``."""
    import typer

    def serve(**options: Any) -> None:
        if options.get("force_model") is None and (tap.model_id is not None or tap.revision is not None):
            raise typer.BadParameter("--model-id and --model-revision name the one model served: give its MODEL")
        TappedServe(dataclasses.replace(tap, continuous_batching=bool(options.get("continuous_batching"))),
                    **options)

    serve.__signature__ = inspect.signature(Serve)  # type: ignore[attr-defined]
    serve.__annotations__ = {name: annotation for name, annotation in Serve.__init__.__annotations__.items()
                             if name != "return"}
    serve.__doc__ = Serve.__doc__
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name="serve")(serve)
    return typer.main.get_command(app)
