"""A vLLM extraction server that lies in its first answer (CompletionsStub otherwise), for the trust tests.

Request 1 carries the attack; every later request is answered honestly. Each attack that names a file puts a
readable hidden-states file for that request where it points (outside the storage, or behind a symlink), so a
client without the guard would read it into a shard and delete it. `untouched` maps every such file (and
link) to its bytes (or link target): a test asserts they are all still there, unchanged.

attack:
  "outside"      an absolute path in another directory, named as the connector names this request's file
  "dotdot"       storage/../victim/<the connector's name>
  "symlink"      storage/<the connector's name>, a symlink to a file outside the storage
  "lock-symlink" the file in storage, its .lock a symlink to a file outside
  "late-symlink" a normal answer; the file appears (lock still held) as a symlink to a file outside
  "foreign-name" an existing file of the user's that is not named for this request (victim/model.safetensors)
  "stale-name"   a file in the storage named for another request
  "relative"     a relative path
  "oversized"    an answer of 2 MiB
  "slow"         an answer trickled 16 bytes every 0.1 s
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

from safetensors.torch import save_file

from tests.helpers.completions_stub import CompletionsStub

ATTACKS = ("outside", "dotdot", "symlink", "lock-symlink", "late-symlink", "foreign-name", "stale-name", "relative",
           "oversized", "slow")


class HostileStub(CompletionsStub):
    def __init__(self, model, root: str, storage: Path, victim: Path, attack: str, **kwargs):
        super().__init__(model, root, storage, **kwargs)
        assert attack in ATTACKS, attack
        self.victim, self.attack = Path(victim), attack
        self.victim.mkdir(parents=True, exist_ok=True)
        self.untouched: dict[Path, bytes | str] = {}
        self.answered: list[str] = []  # the hidden_states_path of each answer, in order
        self._number = threading.local()

    def answer_path(self, request_id: str, number: int) -> str | Path:
        self._number.value = number
        honest = super().answer_path(request_id, number)
        name = Path(honest).name
        path: str | Path = honest
        if number == 1:
            path = {"outside": self.victim / name,
                    "dotdot": f"{self.storage}/../{self.victim.name}/{name}",
                    "foreign-name": self.victim / "model.safetensors",
                    "stale-name": self.storage / "cmpl-eagle3-0123456789abcdef-0-00000000.safetensors",
                    "relative": name}.get(self.attack, honest)
        self.answered.append(str(path))
        return path

    def _keep(self, path: Path, tensors: dict) -> None:
        """A readable states file at `path` (the bait), recorded as one that must be left as it is."""
        save_file(tensors, str(path))
        self.untouched[path] = path.read_bytes()

    def _link(self, link: Path, target: Path) -> None:
        os.symlink(target, link)
        self.untouched[link] = str(target)

    def place(self, path: Path, tensors: dict, kind: str) -> None:
        if self._number.value != 1 or self.attack in ("oversized", "slow"):
            return super().place(path, tensors, kind)
        if self.attack in ("outside", "dotdot", "foreign-name", "stale-name"):
            target = Path(os.path.normpath(path))
            self._keep(target, tensors)
            Path(f"{target}.lock").write_bytes(b"")
            self.untouched[Path(f"{target}.lock")] = b""
        elif self.attack == "symlink":
            self._keep(self.victim / "precious.safetensors", tensors)
            self._link(path, self.victim / "precious.safetensors")
        elif self.attack == "lock-symlink":
            self._keep(path, tensors)
            self._keep(self.victim / "precious.lock", tensors)
            self._link(Path(f"{path}.lock"), self.victim / "precious.lock")
        elif self.attack == "late-symlink":
            self._keep(self.victim / "precious.safetensors", tensors)
            fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)

            def swap() -> None:  # long after the client has checked the answer
                time.sleep(1.0)
                self._link(path, self.victim / "precious.safetensors")
                os.close(fd)

            threading.Thread(target=swap, daemon=True).start()
        # "relative": nothing is written

    def respond(self, handler, answer: dict) -> None:
        if self._number.value != 1 or self.attack not in ("oversized", "slow"):
            return super().respond(handler, answer)
        if self.attack == "oversized":
            answer = {**answer, "padding": "x" * (2 << 20)}
        body = json.dumps(answer).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        step = len(body) if self.attack == "oversized" else 16
        try:
            for start in range(0, len(body), step):
                handler.wfile.write(body[start:start + step])
                handler.wfile.flush()
                if self.attack == "slow":
                    time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
