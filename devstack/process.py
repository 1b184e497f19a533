"""A child process with a log file, stopped cleanly, that explains its failures."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path


class ServiceError(RuntimeError):
    """A development service could not be started; the message says why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ManagedProcess:
    """Runs ``argv`` with stdout and stderr in ``log_path``."""

    def __init__(self, name: str, argv: list[str], log_path: Path, cwd: Path | None = None,
                 env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise :class:`ServiceError` with the log's tail if the process has exited."""
        if not self.alive():
            raise ServiceError(
                f"{self.name} exited with code {self.proc.returncode}; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout`` seconds."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL at once, as a crash would."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
