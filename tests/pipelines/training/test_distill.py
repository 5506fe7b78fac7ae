"""Cold-start distillation: the pure loss terms, the pooled representation, the covariance init of
LoRA A (real PEFT), and the distillation loop."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from pipelines.config import ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.model import inference
from pipelines.model.base import CTRModel, fingerprint
from pipelines.training import distill as D

CFG = ModelConfig(embed_dim=16, n_heads=2, n_blocks=2, id_buckets=512, small_buckets=16)
R = 4


def lora_wrap(base, r: int = R, targets=("q_proj", "v_proj"), seed: int = 0):
    torch.manual_seed(seed)
    base.requires_grad_(False)
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), bias="none"))


def base_model(seed: int = 0) -> CTRModel:
    torch.manual_seed(seed)
    return CTRModel(CFG).eval()


def tokens(n: int = 256, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cols = [
        rng.integers(0, 64, n) if f in ("user_id", "item_id") else rng.integers(0, CFG.small_buckets, n)
        for f in FEATURE_FIELDS
    ]
    return np.stack(cols, axis=1).astype(np.int64)


def labels_for(x: np.ndarray, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return ((x[:, 1] % 3 == 0) ^ (rng.random(len(x)) < 0.2)).astype(np.float32)


def out(model, x: np.ndarray) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x))


def randomise_B(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


# ----------------------------------------------------------------------------- loss terms: values
def test_bce_term_on_a_hand_computed_case():
    s = torch.tensor([0.0, math.log(3.0)])
    y = torch.tensor([1.0, 0.0])
    # -log sigmoid(0) = ln 2; -log(1 - sigmoid(ln 3)) = -log(1/4) = 2 ln 2
    assert D.bce_term(s, y).item() == pytest.approx(1.5 * math.log(2.0), rel=1e-6)
    assert D.bce_term(torch.zeros(0), torch.zeros(0)).item() == 0.0


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
def test_kd_term_is_the_bernoulli_kl_times_t_squared(temperature):
    s, t = torch.tensor([0.0, -1.0]), torch.tensor([math.log(3.0), 2.0])

    def kl(p, q):
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    sig = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731
    expected = temperature**2 * np.mean(
        [kl(sig(tv / temperature), sig(sv / temperature)) for sv, tv in zip(s.tolist(), t.tolist())]
    )
    assert D.kd_term(s, t, temperature).item() == pytest.approx(expected, rel=1e-5)
    if temperature == 1.0:  # p = 0.75 vs q = 0.5, and 0.881 vs 0.269, averaged
        hand = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
        assert D.kd_term(s[:1], t[:1], 1.0).item() == pytest.approx(hand, rel=1e-6)


def test_kd_term_equals_soft_bce_minus_teacher_entropy():
    g = torch.Generator().manual_seed(0)
    s, t, T = torch.randn(50, generator=g) * 3, torch.randn(50, generator=g) * 3, 2.0
    p = torch.sigmoid(t / T)
    soft_bce = F.binary_cross_entropy_with_logits(s / T, p)
    entropy = F.binary_cross_entropy_with_logits(t / T, p)
    assert D.kd_term(s, t, T).item() == pytest.approx((T**2 * (soft_bce - entropy)).item(), rel=1e-4, abs=1e-6)


def test_kd_gradient_is_t_times_the_probability_gap_and_never_reaches_the_teacher():
    s = torch.tensor([0.5, -2.0, 3.0], requires_grad=True)
    t = torch.tensor([1.0, 1.0, -1.0], requires_grad=True)
    T = 3.0
    D.kd_term(s, t, T).backward()
    expected = T * (torch.sigmoid(s / T) - torch.sigmoid(t / T)) / 3
    torch.testing.assert_close(s.grad, expected.detach(), rtol=1e-5, atol=1e-7)
    assert t.grad is None


def test_kd_term_is_stable_for_extreme_logits_and_rejects_a_bad_temperature():
    v = D.kd_term(torch.tensor([80.0, -80.0]), torch.tensor([-80.0, 80.0]), 1.0)
    assert v.item() == pytest.approx(80.0, rel=1e-3)  # teacher p ~ 0: KL ~ -log(1 - sigmoid(80)) = 80
    with pytest.raises(ValueError, match="temperature"):
        D.kd_term(torch.zeros(2), torch.zeros(2), 0.0)


def test_align_terms_on_hand_computed_cases():
    a, b = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    assert D.align_term(a, b, "mse").item() == pytest.approx((1 + 4) / 4)
    assert D.align_term(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]]), "cosine").item() == pytest.approx(1.0)
    same_direction = D.align_term(torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 4.0]]), "cosine")
    assert same_direction.item() == pytest.approx(0.0, abs=1e-7)
    assert D.align_term(torch.tensor([[1.0, 0.0]]), torch.tensor([[-1.0, 0.0]]), "cosine").item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="alignment"):
        D.align_term(a, b, "l1")


def test_every_term_is_zero_when_student_equals_teacher():
    g = torch.Generator().manual_seed(0)
    logits, h = torch.randn(32, generator=g) * 4, torch.randn(32, 8, generator=g)
    for T in (0.5, 1.0, 3.0):
        assert D.kd_term(logits, logits.clone(), T).item() == pytest.approx(0.0, abs=1e-6)
    assert D.align_term(h, h.clone(), "mse").item() == 0.0
    assert D.align_term(h, h.clone(), "cosine").item() == pytest.approx(0.0, abs=1e-6)
    total, parts = D.distill_loss(
        D.LossWeights(bce=0.0, kd=1.0, align=1.0),
        labelled_logits=logits[:0],
        labels=logits[:0],
        transfer_logits=logits,
        teacher_logits=logits.clone(),
        transfer_h=h,
        teacher_h=h.clone(),
    )
    assert total.item() == pytest.approx(0.0, abs=1e-6) and set(parts) == {"kd", "align"}


def test_distill_loss_is_the_weighted_sum_of_the_terms():
    g = torch.Generator().manual_seed(1)
    ls, y = torch.randn(8, generator=g), (torch.rand(8, generator=g) > 0.5).float()
    ts, tt = torch.randn(16, generator=g), torch.randn(16, generator=g)
    hs, ht = torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)
    w = D.LossWeights(bce=0.5, kd=2.0, align=0.25, temperature=3.0, align_kind="cosine")
    total, parts = D.distill_loss(
        w, labelled_logits=ls, labels=y, transfer_logits=ts, teacher_logits=tt, transfer_h=hs, teacher_h=ht
    )
    expected = 0.5 * D.bce_term(ls, y) + 2.0 * D.kd_term(ts, tt, 3.0) + 0.25 * D.align_term(hs, ht, "cosine")
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert parts == pytest.approx(
        {
            "bce": D.bce_term(ls, y).item(),
            "kd": D.kd_term(ts, tt, 3.0).item(),
            "align": D.align_term(hs, ht, "cosine").item(),
        }
    )
    only_bce, p2 = D.distill_loss(
        D.LossWeights(1.0, 0.0, 0.0),
        labelled_logits=ls,
        labels=y,
        transfer_logits=ts,
        teacher_logits=tt,
        transfer_h=hs,
        teacher_h=ht,
    )
    assert set(p2) == {"bce"} and only_bce.item() == pytest.approx(D.bce_term(ls, y).item())
    with pytest.raises(ValueError, match="every loss weight"):
        D.distill_loss(
            D.LossWeights(0.0, 0.0, 0.0),
            labelled_logits=ls,
            labels=y,
            transfer_logits=ts,
            teacher_logits=tt,
            transfer_h=hs,
            teacher_h=ht,
        )


# ----------------------------------------------------------------------------- pooled representation
def test_logits_and_pooled_match_forward_exactly_plain_and_peft_wrapped():
    x = torch.from_numpy(tokens(64))
    base = base_model()
    with torch.no_grad():
        logits, h = inference.logits_and_pooled(base, x)
        assert torch.equal(logits, base(x)) and h.shape == (64, CFG.embed_dim)
        base_h = h.clone()

    wrapped = lora_wrap(base_model())
    randomise_B(wrapped)  # a non-zero update: LoRA must act inside the helper's calls too
    with torch.no_grad():
        logits, h = inference.logits_and_pooled(wrapped, x)
        assert torch.equal(logits, wrapped(x))
        assert not torch.allclose(h, base_h)
        with wrapped.disable_adapter():
            assert torch.equal(inference.logits_and_pooled(wrapped, x)[1], base_h)


def test_gradient_flows_only_to_lora_parameters():
    x, y = tokens(64), labels_for(tokens(64))
    teacher = base_model(seed=3)
    t_logits, t_h = inference.forward_by_group({None: teacher}, x, np.array(["a"] * len(x)))
    student = lora_wrap(base_model())
    randomise_B(student)  # with B = 0 the gradient of A is exactly zero; make both non-trivial
    logits, h = inference.logits_and_pooled(student.train(), torch.from_numpy(x))
    loss, _ = D.distill_loss(
        D.LossWeights(1.0, 1.0, 1.0),
        labelled_logits=logits,
        labels=torch.from_numpy(y),
        transfer_logits=logits,
        teacher_logits=torch.from_numpy(t_logits),
        transfer_h=h,
        teacher_h=torch.from_numpy(t_h),
    )
    loss.backward()
    for n, p in student.named_parameters():
        if "lora_" in n:
            assert p.grad is not None and torch.count_nonzero(p.grad) > 0, n
        else:
            assert not p.requires_grad and p.grad is None, n


def test_forward_by_group_routes_rows_and_keeps_their_order():
    x = tokens(30)
    a, b = base_model(1), base_model(2)
    groups = np.array(["a", "b", "c"] * 10)
    logits, pooled = inference.forward_by_group({"a": a, "b": b, None: a}, x, groups)
    for g, m in (("a", a), ("b", b), ("c", a)):
        idx = np.flatnonzero(groups == g)
        expect_l, expect_h = inference.logits_and_pooled(m, torch.from_numpy(x[idx]))
        np.testing.assert_allclose(logits[idx], expect_l.detach().numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(pooled[idx], expect_h.detach().numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(KeyError, match="'c'"):
        inference.forward_by_group({"a": a, "b": b}, x, groups)


# ----------------------------------------------------------------------------- covariance init
def axis_data(n: int = 4000, d: int = 16, seed: int = 0):
    """Vectors with known principal axes: std 8, 4, 2, 1 on dims 3, 7, 1, 12, 0.1 elsewhere."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.1, (n, d))
    for dim, std in ((3, 8.0), (7, 4.0), (1, 2.0), (12, 1.0)):
        x[:, dim] = rng.normal(0, std, n)
    return torch.tensor(x, dtype=torch.float32)


def test_behaviour_covariance_matches_numpy_weighted_covariance():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(200, 6)), rng.integers(1, 20, 200).astype(float)
    got = D.behaviour_covariance(torch.tensor(x), torch.tensor(w)).numpy()
    np.testing.assert_allclose(got, np.cov(x.T, aweights=w, bias=True), rtol=1e-10, atol=1e-12)
    # impressions weight users: a user counted twice is the same as the user listed twice
    twice = D.behaviour_covariance(torch.tensor(np.vstack([x, x[:1]])), torch.tensor(np.r_[w, w[:1]]))
    once = D.behaviour_covariance(torch.tensor(x), torch.tensor(np.r_[2 * w[0], w[1:]]))
    torch.testing.assert_close(twice, once)
    with pytest.raises(ValueError):
        D.behaviour_covariance(torch.zeros(0, 4))
    with pytest.raises(ValueError):
        D.behaviour_covariance(torch.ones(3, 4), torch.tensor([1.0, -1.0, 1.0]))


def test_principal_directions_are_the_top_eigenvectors_in_order():
    cov = D.behaviour_covariance(axis_data())
    vals, vecs = D.principal_directions(cov, 4)
    assert vecs.shape == (4, 16)
    torch.testing.assert_close(vecs @ vecs.T, torch.eye(4, dtype=vecs.dtype), atol=1e-10, rtol=0)
    assert all(a >= b for a, b in zip(vals.tolist(), vals[1:].tolist()))
    assert [int(v.abs().argmax()) for v in vecs] == [3, 7, 1, 12]
    assert (vecs[torch.arange(4), vecs.abs().argmax(dim=1)] > 0).all()  # sign convention
    torch.testing.assert_close(cov @ vecs.T, vecs.T * vals, atol=1e-8, rtol=1e-6)
    np.testing.assert_allclose(vals.numpy(), [64, 16, 4, 1], rtol=0.1)
    with pytest.raises(ValueError, match="rank"):
        D.principal_directions(cov, 17)


def test_covariance_lora_A_rows_are_scaled_eigenvectors_with_the_default_norm():
    cov = D.behaviour_covariance(axis_data())
    A = D.covariance_lora_A(cov, 4)
    vals, vecs = D.principal_directions(cov, 4)
    assert A.shape == (4, 16) and A.dtype == torch.float32
    norms = A.norm(dim=1)
    # rows along the eigenvectors (cosine 1), mutually orthogonal
    cos = (A.double() @ vecs.T).diag() / norms.double()
    torch.testing.assert_close(cos, torch.ones(4, dtype=torch.float64), atol=1e-6, rtol=0)
    off = A @ A.T - torch.diag(norms**2)
    assert off.abs().max() < 1e-6
    # row i has norm s * sqrt(l_i / mean(l)), so ||A||_F^2 = r * s^2 = r / 3 (PEFT's default's expectation)
    expected = D.KAIMING_ROW_NORM * torch.sqrt(vals / vals.mean())
    torch.testing.assert_close(norms.double(), expected, rtol=1e-5, atol=0)
    assert (A**2).sum().item() == pytest.approx(4 / 3, rel=1e-5)


def test_covariance_lora_A_floors_small_eigenvalues_so_no_rank_is_dead():
    rank_one = torch.zeros(8, 8, dtype=torch.float64)
    rank_one[0, 0] = 1.0
    A = D.covariance_lora_A(rank_one, 3)
    norms = A.norm(dim=1)
    assert (norms > 0).all()
    assert norms[1].item() == pytest.approx(norms[0].item() * math.sqrt(D.EIGEN_FLOOR), rel=1e-5)


def test_set_lora_A_initialises_every_target_and_the_student_starts_at_the_base():
    x = tokens(128)
    reference = out(base_model(), x)
    student = lora_wrap(base_model(), targets=("q_proj", "k_proj", "v_proj"))
    emb, counts = D.user_embedding_rows(student, x[:, 0])
    A = D.covariance_lora_A(D.behaviour_covariance(emb, counts), R)
    names = D.set_lora_A(student, A)
    assert sorted(n.rsplit(".", 1)[-1] for n in names) == sorted(["k_proj", "q_proj", "v_proj"] * CFG.n_blocks)
    for n, p in student.named_parameters():
        if "lora_A" in n:
            assert tuple(p.shape) == (R, CFG.embed_dim) and torch.equal(p.detach(), A), n
        if "lora_B" in n:
            assert torch.count_nonzero(p) == 0, n
    assert torch.equal(out(student, x), reference)  # B = 0: exactly the base's output
    with pytest.raises(ValueError, match="lora_A is"):
        D.set_lora_A(student, torch.zeros(R + 1, CFG.embed_dim))
    with pytest.raises(ValueError, match="no LoRA layers"):
        D.set_lora_A(base_model(), A)


def test_user_embedding_rows_are_distinct_users_weighted_by_impressions():
    m = base_model()
    emb, counts = D.user_embedding_rows(m, np.array([5, 3, 5, 5, 9]))
    assert counts.tolist() == [1.0, 3.0, 1.0]
    assert torch.equal(emb, m.embeddings["user_id"].weight.detach()[torch.tensor([3, 5, 9])])


# ----------------------------------------------------------------------------- the loop
def settings(**kw) -> D.DistillSettings:
    base = dict(
        epochs=3,
        batch_size=32,
        transfer_batch_size=64,
        lr=1e-2,
        weight_decay=0.0,
        warmup_steps=2,
        seed=7,
        weights=D.LossWeights(1.0, 1.0, 0.1, 2.0),
    )
    return D.DistillSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def teacher_setup():
    """A teacher that differs from the base (base + a random adapter) and its outputs on the transfer set."""
    teacher = lora_wrap(base_model(), seed=5)
    randomise_B(teacher, seed=5)
    xt = tokens(512, seed=1)
    tl, th = inference.forward_by_group({None: teacher}, xt, np.zeros(len(xt), dtype=object))
    xl = tokens(96, seed=2)
    return D.TransferSet(xt, tl, th), (xl, labels_for(xl))


def test_distill_moves_only_lora_and_pulls_the_student_towards_the_teacher(teacher_setup):
    transfer, labelled = teacher_setup
    student = lora_wrap(base_model())
    fp = fingerprint(student)
    before = D.kd_term(out(student, transfer.tokens), torch.from_numpy(transfer.teacher_logits), 1.0).item()
    hist = D.distill(student, labelled, transfer, settings(epochs=8, weights=D.LossWeights(0.0, 1.0, 0.1, 1.0)))
    after = D.kd_term(out(student, transfer.tokens), torch.from_numpy(transfer.teacher_logits), 1.0).item()
    assert after < 0.5 * before
    assert fingerprint(student) == fp  # the base is bit-identical
    assert len(hist) == 8 and {"train_loss", "train_kd", "train_align"} <= set(hist[0]) and "train_bce" not in hist[0]
    assert not student.training


def test_distill_is_deterministic_for_a_seed(teacher_setup):
    transfer, labelled = teacher_setup
    runs = []
    for seed in (7, 7, 8):
        student = lora_wrap(base_model())
        hist = D.distill(student, labelled, transfer, settings(seed=seed))
        runs.append(({k: v.clone() for k, v in student.state_dict().items() if "lora_" in k}, hist))
    (a, ha), (b, hb), (c, _) = runs
    assert [h["train_loss"] for h in ha] == [h["train_loss"] for h in hb]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_without_transfer_set_it_is_plain_bce_fine_tuning(teacher_setup):
    _, (xl, yl) = teacher_setup
    student = lora_wrap(base_model())
    hist = D.distill(student, (xl, yl), None, settings(epochs=2), val=(xl, yl))
    assert {"train_bce", "val_auc", "val_logloss"} <= set(hist[-1]) and "train_kd" not in hist[-1]
    assert hist[-1]["train_loss"] == pytest.approx(hist[-1]["train_bce"])
    # an epoch is one pass over the labelled rows: ceil(96 / 32) = 3 steps
    steps = []
    D.distill(lora_wrap(base_model()), (xl, yl), None, settings(epochs=1), on_epoch=steps.append)
    assert len(steps) == 1
    with pytest.raises(ValueError, match="no labelled rows"):
        D.distill(lora_wrap(base_model()), (xl[:0], yl[:0]), None, settings())
    with pytest.raises(ValueError, match="no trainable"):
        D.distill(base_model().requires_grad_(False), (xl, yl), None, settings())


def test_first_step_sees_zero_distillation_when_the_teacher_is_the_base():
    """Student = base + B=0 adapter and teacher = base: KD and alignment start at exactly zero."""
    xt = tokens(128, seed=3)
    tl, th = inference.forward_by_group({None: base_model()}, xt, np.zeros(len(xt), dtype=object))
    student = lora_wrap(base_model())
    D.set_lora_A(student, D.covariance_lora_A(D.behaviour_covariance(*D.user_embedding_rows(student, xt[:, 0])), R))
    logits, h = inference.logits_and_pooled(student.eval(), torch.from_numpy(xt))
    assert D.kd_term(logits, torch.from_numpy(tl), 2.0).item() == pytest.approx(0.0, abs=1e-7)
    assert D.align_term(h, torch.from_numpy(th)).item() == pytest.approx(0.0, abs=1e-10)
    copy.deepcopy(student)  # the wrapped student stays a plain, copyable module


def test_logits_and_pooled_is_the_whole_logit_of_a_wrapped_wide_model():
    """Distillation reads the teacher's and the student's logits through logits_and_pooled: with the
    first-order (wide) term and LoRA injected they must still be exactly model(x)."""
    torch.manual_seed(0)
    base = CTRModel(replace(CFG, wide=True)).eval()
    with torch.no_grad():
        for emb in base.wide.values():
            emb.weight.normal_(std=0.5)  # a trained wide term, not its zero init
    model = lora_wrap(base)
    randomise_B(model)
    x = tokens()
    logits, pooled = inference.logits_and_pooled(model.eval(), torch.from_numpy(x))
    assert torch.allclose(logits, out(model, x), atol=1e-6) and pooled.shape == (len(x), CFG.embed_dim)
    assert base.wide_logit(torch.from_numpy(x)).abs().max() > 0.1  # the wide term is part of what matched
