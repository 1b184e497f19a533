"""The ``attention-monitor`` command line."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="attention-monitor",
    help="Watch the attention heads of transformer models in production.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def demo() -> None:
    """Run the monitor on built-in synthetic traces, with no external service.

    Two revisions of a model are simulated; the second develops low head diversity in
    one layer. The same pipeline as `run` computes the metrics, raises the anomalies,
    joins them to outcomes and serves /metrics; a summary is printed at the end.
    """
    typer.echo("attention-monitor demo: not built yet. It will feed synthetic traces of two "
               "model revisions through the monitor's pipeline, serve /metrics, and print "
               "per-layer metrics and the anomalies raised.")


@app.command()
def version() -> None:
    """Print the version."""
    from monitor import __version__

    typer.echo(__version__)


def main() -> None:
    app()
