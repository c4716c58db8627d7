"""Which folders under a checkpoint root are complete checkpoints: the one rule `tetrad train`
resumes by (train/checkpoint) and `tetrad plan --write` refuses a trained folder by (plan/cli.py),
kept on the lowest floor so that both import it rather than each spell it out.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "tetrad.json"  # written last, before the rename that publishes a step folder


def step_of(path: Path) -> int:
    """The step a checkpoint folder holds, from its name (step_00000010 -> 10)."""
    return int(path.name.removeprefix("step_"))


def published(root: Path) -> list[Path]:
    """Folders named like a published checkpoint (step_ and digits only), newest first; whether
    they are complete and intact is for `verify` to say."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name.removeprefix("step_").isdigit()]
    return sorted(found, key=step_of, reverse=True)


def complete(root: Path) -> list[Path]:
    """The published folders that hold their manifest, newest first: what a resume considers (a
    folder without one is a crashed save's, or not tetrad's). Intact or not is `verify`'s to say."""
    return [p for p in published(root) if (p / MANIFEST).exists()]
