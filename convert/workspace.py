"""Where a conversion is built before it appears at DST, and its resume journal.

`<parent of DST>/.<name of DST>.ling-convert-partial/` holds the Orbax arrays being written, `job.json` (what
is being converted, so `--resume` cannot mix two different conversions) and one `journal.process_<i>.jsonl`
per process with a line per parameter whose arrays are completely written. DST itself only appears at the
end, by renaming the finished directory (`publish`), so nothing at DST ever looks complete early.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

from convert import ConvertError
from convert.store import CHECKPOINT_METADATA_FILE
from ling_jax.orbax_checkpoint import LAYOUT_FILE

JOB_FILE = "job.json"


def check_destination(dst: str, overwrite: bool) -> None:
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ConvertError(f"{dst}: exists and is not a directory")
    if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        finished = any(os.path.exists(os.path.join(dst, f)) for f in (LAYOUT_FILE, CHECKPOINT_METADATA_FILE))
        what = "a finished checkpoint" if finished else "a non-empty directory"
        raise ConvertError(f"{dst}: already {what}; pass --overwrite to replace it")


class Journal:
    """Append-only record of finished parameters; a line cut short by a kill is ignored on resume."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def finished(self) -> set[str]:
        if not os.path.exists(self.path):
            return set()
        names = set()
        with open(self.path) as f:
            for line in f:
                try:
                    names.add(json.loads(line)["param"])
                except (json.JSONDecodeError, KeyError):
                    continue
        return names

    def record(self, name: str) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps({"param": name}) + "\n")


class Workspace:
    def __init__(self, dst: str):
        self.dst = dst
        self.path = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.ling-convert-partial")

    def journal(self, process_index: int) -> Journal:
        return Journal(os.path.join(self.path, f"journal.process_{process_index}.jsonl"))

    def prepare(self, job: dict, *, resume: bool, overwrite: bool) -> None:
        """Create the workspace, or keep the one `--resume` continues (after checking it is the same job)."""
        if os.path.exists(self.path):
            if resume:
                self.attach(job)
                return
            if not overwrite:
                raise ConvertError(f"{self.path}: an unfinished conversion to {self.dst} is there; pass --resume to "
                                   f"continue it or --overwrite to start over")
            shutil.rmtree(self.path)
        os.makedirs(self.path)
        with open(os.path.join(self.path, JOB_FILE), "w") as f:
            json.dump(job, f, indent=1)

    def attach(self, job: dict) -> None:
        """Check that the existing workspace was started for `job`."""
        file = os.path.join(self.path, JOB_FILE)
        try:
            with open(file) as f:
                started = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConvertError(f"{file}: cannot read the unfinished conversion's job ({e}); pass --overwrite to "
                               f"start over") from e
        if started != job:
            raise ConvertError(f"{file}: the unfinished conversion is {started}, not {job}; pass --overwrite to "
                               f"start over")

    def publish(self) -> None:
        """Drop the bookkeeping and move the finished checkpoint to DST (replacing what `--overwrite` allowed)."""
        for entry in os.listdir(self.path):
            if entry == JOB_FILE or entry.startswith("journal."):
                os.remove(os.path.join(self.path, entry))
        replaced = self.path + ".replaced"
        if os.path.exists(self.dst):
            os.rename(self.dst, replaced)
        os.rename(self.path, self.dst)
        if os.path.exists(replaced):
            shutil.rmtree(replaced)
