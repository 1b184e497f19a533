"""Imports point one way. monitor/core and monitor/routing are pure (numpy + stdlib +
themselves); every other module sits on a rank of the table below and imports only from
lower ranks, so the record's path reads top-down and no import circle can form. The
concept packages (``protocol``, ``measuring``, ``service``) are ranked module by module,
so their insides obey the same rule. Only ``monitor.broker`` imports the Kafka clients;
only ``monitor.integrations`` imports torch or transformers. A new module must be given
its rank here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "monitor"
PURE = ("core", "routing")
ALLOWED_THIRD_PARTY = {"numpy"}
#: packages whose modules are ranked one by one (``protocol.codec``); any other package is one unit
SPLIT = {"protocol", "measuring", "service"}

#: lowest first; a unit is a module, a module of a SPLIT package, or a whole other package
RANKS: list[set[str]] = [
    {"core"},
    {"routing", "errors", "protocol.records", "protocol.topics", "protocol.file_digests", "measuring.tuning",
     "measuring.batching", "service.health", "service.label_guard"},
    {"protocol.wire", "protocol.schema", "protocol.model_contract", "protocol.decisions", "measuring.ring",
     "service.retry"},
    {"protocol.access", "protocol.dead_letter", "protocol.findings", "protocol.observations", "protocol.judge_state",
     "protocol.pending",
     "protocol.contract_derivation", "triage",
     "study", "service.metric_families", "service.http", "service.assignment", "service.pins",
     "service.batch"},
    {"protocol.codec", "service.layer_series"},
    {"broker", "measuring.measurer", "service.exporter"},
    {"settings", "measuring.child", "service.join", "service.findings", "service.late"},
    {"measuring.judge"},
    {"measuring.workers"},
    {"service.fleet", "service.state_file"},
    {"service.pipeline", "producer"},
    {"service.delivery"},
    {"service.loop"},
    {"service.app"},
    {"tools", "integrations"},
    {"cli"},
    {"__main__"},
]
ONLY_HERE = {"kafka": "broker", "confluent_kafka": "broker", "torch": "integrations", "transformers": "integrations"}


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """Absolute module names imported anywhere in the file (function-level imports too);
    ``from monitor.p import x`` counts as an import of ``monitor.p.x`` when x is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["monitor", *path.relative_to(root).parent.parts]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            found.append((node.lineno, base))
            if base == "monitor" or base.startswith("monitor."):
                folder = root.joinpath(*base.split(".")[1:])
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                          if (folder / alias.name).is_dir() or (folder / f"{alias.name}.py").exists()]
    return found


def _unit(module: str) -> str | None:
    """The ranked unit of a ``monitor.…`` module name (None for the package itself and
    for a SPLIT package's own ``__init__``)."""
    parts = module.split(".")
    if parts[0] != "monitor" or len(parts) == 1:
        return None
    if parts[1] in SPLIT:
        return f"{parts[1]}.{parts[2]}" if len(parts) > 2 and parts[2] != "__init__" else None
    return parts[1]


def _rank(unit: str) -> int:
    for rank, units in enumerate(RANKS):
        if unit in units:
            return rank
    raise AssertionError(f"monitor.{unit} has no rank in tests/test_layering.py")


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        unit = _unit(".".join(["monitor", *rel.with_suffix("").parts]))
        if unit is not None and unit != "__init__":
            out.append((path, unit))
    return out


def test_every_module_has_a_rank():
    for _, unit in _modules():
        _rank(unit)


def test_imports_only_point_down():
    bad = []
    for path, unit in _modules():
        for line, module in _imports(path):
            target = _unit(module)
            if target is None or target == unit:
                continue
            if _rank(target) >= _rank(unit):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({unit}, rank {_rank(unit)}) imports {module} "
                           f"(rank {_rank(target)})")
    assert not bad, "\n".join(bad)


def test_the_kafka_client_and_torch_stay_at_their_edges():
    bad = []
    for path, unit in _modules():
        for line, module in _imports(path):
            home = ONLY_HERE.get(module.split(".")[0])
            if home is not None and unit.split(".")[0] != home:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} (only monitor.{home} may)")
    assert not bad, "\n".join(bad)


def _pure(module: str) -> bool:
    top = module.split(".")[0]
    return (
        any(module == f"monitor.{p}" or module.startswith(f"monitor.{p}.") for p in PURE)
        or top in ALLOWED_THIRD_PARTY
        or top in sys.stdlib_module_names
        or top == "__future__"
    )


def test_core_and_routing_import_only_numpy_stdlib_and_themselves():
    files = [path for name in PURE for path in sorted((PACKAGE / name).rglob("*.py"))]
    assert files, "monitor/core has no modules"
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in files for line, module in _imports(path) if not _pure(module)]
    assert not bad, "\n".join(bad)


def test_the_checks_themselves_catch_what_they_forbid(tmp_path):
    root = tmp_path / "monitor"
    (root / "core").mkdir(parents=True)
    for name in ("settings.py", "cli.py", "core/metrics.py"):
        (root / name).write_text("")
    probe = root / "core" / "probe.py"
    probe.write_text("import pydantic\nfrom monitor import settings\nfrom .. import cli\nfrom . import metrics\n")
    modules = [m for _, m in _imports(probe, root)]
    assert modules == ["pydantic", "monitor", "monitor.settings", "monitor", "monitor.cli", "monitor.core",
                       "monitor.core.metrics"]
    assert [m for m in modules if not _pure(m)] == ["pydantic", "monitor", "monitor.settings", "monitor",
                                                    "monitor.cli"]
    assert _unit("monitor.settings") == "settings" and _rank("settings") > _rank("protocol.codec")
    assert _unit("monitor.protocol.codec") == "protocol.codec" and _unit("monitor.protocol") is None
    assert _unit("monitor.broker.tables") == "broker"
    (root / "protocol").mkdir()
    (root / "protocol" / "wire.py").write_text("")
    nested = root / "protocol" / "probe.py"
    nested.write_text("from monitor.protocol import wire\nfrom . import wire as w\n")
    assert [m for _, m in _imports(nested, root)] == ["monitor.protocol", "monitor.protocol.wire", "monitor.protocol",
                                                      "monitor.protocol.wire"]
