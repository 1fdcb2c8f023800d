"""The acceptance losses (`--objective lk-alpha | lk-hybrid`, train/objective.py) against plain autograd on dense
fp64 tensors over the verifier's *full* vocabulary: the loss, its gradient, the teacher's in-vocabulary mass and
the α metric, including the mass outside the draft vocabulary that can never be accepted."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.model.checkpoint import vocab_from_target_ids
from eagle3_hf.train import loss as loss_module
from eagle3_hf.train.arguments import Eagle3TrainingArguments, parse_args
from eagle3_hf.train.loss import acceptance_objective, drafter_loss
from eagle3_hf.train.metrics import StepStats
from eagle3_hf.train.objective import Objective
from eagle3_hf.verifier.family import softcap_logits

from tests.train.step_helpers import tiny_trainer, trainer_batch

VOCAB, HIDDEN, DRAFT_VOCAB, STEPS, GAMMA, SOFTCAP = 300, 32, 64, 3, 0.8, 20.0
OBJECTIVES = [Objective("kl"), Objective("lk-alpha"), Objective("lk-hybrid", 3.0), Objective("lk-hybrid", 0.7)]


def _rows(seed: int = 0, n: int = 40, m: int = 25, vocab: int = 90, draft: int = 30):
    """Student logits [n, draft], the verifier's full-vocabulary logits [m, vocab], the draft ids, and row indices
    (some teacher rows read twice, some student rows never)."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, draft, generator=g, dtype=torch.float64) * 2
    verifier = torch.randn(m, vocab, generator=g, dtype=torch.float64) * 2
    ids = torch.randperm(vocab, generator=g)[:draft]
    student_rows = torch.randperm(n, generator=g)[: n - 5]
    teacher_rows = torch.randint(0, m, (n - 5,), generator=g)
    return student, verifier, ids, student_rows, teacher_rows


def _dense_alpha(student: torch.Tensor, p_full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """α = Σ_v min(p_v, q_v) over the full vocabulary, q zero outside the draft ids."""
    q_full = torch.zeros(student.shape[0], p_full.shape[1], dtype=student.dtype)
    q_full = q_full.index_copy(1, ids, student.softmax(-1))
    return torch.minimum(p_full, q_full).sum(-1)


def _dense_loss(objective: Objective, student: torch.Tensor, verifier: torch.Tensor, ids: torch.Tensor,
                student_rows: torch.Tensor, teacher_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ loss, Σ α) by plain autograd on the full-vocabulary distributions."""
    p_full = verifier.softmax(-1)[teacher_rows]
    renormalised = p_full[:, ids] / p_full[:, ids].sum(-1, keepdim=True)
    z = student[student_rows]
    alpha = _dense_alpha(z, p_full, ids)
    ce = -(renormalised * z.log_softmax(-1)).sum(-1)
    if objective.name == "kl":
        rows = ce
    elif objective.name == "lk-alpha":
        rows = -alpha.log()
    else:
        w = torch.exp(-objective.eta * alpha.detach())
        rows = w * ce + (1 - w) * (1 - alpha)
    return rows.sum(), alpha.sum()


def _ours(objective: Objective, student: torch.Tensor, verifier: torch.Tensor, ids: torch.Tensor,
          student_rows: torch.Tensor, teacher_rows: torch.Tensor, mass: bool = True):
    """acceptance_objective on fp32 inputs as the loss gives them: the renormalised teacher and its mass."""
    p_full = verifier.softmax(-1)
    teacher = (p_full[:, ids] / p_full[:, ids].sum(-1, keepdim=True)).float()
    in_vocab = p_full[:, ids].sum(-1).float() if mass else None
    z = student.float().requires_grad_(True)
    total, alphas = acceptance_objective(z, teacher, student_rows, teacher_rows, in_vocab, objective)
    total.backward()
    return total.detach(), alphas, z.grad


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.name}-{o.eta}")
def test_loss_and_gradient_match_dense_fp64_autograd(monkeypatch, objective):
    """Several blocks of rows (a tiny block size), teacher rows read twice, mass outside the draft vocabulary."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 7 * 30)
    student, verifier, ids, srows, trows = _rows()
    reference = student.clone().requires_grad_(True)
    want, want_alpha = _dense_loss(objective, reference, verifier, ids, srows, trows)
    want.backward()
    got, alphas, grad = _ours(objective, student, verifier, ids, srows, trows)
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-5)
    assert alphas is not None and float(alphas) == pytest.approx(float(want_alpha.detach()), rel=1e-5)
    assert torch.allclose(grad.double(), reference.grad, rtol=1e-4, atol=1e-6)
    assert float(want_alpha.detach()) / len(srows) < 0.9  # mass outside the draft vocabulary matters here


def test_renormalising_the_teacher_would_overstate_alpha():
    """Without the in-vocabulary mass α is that of the renormalised teacher: larger than the true one."""
    student, verifier, ids, srows, trows = _rows(1)
    _, true_alpha, _ = _ours(Objective("lk-alpha"), student, verifier, ids, srows, trows)
    _, renormalised_alpha, _ = _ours(Objective("lk-alpha"), student, verifier, ids, srows, trows, mass=False)
    assert float(renormalised_alpha) > float(true_alpha) * 1.2


def test_lk_hybrid_at_eta_zero_is_kl_and_at_large_eta_is_one_minus_alpha():
    """w = exp(-η α): η = 0 gives w = 1, the soft cross-entropy (the `kl` objective); a large η gives w ≈ 0, 1 - α."""
    student, verifier, ids, srows, trows = _rows(2)
    kl, _, kl_grad = _ours(Objective("kl"), student, verifier, ids, srows, trows)
    hybrid, _, hybrid_grad = _ours(Objective("lk-hybrid", 0.0), student, verifier, ids, srows, trows)
    assert float(hybrid) == pytest.approx(float(kl), rel=1e-6)
    assert torch.allclose(hybrid_grad, kl_grad, rtol=1e-5, atol=1e-7)
    tv, alphas, tv_grad = _ours(Objective("lk-hybrid", 1e4), student, verifier, ids, srows, trows)
    assert float(tv) == pytest.approx(len(srows) - float(alphas), rel=1e-5)
    reference = student.clone().requires_grad_(True)
    p_full = verifier.softmax(-1)[trows]
    (1 - _dense_alpha(reference[srows], p_full, ids)).sum().backward()
    assert torch.allclose(tv_grad.double(), reference.grad, rtol=1e-4, atol=1e-6)


def _drafter(softcap: float | None = SOFTCAP) -> tuple[Eagle3DraftModel, torch.Tensor]:
    torch.manual_seed(0)
    verifier = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2)
    config = Eagle3Config.from_verifier(verifier, draft_vocab_size=DRAFT_VOCAB)
    config._attn_implementation = "sdpa"
    model = Eagle3DraftModel(config)
    model.set_vocab_mapping(*vocab_from_target_ids(torch.arange(0, 2 * DRAFT_VOCAB, 2), VOCAB))
    head = torch.randn(VOCAB + 4, HIDDEN) * 0.3  # 4 padding rows past vocab_size: the verifier's softmax spans them
    model.attach_teacher(head, softcap, in_vocab_mass=True)
    return model, head


def test_teacher_mass_is_the_full_vocabulary_softmax_on_the_draft_vocabulary():
    model, head = _drafter()
    hidden = torch.randn(2, 11, HIDDEN)
    probs, mass = model.teacher_distribution_and_mass(hidden)
    p_full = softcap_logits(hidden.double() @ head.double().T, SOFTCAP).softmax(-1)
    ids = model.draft_to_target(torch.arange(DRAFT_VOCAB))
    assert torch.allclose(mass.double(), p_full[..., ids].sum(-1), rtol=1e-5)
    assert torch.equal(probs, model.teacher_distribution(hidden))  # the distribution itself is unchanged
    whole = Eagle3DraftModel(Eagle3Config.from_verifier(
        LlamaConfig(vocab_size=DRAFT_VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=6),
        draft_vocab_size=DRAFT_VOCAB))
    whole.attach_teacher(torch.randn(DRAFT_VOCAB, HIDDEN), in_vocab_mass=True)
    assert whole.verifier_lm_head_rest is None  # nothing outside: nothing more kept, the mass is 1
    assert torch.equal(whole.teacher_distribution_and_mass(hidden)[1], torch.ones(2, 11))


def _batch(seed: int, docs: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    length = sum(docs)
    return {"input_ids": torch.randint(0, VOCAB, (1, length), generator=g),
            "aux_hidden_states": torch.randn(1, length, 3 * HIDDEN, generator=g),
            "last_hidden_state": torch.randn(1, length, HIDDEN, generator=g),
            "verifier_greedy": torch.randint(0, 2 * DRAFT_VOCAB + 20, (1, length), generator=g),
            "document_ids": torch.cat([torch.full((n,), d) for d, n in enumerate(docs)])[None],
            "position_ids": torch.cat([torch.arange(n) for n in docs])[None],
            "loss_mask": torch.cat([torch.arange(n) >= n // 3 for n in docs])[None].long()}


@pytest.mark.parametrize("objective", ["kl", "lk-hybrid"])
def test_alpha_metric_and_t1_tau_match_a_dense_reference(objective):
    """Per step, the mean α over the loss positions from the full-vocabulary softmax of the verifier's head; the
    simulated τ at T = 1 is 1 + Σ_k Π_{j≤k} mean α_j. The same whether the heads run where read or everywhere."""
    model, head = _drafter()
    batch = _batch(0, [30, 18])
    ids = model.draft_to_target(torch.arange(DRAFT_VOCAB))
    p_full = softcap_logits(batch["last_hidden_state"][0].double() @ head.double().T, SOFTCAP).softmax(-1)
    for heads_where_read in (True, False):
        step = drafter_loss(model, batch, model.t2d, STEPS, GAMMA, heads_where_read=heads_where_read,
                            objective=Objective(objective))
        stats = StepStats(STEPS)
        stats.update(step.outputs.logits, batch, model.d2t, model.t2d, step.step_losses, logits_mask=step.logits_mask,
                     head_rows=step.head_rows, step_alphas=step.step_alphas)
        metrics = stats.metrics()
        dense = drafter_loss(model, batch, model.t2d, STEPS, GAMMA, heads_where_read=False)
        want = []
        for i in range(STEPS):
            t = drafter_targets(batch, i, model)
            student = dense.outputs.logits[i][0, t].detach().double()
            want.append(float(_dense_alpha(student, p_full[t + i + 1], ids).mean()))
            assert metrics[f"alpha_{i}"] == pytest.approx(want[i], rel=1e-5), i
        tau = 1 + want[0] + want[0] * want[1] + want[0] * want[1] * want[2]
        assert metrics["simulated_acceptance_length_t1"] == pytest.approx(tau, rel=1e-5)


def drafter_targets(batch: dict[str, torch.Tensor], step: int, model: Eagle3DraftModel) -> torch.Tensor:
    """Step `step`'s loss positions of the one row."""
    from eagle3_hf.train.loss import step_targets

    return step_targets(batch, step, model.t2d).loss_mask[0].nonzero().squeeze(1)


def test_without_the_mass_no_alpha_is_reported_and_lk_is_refused(tmp_path):
    model, _ = _drafter()
    model.attach_teacher(torch.randn(VOCAB, HIDDEN))  # no in-vocabulary mass
    batch = _batch(1, [20])
    step = drafter_loss(model, batch, model.t2d, STEPS, GAMMA)
    stats = StepStats(STEPS)
    stats.update(step.outputs.logits, batch, model.d2t, model.t2d, step.step_losses, head_rows=step.head_rows,
                 step_alphas=step.step_alphas)
    assert step.step_alphas is None and "alpha_0" not in stats.metrics()
    with pytest.raises(ValueError, match="in_vocab_mass=True"):
        drafter_loss(model, batch, model.t2d, STEPS, GAMMA, objective=Objective("lk-alpha"))
    trainer_model = tiny_trainer(tmp_path, 3).model
    with pytest.raises(ValueError, match="--objective lk-hybrid needs the verifier's mass"):
        type(tiny_trainer(tmp_path, 3))(model=trainer_model, args=Eagle3TrainingArguments(
            output_dir=str(tmp_path / "x"), use_cpu=True, report_to="none", objective="lk-hybrid"))


def test_objective_arguments_are_parsed_checked_and_recorded(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("objective: lk-hybrid\nlk_eta: 2.5\n")
    _, _, args = parse_args(["--config", str(config), "--output-dir", str(tmp_path / "o")])
    assert args.training_objective() == Objective("lk-hybrid", 2.5)
    with pytest.raises(ValueError, match="lk-eta must be a finite number >= 0"):
        Eagle3TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, objective="lk-hybrid", lk_eta=-1.0)
    with pytest.raises(SystemExit):
        parse_args(["--objective", "tv", "--output-dir", str(tmp_path / "o")])


@pytest.mark.parametrize("objective", ["lk-alpha", "lk-hybrid"])
def test_a_trainer_step_trains_the_objective_and_logs_alpha(tmp_path, objective):
    """The Trainer's step under an LK objective: its loss is the objective's (not the kl one), its gradient reaches
    the drafter, the recipe records it, and the step's metrics carry α and the simulated τ at T = 1."""
    from eagle3_hf.train.trainer import training_summary

    batch = trainer_batch(256, 2)
    losses = {}
    for name in ("kl", objective):
        trainer = tiny_trainer(tmp_path / name, 3, objective=name)
        num_items = trainer._get_num_items_in_batch([dict(batch)], trainer.args.device)
        losses[name] = float(trainer.training_step(trainer.model, dict(batch), num_items))
        metrics = trainer._train_stats.metrics()
        assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)
    assert losses[objective] != pytest.approx(losses["kl"], rel=1e-3)
    assert 0 < metrics["alpha_0"] < 1 and 1 < metrics["simulated_acceptance_length_t1"] < 4
    recipe = training_summary(trainer, {"eval_alpha_0": 0.5, "eval_simulated_acceptance_length_t1": 1.5})
    assert recipe["recipe"]["objective"] == objective and recipe["metrics"]["simulated_acceptance_length_t1"] == 1.5
    assert ("lk_eta" in recipe["recipe"]) == (objective == "lk-hybrid")


def test_kl_is_the_same_bit_for_bit_with_the_mass_attached():
    """The teacher's mass (and the α metric it brings) leaves the kl loss and its gradient exactly as they were."""
    batch = _batch(2, [26, 14])
    results = []
    for mass in (False, True):
        model, head = _drafter()
        model.attach_teacher(head, SOFTCAP, in_vocab_mass=mass)
        step = drafter_loss(model, batch, model.t2d, STEPS, GAMMA)
        step.normalised().backward()
        results.append((step.normalised().detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_the_training_script_trains_an_lk_objective_and_records_it(synthetic, tmp_path):
    """`train --objective lk-hybrid`: the script attaches the verifier's whole head (its mass outside the draft
    vocabulary), the logs carry α per step, and eagle3_training.json records the objective, η and the T = 1 metrics."""
    from eagle3_hf.scripts.train import main as train_main

    from tests.helpers.data import COMMON

    out = tmp_path / "run"
    summary = train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                          "--output-dir", str(out), "--num-train-epochs", "1", "--validation-fraction", "0.2",
                          "--save-strategy", "no", "--eval-strategy", "no", "--logging-steps", "2",
                          "--objective", "lk-hybrid", "--lk-eta", "2.0", *COMMON])
    assert summary["recipe"]["objective"] == "lk-hybrid" and summary["recipe"]["lk_eta"] == 2.0
    alphas = summary["metrics"]["step_alpha"]
    assert len(alphas) == 3 and all(0 < a < 1 for a in alphas)
    assert 1 < summary["metrics"]["simulated_acceptance_length_t1"] < 4
    assert any("alpha_0" in h for h in summary["log_history"])
