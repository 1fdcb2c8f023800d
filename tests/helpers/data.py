"""A learnable synthetic verifier and the offline data for it, built through the real pipeline stages.

The verifier is a tiny Llama whose lm_head is its embedding shifted by one id, with small layer outputs,
so its greedy next token is mostly (token + 1): a drafter can learn it at every TTT step, and a drafter
that learned nothing scores near zero. Data goes prepare-format -> extract_features -> vocab, as users'.

Also: `make_prepared` (a random prepared dataset for any tokenizer fingerprint), extraction helpers
(`extract_in_process`, `kill_after_shards` for SIGKILL-and-resume tests), `rows` (a JSONL file by id), and
COMMON, the training flags the training tests share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import datasets
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf.data.vocab import save_vocab, vocab_from_target_ids
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.write import StoreOptions

SYN_VOCAB, SYN_HIDDEN, SYN_LAYERS = 256, 64, 6
FINGERPRINT = "synthetic-tokenizer"
COMMON = ["--max-seq-len", "128", "--per-device-train-batch-size", "2", "--learning-rate", "1e-2",
          "--disable-tqdm", "true", "--seed", "7"]


def make_learnable_verifier(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=SYN_VOCAB, hidden_size=SYN_HIDDEN, intermediate_size=128,
                         num_hidden_layers=SYN_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0, 1.0)
        model.lm_head.weight.copy_(torch.roll(embed, shifts=1, dims=0))  # logit(v) ~ <h, e_{v-1}>
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    return model.eval().requires_grad_(False)


def save_verifier(path: Path, seed: int = 0) -> LlamaForCausalLM:
    model = make_learnable_verifier(seed)
    model.save_pretrained(path)
    return model


def prepared_dataset(path: Path, num_samples: int = 48, seed: int = 0, min_len: int = 12, max_len: int = 40) -> Path:
    """Random walks over a subset of ids; the first 4 tokens are 'prompt' (no loss), the rest 'assistant'."""
    g = torch.Generator().manual_seed(seed)
    alphabet = torch.arange(2, 200, 2)  # even ids: greedy targets (odd ids) are then a distinct set
    ids, tokens, masks = [], [], []
    for i in range(num_samples):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        seq = alphabet[torch.randint(0, len(alphabet), (n,), generator=g)]
        mask = torch.ones(n, dtype=torch.int8)
        mask[:4] = 0
        ids.append(f"syn-{i:04d}")
        tokens.append(seq.to(torch.int32).tolist())
        masks.append(mask.tolist())
    Dataset.from_dict({"id": ids, "input_ids": tokens, "loss_mask": masks}).save_to_disk(str(path))
    (path / "eagle3_prepare.json").write_text(json.dumps({"tokenizer_fingerprint": FINGERPRINT,
                                                          "tokenizer": "synthetic"}))
    return path


def build_offline_data(root: Path, verifier: LlamaForCausalLM, num_samples: int = 48, draft_vocab: int = 128,
                       seed: int = 0, verifier_name: str = "synthetic-verifier",
                       aux_indices: tuple[int, ...] | None = (1, 3, 4)) -> Path:
    """prepared -> features (float32) -> vocab.safetensors over the verifier's greedy tokens. `aux_indices`
    None: the layers `Eagle3Config.from_verifier` picks by default."""
    prepared = prepared_dataset(root / "prepared", num_samples, seed)
    features = root / "features"
    extract_features(verifier, FINGERPRINT, prepared, features, aux_indices=aux_indices, dtype="float32",
                     store=StoreOptions(16), verifier_name=verifier_name, progress=False)
    from eagle3_hf.features.reader import FeatureDataset

    counts = torch.zeros(SYN_VOCAB)
    all_samples = FeatureDataset(features, split="all")
    for i in range(len(all_samples)):
        item = all_samples[i]
        counts += torch.bincount(item["verifier_greedy"], minlength=SYN_VOCAB).float()
    kept = torch.sort(torch.argsort(counts, descending=True, stable=True)[:draft_vocab]).values
    d2t, t2d = vocab_from_target_ids(kept, SYN_VOCAB)
    save_vocab(features / "vocab.safetensors", d2t, t2d, FINGERPRINT, coverage=1.0)
    return features


def synthetic_data(root: Path, num_samples: int = 48) -> dict:
    """The learnable verifier saved under root/verifier and offline features for it (the `synthetic` fixture)."""
    verifier = save_verifier(root / "verifier")
    features = build_offline_data(root, verifier, num_samples=num_samples)
    return {"root": root, "verifier": verifier, "verifier_dir": root / "verifier", "features": features}


# ---------------------------------------------------------------- prepared data and extraction

def make_prepared(path: Path, fingerprint: str, n: int = 12, seed: int = 0, lo: int = 4, hi: int = 40,
                  vocab: int = 49152) -> Path:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    input_ids = [torch.randint(3, vocab, (t,), generator=g).tolist() for t in lengths]
    loss_mask = [[int(j >= t // 3) for j in range(t)] for t in lengths]
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    ds = datasets.Dataset.from_dict({"id": [f"s{i:03d}" for i in range(n)], "input_ids": input_ids,
                                     "loss_mask": loss_mask}, features=features)
    ds.save_to_disk(str(path))
    (path / "eagle3_prepare.json").write_text(json.dumps({"tokenizer_fingerprint": fingerprint}))
    return path


def _shard_lines(journal: Path) -> int:
    if not journal.is_file():
        return 0
    return sum(1 for line in journal.read_text().splitlines() if '"shard": {' in line)


def kill_after_shards(proc: subprocess.Popen, journal: Path, shards: int, timeout: float) -> None:
    """SIGKILL `proc` as soon as its journal records `shards` finished shards (mid-run, not at the end)."""
    deadline = time.monotonic() + timeout
    while _shard_lines(journal) < shards:
        assert proc.poll() is None, "child finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def extract_in_process(verifier_dir, prepared, out, fingerprint):
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's setting: same kernels, same bits
    try:
        model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype="float32").eval()
        extract_features(model, fingerprint, prepared, out, store=StoreOptions(2), progress=False)
    finally:
        torch.set_num_threads(threads)


def rows(path) -> dict[str, dict]:
    """JSONL rows by id, refusing duplicates."""
    out = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        assert row["id"] not in out, f"duplicate {row['id']}"
        out[row["id"]] = row
    return out


def manifest_without_stat(manifest: Path) -> dict:
    """manifest.json without each shard's `written` stat (that file's own mtime, ctime and inode): what two
    extractions of the same samples must agree on byte for byte."""
    record = json.loads(Path(manifest).read_text())
    for shard in record["shards"]:
        assert set(shard.pop("written")) == {"mtime_ns", "ctime_ns", "ino"}
    return record


def feature_files(out: Path) -> dict[str, str]:
    """sha256 of every file of a feature directory (shards, journals, manifest), the `written` stat of each shard
    left out of the manifest and the journals: what two writers of the same samples must agree on."""
    import hashlib

    digests = {}
    for path in sorted(Path(out).iterdir()):
        if not path.is_file():
            continue
        if path.name == "manifest.json":
            data = json.dumps(manifest_without_stat(path), sort_keys=True).encode()
        elif path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            for row in rows:
                (row.get("shard") or {}).pop("written", None)
            data = json.dumps(rows, sort_keys=True).encode()
        else:
            data = path.read_bytes()
        digests[path.name] = hashlib.sha256(data).hexdigest()
    return digests


class HashSpy:
    """store.sha256_file, recording the names of the files it hashed (what a launch read in full)."""

    def __init__(self) -> None:
        self.files: list[str] = []

    def __call__(self, path: Path) -> str:
        from eagle3_hf.features.store import sha256_file

        self.files.append(Path(path).name)
        return sha256_file(path)
