"""The paper's Noam schedule and Adam settings, and warmup-cosine."""

from __future__ import annotations

import math

import pytest
import torch

from training import NoamLR, WarmupCosineLR, noam_rate, paper_adam, warmup_cosine_rate


def test_noam_values_follow_the_formula() -> None:
    d, warmup = 512, 4000
    assert noam_rate(1, d) == pytest.approx(512**-0.5 * 4000**-1.5)
    assert noam_rate(4000, d) == pytest.approx(512**-0.5 * 4000**-0.5)  # the peak, ~7.0e-4
    assert noam_rate(4000, d) == pytest.approx(6.9877e-4, rel=1e-4)
    assert noam_rate(16000, d) == pytest.approx(noam_rate(4000, d) / 2)  # inverse square root after warmup
    assert noam_rate(2000, d) == pytest.approx(noam_rate(4000, d) / 2)  # linear during warmup
    rates = [noam_rate(s, d, warmup) for s in range(1, 10001)]
    assert max(range(len(rates)), key=rates.__getitem__) + 1 == warmup
    assert noam_rate(100, 64, warmup=10, factor=2.0) == pytest.approx(2 * 64**-0.5 * 100**-0.5)


def test_noam_scheduler_drives_the_optimizer_from_step_one() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    opt = paper_adam([param])
    sched = NoamLR(opt, d_model=64, warmup=5)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert seen == pytest.approx([noam_rate(s, 64, 5) for s in range(1, 9)])
    fresh_opt = paper_adam([torch.nn.Parameter(torch.zeros(3))])
    fresh = NoamLR(fresh_opt, d_model=64, warmup=5)
    fresh.load_state_dict(sched.state_dict())
    assert fresh.get_last_lr() == sched.get_last_lr()


def test_paper_adam_settings() -> None:
    opt = paper_adam([torch.nn.Parameter(torch.zeros(1))])
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.Adam)
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["weight_decay"] == 0.0


def test_warmup_cosine_rises_then_decays_to_the_floor() -> None:
    assert warmup_cosine_rate(5, warmup=10, total=110) == pytest.approx(0.5)
    assert warmup_cosine_rate(10, warmup=10, total=110) == pytest.approx(1.0)
    assert warmup_cosine_rate(60, warmup=10, total=110, min_ratio=0.1) == pytest.approx(0.55)
    assert warmup_cosine_rate(500, warmup=10, total=110, min_ratio=0.1) == pytest.approx(0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    WarmupCosineLR(opt, warmup=4, total=20)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.25)
    assert not math.isnan(warmup_cosine_rate(1, warmup=0, total=1))


def test_bad_schedule_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="step must be a positive integer"):
        noam_rate(0, 512)
    with pytest.raises(ValueError, match="warmup"):
        NoamLR(paper_adam([torch.nn.Parameter(torch.zeros(1))]), d_model=64, warmup=0)
    with pytest.raises(ValueError, match="factor"):
        noam_rate(1, 512, factor=-1.0)
    with pytest.raises(ValueError, match="min_ratio"):
        warmup_cosine_rate(1, 1, 10, min_ratio=2.0)


def test_decay_groups_split_matrices_from_vectors() -> None:
    import math

    from training import decay_groups

    layer = torch.nn.Linear(3, 2)
    groups = decay_groups(layer.parameters(), 0.1)
    assert [g["params"] for g in groups] == [[layer.weight], [layer.bias]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    for bad in (math.nan, -1.0, True, "0.1"):
        with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
            decay_groups(layer.parameters(), bad)
