"""Importers: tiny files written the way speculators (vLLM) and SpecForge (SGLang) write them, imported,
must equal our own extraction of the same samples — layer conventions and final norm included."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest
import torch
from safetensors.torch import save_file

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.engine_files import ImportedFeatures
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.write import import_features, write_features
from eagle3_hf.verifier.head import load_verifier_head

from tests.helpers.data import make_prepared

AUX = (1, 3, 5)  # our indices on the 6-layer tiny verifier


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, verifier, fingerprint):
    root = tmp_path_factory.mktemp("imp")
    prepared = make_prepared(root / "prep", fingerprint, n=5, hi=25)
    extract_features(verifier, fingerprint, prepared, root / "ours", aux_indices=AUX, dtype="float32",
                     progress=False)
    return root


def _import(fmt, src, out, verifier, fingerprint, aux_indices=AUX, dtype="bfloat16", prepared=None):
    return import_features(ImportedFeatures(fmt, src, verifier, fingerprint, aux_indices, dtype), out,
                           prepared=prepared)


def _engine_states(model, ids):
    """What an engine captures: the residual stream entering layers AUX (vLLM ids) and after the last layer."""
    out = model(ids[None], output_hidden_states=True)
    pre = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, a, o: pre.update(last=o[0]))
    model(ids[None])
    h.remove()
    return [out.hidden_states[i][0] for i in AUX], pre["last"], out.hidden_states[-1][0]


def _compare(ours: FeatureDataset, imported: FeatureDataset, exact_last: bool):
    assert sorted(imported.sample_ids) == sorted(ours.sample_ids)
    for i, sid in enumerate(imported.sample_ids):
        a, b = ours[ours.sample_ids.index(sid)], imported[i]
        for key in ("input_ids", "loss_mask", "verifier_greedy", "aux_hidden_states"):
            assert torch.equal(a[key], b[key]), key
        if exact_last:
            assert torch.equal(a["last_hidden_state"], b["last_hidden_state"])
        else:  # we applied the final norm ourselves
            torch.testing.assert_close(a["last_hidden_state"], b["last_hidden_state"], rtol=1e-5, atol=1e-6)


def test_head_only_load_matches_model(tiny_verifier_dir, verifier):
    norm, head, config = load_verifier_head(str(tiny_verifier_dir), dtype=torch.float32)
    x = torch.randn(7, config.hidden_size)
    assert torch.equal(norm(x), verifier.model.norm(x))
    assert torch.equal(head(x), verifier.lm_head(x))  # tied: read from the embedding tensor


def test_speculators_roundtrip(tmp_path, reference, verifier, fingerprint, tiny_verifier_dir):
    prep = datasets.load_from_disk(str(reference / "prep"))
    src = tmp_path / "spec"
    rows = {"input_ids": prep["input_ids"], "loss_mask": prep["loss_mask"],
            "seq_len": [len(x) for x in prep["input_ids"]]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(src))  # speculators' prepared rows: no ids
    (src / "hidden_states").mkdir()
    for i, ids in enumerate(prep["input_ids"]):
        if i == 3:
            continue  # a failed request: no file
        ids = torch.tensor(ids)
        aux, pre_norm_last, _ = _engine_states(verifier, ids)
        save_file({"hidden_states": torch.stack([*aux, pre_norm_last], dim=1).contiguous(),  # [T, 4, H]
                   "token_ids": ids}, str(src / "hidden_states" / f"hs_{i}.safetensors"))
    out = tmp_path / "imported"
    s = _import("speculators", src, out, str(tiny_verifier_dir), fingerprint, aux_indices=AUX,
                        dtype="float32", prepared=reference / "prep")
    assert s.written_samples == 4 and s.total_skipped == {"missing_file": 1}
    imported = FeatureDataset(out, split="all")
    m = imported.manifest
    assert m["source"] == "vllm/speculators" and "pre-norm" in m["provenance"]["last_hidden_state"]
    assert m["skipped_ids"] == {"missing_file": [prep["id"][3]]}
    ours = FeatureDataset(reference / "ours", split="all")
    ours_wo3 = [sid for sid in ours.sample_ids if sid != prep["id"][3]]
    assert sorted(imported.sample_ids) == sorted(ours_wo3)
    ours._samples = [s for s in ours._samples if s["id"] != prep["id"][3]]
    ours.sample_ids = ours_wo3
    _compare(ours, imported, exact_last=False)
    # the same capture as a FeatureSource through the one write loop, asked for our prepared samples: the same
    # features, the sample without a file recorded as skipped
    source = ImportedFeatures("speculators", src, str(tiny_verifier_dir), fingerprint, AUX, "float32")
    checked = PreparedDataset(reference / "prep", "all", tokenizer_fingerprint=fingerprint)
    summary = write_features(source, checked, tmp_path / "via_source",
                             progress=False)
    assert summary.written_samples == 4 and summary.skipped == {"missing_file": 1}
    via_source = FeatureDataset(tmp_path / "via_source", split="all")
    assert via_source.manifest["skipped_ids"] == {"missing_file": [prep["id"][3]]}
    _compare(via_source, imported, exact_last=True)


def test_specforge_roundtrip(tmp_path, reference, verifier, fingerprint, tiny_verifier_dir, capsys):
    from eagle3_hf.cli import main

    prep = datasets.load_from_disk(str(reference / "prep"))
    src = tmp_path / "sf" / "rows_0-2000"
    src.mkdir(parents=True)
    for i, (ids, mask) in enumerate(zip(prep["input_ids"], prep["loss_mask"])):
        ids = torch.tensor(ids)
        aux, _, post_norm_last = _engine_states(verifier, ids)
        record = {"input_ids": ids, "loss_mask": torch.tensor(mask), "aux_hidden_state": torch.cat(aux, -1)[None],
                  "hidden_state": post_norm_last[None]}
        if i % 2:
            with gzip.open(src / f"data_{i}.ckpt.gz", "wb") as f:
                torch.save(record, f)
        else:
            torch.save(record, src / f"data_{i}.ckpt")
    out = tmp_path / "imported"
    sglang_ids = ",".join(str(i - 1) for i in AUX)  # what SpecForge/SGLang were told
    rc = main(["import-features", "specforge", str(tmp_path / "sf"), "--verifier", str(tiny_verifier_dir),
               "--output", str(out), "--engine-layer-ids", sglang_ids, "--features-dtype", "fp32", "--data",
               str(reference / "prep"), "--no-progress"])
    assert rc == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["total_samples"] == 5
    imported = FeatureDataset(out, split="all")
    assert imported.manifest["aux_layer_indices"] == list(AUX) and imported.manifest["source"] == "sglang/specforge"
    _compare(FeatureDataset(reference / "ours", split="all"), imported, exact_last=True)
    # importing again resumes (nothing to do); mixing with transformers-extracted features is refused
    assert _import("specforge", tmp_path / "sf", out, str(tiny_verifier_dir), fingerprint, aux_indices=AUX,
                           dtype="fp32", prepared=reference / "prep").written_samples == 0
    with pytest.raises(ValueError, match="source"):
        _import("specforge", tmp_path / "sf", reference / "ours", str(tiny_verifier_dir), fingerprint,
                        aux_indices=AUX, dtype="fp32")



def test_engine_layer_ids_or_aux_layers_not_both(tmp_path, tiny_verifier_dir, capsys):
    from eagle3_hf.cli import main

    rc = main(["import-features", "specforge", str(tmp_path / "sf"), "--verifier", str(tiny_verifier_dir), "--output",
               str(tmp_path / "out"), "--aux-layers", "1,2,3", "--engine-layer-ids", "0,1,2"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == "error: give --aux-layers or --engine-layer-ids, not both"
    assert not (tmp_path / "out").exists()


class _NotATensor:
    pass


def test_specforge_pickles_loaded_weights_only(tmp_path, tiny_verifier_dir, fingerprint):
    (tmp_path / "sf").mkdir()
    torch.save({"input_ids": torch.arange(3), "payload": _NotATensor()}, tmp_path / "sf" / "data_0.ckpt")
    with pytest.raises(ValueError, match=r"data_0\.ckpt: cannot be loaded with torch.load\(weights_only=True\)"):
        _import("specforge", tmp_path / "sf", tmp_path / "out", str(tiny_verifier_dir), fingerprint,
                        aux_indices=AUX)


def test_speculators_wrong_shape_named(tmp_path, tiny_verifier_dir, fingerprint):
    src = tmp_path / "spec"
    datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "loss_mask": [[1, 1, 1]]}).save_to_disk(str(src))
    (src / "hidden_states").mkdir()
    save_file({"hidden_states": torch.zeros(3, 3, 64), "token_ids": torch.tensor([5, 6, 7])},
              str(src / "hidden_states" / "hs_0.safetensors"))
    with pytest.raises(ValueError, match=r"hs_0\.safetensors: hidden_states has shape \(3, 3, 64\)"):
        _import("speculators", src, tmp_path / "out", str(tiny_verifier_dir), fingerprint, aux_indices=AUX)


def _speculators(src, tensors=None, columns=("input_ids", "loss_mask"), raw: bytes | None = None):
    rows = {"input_ids": [[5, 6, 7]], "loss_mask": [[1, 1, 1]]}
    datasets.Dataset.from_dict({c: rows[c] for c in columns}).save_to_disk(str(src))
    (src / "hidden_states").mkdir()
    path = src / "hidden_states" / "hs_0.safetensors"
    if raw is not None:
        path.write_bytes(raw)
    else:
        save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("case", ["no-token-ids", "corrupt", "no-loss-mask", "specforge-no-key",
                                  "specforge-not-a-dict", "specforge-scalar"])
def test_a_malformed_file_is_one_line_naming_the_file_and_key(tmp_path, tiny_verifier_dir, case, capsys):
    from eagle3_hf.cli import main

    src, fmt = tmp_path / "src", "speculators"
    if case == "no-token-ids":
        path = _speculators(src, {"hidden_states": torch.zeros(3, 4, 64)})
        line = f"{path}: no tensor 'token_ids' (found ['hidden_states'])"
    elif case == "corrupt":
        path = _speculators(src, raw=b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
        line = f"{path}: not a readable safetensors file ("
    elif case == "no-loss-mask":
        _speculators(src, {"hidden_states": torch.zeros(3, 4, 64)}, columns=("input_ids",))
        line = f"{src}: the speculators dataset has no 'loss_mask' column (found ['input_ids'])"
    else:
        fmt = "specforge"
        (src / "rows_0-2000").mkdir(parents=True)
        path = src / "rows_0-2000" / "data_0.ckpt"
        ok = {"input_ids": torch.arange(3), "loss_mask": torch.ones(3), "aux_hidden_state": torch.zeros(1, 3, 192),
              "hidden_state": torch.zeros(1, 3, 64)}
        if case == "specforge-no-key":
            torch.save({k: v for k, v in ok.items() if k != "hidden_state"}, path)
            line = f"{path}: no key 'hidden_state' (has ['aux_hidden_state', 'input_ids', 'loss_mask'])"
        elif case == "specforge-not-a-dict":
            torch.save(torch.zeros(3), path)
            line = (f"{path}: holds a Tensor, expected a dict of tensors ['input_ids', 'loss_mask', "
                    "'aux_hidden_state', 'hidden_state']")
        else:
            torch.save({**ok, "hidden_state": torch.tensor(1.0)}, path)
            line = f"{path}: key 'hidden_state' holds Tensor (), expected a tensor"
    capsys.readouterr()  # the fixture's own progress bars
    code = main(["import-features", fmt, str(src), "--verifier", str(tiny_verifier_dir), "--output",
                 str(tmp_path / "out"), "--aux-layers", ",".join(map(str, AUX)), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: " + line), (err[0], line)
