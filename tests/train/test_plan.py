"""`eagle3-hf plan`: the Kimi-K2.5 recipes' verdicts, the feature bytes the shard writer really stores, the
verifier's parameter counts, and the activation model against a measured training step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_hf.cli import main as cli_main
from eagle3_hf.features.records import make_header
from eagle3_hf.features.shard_writer import ShardWriter
from eagle3_hf.train.plan import GIB, feature_bytes_per_token, verifier_params

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "examples/recipes/kimi_k25_text_config.json")


def plan(capsys, tmp_path: Path, recipe: str, accelerate: str, *extra: str) -> tuple[int, str, dict]:
    out_json = tmp_path / "plan.json"
    rc = cli_main(["plan", str(ROOT / "examples/recipes" / recipe), "--accelerate-config",
                   str(ROOT / "accelerate_configs" / accelerate), "--verifier-config", KIMI,
                   "--dataset-tokens", "17.3e6", "--json", str(out_json), *extra])
    return rc, capsys.readouterr().out, json.loads(out_json.read_text())


def test_kimi_recipes_fit_on_80_gib_and_say_plainly_when_they_do_not(capsys, tmp_path):
    rc, text, one = plan(capsys, tmp_path, "kimi_k25_1gpu.yaml", "1gpu.yaml")
    assert rc == 0 and "verdict     fits" in text
    assert one["launch"]["zero_stage"] == 0 and one["drafter"]["hidden_size"] == 7168
    rc, text, eight = plan(capsys, tmp_path, "kimi_k25_8gpu_zero3.yaml", "8gpu_zero3.yaml")
    assert rc == 0 and eight["launch"]["zero_stage"] == 3 and eight["launch"]["num_processes"] == 8
    assert eight["memory"]["model_states"] < one["memory"]["model_states"] / 2  # ZeRO-3 partitions the states
    rc, text, small = plan(capsys, tmp_path, "kimi_k25_1gpu.yaml", "1gpu.yaml", "--gpu-memory-gib", "16")
    assert rc == 1 and "DOES NOT FIT: needs" in text and not small["memory"]["fits"]
    # and 8 such GPUs cannot hold the verifier's 594 GB for the extraction either: said in the same verdict form
    assert "DOES NOT FIT: the verifier's weights take 594" in text and small["verifier"]["problem"]


def test_feature_disk_is_what_the_shard_writer_stores(tmp_path):
    hidden, tokens = 64, 300
    for dtype, name in (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn")):
        out = tmp_path / dtype
        writer = ShardWriter(out, make_header({"hidden_size": hidden, "num_hidden_layers": 6}, "fp", [1, 3, 4], name))
        writer.add("s0", torch.arange(tokens), torch.ones(tokens), torch.randn(tokens, 3 * hidden),
                   torch.randn(tokens, hidden), torch.arange(tokens))
        writer.close()
        stored = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        expected = feature_bytes_per_token(hidden, dtype) * tokens
        assert expected <= stored <= expected + 2048  # + the safetensors header
    assert feature_bytes_per_token(7168, "bf16") * 17.3e6 / GIB == pytest.approx(924, abs=1)  # the Kimi-K2.5 run


def test_kimi_verifier_parameters_match_the_published_counts():
    counts = verifier_params(json.loads(Path(KIMI).read_text()))
    assert counts["total"] / 1e9 == pytest.approx(1030, rel=0.02)  # "1 T total parameters"
    assert counts["active"] / 1e9 == pytest.approx(32, rel=0.03)  # "32 B activated"


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["h256-L2048", "dflash-h256-V32k"])
def test_activation_model_within_15_percent_of_a_measured_step(shape):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, str(ROOT / "bench/plan_memory.py"), "--shapes", shape, "--json",
                           "/dev/stdout"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout[proc.stdout.index("["):])[0]
    assert 0.85 <= row["ratio"] <= 1.15, row


def test_dataset_size_and_draft_vocabulary_come_from_the_recipes_features(tmp_path, capsys):
    from tests.helpers.data import build_offline_data, save_verifier

    verifier = save_verifier(tmp_path / "verifier")
    features = build_offline_data(tmp_path, verifier, num_samples=12)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"verifier: {tmp_path / 'verifier'}\nfeatures: {features}\nmax_seq_len: 128\n")
    assert cli_main(["plan", str(recipe), "--json", str(tmp_path / "plan.json")]) == 0
    got = json.loads((tmp_path / "plan.json").read_text())
    manifest = json.loads((features / "manifest.json").read_text())
    assert got["data"]["tokens"] == sum(s["length"] for s in manifest["samples"])
    assert got["drafter"]["draft_vocab_size"] == 128  # the fixture's vocab.safetensors, not the 32000 default
    assert got["data"]["disk_bf16"] == feature_bytes_per_token(64, "bf16") * got["data"]["tokens"]


@pytest.mark.parametrize("recipe,verifier", [("llama31_8b_8gpu_ddp.yaml", "llama31_8b_text_config.json"),
                                             ("qwen3_8b_8gpu_ddp.yaml", "qwen3_8b_text_config.json"),
                                             ("kimi_k25_8gpu_ddp.yaml", "kimi_k25_text_config.json")])
def test_8gpu_recipes_run_ddp_because_the_plan_says_the_drafter_fits(capsys, tmp_path, recipe, verifier):
    out_json = tmp_path / "plan.json"
    rc = cli_main(["plan", str(ROOT / "examples/recipes" / recipe), "--accelerate-config",
                   str(ROOT / "accelerate_configs/8gpu_ddp.yaml"), "--verifier-config",
                   str(ROOT / "examples/recipes" / verifier), "--json", str(out_json)])
    text, result = capsys.readouterr().out, json.loads(out_json.read_text())
    assert rc == 0 and "verdict     fits" in text and "DDP buckets" in text
    assert result["launch"]["zero_stage"] == 0 and result["launch"]["num_processes"] == 8
    assert result["memory"]["ddp_buckets"] == 4 * result["drafter"]["params_trained"]  # fp32 gradient copy


def test_zero3_plan_reports_the_weights_gathered_per_micro_batch(capsys, tmp_path):
    rc, text, eight = plan(capsys, tmp_path, "kimi_k25_8gpu_zero3.yaml", "8gpu_zero3.yaml")
    gathered = eight["zero3_gathered_per_micro_step"]
    embedding = 2 * 163840 * 7168  # the frozen bf16 verifier embedding, 2.35 GB, gathered at each of 3 TTT steps
    assert rc == 0 and 3 * embedding < gathered < 3 * embedding + 2 * 8 * 2**30
    assert "ZeRO-3 all-gathers" in text and "prefer it" in text


def test_the_feature_read_rate_a_node_needs_is_its_training_tokens_times_their_bytes():
    """What the loader must sustain per node: the planned training tokens/s of its GPUs times the bf16 bytes a
    token's features take, so bench/dataset_read.py's measured rate can be read against it."""
    import yaml

    from eagle3_hf.train.plan import build_plan
    from eagle3_hf.train.plan_drafter import Eagle3Arithmetic
    from eagle3_hf.train.plan_inputs import read_launch, verifier_text_config

    root = Path(__file__).resolve().parents[2]
    recipe = yaml.safe_load((root / "examples/recipes/llama31_8b_8gpu_ddp.yaml").read_text())
    launch = read_launch(str(root / "accelerate_configs/8gpu_ddp.yaml"), recipe)
    text = verifier_text_config(recipe, str(root / "examples/recipes/llama31_8b_text_config.json"))
    data = build_plan(recipe, launch, text, 1e6, mean_document=2048.0).data
    assert data is not None
    tokens = data.read_tokens_per_s_per_node
    assert data.read_bytes_per_s_per_node == pytest.approx(tokens * feature_bytes_per_token(4096, "bf16"))
    from eagle3_hf.model.configuration_eagle3 import Eagle3Config

    config = Eagle3Config.from_verifier(text, draft_vocab_size=32000, ttt_steps=int(recipe["ttt_steps"]))
    drafter = Eagle3Arithmetic(config, int(recipe["ttt_steps"]))
    per_gpu = data.peak_tflops * 1e12 * data.mfu / drafter.train_flops_per_token(2048.0)
    assert tokens == pytest.approx(8 * per_gpu)  # one node of 8 GPUs


def test_extraction_budget_beside_training(capsys, tmp_path):
    """Assumed prefill tokens/s -> hours and the GB/s the feature disk must take; a slow disk bounds the time."""
    rc, text, p = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--extract-tokens-per-s",
                       "20000", "--disk-gbps", "4")
    e = p["extraction"]
    per_token = feature_bytes_per_token(7168, "bf16")
    assert rc == 0 and e["tokens_per_s"] == 20000 and e["bound"] == "verifier"
    assert e["write_gbps"] == pytest.approx(20000 * per_token / 1e9)
    assert e["hours"] == pytest.approx(17.3e6 / 20000 / 3600)
    assert "extract at  20,000 tokens/s (assumed, --extract-tokens-per-s)" in text
    assert text.index("extract at") < text.index("training ")
    _, _, slow = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--extract-tokens-per-s",
                      "20000", "--disk-gbps", "0.5")
    assert slow["extraction"]["bound"] == "disk"
    assert slow["extraction"]["hours"] == pytest.approx(17.3e6 * per_token / 0.5e9 / 3600)


def test_the_run_takes_as_long_as_its_disk_reads_when_they_are_slower_than_the_gpus(capsys, tmp_path):
    """5 epochs of Kimi-K2.5's 924 GiB of bf16 features at 2 GB/s take at least 0.64 h, far longer than the GPUs'
    compute: the run is disk-bound and says so; a small verifier's features keep up with its GPUs."""
    rc, text, p = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--disk-gbps", "2",
                       "--mean-document-tokens", "1730")
    x = p["data"]
    assert rc == 0 and x["bound"] == "disk" and x["run_hours"] >= 5 * 924e9 / 2e9 / 3600 >= 0.64
    assert x["run_hours"] == x["read_hours"] > x["compute_hours"]
    per_token = feature_bytes_per_token(7168, "bf16")
    assert x["evaluations"] == 11  # of the 5 % split: every 500 of 5,020 steps, and the final one
    assert x["read_bytes_per_node"] == pytest.approx(17.3e6 * per_token * (5 * 0.95 + 11 * 0.05))
    assert f"run         {x['run_hours']:.2f} h (bound: disk;" in text
    # on a fast disk the same run is bound by its compute
    _, text, fast = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--disk-gbps", "100",
                         "--mean-document-tokens", "1730")
    assert fast["data"]["bound"] == "compute" and fast["data"]["run_hours"] == fast["data"]["compute_hours"]
    assert "(bound: compute;" in text


def test_a_small_recipe_is_compute_bound(capsys, tmp_path):
    """One GPU reads what it trains on well within the disk: the Kimi-K2.5 1-GPU recipe (1.3 GB/s of features at
    2 GB/s), and the demo's CPU recipe on its tiny verifier."""
    from tests.helpers.data import save_verifier

    rc, text, one = plan(capsys, tmp_path, "kimi_k25_1gpu.yaml", "1gpu.yaml", "--mean-document-tokens", "1730")
    x = one["data"]
    assert rc == 0 and x["bound"] == "compute" and x["run_hours"] == x["compute_hours"] > x["read_hours"]
    assert "(bound: compute;" in text
    save_verifier(tmp_path / "verifier")
    out = tmp_path / "small.json"
    assert cli_main(["plan", str(ROOT / "examples/recipes/small_cpu.yaml"), "--accelerate-config",
                     str(ROOT / "accelerate_configs/cpu_2proc.yaml"), "--verifier-config",
                     str(tmp_path / "verifier" / "config.json"), "--dataset-tokens", "1e5", "--draft-vocab", "128",
                     "--peak-tflops", "0.2", "--json", str(out)]) == 0
    x = json.loads(out.read_text())["data"]
    assert x["bound"] == "compute" and x["run_hours"] == x["compute_hours"] > x["read_hours"]
    assert x["evaluations"] == 7  # every one of 6 epochs + the final one


def test_two_nodes_read_half_each_and_need_the_readers_of_their_own_engines(capsys, tmp_path):
    """Two nodes: each node's engines, readers and disk carry half of the run; per node nothing doubles."""
    args = ("--extract-tokens-per-s", "40000", "--mean-document-tokens", "1730")
    _, _, one = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", *args)
    rc, text, two = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "multinode_ddp_template.yaml",
                         "--extract-tokens-per-s", "80000", "--mean-document-tokens", "1730")
    assert rc == 0 and one["verifier"]["gpus_per_engine"] == two["verifier"]["gpus_per_engine"] == 8
    r1, r2 = one["reader"], two["reader"]
    assert r2["engines"] == 2 * r1["engines"] == 2 and r2["engines_per_node"] == r1["engines_per_node"] == 1
    assert r2["readers_per_node"] == r1["readers_per_node"] == r1["readers_per_engine"]
    assert f"({r1['readers_per_node']} per node)" in text
    d1, d2 = one["data"], two["data"]
    assert d2["read_bytes_per_node"] < 0.55 * d1["read_bytes_per_node"]  # half, fewer evaluations
    # ... and each node's disk reads its half in half the time: the hours are of the node's bytes, not the run's
    assert d2["nodes"] == 2 and d2["read_hours"] < 0.55 * d1["read_hours"]
    assert d2["read_hours"] == pytest.approx(d2["read_bytes_per_node"] / (d2["disk_gbps"] * 1e9) / 3600)
    assert f"per node (1/2 of the run's): {d2['read_hours']:.2f} h at 2 GB/s" in text
    assert two["extraction"]["hours"] == pytest.approx(one["extraction"]["hours"] / 2)
    assert two["extraction"]["write_gbps"] == pytest.approx(one["extraction"]["write_gbps"])  # per node


def test_the_vllm_readers_a_node_needs(capsys, tmp_path):
    """One engine over 8 GPUs (Kimi) takes all the node's prefill through one process; 8 replicas split it."""
    from eagle3_hf.train.plan_reader import reader_plan

    rc, text, p = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--extract-tokens-per-s",
                       "40000", "--extract-gpus-per-engine", "8", "--reader-gbps", "0.5")
    r = p["reader"]
    assert rc == 0 and r["file_bytes_per_token"] == 4 * 7168 * 2 and r["engines"] == 1
    assert r["tokens_per_s_per_reader"] == pytest.approx(0.5e9 / (4 * 7168 * 2))
    assert r["tokens_per_s_per_engine"] == 40000
    per = r["tokens_per_s_per_reader"]
    assert (r["readers_per_engine"] - 1) * per < 40000 <= r["readers_per_engine"] * per  # the fewest that keep up
    assert f"--vllm-readers {r['readers_per_engine']} per engine" in text
    replicas = reader_plan(4096, 160000, extract_gpus=8, gpus_per_engine=1, reader_gbps=0.5)
    assert replicas.engines == 8 and replicas.tokens_per_s_per_engine == 20000
    assert replicas.readers_per_engine == 2 and replicas.readers_per_node == 16  # 15,259 tokens/s per reader
    # 16 replicas over two nodes at twice the rate: each node still runs 8 of them, 16 readers
    two = reader_plan(4096, 320000, extract_gpus=16, gpus_per_engine=1, reader_gbps=0.5, nodes=2)
    assert two.engines == 16 and two.engines_per_node == 8 and two.readers_per_node == 16


def test_the_extraction_engine_spans_the_gpus_that_hold_the_verifiers_weights(capsys, tmp_path):
    """Kimi-K2.5's INT4 experts make 594 GB: 8 H200s by default; one GPU per engine is refused in the verdict;
    an 8B verifier in bf16 is one GPU per engine (8 replicas)."""
    rc, text, p = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--gpu-memory-gib", "141")
    v = p["verifier"]
    assert rc == 0 and v["gpus_per_engine"] == 8 and v["derived"] and v["problem"] is None
    assert v["weights_bytes"] / 1e9 == pytest.approx(594, rel=0.01) and "INT4" in v["weights"]
    rc, text, p = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--gpu-memory-gib", "141",
                       "--extract-gpus-per-engine", "1")
    assert rc == 1 and "DOES NOT FIT: the verifier's weights take 594" in text and "at least 4 such GPUs" in text
    rc, text, p = plan(capsys, tmp_path, "kimi_k25_8gpu_ddp.yaml", "8gpu_ddp.yaml", "--gpu-memory-gib", "141",
                       "--verifier-dtype", "bf16")
    assert rc == 0 and p["verifier"]["gpus_per_engine"] == 8  # the quantized checkpoint is sized as stored
    out = tmp_path / "llama.json"
    assert cli_main(["plan", str(ROOT / "examples/recipes/llama31_8b_8gpu_ddp.yaml"), "--accelerate-config",
                     str(ROOT / "accelerate_configs/8gpu_ddp.yaml"), "--verifier-config",
                     str(ROOT / "examples/recipes/llama31_8b_text_config.json"), "--json", str(out)]) == 0
    llama = json.loads(out.read_text())
    assert llama["verifier"]["gpus_per_engine"] == 1 and llama["reader"]["engines"] == 8
    assert llama["verifier"]["weights_bytes"] / 1e9 == pytest.approx(16.1, rel=0.01)  # 8.03 B x 2 bytes


def test_a_drafter_kind_the_plan_has_no_arithmetic_for_is_refused_in_one_line(tmp_path, capsys):
    """The recipe's `drafter_kind` picks the arithmetic (eagle3 when absent); a kind without one is not planned as
    EAGLE-3."""
    recipe = tmp_path / "recipe.yaml"
    base = (ROOT / "examples/recipes/llama31_8b_8gpu_ddp.yaml").read_text()
    recipe.write_text(base + "\ndrafter_kind: medusa\n")
    args = ["plan", str(recipe), "--verifier-config", str(ROOT / "examples/recipes/llama31_8b_text_config.json")]
    assert cli_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: the recipe's drafter_kind 'medusa': plan knows dflash, eagle3"
    recipe.write_text(base + "\ndrafter_kind: eagle3\n")
    assert cli_main(args) == 0 and "drafter     hidden 4096" in capsys.readouterr().out


QWEN = str(ROOT / "examples/recipes/qwen3_8b_text_config.json")


def test_a_dflash_recipe_plans_its_blocks_and_full_vocabulary_logits(tmp_path, capsys):
    """`drafter_kind: dflash` plans the block drafter with the training defaults (5 layers, blocks of 16, 64 anchors
    per row); its features are EAGLE-3's, and each added vocabulary entry costs the step peak what the logits, the
    fp32 teacher and the three gradients of the logits alive in the loss's backward take at every scored row."""
    from eagle3_hf.train.plan_drafter import drafter_arithmetic

    base = (ROOT / "examples/recipes/qwen3_8b_8gpu_ddp.yaml").read_text()
    plans = {}
    for kind in ("eagle3", "dflash"):
        recipe = tmp_path / f"{kind}.yaml"
        recipe.write_text(base + f"\ndrafter_kind: {kind}\n")
        out = tmp_path / f"{kind}.json"
        assert cli_main(["plan", str(recipe), "--accelerate-config", str(ROOT / "accelerate_configs/8gpu_ddp.yaml"),
                         "--verifier-config", QWEN, "--dataset-tokens", "17.3e6", "--json", str(out)]) == 0
        plans[kind] = json.loads(out.read_text())
    text = capsys.readouterr().out
    d = plans["dflash"]
    assert "drafter     DFlash, 5 layers, hidden 4096" in text and "blocks of 16 at 64 anchors per row" in text
    assert (d["drafter"]["layers"], d["drafter"]["block_size"], d["drafter"]["anchors_per_row"]) == (5, 16, 64)
    assert d["drafter"]["vocab_size"] == 151936 and d["memory"]["step_peak"] > 0 and d["data"]["epoch_flops"] > 0
    assert d["data"]["disk_bf16"] == plans["eagle3"]["data"]["disk_bf16"]  # the same features
    cfg = json.loads(Path(QWEN).read_text())
    recipe = {"drafter_kind": "dflash", "max_seq_len": 2048}
    small = drafter_arithmetic(recipe, cfg, 32000).step_peak_bytes(2048, 0, "bf16")
    large = drafter_arithmetic(recipe, cfg | {"vocab_size": 2 * cfg["vocab_size"]}, 32000).step_peak_bytes(
        2048, 0, "bf16")
    scored = 64 * 15
    per_vocab = scored * (2 + 4 + 3 * 2)  # bf16 logits, fp32 teacher, three bf16 gradients
    assert large - small == pytest.approx(per_vocab * cfg["vocab_size"], rel=2e-3)  # (the loss blocks: ~constant)
    assert per_vocab * cfg["vocab_size"] > small / 2  # the full-vocabulary terms are most of the step peak


def test_dflash_plan_counts_the_parameters_the_real_drafter_trains_and_freezes():
    from eagle3_hf.model.configuration_dflash import DFlashConfig
    from eagle3_hf.model.modeling_dflash import DFlashDraftModel
    from eagle3_hf.train.plan_drafter import drafter_arithmetic

    verifier = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 512}
    counted = drafter_arithmetic({"drafter_kind": "dflash", "dflash_layers": 3, "block_size": 4}, verifier,
                                 32000).params()
    model = DFlashDraftModel(DFlashConfig.from_verifier(verifier, mask_token_id=299, num_hidden_layers=3,
                                                        block_size=4))
    assert counted.trained == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counted.frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad) == 2 * 300 * 64
    assert counted.largest_layer == 300 * 64


def test_dflash_plan_counts_the_linear_flops_of_a_real_training_step():
    """FLOPs per token of `plan` against torch's count of a real DFlash step (forward, loss, backward): fc (no
    gradient for the features), the context k/v projections, the layers over the blocks, the frozen head and the
    teacher. torch does not count the CPU attention kernel, so the plan's attention term (12 x nh*hd per key: half
    a document of context, plus the block) is taken off."""
    from torch.utils.flop_counter import FlopCounterMode

    from eagle3_hf.model.configuration_dflash import DFlashConfig
    from eagle3_hf.model.modeling_dflash import DFlashDraftModel
    from eagle3_hf.train.dflash_loss import ANCHORS_KEY, dflash_loss, sample_anchors
    from eagle3_hf.train.plan_drafter import drafter_arithmetic

    verifier = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 512}
    length, anchors, size, layers = 128, 8, 4, 2
    torch.manual_seed(0)
    model = DFlashDraftModel(DFlashConfig.from_verifier(verifier, mask_token_id=299, num_hidden_layers=layers,
                                                        block_size=size))
    model.load_verifier_weights(torch.randn(300, 64), torch.randn(300, 64))
    batch = {"input_ids": torch.randint(0, 299, (1, length)), "aux_hidden_states": torch.randn(1, length, 3 * 64),
             "last_hidden_state": torch.randn(1, length, 64), "document_ids": torch.zeros(1, length, dtype=torch.long),
             "position_ids": torch.arange(length)[None], "loss_mask": torch.ones(1, length, dtype=torch.long),
             "verifier_greedy": torch.randint(0, 299, (1, length))}
    batch[ANCHORS_KEY] = sample_anchors(batch, anchors)
    with FlopCounterMode(display=False) as counter:
        dflash_loss(model, batch, anchors).normalised().backward()
    counted = counter.get_total_flops() / length
    recipe = {"drafter_kind": "dflash", "dflash_layers": layers, "block_size": size, "dflash_anchors": anchors,
              "max_seq_len": length}
    planned = drafter_arithmetic(recipe, verifier, 32000).train_flops_per_token(length)
    attention = anchors * size / length * layers * 12 * 4 * 16 * (length / 2 + size)
    assert planned - attention == pytest.approx(counted, rel=1e-6)
