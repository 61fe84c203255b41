"""moe-rl-chaos's own logic: the schedule a seed draws, the comparison of two runs' metrics, its refusals. The runs
themselves: tests/faults/test_chaos.py."""

from __future__ import annotations

import json

import pytest

from moe_rl.tools.chaos import KINDS, compare_metrics, main, schedule


@pytest.mark.parametrize("seed", range(20))
def test_a_seed_draws_one_schedule_of_different_kinds_at_later_and_later_steps(seed):
    plan = schedule(seed, 3, 8, 2)
    assert plan == schedule(seed, 3, 8, 2)  # replayable
    assert len({f.kind for f in plan}) == 3 and {f.kind for f in plan} <= set(KINDS)
    steps = [f.after_step for f in plan]
    assert steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] < 8
    assert all(0.0 <= f.delay_s <= 1.0 and f.victim in (0, 1) for f in plan)
    two = [f.kind for f in schedule(seed, 6, 8, 2, ("rank", "engine"))]  # the kinds given, alternating
    assert two in (["rank", "engine"] * 3, ["engine", "rank"] * 3)


def test_metrics_compare_value_for_value_but_the_machines_numbers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for run, timing in ((a, 1.0), (b, 2.5)):
        run.mkdir()
        rows = [{"step": s, "reward/mean": 0.1 * s, "time/step": timing, "memory/peak_rss_gib": timing} for s in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare_metrics(a, b, 2) is None
    with (b / "metrics.jsonl").open("a") as f:  # a step trained again after a resume: the last record counts
        f.write(json.dumps({"step": 2, "reward/mean": 0.2000001, "time/step": 3.0}) + "\n")
    assert compare_metrics(a, b, 2) == "step 2, reward/mean: reference 0.2, chaos run 0.2000001"
    assert compare_metrics(a, a, 3) == "step 3 is missing from the reference"


def test_the_command_refuses_what_it_cannot_run(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    for argv, message in [
        (["--faults", "8", "--steps", "8"], "--faults 8: choose 1 to 7"),
        (["--kinds", "rank,disk"], "--kinds: disk not among"),
        (["--", "trainer.steps=4"], "trainer.steps and trainer.checkpoint_every are this command's"),
        (["--out", str(tmp_path / "used")], "is not empty"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "moe-rl-chaos --seed 7" in capsys.readouterr().out
