"""Ranks of one `torchrun` launch opening a verifier whose config is its own code, all at once, into a cold modules
cache: the copy race of verifier/code_cache.py. Run as

    torchrun --nproc-per-node 8 tests/helpers/remote_code_race.py MODE ROOT REPS OUT

with HF_MODULES_CACHE pointing at an empty directory. Each repetition is a new copy of the verifier (ROOT/v<rep>, a
module transformers has not cached yet), opened by every rank after a gloo barrier. MODE "project" loads it as the
project does (remote_code.load_with_trust); "transformers" calls AutoConfig.from_pretrained directly, as each rank
would without code_cache.py. Rank 0 writes every rank's failures (one line each) to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CLASS = "TinyRemoteConfig"
# the module is padded to about 300 KB (a verifier's own modeling code is tens of KB), so that each copy lasts long
# enough for the race to show within 20 repetitions of a launch on a small CPU machine
PADDING_LINES = 4000


def write_verifier(path: Path) -> None:
    """A checkpoint directory whose config class is its own code (auto_map), nothing else."""
    path.mkdir(parents=True, exist_ok=True)
    code = ["from transformers import PretrainedConfig", "", "",
            f"class {CLASS}(PretrainedConfig):", '    model_type = "tiny_remote"', "",
            "    def __init__(self, width=8, **kwargs):", "        self.width = width",
            "        super().__init__(**kwargs)", ""]
    code += [f"# padding line {i:05d}: what a real modeling file's length makes the copy take" for i in
             range(PADDING_LINES)]
    (path / "configuration_tiny.py").write_text("\n".join(code) + "\n", encoding="utf-8")
    (path / "config.json").write_text(json.dumps({"model_type": "tiny_remote", "width": 8,
                                                  "auto_map": {"AutoConfig": f"configuration_tiny.{CLASS}"}}))


def main(mode: str, root: str, reps: int, out: str) -> int:
    import torch.distributed as dist
    from transformers import AutoConfig

    from eagle3_hf.verifier.remote_code import load_with_trust, set_trusted

    dist.init_process_group("gloo")
    set_trusted(True)
    failures: list[str] = []
    for rep in range(reps):
        path = str(Path(root) / f"v{rep}")
        dist.barrier()
        try:
            if mode == "project":
                config = load_with_trust(AutoConfig.from_pretrained, path, "config")
            else:
                config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            if type(config).__name__ != CLASS or config.width != 8:
                failures.append(f"v{rep}: loaded {type(config).__name__}")
        except Exception as exc:  # noqa: BLE001 - every way a half-copied module fails is a failure here
            failures.append(f"v{rep}: {type(exc).__name__}: {str(exc).strip().splitlines()[:1]}")
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered), encoding="utf-8")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
