"""Show that a refactor changed no behaviour: the same small pipeline, run on two commits, writes the same bytes.

Sixteen of the demo's prompts go through every offline feature route the CLI has (regenerate with features in one
pass, as `make demo` runs it; `extract` with transformers hooks; `import-features speculators` of files written
the way speculators writes them; with --vllm, `extract --engine vllm`), and two short trainings from them (from
the regenerated shards, and online with `--features hf`). Every feature directory is reduced to the sha256 of its
files (each shard's own `written` stat left out: it names the file's inode and times, which no two runs share; a
safetensors file by its sorted metadata and tensors: the format does not fix the order of its metadata)
and every drafter to the sha256 of its model.safetensors. The stages run through the CLI only, so the same
script runs against any commit:

    .venv/bin/python scripts/behaviour_unchanged.py --against BASE_COMMIT [--vllm] [--out runs/unchanged]

checks BASE_COMMIT out into a temporary worktree, runs the pipeline there and here, prints one table and exits 1
where any digest differs. The embedded default verifier (SmolLM2-135M-Instruct) runs in fp32 on the CPU with one
thread, so both sides compute the same floats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = "smollm2-135m-instruct"
PROMPTS, NEW_TOKENS, STEPS = 16, 24, 6
TRAIN = ["--config", "examples/recipes/small_cpu.yaml", "--max-steps", str(STEPS), "--max-seq-len", "128",
         "--eval-strategy", "no", "--save-strategy", "no", "--load-best-model-at-end", "false",
         "--validation-fraction", "0.125", "--logging-steps", "1", "--disable-tqdm", "true", "--seed", "3"]


def digest_dir(directory: Path) -> str:
    """One sha256 over a feature directory's files, each shard's `written` stat left out."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        if path.suffix == ".lock":
            continue
        if path.suffix in (".json", ".jsonl") and path.name != "prepared_meta.json":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
                if path.suffix == ".jsonl" else [json.loads(path.read_text(encoding="utf-8"))]
            for row in rows:
                for shard in [row.get("shard") or {}, *(row.get("shards") or [])]:
                    shard.pop("written", None)
            data = json.dumps(rows, sort_keys=True).encode()
        elif path.suffix == ".safetensors":
            data = safetensors_content(path)
        else:
            data = path.read_bytes()
        h.update(str(path.relative_to(directory)).encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def safetensors_content(path: Path) -> bytes:
    """A safetensors file's metadata (sorted: the format keeps a map, whose order is not fixed) and tensors."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        h.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name)
            raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode() + raw)
    return h.digest()


def speculators_files(prepared: Path, out: Path) -> None:
    """Files as speculators writes them for our prepared samples: its rows, and per sample `hs_i.safetensors` with
    the residual stream entering layers (2, 15, 27) and the last layer's pre-norm output, [T, 4, H]."""
    import datasets
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from eagle3_hf.verifier.loading import resolve_verifier

    rows = datasets.load_from_disk(str(prepared))
    datasets.Dataset.from_dict({"input_ids": rows["input_ids"], "loss_mask": rows["loss_mask"],
                                "seq_len": [len(x) for x in rows["input_ids"]]}).save_to_disk(str(out))
    model = AutoModelForCausalLM.from_pretrained(resolve_verifier(VERIFIER), dtype=torch.float32).eval()
    (out / "hidden_states").mkdir()
    captured: dict[str, torch.Tensor] = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, o: captured.update(last=o[0] if isinstance(o, tuple)
                                                                                 else o))
    with torch.no_grad():
        for i, ids in enumerate(rows["input_ids"]):
            ids = torch.tensor(ids)
            states = model(ids[None], output_hidden_states=True).hidden_states
            stacked = torch.stack([states[2][0], states[15][0], states[27][0], captured["last"].reshape(len(ids), -1)],
                                  dim=1)
            save_file({"hidden_states": stacked.contiguous(), "token_ids": ids},
                      str(out / "hidden_states" / f"hs_{i}.safetensors"))


def run(cmd: list[str], cwd: Path, log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        raise SystemExit(f"failed (exit {rc}) in {cwd}: {' '.join(cmd)}; see {log}")


def pipeline(repo: Path, out: Path, vllm: bool) -> dict[str, str]:
    """Every stage in `repo`'s code; {stage: digest}."""
    cli = [sys.executable, "-m", "eagle3_hf.cli"]
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    prompts = out / "prompts.jsonl"
    run([sys.executable, "-c", "import json; from eagle3_hf.demo_data.prompts import short_prompts; "
         f"open({str(prompts)!r}, 'w').writelines(json.dumps(p) + '\\n' for p in short_prompts({PROMPTS}))"],
        repo, log)
    gen, prepared = out / "regenerated", out / "prepared"
    run([*cli, "regenerate", "--input", str(prompts), "--output", str(out / "conversations.jsonl"), "--verifier",
         VERIFIER, "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "8", "--features-out", str(gen),
         "--prepared-out", str(prepared), "--max-seq-len", "256", "--features-dtype", "bf16", "--no-progress"],
        repo, log)
    run([*cli, "vocab", "--data", str(prepared), "--draft-vocab-size", "512", "--output",
         str(gen / "vocab.safetensors")], repo, log)
    digests = {"regenerate --features-out (bf16)": digest_dir(gen), "prepared dataset": digest_dir(prepared)}
    extracted = out / "extracted"
    run([*cli, "extract", "--verifier", VERIFIER, "--data", str(prepared), "--output", str(extracted),
         "--features-dtype", "fp32", "--samples-per-shard", "5", "--no-progress"], repo, log)
    digests["extract --engine transformers (fp32)"] = digest_dir(extracted)
    run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
         "from behaviour_unchanged import speculators_files; from pathlib import Path; "
         f"speculators_files(Path({str(prepared)!r}), Path({str(out / 'speculators')!r}))"], repo, log)
    imported = out / "imported"
    run([*cli, "import-features", "speculators", str(out / "speculators"), "--verifier", VERIFIER, "--output",
         str(imported), "--data", str(prepared), "--features-dtype", "fp32", "--no-progress"], repo, log)
    digests["import-features speculators (fp32)"] = digest_dir(imported)
    if vllm:
        via_vllm = out / "vllm"
        run([*cli, "extract", "--engine", "vllm", "--verifier", VERIFIER, "--data", str(prepared), "--output",
             str(via_vllm), "--vllm-batch-size", "8", "--no-progress"], repo, log)
        digests["extract --engine vllm (bf16)"] = digest_dir(via_vllm)
    train = [sys.executable, "examples/train.py", *TRAIN, "--verifier", VERIFIER, "--vocab",
             str(gen / "vocab.safetensors")]
    run([*train, "--features", str(gen), "--output-dir", str(out / "drafter-offline")], repo, log)
    run([*train, "--features", "hf", "--prepared-dir", str(prepared), "--features-dtype", "bf16",
         "--output-dir", str(out / "drafter-online")], repo, log)
    for name in ("offline", "online"):
        model = out / f"drafter-{name}" / "model.safetensors"
        digests[f"train --features {'DIR' if name == 'offline' else 'hf'}: model.safetensors"] = \
            hashlib.sha256(model.read_bytes()).hexdigest()[:16]
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the commit to compare with (e.g. the one before a refactor)")
    parser.add_argument("--vllm", action="store_true", help="also extract with vLLM (`make vllm` first)")
    parser.add_argument("--out", type=Path, default=None, help="keep both runs' outputs here (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="eagle3_unchanged_"))
    if out.exists():
        shutil.rmtree(out)
    base = out / "base-worktree"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.against], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        before = pipeline(base, out / "before", args.vllm)
        after = pipeline(ROOT, out / "after", args.vllm)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"| stage | {args.against[:12]} | {head.strip()} | equal |\n|---|---|---|---|")
    for stage, digest in before.items():
        print(f"| {stage} | {digest} | {after.get(stage)} | {'yes' if after.get(stage) == digest else 'NO'} |")
    if before != after:
        raise SystemExit("behaviour changed: the digests above differ")


if __name__ == "__main__":
    main()
