"""Membership inference: LiRA scores, metrics, and `fedvl privacy` on a finished run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from fedvl.cli import main
from fedvl.eval.membership import (
    attack_metrics,
    balanced_masks,
    lira_scores,
    logit_confidence,
    nearest_synthetic_scores,
)


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 4))


def _fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def pool():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 32, generator=g)
    y = torch.randint(0, 4, (128,), generator=g)  # random labels: only memorisation fits them
    members = np.r_[np.ones(64, dtype=int), np.zeros(64, dtype=int)]
    masks = balanced_masks(128, 8, seed=1)
    shadow = np.stack([logit_confidence(_fit(_mlp(10 + s), x[torch.from_numpy(m)],
                                             y[torch.from_numpy(m)]), x, y)
                       for s, m in enumerate(masks)])
    return x, y, members, masks, shadow


def test_lira_separates_the_members_of_a_model_that_memorised_them(pool):
    x, y, members, masks, shadow = pool
    target = logit_confidence(_fit(_mlp(99), x[:64], y[:64]), x, y)
    for online in (True, False):
        m = attack_metrics(lira_scores(target, shadow, masks, online, fix_variance=True), members)
        assert m["auc"] > 0.9, (online, m["auc"])


def test_lira_on_an_untrained_model_is_chance(pool):
    x, y, members, masks, shadow = pool
    target = logit_confidence(_mlp(98), x, y)
    m = attack_metrics(lira_scores(target, shadow, masks, True, fix_variance=True), members)
    # Under the null, the AUC of 64 vs 64 has std ~0.051: 0.5 +- 0.2 is about 4 std.
    assert abs(m["auc"] - 0.5) < 0.2, m["auc"]


def test_balanced_masks_put_every_example_in_half_the_shadows():
    masks = balanced_masks(50, 6, seed=3)
    assert masks.shape == (6, 50) and (masks.sum(0) == 3).all()
    assert not (masks == balanced_masks(50, 6, seed=4)).all()
    with pytest.raises(ValueError, match="even number"):
        balanced_masks(10, 3, seed=0)


def test_logit_confidence_is_the_log_odds_of_the_true_class():
    model = _mlp(0)
    x, y = torch.randn(20, 32), torch.randint(0, 4, (20,))
    p = torch.softmax(model(x), 1).gather(1, y[:, None]).squeeze(1).double()
    assert logit_confidence(model, x, y, batch=7) == pytest.approx(
        torch.log(p / (1 - p)).detach().numpy(), abs=1e-5)


def test_auc_and_tpr_agree_with_their_definitions():
    rng = np.random.default_rng(0)
    scores = np.r_[rng.normal(1, 1, 300), rng.normal(0, 1, 700)]
    member = np.r_[np.ones(300, dtype=int), np.zeros(700, dtype=int)]
    m = attack_metrics(scores, member)
    u = stats.mannwhitneyu(scores[:300], scores[300:]).statistic
    assert m["auc"] == pytest.approx(u / (300 * 700))
    # TPR at 1 % FPR: the threshold may drop to just above the 8th-highest non-member score
    # (7 / 700 = 1 % false positives), so every member above that score counts.
    eighth = np.sort(scores[300:])[::-1][7]
    assert m["tpr_at_1%_fpr"] == pytest.approx((scores[:300] > eighth).mean())
    assert m["members"] == 300 and m["non_members"] == 700


def test_nearest_synthetic_score_is_minus_the_distance_to_the_closest_image():
    pool = torch.tensor([[0.0, 0.0], [3.0, 4.0]]).view(2, 1, 1, 2)
    syn = torch.tensor([[0.0, 1.0], [3.0, 3.0]]).view(2, 1, 1, 2)
    assert nearest_synthetic_scores(pool, syn) == pytest.approx([-1.0, -1.0])


@pytest.mark.parametrize("method,extra,synthetic", [
    ("fedavg", [], False),
    ("desa", ["--client-models", "alternate", "--method-arg", "ipc=2", "--method-arg",
              "anchor_steps=2", "--method-arg", "batch_real=4", "--method-arg", "dsa=false"], True),
])
def test_fedvl_privacy_runs_lira_on_a_finished_run(tmp_path, capsys, method, extra, synthetic):
    run = tmp_path / "run"
    assert main(["run", "--benchmark", "digits-offline", "--train-cap", "20", "--test-cap", "20",
                 "--rounds", "2", "--width", "8", "--depth", "2", "--batch-size", "16",
                 "--quiet", "--method", method, *extra, "--out", str(run)]) == 0
    assert main(["privacy", str(run), "--client", "1", "--shadows", "2", "--quiet"]) == 0
    res = json.loads((run / "privacy.json").read_text())
    assert res["shadows"] == 2 and res["method"] == method
    want = {"lira_online", "lira_offline", "confidence"} | ({"nearest_synthetic"} if synthetic
                                                            else set())
    assert set(res["attacks"]) == want
    for m in res["attacks"].values():
        assert 0 <= m["auc"] <= 1 and m["members"] == 20 and m["non_members"] == 20
    assert (run / "privacy_roc.png").stat().st_size > 0
    assert len(list((run / "shadows" / "handwritten-color-of2").glob("shadow*/summary.json"))) == 2
    assert "lira_online" in capsys.readouterr().out
    # Finished shadows are reused: a second call trains nothing and gives the same numbers.
    done = run / "shadows" / "handwritten-color-of2" / "shadow0" / "summary.json"
    stamp = done.stat().st_mtime_ns
    assert main(["privacy", str(run), "--client", "1", "--shadows", "2", "--quiet"]) == 0
    assert done.stat().st_mtime_ns == stamp
    # A shadow folder trained on another half (another count, an older layout) is wiped and
    # trained afresh: nothing of it (its checkpoint included) survives to be resumed.
    mask = np.load(done.parent / "pool_in.npy")
    np.save(done.parent / "pool_in.npy", ~mask)
    (done.parent / "stale.txt").write_text("from another half")
    assert main(["privacy", str(run), "--client", "1", "--shadows", "2", "--quiet"]) == 0
    assert (np.load(done.parent / "pool_in.npy") == mask).all()
    assert not (done.parent / "stale.txt").exists() and done.is_file()
    assert json.loads((run / "privacy.json").read_text())["attacks"] == res["attacks"]
    # ... and the run's report has a membership-inference section with the ROC.
    assert main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    assert 'id="privacy"' in html and f"{res['attacks']['lira_online']['auc']:.4f}" in html


def test_privacy_of_a_folder_that_is_not_a_run_is_one_clear_error(tmp_path, capsys):
    assert main(["privacy", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_privacy_of_a_run_without_client_states_is_one_clear_error(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--benchmark", "digits-offline", "--train-cap", "20", "--test-cap", "10",
                 "--rounds", "1", "--width", "8", "--depth", "2", "--quiet", "--method", "fedavg",
                 "--out", str(run)]) == 0
    ck = torch.load(run / "checkpoint.pt", weights_only=True)
    ck.pop("client_states")  # as a Flower run's checkpoint: nodes keep their own state
    torch.save(ck, run / "checkpoint.pt")
    assert main(["privacy", str(run), "--shadows", "2", "--quiet"]) == 2
    assert "not run by the in-process engine" in capsys.readouterr().err
