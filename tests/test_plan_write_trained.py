"""`tetrad plan --write` never writes a config whose run folder (the layout's own, chosen by the
plan) already holds an earlier run's checkpoints, which `tetrad train` would resume instead of
starting the planned run: one line says so and what to pass; a flag naming that folder resumes it."""

from __future__ import annotations

from pathlib import Path

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.config.checkpoints import MANIFEST

PLAN = ["--cluster", "dgx-h100", "--global-batch", "16", "--top", "1"]


def _saved(step: Path) -> None:
    """A checkpoint as `tetrad train` publishes it: its folder holds the manifest (written last)."""
    step.mkdir(parents=True)
    (step / MANIFEST).write_text("{}")


def test_plan_write_refuses_a_layout_folder_that_holds_checkpoints(tmp_path, capsys):
    run = tmp_path / "runs" / "mine"
    config = tmp_path / "mine.toml"
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{run}"\n')
    best, again = tmp_path / "best.toml", tmp_path / "again.toml"
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 0
    written = load_config(best).run.dir
    capsys.readouterr()
    # `tetrad train best.toml` ran and saved (step_N with its manifest, and the `latest` pointer)
    _saved(tmp_path / written / "checkpoints" / "step_40")
    (tmp_path / written / "checkpoints" / "latest").write_text("step_40\n")
    for planned in (config, best):  # the same layout planned again, from the run's config or the written one
        assert main(["plan", str(planned), *PLAN, "--write", str(again)]) == 2
        err = capsys.readouterr().err
        assert err == (f"tetrad plan: run.dir = '{written}', the layout's own folder, already holds checkpoints of a "
                       f"run ({written}/checkpoints/step_40), which `tetrad train` would resume; give the plan "
                       f"--run.dir=NEW for a fresh run, or --run.dir={written} to resume it\n"), err
        assert not again.exists()
    assert main(["plan", str(config), *PLAN, "--write", str(again), f"--run.dir={written}"]) == 0  # the user's word
    assert load_config(again).run.dir == written
    elsewhere = tmp_path / "ckpts"
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{run}"\n[checkpoint]\ndir = "{elsewhere}"\n')
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 0
    _saved(tmp_path / load_config(best).checkpoint.dir / "step_7")
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 2
    assert "tetrad plan: checkpoint.dir = " in capsys.readouterr().err


def test_plan_write_keeps_a_flagged_run_dir_whose_checkpoint_dir_is_inside_it(tmp_path, capsys):
    """checkpoint.dir inside run.dir (the config file's) moves with run.dir: --run.dir=THE_RUN is
    the user's word to resume it, as where checkpoint.dir is unset. Before: refused, naming
    checkpoint.dir as 'the layout's own folder' though the user's run chose it."""
    run = tmp_path / "runs" / "mine"
    config, out = tmp_path / "mine.toml", tmp_path / "again.toml"
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{run}"\n[checkpoint]\ndir = "{run}/ckpt"\n')
    _saved(run / "ckpt" / "step_00000040")
    assert main(["plan", str(config), *PLAN, "--write", str(out), f"--run.dir={run}"]) == 0, capsys.readouterr().err
    assert load_config(out).run.dir == str(run) and load_config(out).checkpoint.dir == f"{run}/ckpt"


def test_plan_write_takes_a_layout_folder_holding_only_a_crashed_save(tmp_path, capsys):
    """A step folder without its manifest (a save killed before it was published, or not tetrad's)
    is no checkpoint: `tetrad train` starts afresh beside it (and removes it at its next save), so
    the plan writes the config. Before: refused, naming the crashed folder as a run to resume."""
    config, best = tmp_path / "mine.toml", tmp_path / "best.toml"
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{tmp_path / "runs" / "mine"}"\n')
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 0
    root = Path(load_config(best).run.dir) / "checkpoints"
    (root / "step_00000040").mkdir(parents=True)
    (root / "step_00000050.partial").mkdir()
    (root / "step_00000050.partial" / MANIFEST).write_text("{}")
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 0, capsys.readouterr().err
    _saved(root / "step_00000030")  # an older complete one beside them is what is named
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 2
    assert f"holds checkpoints of a run ({root}/step_00000030)" in capsys.readouterr().err


def test_plan_write_says_train_refuses_a_trained_folder_where_resume_is_never(tmp_path, capsys):
    """checkpoint.resume = "never": `tetrad train` refuses a checkpoint root holding checkpoints
    (recovery.refuse_later), it does not resume them; the line says so, and that resuming it needs
    --checkpoint.resume=auto too. Before: "which `tetrad train` would resume", and a flag that
    would still be refused."""
    config, best, again = tmp_path / "mine.toml", tmp_path / "best.toml", tmp_path / "again.toml"
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{tmp_path / "runs" / "mine"}"\n'
                      '[checkpoint]\nresume = "never"\n')
    assert main(["plan", str(config), *PLAN, "--write", str(best)]) == 0
    written = load_config(best).run.dir
    _saved(Path(written) / "checkpoints" / "step_00000040")
    capsys.readouterr()
    assert main(["plan", str(config), *PLAN, "--write", str(again)]) == 2
    assert capsys.readouterr().err == (
        f"tetrad plan: run.dir = '{written}', the layout's own folder, already holds checkpoints of a run "
        f"({written}/checkpoints/step_00000040), which `tetrad train` refuses to train over (checkpoint.resume = "
        f"'never'); give the plan --run.dir=NEW for a fresh run, or --run.dir={written} --checkpoint.resume=auto "
        "to resume it\n")
    argv = ["plan", str(config), *PLAN, "--write", str(again), f"--run.dir={written}", "--checkpoint.resume=auto"]
    assert main(argv) == 0
    assert (load_config(again).run.dir, load_config(again).checkpoint.resume) == (written, "auto")
