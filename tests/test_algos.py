"""asyncflow.algos against hand-computed values: the arithmetic is written out in each test."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from asyncflow.algos import ESTIMATORS, LOSSES, compute_loss, resolve  # noqa: E402
from asyncflow.algos import estimate, estimate_columns, loss_aggregation  # noqa: E402
from asyncflow.algos import advantages as adv  # noqa: E402
from asyncflow.algos import kl  # noqa: E402
from asyncflow.algos.config import AlgoError, LossConfig  # noqa: E402
from asyncflow.algos.ppo import token_logprobs  # noqa: E402

POLICY_LOSSES = [n for n, info in LOSSES.items() if not info.critic]
L = math.log


def approx(x, rel=1e-5, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


def t(rows, grad=False):
    x = torch.tensor(rows, dtype=torch.float64)
    return x.requires_grad_(grad)


# ============================================================================ package surface


def test_package_import_is_torch_free():
    code = "import sys, asyncflow.algos; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_table_target_resolves():
    for info in list(ESTIMATORS.values()) + list(LOSSES.values()):
        assert callable(resolve(info.target)), info.target


# ============================================================================ estimators


def test_grpo_one_group():
    # mean = 0.5; unbiased std = sqrt((4 * 0.5^2) / 3) = sqrt(1/3); 0.5 / sqrt(1/3) = 0.8660254
    a = adv.grpo([1, 0, 0, 1], [0, 0, 0, 0])
    assert a == approx([0.8660254, -0.8660254, -0.8660254, 0.8660254])
    # population std = 0.5 -> +-1
    assert adv.grpo([1, 0, 0, 1], [0] * 4, unbiased_std=False) == approx([1, -1, -1, 1])
    # Dr. GRPO: r - mean only
    assert adv.grpo([1, 0, 0, 1], [0] * 4, scale_by_std=False) == approx([0.5, -0.5, -0.5, 0.5])


def test_grpo_groups_interleaved_zero_std_and_singletons():
    # group a: [1, 3] mean 2, std sqrt(2) -> -+1/sqrt(2); group b: [5, 5] std 0 -> 0; c alone -> 0
    a = adv.grpo([1, 5, 3, 5, 7], ["a", "b", "a", "b", "c"])
    s = 1 / math.sqrt(2)
    assert a == approx([-s, 0.0, s, 0.0, 0.0])
    assert adv.grpo([], []) == []
    assert adv.grpo(torch.tensor([2.0, 4.0]), torch.tensor([3, 3])) == approx([-s, s])


def test_grpo_rejects_mismatched_groups():
    with pytest.raises(AlgoError):
        adv.grpo([1, 2, 3], [0, 0])


def test_rloo():
    # 1 - (2 + 3)/2 = -1.5 ; 2 - (1 + 3)/2 = 0 ; 3 - (1 + 2)/2 = 1.5
    assert adv.rloo([1, 2, 3], [7, 7, 7]) == approx([-1.5, 0.0, 1.5])
    # two groups, and a group of one (no baseline -> 0)
    assert adv.rloo([1, 3, 9], [0, 0, 1]) == approx([-2.0, 2.0, 0.0])
    assert adv.rloo([], []) == []


def test_reinforce_pp_batch_normalised():
    # mean 2, unbiased std 1 -> (r - 2) / 1, groups ignored
    assert adv.reinforce_pp([1, 2, 3], [0, 0, 1]) == approx([-1, 0, 1])
    # baseline: [1,3] - 2 = [-1, 1]; [5,5] - 5 = [0, 0]; batch mean 0, std sqrt(2/3) = 0.8164966
    assert adv.reinforce_pp([1, 3, 5, 5], [0, 0, 1, 1], group_baseline=True) == approx(
        [-1.2247449, 1.2247449, 0.0, 0.0])
    assert adv.reinforce_pp([4.0], [0]) == [0.0]  # one sample: std 0 -> 0
    assert adv.reinforce_pp([], []) == []


def test_reinforce_pp_with_kl_is_per_token():
    # token rewards: -0.5*0.2 = -0.1, then -0.5*0.4 + 1 = 0.8 ; returns G = [0.7, 0.8]
    # mean 0.75, unbiased std sqrt(2 * 0.05^2 / 1) = 0.0707107 -> [-0.7071068, 0.7071068]
    a = adv.reinforce_pp([1.0], [0], kl=[[0.2, 0.4]], kl_coef=0.5)
    assert len(a) == 1 and a[0] == approx([-0.7071068, 0.7071068], rel=1e-4)


def test_gae_three_tokens():
    # V = [0.5, 0.6, 0.7], reward 1 at the last token, gamma 1, lambda 0.95, V_3 = 0
    # delta = [0.6 - 0.5, 0.7 - 0.6, 1 + 0 - 0.7] = [0.1, 0.1, 0.3]
    # A_2 = 0.3 ; A_1 = 0.1 + 0.95 * 0.3 = 0.385 ; A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    # returns = A + V = [0.96575, 0.985, 1.0]
    # second sample, one token, V = [0.2], reward 0: delta = -0.2 = A, return 0
    a, r = adv.gae([1.0, 0.0], [0, 0], [[0.5, 0.6, 0.7], [0.2]], gamma=1.0, lam=0.95)
    assert a[0] == approx([0.46575, 0.385, 0.3]) and a[1] == approx([-0.2])
    assert r[0] == approx([0.96575, 0.985, 1.0]) and r[1] == approx([0.0])


def test_gae_discount_and_kl():
    # gamma 0.5, lam 1, V = [0, 0], reward 1, kl [0.2, 0.2] with coef 1: r = [-0.2, 0.8]
    # delta = r ; A_1 = 0.8 ; A_0 = -0.2 + 0.5 * 0.8 = 0.2
    a, r = adv.gae([1.0], [0], [[0.0, 0.0]], kl=[[0.2, 0.2]], kl_coef=1.0, gamma=0.5, lam=1.0)
    assert a[0] == approx([0.2, 0.8]) and r[0] == approx([0.2, 0.8])
    assert adv.gae([], [], []) == ([], [])
    with pytest.raises(AlgoError):
        adv.gae([1.0], [0], None)


def test_estimate_dispatch():
    assert estimate("grpo", [1, 0], [0, 0], scale_by_std=False, lr=3) == approx([0.5, -0.5])
    cols = estimate_columns("gae", [1.0], [0], [[0.5, 0.6, 0.7]], lam=0.95)
    assert cols["advantages"][0] == approx([0.46575, 0.385, 0.3])
    assert cols["returns"][0] == approx([0.96575, 0.985, 1.0])
    assert estimate("gae", [1.0], [0], [[0.7]]) == [approx([0.3])]
    assert estimate_columns("rloo", [1, 2, 3], [0, 0, 0]) == {"advantages": approx([-1.5, 0, 1.5])}
    with pytest.raises(AlgoError):
        estimate("nope", [1], [0])
    with pytest.raises(AlgoError):
        estimate("rloo", [1], [0], kl=[[0.1]])


# ============================================================================ KL


def test_kl_estimators():
    # log pi = log 0.5, log ref = log 0.25: log r = log ref - log pi = -log 2
    # k1 = log 2 = 0.693147 ; k2 = 0.5 * (log 2)^2 = 0.240227 ; k3 = 0.5 + log 2 - 1 = 0.193147
    p, q = t([L(0.5)]), t([L(0.25)])
    assert kl.k1(p, q).item() == approx(0.6931472)
    assert kl.k2(p, q).item() == approx(0.2402265)
    assert kl.k3(p, q).item() == approx(0.1931472)
    same = t([[L(0.3), L(0.9)]])
    for name in ("k1", "k2", "k3"):
        assert torch.equal(kl.kl(name, same, same), torch.zeros_like(same))
    with pytest.raises(AlgoError):
        kl.kl("k9", same, same)


# ============================================================================ on-policy losses


def _ratio_batch():
    # four one-token samples: ratios 1.5, 1.5, 0.5, 0.5 with A = +1, -1, -1, +1
    old = t([[L(0.5)], [L(0.5)], [L(0.5)], [L(0.5)]])
    new = t([[L(0.75)], [L(0.75)], [L(0.25)], [L(0.25)]], grad=True)
    return new, old, t([1.0, -1.0, -1.0, 1.0]), torch.ones(4, 1)


def test_ppo_clipping_takes_the_min():
    # eps 0.2:  rho 1.5, A +1: min(1.5, 1.2) = 1.2  -> l = -1.2 (clipped, no gradient)
    #           rho 1.5, A -1: min(-1.5, -1.2) = -1.5 -> l = 1.5  (unclipped, dl/dlogp = rho = 1.5)
    #           rho 0.5, A -1: min(-0.5, -0.8) = -0.8 -> l = 0.8  (clipped, no gradient)
    #           rho 0.5, A +1: min(0.5, 0.8) = 0.5   -> l = -0.5 (unclipped, dl/dlogp = -0.5)
    # token mean: (-1.2 + 1.5 + 0.8 - 0.5) / 4 = 0.15 ; clip_frac 2/4
    new, old, a, m = _ratio_batch()
    loss, met = compute_loss("ppo", new, old, a, m, {"clip_eps": 0.2})
    assert loss.item() == approx(0.15)
    assert met["clip_frac"] == approx(0.5)
    loss.backward()
    assert new.grad.flatten().tolist() == approx([0.0, 1.5 / 4, 0.0, -0.5 / 4])


def test_dapo_clip_higher():
    # rho = 1.25, A = 1: PPO (eps 0.2) clips at 1.2 -> -1.2; DAPO (eps_high 0.28) keeps -1.25
    # rho = 0.75, A = -1: both clip below at 0.8 -> l = 0.8
    new, old = t([[L(0.625), L(0.375)]]), t([[L(0.5), L(0.5)]])
    a, m = t([[1.0, -1.0]]), torch.ones(1, 2)
    assert compute_loss("ppo", new, old, a, m)[0].item() == approx((-1.2 + 0.8) / 2)
    assert compute_loss("dapo", new, old, a, m)[0].item() == approx((-1.25 + 0.8) / 2)
    # clip_eps_low widens the lower side: 0.75 within [0.7, 1.28] -> l = 0.75
    cfg = {"clip_eps_low": 0.3}
    assert compute_loss("dapo", new, old, a, m, cfg)[0].item() == approx((-1.25 + 0.75) / 2)


def test_token_mean_vs_sequence_mean_on_unequal_lengths():
    # ratio 1, so l_t = -A_i. Sample 0: 3 tokens, A = +1 ; sample 1: 1 token, A = -1.
    # token mean (dapo): (-1 -1 -1 +1) / 4 = -0.5 ; sequence mean (grpo): (-1 + 1) / 2 = 0
    new = t([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]])
    m = t([[1, 1, 1], [1, 0, 0]])
    a = t([1.0, -1.0])
    assert compute_loss("dapo", new, new, a, m)[0].item() == approx(-0.5)
    assert compute_loss("grpo", new, new, a, m)[0].item() == approx(0.0)
    # Dr. GRPO aggregation: sum / (2 samples * L=4) = -2 / 8
    cfg = {"loss_agg": "seq_sum_norm", "norm_length": 4}
    assert compute_loss("grpo", new, new, a, m, cfg)[0].item() == approx(-0.25)


def test_grpo_kl_penalty_k3():
    # ratio 1, A = 0: only the penalty: 0.1 * k3 = 0.1 * (0.5 + log 2 - 1) = 0.01931472
    new, ref = t([[L(0.5)]]), t([[L(0.25)]])
    loss, met = compute_loss("grpo", new, new, t([0.0]), torch.ones(1, 1), {"kl_coef": 0.1},
                             ref_logprobs=ref)
    assert loss.item() == approx(0.01931472)
    assert met["kl_ref"] == approx(0.1931472)
    with pytest.raises(AlgoError):  # a KL penalty without a reference is a configuration error
        compute_loss("grpo", new, new, t([0.0]), torch.ones(1, 1), {"kl_coef": 0.1})


def test_entropy_bonus():
    # l = -A * rho - coef * H = -1 - 0.1 * 2 = -1.2 ; metric entropy 2
    new = t([[0.0]])
    loss, met = compute_loss("ppo", new, new, t([1.0]), torch.ones(1, 1), {"entropy_coef": 0.1},
                             entropy=t([[2.0]]))
    assert loss.item() == approx(-1.2) and met["entropy"] == approx(2.0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_normalizer_makes_micro_batches_sum_to_the_batch(name):
    # the table's aggregation says which count to pass: tokens (token_mean) or sequences
    torch.manual_seed(0)
    new, old = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    ref, a = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    m = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    kw = {} if LOSSES[name].critic else {"ref_logprobs": ref}
    agg = loss_aggregation(name)
    assert agg == ("seq_mean" if name == "grpo" else "token_mean")
    total = m.sum().item() if agg == "token_mean" else 4
    full = compute_loss(name, new, old, a, m, **kw)[0]
    parts = 0.0
    for s in (slice(0, 1), slice(1, 4)):
        kws = {k: v[s] for k, v in kw.items()}
        parts += compute_loss(name, new[s], old[s], a[s], m[s], normalizer=total, **kws)[0]
    assert parts.item() == approx(full.item())
    assert loss_aggregation(name, {"loss_agg": "seq_sum_norm"}) == "seq_sum_norm"


# ============================================================================ off-policy losses


def test_tis_truncates_at_the_cap():
    # token 0: pi_prox / pi_behav = 0.8 / 0.2 = 4 -> min(4, 2) = 2 ; token 1: 0.6 / 0.5 = 1.2
    # new = prox (rho = 1), A = 1: l = [-2, -1.2], token mean -1.6, dl/dlogp = [-2, -1.2] / 2
    behav, prox = t([[L(0.2), L(0.5)]]), t([[L(0.8), L(0.6)]])
    new = prox.clone().requires_grad_(True)
    loss, met = compute_loss("tis", new, behav, t([1.0]), torch.ones(1, 2), {"tis_cap": 2.0},
                             prox_logprobs=prox)
    assert loss.item() == approx(-1.6)
    assert met["is_weight_mean"] == approx(1.6) and met["is_trunc_frac"] == approx(0.5)
    loss.backward()
    assert new.grad.flatten().tolist() == approx([-1.0, -0.6])
    # without prox the current policy is the proximal one: the same here, since new == prox
    assert compute_loss("tis", new, behav, t([1.0]), torch.ones(1, 2))[0].item() == approx(-1.6)


def test_decoupled_ppo_equals_ppo_when_prox_is_behaviour():
    torch.manual_seed(1)
    behav = torch.randn(3, 4, dtype=torch.float64)
    base = behav + 0.3 * torch.randn(3, 4, dtype=torch.float64)  # ratios in and out of the clip
    a, m = torch.randn(3, dtype=torch.float64), t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    n1, n2 = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    l1, m1 = compute_loss("ppo", n1, behav, a, m)
    l2, m2 = compute_loss("decoupled_ppo", n2, behav, a, m, prox_logprobs=behav)
    assert l2.item() == approx(l1.item()) and m2["clip_frac"] == approx(m1["clip_frac"])
    l1.backward(), l2.backward()
    assert torch.allclose(n1.grad, n2.grad)


def test_decoupled_ppo_weight_and_cap():
    # w = pi_prox / pi_behav = 0.25 / 0.5 = 0.5 ; rho = 0.275 / 0.25 = 1.1 (inside the clip)
    # l = 0.5 * -(1.1 * 1) = -0.55
    behav, prox, new = t([[L(0.5)]]), t([[L(0.25)]]), t([[L(0.275)]])
    one = torch.ones(1, 1)
    loss, met = compute_loss("decoupled_ppo", new, behav, t([1.0]), one, prox_logprobs=prox)
    assert loss.item() == approx(-0.55) and met["is_weight_mean"] == approx(0.5)
    # behav_weight_cap 0.4 < 0.5: the token is dropped, nothing is left
    loss, met = compute_loss("decoupled_ppo", new, behav, t([1.0]), one,
                             {"behav_weight_cap": 0.4}, prox_logprobs=prox)
    assert loss.item() == 0.0 and met["tokens"] == 0.0


def test_cispo_gradient_is_clipped_weight_times_advantage():
    # token 0: r = 0.9 / 0.1 = 9 -> w = min(9, 1 + 2) = 3 ; token 1: r = 1 -> w = 1 ; A = 2
    # L = -(3 * 2 * log 0.9 + 1 * 2 * log 0.5) / 2 ; dL/dlogp = -[3 * 2, 1 * 2] / 2 = [-3, -1]
    behav = t([[L(0.1), L(0.5)]])
    new = t([[L(0.9), L(0.5)]], grad=True)
    loss, met = compute_loss("cispo", new, behav, t([2.0]), torch.ones(1, 2))
    assert loss.item() == approx(-(3 * 2 * L(0.9) + 2 * L(0.5)) / 2)
    assert met["is_weight_mean"] == approx(2.0) and met["is_trunc_frac"] == approx(0.5)
    loss.backward()
    assert new.grad.flatten().tolist() == approx([-3.0, -1.0])
    # the weight is a constant: autograd of w * A * logp with w detached gives the same
    new2 = t([[L(0.9), L(0.5)]], grad=True)
    (-(t([[3.0, 1.0]]) * 2.0 * new2).sum() / 2).backward()
    assert torch.allclose(new.grad, new2.grad)
    # a tighter cap: w = 1.5
    new3 = t([[L(0.9)]], grad=True)
    compute_loss("cispo", new3, t([[L(0.1)]]), t([1.0]), torch.ones(1, 1),
                 {"cispo_eps_high": 0.5})[0].backward()
    assert new3.grad.item() == approx(-1.5)


def test_topr_positive_plain_negative_truncated():
    # token 0: A = +1, r = 9 -> w = 1 (no IS for positives)  dL/dlogp = -1
    # token 1: A = -1, r = 9 -> w = min(9, 1) = 1             dL/dlogp = +1
    # token 2: A = -1, r = 0.25 / 0.5 = 0.5 -> w = 0.5        dL/dlogp = +0.5   (token mean: / 3)
    behav = t([[L(0.1), L(0.1), L(0.5)]])
    new = t([[L(0.9), L(0.9), L(0.25)]], grad=True)
    a = t([[1.0, -1.0, -1.0]])
    loss, met = compute_loss("topr", new, behav, a, torch.ones(1, 3))
    assert loss.item() == approx(-(L(0.9) - L(0.9) - 0.5 * L(0.25)) / 3)
    loss.backward()
    assert new.grad.flatten().tolist() == approx([-1 / 3, 1 / 3, 0.5 / 3])
    assert met["is_trunc_frac"] == approx(1 / 3)
    # sequence level: r = (0.4 / 0.2) * (0.25 / 0.5) ... here 2 * 0.25 = 0.5 for both tokens
    new = t([[L(0.4), L(0.125)]], grad=True)
    loss, _ = compute_loss("topr", new, t([[L(0.2), L(0.5)]]), t([-1.0]), torch.ones(1, 2),
                           {"topr_level": "sequence"})
    loss.backward()
    assert new.grad.flatten().tolist() == approx([0.25, 0.25])


# ============================================================================ value loss


def test_value_loss_clipped():
    # v=1.5, old=1, R=2: v_clip = 1.2 ; max(0.25, 0.64) -> 0.5 * 0.64 = 0.32, grad 0 (clamped)
    # v=0.5, old=1, R=0: v_clip = 0.8 ; max(0.25, 0.64) -> 0.32, grad 0
    # v=1.1, old=1, R=2: v_clip = 1.1 ; 0.81 -> 0.405, grad (v - R) = -0.9
    # token mean: (0.32 + 0.32 + 0.405) / 3 = 0.348333
    v = t([[1.5, 0.5, 1.1]], grad=True)
    old, ret = t([[1.0, 1.0, 1.0]]), t([[2.0, 0.0, 2.0]])
    loss, met = compute_loss("value", v, old, ret, torch.ones(1, 3), {"value_clip": 0.2})
    assert loss.item() == approx(1.045 / 3)
    assert met["value_clip_frac"] == approx(2 / 3)
    loss.backward()
    assert v.grad.flatten().tolist() == approx([0.0, 0.0, -0.9 / 3])
    # unclipped: 0.5 * (0.25 + 0.25 + 0.81) / 3
    loss, _ = compute_loss("value", v, old, ret, torch.ones(1, 3), {"value_clip": None})
    assert loss.item() == approx(0.5 * 1.31 / 3)


# ============================================================================ masks and gradients


@pytest.mark.parametrize("name", list(LOSSES))
def test_padding_changes_nothing(name):
    torch.manual_seed(2)
    shape = (3, 4)
    m = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    tensors = [torch.randn(*shape, dtype=torch.float64) for _ in range(5)]  # new old ref prox ent
    a = torch.randn(*shape, dtype=torch.float64)
    cfg = {"kl_coef": 0.1, "entropy_coef": 0.01, "value_clip": 0.2}

    def run(fill):
        xs = [torch.where(m.bool(), x, torch.full_like(x, fill)) for x in tensors]
        aa = torch.where(m.bool(), a, torch.full_like(a, fill))
        new = xs[0].clone().requires_grad_(True)
        ent = xs[4].clone().requires_grad_(True)
        kw = {} if LOSSES[name].critic else dict(ref_logprobs=xs[2], prox_logprobs=xs[3],
                                                 entropy=ent)
        loss, met = compute_loss(name, new, xs[1], aa, m, cfg, **kw)
        loss.backward()
        return loss.item(), new.grad, met

    l1, g1, m1 = run(0.0)
    for fill in (1e6, -1e6, float("nan"), float("inf")):
        l2, g2, m2 = run(fill)
        assert l2 == approx(l1) and torch.allclose(g1, g2)
        assert torch.all(g2[~m.bool()] == 0)
        assert all(m2[k] == approx(v) for k, v in m1.items())


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_step_moves_chosen_tokens(name, sign):
    # logits [2, 3, 5] as parameters; one SGD step on the loss with A = +1 must raise
    # log pi of every chosen response token (A = -1 lowers it); padding is untouched
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 4, 2], [0, 3, 3]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    before, _ = token_logprobs(logits, tokens)
    before = before.detach()
    opt = torch.optim.SGD([logits], lr=0.5)
    new, ent = token_logprobs(logits, tokens)
    loss, _ = compute_loss(name, new, before, torch.tensor([sign, sign]), m, entropy=ent)
    opt.zero_grad()
    loss.backward()
    opt.step()
    after, _ = token_logprobs(logits, tokens)
    moved = (after.detach() - before) * sign
    assert torch.all(moved[m.bool()] > 0)
    assert logits.grad[1, 2].abs().sum() == 0


# ============================================================================ configuration


def test_config_from_args():
    c = LossConfig.from_args({"kl_coef": 0.001, "lr": 1e-4, "micro_batch": 16})
    assert c.kl_coef == 0.001 and c.clip_eps == 0.2 and c.clip_eps_high == 0.28
    assert c.tis_cap == 2.0 and c.eps_low == 0.2
    with pytest.raises(AlgoError):
        LossConfig.from_args({"lr": 1e-4}, strict=True)
    with pytest.raises(AlgoError):
        compute_loss("nope", t([[0.0]]), t([[0.0]]), t([0.0]), torch.ones(1, 1))
    with pytest.raises(AlgoError):
        compute_loss("ppo", t([[0.0]]), t([[0.0]]), t([0.0]), torch.ones(1, 1),
                     {"loss_agg": "median"})
