"""The one online collator: rows of a `PackedDataset` over prepared samples -> exactly the batch offline mode builds,
the features asked of any `FeatureSource` while training (`train --features hf`, `--features http://...`).

Offline, a route computes each whole sample once (write.write_features), a shard stores it rounded to its dtype,
the reader slices the pieces a row holds and `PackedCollator` builds the batch. Here the same happens in memory:
the distinct samples of a batch are asked of `source.states` whole (so a truncated or split piece gets the states
offline extraction computed for it), rounded as a shard of `storage_dtype` stores them (quantize.as_stored, per
token row, so rounding then slicing equals the reverse), sliced to the pieces, and handed to the same
`PackedCollator`. The batch is therefore bit-equal to offline's whenever the source returns the same states
(tests/features/test_sources_contract.py checks it for every route of the table).

`cache` (feature_cache.FeatureCache, `--cache-features DIR`) wraps any source: samples DIR holds are read from it,
the others asked of the source and committed there before the batch is returned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..data.prepared_samples import PreparedDataset
from ..errors import Eagle3Error
from .interface import FeatureSource, PreparedSample
from .packing import PackedCollator
from .quantize import as_stored
from .records import canonical_dtype

if TYPE_CHECKING:
    from .feature_cache import FeatureCache

Features = dict[str, torch.Tensor]  # aux_hidden_states [T, 3H], last_hidden_state [T, H], verifier_greedy [T]


class FeatureCollator:
    """Rows over `prepared` (a PreparedDataset holding every sample the rows name) -> offline's batch, the features
    from `source`. `storage_dtype` (default: the source's own, `source.identity.dtype`) rounds them as a shard of
    that dtype stores them; "float32" keeps the source's output as it is. The batch is assembled on the CPU, like
    an offline one; the trainer moves it to its device."""

    def __init__(self, source: FeatureSource, prepared: PreparedDataset, *, cache: FeatureCache | None = None,
                 storage_dtype: str | None = None, max_seq_len: int | None = None, pad_token_id: int = 0) -> None:
        self.source, self.prepared, self.cache = source, prepared, cache
        self.storage_dtype = canonical_dtype(storage_dtype or source.identity.dtype)
        self.collate = PackedCollator(pad_token_id=pad_token_id, max_seq_len=max_seq_len)
        # the route's checks before the first batch (a server serving another verifier), and its length limit
        self.max_sample_tokens = source.check(prepared.lengths)
        if cache is not None and canonical_dtype(cache.header["dtype"]) != self.storage_dtype:
            raise ValueError(f"--cache-features {cache.dir} stores {cache.header['dtype']}, the batches are rounded "
                             f"to {self.storage_dtype}: they must agree")

    def sample(self, sample_id: str) -> PreparedSample:
        sample = self.prepared.sample(self.prepared.position(sample_id))
        limit = self.max_sample_tokens
        if limit is not None and len(sample.input_ids) > limit:
            raise Eagle3Error(f"sample {sample_id!r} has {len(sample.input_ids)} tokens, more than the feature source "
                              f"({self.source.identity.source}) takes ({limit}): prepare with --max-seq-len {limit}")
        return sample

    def rounded(self, aux: torch.Tensor, last: torch.Tensor, greedy: torch.Tensor) -> Features:
        """A whole sample's features rounded as a shard stores them, on the CPU."""
        rows = aux.shape[-1] // last.shape[-1]  # the aux layers concatenated: [T, rows*H]
        return {"aux_hidden_states": as_stored(aux, rows, self.storage_dtype).cpu(),
                "last_hidden_state": as_stored(last, 1, self.storage_dtype).cpu(),
                "verifier_greedy": greedy.long().cpu()}

    def features(self, wanted: list[str]) -> dict[str, Features]:
        """{id: rounded features}: from the cache where it holds the sample, else asked of the source (and cached)."""
        samples = {sid: self.sample(sid) for sid in wanted}
        have: dict[str, Features] = {}
        if self.cache is not None:
            have = self.cache.get(wanted, {sid: s.input_ids for sid, s in samples.items()})
        missing = [samples[sid] for sid in wanted if sid not in have]
        if not missing:
            return have
        fetched = {f.sample.sample_id: f for f in self.source.states(missing)}
        lost = [s.sample_id for s in missing if s.sample_id not in fetched]
        if lost:
            raise Eagle3Error(f"the feature source ({self.source.identity.source}) returned no features for sample "
                              f"{lost[0]!r}" + (f" and {len(lost) - 1} more" if len(lost) > 1 else ""))
        skipped = [f for f in fetched.values() if f.skip_reason is not None]
        if skipped:  # offline, write_features leaves such a sample out; a batch that names it cannot be built
            raise Eagle3Error(f"the feature source ({self.source.identity.source}) skipped sample "
                              f"{skipped[0].sample.sample_id!r} ({skipped[0].skip_reason}): it has no features to "
                              "train on; leave it out of the prepared samples or write the features offline "
                              "(`eagle3-hf extract`), which records it as skipped")
        if self.cache is not None:
            self.cache.put({sid: {"input_ids": f.sample.input_ids, "loss_mask": f.sample.loss_mask,
                                  "aux_hidden_states": f.aux_hidden_states, "last_hidden_state": f.last_hidden_state,
                                  "verifier_greedy": f.verifier_greedy} for sid, f in fetched.items()})
        have.update((sid, self.rounded(f.aux_hidden_states, f.last_hidden_state, f.verifier_greedy))
                    for sid, f in fetched.items())
        return have

    @torch.no_grad()
    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        wanted = list(dict.fromkeys(sid for row in rows for sid, _s, _e in row["pieces"]))
        features = self.features(wanted)
        full = []
        for row in rows:
            pieces = [(features[sid], start, end) for sid, start, end in row["pieces"]]
            out = dict(row)
            for key in ("aux_hidden_states", "last_hidden_state", "verifier_greedy"):
                out[key] = torch.cat([f[key][start:end] for f, start, end in pieces])
            full.append(out)
        return self.collate(full)
