"""`tinylm train --log-to tensorboard,wandb`: the metrics, read back by each library's own reader.

Every number of every metrics.jsonl row must appear in TensorBoard and in W&B under ``<kind>/<key>``
at the row's step, and nothing else: TensorBoard's `EventAccumulator` reads the event files, and
wandb's own reader of its transaction log (``wandb leet inspect --json``, the wandb-core program)
reads the offline run. W&B runs offline in a temporary folder: no account, no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainkit import cli_flags, run_cli

from tinylm.cli import main
from tinylm.config import resolve_config
from tinylm.errors import TinyLMError
from tinylm.run import read_metrics


@pytest.fixture(scope="module")
def wandb_home(tmp_path_factory):
    """wandb's own folders (settings, caches, logs) in a temporary one, offline and quiet, for every run here."""
    home = tmp_path_factory.mktemp("wandb-home")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(home),
           "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield home
    # nothing of wandb's outlives the runs: its service stops with the process that started it
    assert _processes_started_under(home) == []


def _processes_started_under(home: Path, wait: float = 5.0) -> list[int]:
    """The processes (wandb-core, its system monitor) whose environment names ``home``: none once they exited.

    Linux's /proc is where a process's environment can be read; waits up to ``wait`` seconds for them to go.
    """
    marker = f"WANDB_DATA_DIR={home / 'data'}".encode()
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0") and int(entry.name) != os.getpid():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the rows say each chart must hold: tag ``kind/key`` -> [(step, value)], for every number but flags."""
    charts: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                charts[f"{row['kind']}/{key}"].append((row["step"], float(value)))
    return dict(charts)


def tensorboard_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard's own reader finds in ``path`` (a folder of event files, or one file)."""
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0}).Reload()  # 0: keep every event
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_float32(charts: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard stores a scalar as a float32: the same numbers, rounded as it rounds them."""
    return {tag: [(step, float(np.float32(value))) for step, value in points] for tag, points in charts.items()}


def wandb_records(offline_run: Path) -> list[dict]:
    """The records of an offline W&B run, as wandb's own reader of .wandb files prints them."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def wandb_history(records: list[dict]) -> dict[int, dict[str, float]]:
    """step -> the logged values of that step (W&B's own _step, _runtime, _timestamp left out)."""
    history = {}
    for record in records:
        if record["type"] == "history":
            item = record["history"]["item"]
            history[record["history"]["step"]["num"]] = {k: v for k, v in item.items() if not k.startswith("_")}
    return history


def by_step(charts: dict[str, list[tuple[int, float]]]) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = defaultdict(dict)
    for tag, points in charts.items():
        for step, value in points:
            steps[step][tag] = value
    return dict(steps)


def offline_runs(run: Path) -> list[Path]:
    """The run's W&B offline runs, one per session, oldest first (their names start with the start time)."""
    return sorted((run / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, corpus, data_dir, wandb_home) -> Path:
    """One tiny run (8 steps, evaluations at 4 and 8) logged to metrics.jsonl, TensorBoard and W&B."""
    out = tmp_path_factory.mktemp("logged") / "run"
    done = run_cli("train", *cli_flags(corpus, data_dir), "--log-to", "tensorboard,wandb", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "metrics: " in done.stdout and "TensorBoard" in done.stdout and "W&B offline run" in done.stdout
    return out


@pytest.mark.slow
def test_tensorboard_holds_every_number_of_metrics_jsonl(logged_run):
    rows = read_metrics(logged_run)
    expected = expected_scalars(rows)
    assert [step for step, _ in expected["train/loss"]] == list(range(1, 9))
    assert [step for step, _ in expected["eval/val_loss"]] == [4, 8]
    assert {"train/lr", "train/tokens_per_s", "eval/val_bpb", "final/val_bpb"} <= set(expected)
    assert tensorboard_scalars(logged_run / "tensorboard") == as_float32(expected)
    # the resolved configuration, as text: config.toml, indented to stay a code block in TensorBoard's Markdown
    acc = EventAccumulator(str(logged_run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    (text,) = acc.Tensors("config/text_summary")
    toml = (logged_run / "config.toml").read_text()
    assert text.tensor_proto.string_val[0].decode() == "".join(f"    {line}\n" for line in toml.splitlines())


def test_wandb_offline_run_holds_every_number_of_metrics_jsonl(logged_run):
    (offline,) = offline_runs(logged_run)
    records = wandb_records(offline)
    # rows of one step (train, eval, final) are one W&B history row; the values are the JSON's, exactly
    assert wandb_history(records) == by_step(expected_scalars(read_metrics(logged_run)))
    (start,) = [r["run"] for r in records if r["type"] == "run"]
    assert start["project"] == "tinylm"
    assert start["run_id"] == (logged_run / "wandb" / "tinylm-run-id").read_text().strip()
    assert offline.name.endswith(start["run_id"])
    saved = tomllib.loads((logged_run / "config.toml").read_text())
    logged = start["config"]["update"]
    assert {"model": logged["model"], "train": logged["train"]} == saved
    assert saved["train"]["log_to"] == "tensorboard,wandb"


@pytest.mark.slow  # two runs of the command
def test_a_resumed_run_appends_to_its_tensorboard_and_wandb_runs(tmp_path, corpus, data_dir, wandb_home):
    """Stopped at step 6, resumed from the best checkpoint (step 4): steps 5 and 6 are done twice."""
    out = tmp_path / "run"
    first = run_cli("train", *cli_flags(corpus, data_dir), "--log-to", "tensorboard,wandb", "--stop-after", "6",
                    "--out", str(out))
    assert first.returncode == 0, first.stderr
    rows_before = read_metrics(out)
    assert max(r["step"] for r in rows_before) == 6
    resumed = run_cli("train", "--out", str(out), "--resume", "best")  # the run's own settings: --log-to included
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step 4 of" in resumed.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))  # the redone steps once

    # TensorBoard: two event files; the first still holds steps 5 and 6 of the first session, and the
    # reader hides them (the second session's purge step), so the folder reads as metrics.jsonl does
    first_file, second_file = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [step for step, _ in tensorboard_scalars(first_file)["train/loss"]] == list(range(1, 7))
    assert [step for step, _ in tensorboard_scalars(second_file)["train/loss"]] == [5, 6, 7, 8]
    assert tensorboard_scalars(out / "tensorboard") == as_float32(expected_scalars(rows))

    # W&B: a second offline run of the same run id, logging from step 5 on
    run_id = (out / "wandb" / "tinylm-run-id").read_text().strip()
    sessions = offline_runs(out)
    assert len(sessions) == 2
    histories = []
    for session in sessions:
        records = wandb_records(session)
        (start,) = [r["run"] for r in records if r["type"] == "run"]
        assert start["run_id"] == run_id
        histories.append(wandb_history(records))
    assert histories[0] == by_step(expected_scalars(rows_before))
    assert histories[1] == by_step(expected_scalars([r for r in rows if r["step"] >= 5]))


@pytest.mark.slow  # torchrun and two processes
def test_under_torchrun_process_0_alone_logs(tmp_path, corpus, data_dir, wandb_home):
    from test_distributed import torchrun

    out = tmp_path / "ddp"
    torchrun(*cli_flags(corpus, data_dir, max_steps=6, eval_interval=3), "--log-to", "tensorboard,wandb",
             "--out", str(out))
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (offline,) = offline_runs(out)
    expected = expected_scalars(read_metrics(out))
    assert tensorboard_scalars(out / "tensorboard") == as_float32(expected)
    assert wandb_history(wandb_records(offline)) == by_step(expected)


def _fails_with(capsys, argv: list[str], message: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [f"tinylm: error: {message}"]


def test_an_unknown_backend_is_a_one_line_error(tmp_path, capsys, corpus, data_dir):
    out = tmp_path / "run"
    _fails_with(capsys, ["train", *cli_flags(corpus, data_dir), "--log-to", "jsonl,tensorbord", "--out", str(out)],
                "log_to: unknown backend 'tensorbord' (did you mean 'tensorboard'?); choose from jsonl, tensorboard, "
                "wandb, several comma-separated (e.g. tensorboard,wandb)")
    assert not out.exists()


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_a_missing_package_is_a_one_line_error_before_training(tmp_path, capsys, monkeypatch, corpus, data_dir,
                                                               backend):
    monkeypatch.setitem(sys.modules, backend, None)  # `import tensorboard` (or wandb) raises ImportError
    out = tmp_path / "run"
    _fails_with(capsys, ["train", *cli_flags(corpus, data_dir), "--log-to", backend, "--out", str(out)],
                f"--log-to {backend} needs the {backend} package: pip install -e '.[{backend}]'")
    assert not out.exists()  # stopped before the run folder was made


def test_the_log_setting_names_each_backend_once_after_metrics_jsonl():
    def backends(log_to: str) -> tuple[str, ...]:
        return resolve_config(preset="tiny", overrides={"log_to": log_to}).train.log_backends

    assert backends("") == backends("jsonl") == ("jsonl",)
    assert backends("wandb, tensorboard,wandb") == ("jsonl", "wandb", "tensorboard")
    with pytest.raises(TinyLMError, match="unknown backend 'mlflow'; choose from"):
        backends("mlflow")
