"""Tests for rank-aware logging, the metrics sinks, step summaries and PNG plots."""

import json
import logging

import pytest

from megatron_rl.observability import (
    MetricsWriter,
    format_step_summary,
    init_logger,
    plot_metrics,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.captureWarnings(False)


# ---------------------------------------------------------------- logging


@pytest.mark.parametrize("rank", [0, 1])
def test_init_logger_console_filtering(rank, tmp_path, capsys, restore_root_logger):
    log_file = tmp_path / "logs" / f"rank{rank}.log"
    init_logger(rank, "INFO", log_file=log_file)
    log = logging.getLogger("megatron_rl.some.module")
    log.debug("debug-line")
    log.info("info-line")
    log.warning("warning-line")
    err = capsys.readouterr().err
    assert ("info-line" in err) == (rank == 0)
    assert "warning-line" in err
    assert "debug-line" not in err
    for handler in logging.getLogger().handlers:
        handler.flush()
    text = log_file.read_text()
    # every rank writes INFO+ to its own file
    assert "info-line" in text and "warning-line" in text and "debug-line" not in text
    line = next(ln for ln in text.splitlines() if "info-line" in ln)
    assert f"[rank{rank}] INFO megatron_rl.some.module: info-line" in line
    assert line[:4].isdigit()  # starts with a timestamp


def test_init_logger_is_idempotent(tmp_path, restore_root_logger):
    before = len(logging.getLogger().handlers)
    init_logger(0, "DEBUG", log_file=tmp_path / "a.log")
    init_logger(0, "DEBUG", log_file=tmp_path / "a.log")
    assert len(logging.getLogger().handlers) == before + 2  # console + file, once
    assert logging.getLogger().level == logging.DEBUG


def test_init_logger_rejects_bad_level(restore_root_logger):
    with pytest.raises(ValueError, match="INFO"):
        init_logger(0, "LOUD")


# ---------------------------------------------------------------- metrics


def test_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, enabled_tensorboard=True, rank=0) as writer:
        writer.log(1, {"loss": 2.5, "lr": 1e-3})
        writer.log(2, {"loss": 1.25, "reward/mean": 0.5})
        # the line is on disk before close(): a killed job keeps it
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in lines] == [
        {"step": 1, "loss": 2.5, "lr": 0.001},
        {"step": 2, "loss": 1.25, "reward/mean": 0.5},
    ]
    assert read_metrics(tmp_path / "metrics.jsonl") == [json.loads(ln) for ln in lines]

    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr", "reward/mean"}
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.5), (2, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(2, 0.5)]
    assert acc.Scalars("lr")[0].value == pytest.approx(1e-3)


def test_metrics_appends_on_resume_and_accepts_tensors(tmp_path):
    import torch

    with MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0) as writer:
        writer.log(1, {"loss": torch.tensor(3.0)})
    with MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0) as writer:
        writer.log(2, {"loss": 2})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    assert not (tmp_path / "tensorboard").exists()


def test_rewind_drops_later_steps_and_a_line_cut_by_a_kill(tmp_path):
    """A job killed while writing leaves a cut last line; the resumed run's rewind must not fail on it."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0) as writer:
        writer.rewind(1)
        writer.log(1, {"loss": 5.0})
    assert read_metrics(tmp_path) == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 5.0}]
    with MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0) as writer:
        writer.rewind(0)  # a run started again before its first checkpoint
    assert read_metrics(tmp_path) == []


def test_metrics_nonzero_rank_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, enabled_tensorboard=True, rank=1)
    writer.log(1, {"loss": 1.0})
    writer.close()
    assert not run_dir.exists()


def test_metrics_rejects_bad_values(tmp_path):
    with MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0) as writer:
        with pytest.raises(ValueError, match="loss"):
            writer.log(1, {"loss": "high"})
        with pytest.raises(ValueError, match="reserved"):
            writer.log(1, {"step": 3.0})


def test_read_metrics_tolerates_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=":1"):
        read_metrics(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_metrics(tmp_path / "missing.jsonl")


def test_format_step_summary():
    metrics = {"loss": 1.23412, "lr": 1e-3, "tok/s": 5234.0, "step_time_s": 0.534, "x": 7.0}
    line = format_step_summary(12, metrics, ["loss", "lr", "tok/s", "step_time_s", "absent"])
    assert line == "step 12 | loss 1.234 | lr 1.0e-03 | tok/s 5.2k | 0.53s"
    assert format_step_summary(3, metrics, {"tok/s": "tps", "x": "x"}) == "step 3 | tps 5.2k | x 7"
    assert format_step_summary(3, {"n": 2.5e6, "z": 0.0}, ["n", "z"]) == "step 3 | n 2.5M | z 0"


# ---------------------------------------------------------------- plots


def test_plot_metrics(tmp_path):
    import matplotlib.image

    with MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0) as writer:
        for step in range(5):
            writer.log(step, {"loss": 1.0 / (step + 1), "reward/mean": step * 0.1})
    out_dir = tmp_path / "plots"
    paths = plot_metrics(tmp_path / "metrics.jsonl", out_dir, ["loss", "reward/mean", "absent"])
    assert [p.name for p in paths] == ["loss.png", "reward_mean.png"]
    for path in paths:
        assert path.parent == out_dir
        assert path.read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not (out_dir / "absent.png").exists()


def test_metrics_to_wandb_offline_continue_one_run_across_restarts(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="W&B logging needs wandb (pip install -e '.[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    init = {"project": "megatron-rl-test", "name": "run", "config": {"lr": 1e-3}}
    writer = MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0, wandb_init=init)
    for step in range(3):
        writer.log(step, {"reward/mean": 0.25 * step})
    run = writer._wandb
    assert run.summary["reward/mean"] == 0.5 and run.config["lr"] == 1e-3
    writer.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    resumed = MetricsWriter(tmp_path, enabled_tensorboard=False, rank=0, wandb_init=init)
    assert resumed._wandb.id == run_id  # the restarted job continues the same W&B run
    resumed.log(3, {"reward/mean": 1.0})
    assert resumed._wandb.summary["reward/mean"] == 1.0
    resumed.close()
    assert wandb.run is None
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    # one directory per start, named by the second it started in (two starts in one second share it)
    assert 1 <= len(runs) <= 2 and all((r / f"run-{run_id}.wandb").stat().st_size > 0 for r in runs)


# ---------------------------------------------------------------- rank-local metrics and the run summary


def test_rank_local_metrics_combine_by_what_they_are():
    """Counts add up, a sandbox client's mean latency is weighted by the calls it is a mean over (its recent
    window, not all its calls), maxima take the largest; metrics every rank holds alike are left out (the caller
    keeps its own), and a rank without a key (no sandbox call) adds nothing to it."""
    from megatron_rl.observability.reduce import combine

    rank0 = {"reward/unscored": 0.0, "reward/verifier_errors": 0.0, "reward/verifier_calls": 2.0,
             "sandbox/training/calls": 3000.0, "sandbox/training/recent_calls": 1024.0,
             "sandbox/training/latency_mean_s": 1.0, "sandbox/training/server_wait_mean_s": 0.5,
             "sandbox/training/recent_server_waits": 1.0,
             "sandbox/training/wait_max_s": 4.0, "sandbox/training/wait_p95_s": 2.0, "reward/mean": 0.25,
             "sandbox/servers_up": 2.0, "time/generate": 1.0, "reward/answers": 6.0,
             "reward/unformatted_answers": 1.0}
    rank1 = {"reward/unscored": 8.0, "reward/verifier_errors": 8.0, "reward/verifier_calls": 2.0,
             "sandbox/training/calls": 1000.0, "sandbox/training/recent_calls": 1000.0,
             "sandbox/training/latency_mean_s": 5.0, "sandbox/training/server_wait_mean_s": 2.0,
             "sandbox/training/recent_server_waits": 3.0,
             "sandbox/training/wait_max_s": 3.0, "sandbox/training/wait_p95_s": 3.0, "reward/mean": 0.75,
             "reward/answers": 4.0, "reward/unformatted_answers": 3.0, "reward/unformatted_share": 0.75}
    rank2 = {"reward/unscored": 1.0, "reward/verifier_errors": 0.0, "reward/verifier_calls": 1.0}
    assert combine([rank0, rank1, rank2]) == {
        "reward/unscored": 9.0, "reward/verifier_errors": 8.0, "reward/verifier_calls": 5.0,
        "sandbox/training/calls": 4000.0, "sandbox/training/recent_calls": 2024.0,
        "sandbox/training/latency_mean_s": (1024 * 1.0 + 1000 * 5.0) / 2024,
        "sandbox/training/recent_server_waits": 4.0, "sandbox/training/server_wait_mean_s": (1 * 0.5 + 3 * 2.0) / 4,
        "sandbox/training/wait_max_s": 4.0, "sandbox/training/wait_p95_s": 3.0, "reward/answers": 10.0,
        "reward/unformatted_answers": 4.0}  # a share is no count: the step recomputes it from the sums


def test_reduce_over_ranks_without_a_process_group_is_the_identity():
    from megatron_rl.observability.reduce import reduce_over_ranks

    metrics = {"reward/unscored": 3.0, "reward/mean": 0.5}
    assert reduce_over_ranks(metrics) == metrics


def _rows(rewards: list[float], evals: dict[int, float]) -> list[dict]:
    """metrics.jsonl rows: step 0's evaluation, then one row per step (with its evaluation, if any)."""
    rows = [{"step": 0, "eval/accuracy": evals[0]}] if 0 in evals else []
    for step, reward in enumerate(rewards, start=1):
        rows.append({"step": step, "reward/mean": reward, **({"eval/accuracy": evals[step]} if step in evals else {})})
    return rows


def test_the_run_summary_names_the_steps_it_averages():
    from megatron_rl.observability.summary import rl_summary

    rows = _rows([0.1, 0.3] + [0.5] * 16 + [0.6, 0.8], {0: 0.25, 10: 0.4, 20: 0.5})
    assert rl_summary(rows, 0) == ("training reward 0.200 over steps 1-2 -> 0.700 over steps 19-20 (x3.50); "
                                   "held-out accuracy 0.250 at step 0 -> 0.500 at step 20")
    assert rl_summary(rows, 30).endswith("0.250 at step 0 (after a 30-step warm start) -> 0.500 at step 20")


def test_the_run_summary_of_few_steps_and_a_zero_start():
    from megatron_rl.observability.summary import rl_summary

    assert rl_summary(_rows([0.0, 0.5, 1.0], {}), 10) == "training reward 0.000 over step 1 -> 1.000 over step 3"
    assert rl_summary(_rows([], {0: 0.5}), 10) == "held-out accuracy 0.500 at step 0 (after a 10-step warm start)"
    assert rl_summary([], 0) == ""


def test_the_run_summary_counts_the_samples_no_verifier_judged():
    from megatron_rl.observability.summary import rl_summary

    rows = _rows([0.5, 0.5, 0.5], {})
    assert "unscored" not in rl_summary(rows, 0)
    rows[1].update({"reward/unscored": 6.0, "reward/verifier_errors": 2.0})
    rows[2].update({"reward/unscored": 8.0, "reward/verifier_errors": 3.0})
    assert rl_summary(rows, 0).endswith("; 14 samples left unscored, no verdict (5 verifier errors; "
                                        "reward/unscored per step)")
