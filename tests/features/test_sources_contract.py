"""The contract every feature source keeps: the same prepared samples give the same training batch whether the
route's features are written to shards (write.write_features, read back by reader.FeatureDataset, packed by
PackedCollator) or asked for while training (collator.FeatureCollator): bit-equal, since both halves round and
slice one route's output the same way.

Parametrised over the table (features/table.py SOURCES): a new row is tested by adding it, and fails here until
HARNESSES says how to open it against this machine (a stub server, files written the route's way). A row that
cannot run here is skipped, saying why (vLLM's own engine only). A sample a route answers as skipped (an import's
missing file) is recorded so by the writer and refused by the collator, never trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.features.collator import FeatureCollator
from eagle3_hf.features.packing import PackedCollator, PackedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.table import SOURCES, SourceRequest, open_source
from eagle3_hf.features.write import StoreOptions, write_features

from tests.helpers.feature_stub import AUX, Stub, identity, vllm_layout
from tests.helpers.serveable import BF16_STEP, walk_prepared

MAX_SEQ_LEN, DTYPE = 24, "bfloat16"  # short rows: samples are split into pieces, the pieces packed together
DTYPE_OF = {"bfloat16": torch.bfloat16}


def transformers(ctx: dict) -> SourceRequest:
    from eagle3_hf.features.routes.transformers import TransformersOptions

    return request(ctx, "transformers", options=TransformersOptions(model=ctx["model"]))


def vllm(ctx: dict) -> SourceRequest:
    pytest.skip("vLLM's own engine runs in its venv, in a subprocess: tests/features/test_vllm_offline.py (slow) "
                "compares it with extract")


def vllm_server(ctx: dict) -> SourceRequest:
    from eagle3_hf.features.vllm.vllm_spec import VllmOptions

    from tests.helpers.completions_stub import CompletionsStub

    stub = ctx["enter"](CompletionsStub(ctx["model"], str(ctx["verifier"]), ctx["tmp"] / "storage"))
    return request(ctx, "vllm-server", options=VllmOptions(endpoint=stub.url, batch_size=3))


def sglang_server(ctx: dict) -> SourceRequest:
    """SGLang started with aux capture at the ids its Llama reader needs for the aux indices and N-1 (stood in:
    tests/helpers/sglang_stub.py; the same client against a real SGLang's recorded answers:
    tests/features/test_sglang_server.py)."""
    from eagle3_hf.features.routes.sglang_server_client import SglangOptions
    from eagle3_hf.publish.aux_id_rules import sglang_ids_to_send

    from tests.helpers.serveable import LAYERS
    from tests.helpers.sglang_stub import SglangStub

    ids = sglang_ids_to_send(sorted(set(AUX) | {LAYERS - 1}), "llama", LAYERS, "0.5.23")
    stub = ctx["enter"](SglangStub(model=ctx["model"], model_path=str(ctx["verifier"]), layer_ids=ids))
    return request(ctx, "sglang-server", options=SglangOptions(stub.url, requests=3))


def server(ctx: dict) -> SourceRequest:
    stub = ctx["enter"](Stub(ctx["model"], identity(ctx["fingerprint"])))
    return request(ctx, "server", target=stub.url)


def directory(ctx: dict) -> SourceRequest:
    source = open_source(transformers(ctx))
    checked = PreparedDataset(ctx["prepared"], "all", tokenizer_fingerprint=ctx["fingerprint"])
    write_features(source, checked, ctx["tmp"] / "stored", progress=False)
    return request(ctx, "directory", target=str(ctx["tmp"] / "stored"))


def speculators(ctx: dict) -> SourceRequest:
    """Files as speculators writes them: its rows, and per row `hidden_states/hs_{i}.safetensors` with vLLM's
    layout ([T, 4, H]: the aux ids, then id N before the final norm)."""
    import datasets
    from safetensors.torch import save_file

    rows = datasets.load_from_disk(str(ctx["prepared"]))
    out = ctx["tmp"] / "speculators"
    datasets.Dataset.from_dict({"input_ids": rows["input_ids"], "loss_mask": rows["loss_mask"],
                                "seq_len": [len(x) for x in rows["input_ids"]]}).save_to_disk(str(out))
    (out / "hidden_states").mkdir()
    for i, ids in enumerate(rows["input_ids"]):
        ids = torch.tensor(ids)
        save_file({"token_ids": ids, "hidden_states": vllm_layout(ctx["model"], ids)},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
    return request(ctx, "speculators", target=str(out))


def specforge(ctx: dict) -> SourceRequest:
    """Files as SpecForge writes them: per sample a torch-saved dict with the aux states (SGLang's layer k is our
    index k + 1, stored here already in our indices' order) and the state after the final norm."""
    from tests.helpers.serveable import reference_states

    rows = PreparedDataset(ctx["prepared"], "all", 0.0)
    out = ctx["tmp"] / "specforge" / "rows_0-2000"
    out.mkdir(parents=True)
    for i in range(len(rows)):
        ids = rows[i]["input_ids"]
        hs, _pre = reference_states(ctx["model"], ids)
        torch.save({"input_ids": ids, "loss_mask": rows[i]["loss_mask"].long(),
                    "aux_hidden_state": torch.cat([hs[k] for k in AUX], dim=-1)[None],
                    "hidden_state": hs[-1][None]}, out / f"data_{i}.ckpt")
    return request(ctx, "specforge", target=str(out.parent))


HARNESSES: dict[str, Callable[[dict], SourceRequest]] = {
    "transformers": transformers, "vllm": vllm, "vllm-server": vllm_server, "sglang-server": sglang_server,
    "server": server,
    "directory": directory, "speculators": speculators, "specforge": specforge}


def request(ctx: dict, kind, target: str = "", options=None) -> SourceRequest:
    return SourceRequest(kind, target or str(ctx["verifier"]), str(ctx["verifier"]), aux_indices=tuple(AUX),
                         dtype=DTYPE, tokenizer_fingerprint=ctx["fingerprint"], options=options)


def batches(rows: PackedDataset, size: int = 3) -> list[list[dict]]:
    return [[rows[r] for r in range(i, min(i + size, len(rows)))] for i in range(0, len(rows), size)]


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_written_and_online_batches_are_equal(kind, tmp_path, serveable_model, serveable_dir, fingerprint):
    assert kind in HARNESSES, (f"the table's row {kind!r} has no harness here: add one to HARNESSES (how to open the "
                               "route on this machine, with a stub where it needs a server)")
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=8)
    with _Stack() as stack:
        ctx = {"model": serveable_model, "verifier": serveable_dir, "fingerprint": fingerprint,
               "prepared": prepared, "tmp": tmp_path, "enter": stack.enter}
        req = HARNESSES[kind](ctx)
        checked = PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)
        summary = write_features(open_source(req), checked, tmp_path / "written",
                                 store=StoreOptions(4), progress=False)
        assert summary.written_samples == 8, summary
        offline = PackedDataset(FeatureDataset(tmp_path / "written", "all"), MAX_SEQ_LEN, overlong="split")
        every = PreparedDataset(prepared, "all", 0.0, fingerprint)
        online = PackedDataset(every, MAX_SEQ_LEN, overlong="split")
        assert offline.rows == online.rows and offline.stats["split"] > 0
        collate = FeatureCollator(open_source(req), every, max_seq_len=MAX_SEQ_LEN)
        assert collate.storage_dtype == DTYPE
        for b, (want_rows, got_rows) in enumerate(zip(batches(offline), batches(online))):
            want = PackedCollator(max_seq_len=MAX_SEQ_LEN)(want_rows)
            got = collate(got_rows)
            assert sorted(got) == sorted(want)
            for key in want:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (kind, b, key)


def test_a_skipped_sample_is_recorded_offline_and_refused_online(tmp_path, serveable_model, serveable_dir,
                                                                  fingerprint):
    """speculators wrote no file for one row (a failed request): write_features records the sample as skipped and
    leaves it out; FeatureCollator refuses a batch naming it, in one line naming the sample and the reason."""
    from eagle3_hf.errors import Eagle3Error

    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=4)
    ctx = {"model": serveable_model, "verifier": serveable_dir, "fingerprint": fingerprint, "prepared": prepared,
           "tmp": tmp_path}
    req = speculators(ctx)
    (Path(req.target) / "hidden_states" / "hs_2.safetensors").unlink()
    checked = PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)
    summary = write_features(open_source(req), checked, tmp_path / "written", progress=False)
    assert (summary.written_samples, summary.skipped) == (3, {"missing_file": 1})
    every = PreparedDataset(prepared, "all", 0.0, fingerprint)
    assert FeatureDataset(tmp_path / "written", "all").sample_ids == [s for s in every.sample_ids if s != "w002"]
    rows = PackedDataset(every, 1000)
    collate = FeatureCollator(open_source(req), every)
    with pytest.raises(Eagle3Error, match=r"skipped sample 'w002' \(missing_file\)") as refused:
        collate([rows[r] for r in range(len(rows))])
    assert "\n" not in str(refused.value)


@torch.no_grad()
def reference(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The verifier's own forward in fp32 through transformers: `output_hidden_states` at the aux indices, the last
    one (after the final norm), and the argmax of its logits; with the top-2 logit margin of each position."""
    out = model.float()(input_ids.long()[None], output_hidden_states=True)
    top = out.logits[0].float().topk(2, dim=-1).values
    return {"aux_hidden_states": torch.cat([out.hidden_states[k][0] for k in AUX], dim=-1),
            "last_hidden_state": out.hidden_states[-1][0], "verifier_greedy": out.logits[0].argmax(-1),
            "margin": top[:, 0] - top[:, 1]}


# Each row against the reference, rounded as the row stores its features: shards in DTYPE (every row writes them),
# and online (the rows training computes batches with) in the dtype its batches carry. A route that computes the
# states itself in fp32 (transformers, on this model) gives them as the reference does, within fp32 noise; a route
# that maps an engine's states (the aux ids, the final norm applied here to the state before it) may land one
# bf16 step from the rounded reference where its fp32 arithmetic differs in the last bit. Adjacent layers of the
# serveable verifier differ by far more than either (tests/helpers/serveable.py), so a wrong slice, layer or
# rounding in any one route fails.
FP32_NOISE = {"atol": 1e-5, "rtol": 1e-5}
ONE_BF16_STEP = {"atol": 1e-5, "rtol": BF16_STEP}
ONLINE_DTYPE = {"transformers": torch.float32, "sglang-server": torch.bfloat16, "server": torch.bfloat16}
TOLERANCE = {"transformers": FP32_NOISE, "vllm-server": ONE_BF16_STEP, "sglang-server": ONE_BF16_STEP,
             "server": ONE_BF16_STEP, "directory": FP32_NOISE, "speculators": ONE_BF16_STEP,
             "specforge": FP32_NOISE}
GREEDY_TIE = 1e-3  # a greedy token may differ from the reference's only where its top two logits are this close


def assert_reference(kind: str, half: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     dtype: torch.dtype, sample: str) -> None:
    """`got` (one sample's features from the route) equals the reference rounded to `dtype`, within the row's
    tolerance; its greedy tokens equal the reference's except at near-ties."""
    where = f"{kind} ({half}), sample {sample}"
    for key in ("aux_hidden_states", "last_hidden_state"):
        rounded = want[key].to(dtype).float()
        assert got[key].shape == rounded.shape, (where, key, got[key].shape, rounded.shape)
        torch.testing.assert_close(got[key].float(), rounded, **TOLERANCE[kind],
                                   msg=lambda m, key=key: f"{where}, {key}: {m}")
    clear = want["margin"] > GREEDY_TIE
    assert clear.float().mean() > 0.9, (where, "the reference has too many near-ties to test greedy tokens")
    assert torch.equal(got["verifier_greedy"].long()[clear], want["verifier_greedy"][clear]), (where, "greedy")


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_row_gives_the_verifiers_own_features(kind, tmp_path, serveable_model, serveable_dir, fingerprint):
    """The same samples through each row, written to shards and (for the rows training computes online) collated
    as `train --features` rounds them (train.training_data.online_dtype), against `reference`, one for all rows."""
    from eagle3_hf.train.training_data import online_dtype

    row = SOURCES[kind]
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=6)
    every = PreparedDataset(prepared, "all", 0.0, fingerprint)
    want = {sid: reference(serveable_model, every[i]["input_ids"]) for i, sid in enumerate(every.sample_ids)}
    with _Stack() as stack:
        ctx = {"model": serveable_model, "verifier": serveable_dir, "fingerprint": fingerprint,
               "prepared": prepared, "tmp": tmp_path, "enter": stack.enter}
        req = HARNESSES[kind](ctx)  # the contract test above requires one per row
        assert kind in TOLERANCE and (kind in ONLINE_DTYPE) == row.online, (
            f"the table's row {kind!r} needs its tolerance here (TOLERANCE) and, online, the dtype its batches "
            "carry (ONLINE_DTYPE)")
        checked = PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)
        write_features(open_source(req), checked, tmp_path / "written", store=StoreOptions(4),
                       progress=False)
        written = FeatureDataset(tmp_path / "written", "all")
        assert sorted(written.sample_ids) == sorted(want)
        for i, sid in enumerate(written.sample_ids):
            assert_reference(kind, "written", written[i], want[sid], DTYPE_OF[DTYPE], sid)
        if row.online:
            dtype = online_dtype(kind, DTYPE)
            collate = FeatureCollator(open_source(replace(req, dtype=dtype)), every, max_seq_len=MAX_SEQ_LEN)
            for sid, got in collate.features(every.sample_ids).items():
                assert got["aux_hidden_states"].dtype == got["last_hidden_state"].dtype == ONLINE_DTYPE[kind], (
                    kind, sid, got["aux_hidden_states"].dtype)
                assert_reference(kind, "online", got, want[sid], ONLINE_DTYPE[kind], sid)


class _Stack:
    """Servers a harness starts, stopped when the test ends."""

    def __init__(self) -> None:
        self.entered: list = []

    def enter(self, server):
        self.entered.append(server.__enter__())
        return self.entered[-1]

    def __enter__(self) -> _Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        for server in reversed(self.entered):
            server.__exit__(None, None, None)


def test_every_row_names_a_module_and_a_use():
    """Each row says which half of the pipeline uses it, and its module is importable (lazily: vLLM not needed)."""
    for kind, row in SOURCES.items():
        assert row.kind == kind and row.selected_by
        assert Path(row.load().__file__ or "").is_file()
