"""A slow tokenizer shipped as remote code, with the vocabulary of a fast one: what Kimi-K2.5 ships.

Kimi-K2.5's tokenizer is a `PreTrainedTokenizer` subclass of its own (`tokenization_kimi.py`, named by the
tokenizer_config's `auto_map`) that transformers 5 runs as a `PythonBackend`: no offsets, loaded only with
`trust_remote_code`. `install_slow_tokenizer` writes such a tokenizer into a directory from a saved fast byte-level
BPE tokenizer (the SmolLM2 one): the same vocabulary, merges, added tokens, special tokens and chat template, tokenized
in pure Python (GPT-2's pre-tokenizer regex and byte-pair merges), so every id and loss mask must equal the fast
tokenizer's. Tests load it with `--trust-remote-code` (fixture `slow_remote_tokenizer_dir` in tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CLASS_NAME = "SlowByteLevelBPETokenizer"
MODULE_FILE = "tokenization_slow_bpe.py"

TOKENIZER_CODE = '''"""A byte-level BPE tokenizer in pure Python (a PythonBackend: no offsets), like Kimi-K2.5's."""

import json
import os

import regex
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "vocab.json", "merges_file": "merges.txt"}
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""


def bytes_to_unicode():
    """GPT-2's map from each byte to a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\\xa1"), ord("\\xac") + 1)) + \\
        list(range(ord("\\xae"), ord("\\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class SlowByteLevelBPETokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, merges_file, **kwargs):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merges_file, encoding="utf-8") as f:
            lines = f.read().split("\\n")
        merges = [tuple(line.split(" ")) for line in lines[1:] if line]  # after the "#version" line
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pattern = regex.compile(PATTERN)
        self.cache = {}
        self.vocab_file, self.merges_file = vocab_file, merges_file
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.encoder)

    def get_vocab(self):
        return dict(self.encoder, **self.added_tokens_encoder)

    def bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            rank, pair = min((self.ranks.get(p, float("inf")), p) for p in zip(parts, parts[1:]))
            if rank == float("inf"):
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def _tokenize(self, text, **kwargs):
        out = []
        for piece in self.pattern.findall(text):
            out.extend(self.bpe("".join(self.byte_encoder[b] for b in piece.encode("utf-8"))))
        return out

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(self.unk_token))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        prefix = filename_prefix + "-" if filename_prefix else ""
        out = []
        for name, src in (("vocab.json", self.vocab_file), ("merges.txt", self.merges_file)):
            dst = os.path.join(save_directory, prefix + name)
            if os.path.abspath(src) != os.path.abspath(dst):
                with open(src, "rb") as a, open(dst, "wb") as b:
                    b.write(a.read())
            out.append(dst)
        return tuple(out)
'''


def install_slow_tokenizer(fast_dir: str | Path, dest: str | Path, keep_fast: bool = False) -> Path:
    """Write the slow remote-code twin of the fast byte-level BPE tokenizer saved in `fast_dir` into `dest`
    (created if needed; other files there, e.g. a model's, are kept; its tokenizer.json is removed, as Kimi ships
    none, so only the remote class can load it). Returns `dest`.

    `keep_fast`: keep tokenizer.json and name transformers' fast class, as a checkpoint that ships both does: then
    the tokenizer loads as the fast class without --trust-remote-code and as the remote one with it."""
    fast_dir, dest = Path(fast_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    spec = json.loads((fast_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec["model"]
    if model.get("type") != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{fast_dir}: not a byte-level BPE tokenizer")
    vocab = dict(model["vocab"])
    for added in spec.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    (dest / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (dest / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (dest / MODULE_FILE).write_text(TOKENIZER_CODE, encoding="utf-8")
    config = json.loads((fast_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = {k: v for k, v in config.items() if k not in ("backend", "tokenizer_class", "auto_map", "is_local")}
    config["tokenizer_class"] = "TokenizersBackend" if keep_fast else CLASS_NAME
    config["auto_map"] = {"AutoTokenizer": [f"{MODULE_FILE[:-3]}.{CLASS_NAME}", None]}
    config["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "rstrip", "normalized",
                                                                           "single_word", "special")}
                                      for t in spec.get("added_tokens", [])}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    for name in ("chat_template.jinja", "special_tokens_map.json"):
        if (fast_dir / name).is_file() and fast_dir != dest:
            shutil.copyfile(fast_dir / name, dest / name)
    if keep_fast:
        if fast_dir != dest:
            shutil.copyfile(fast_dir / "tokenizer.json", dest / "tokenizer.json")
    else:
        (dest / "tokenizer.json").unlink(missing_ok=True)
    return dest
