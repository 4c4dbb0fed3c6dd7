"""Where a conversion is built before it appears at DST, and its resume journal.

`<parent of DST>/.<name of DST>.ling-convert-partial/` holds the Orbax arrays being written, `job.json` (what
is being converted, so `--resume` cannot mix two different conversions) and one `journal.process_<i>.jsonl`
per process with a line per parameter whose arrays are completely written. DST itself only appears at the
end, by renaming the finished directory (`publish`), so nothing at DST ever looks complete early; an earlier
output it replaces is renamed aside first and deleted only once the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

from convert import ConvertError
from convert.destination import check_destination

JOB_FILE = "job.json"


class Journal:
    """Append-only record of finished parameters; a last line cut short by a kill is ignored on resume, any
    other line that is not an entry means the journal is damaged."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def finished(self) -> set[str]:
        if not os.path.exists(self.path):
            return set()
        with open(self.path, "rb") as f:
            # after the last newline: nothing, or the entry a kill cut short (that parameter is converted again)
            complete = f.read().split(b"\n")[:-1]
        return {self._entry(line, number) for number, line in enumerate(complete, 1)}

    def _entry(self, line: bytes, number: int) -> str:
        try:
            entry = json.loads(line.decode("utf-8"))
        except ValueError as e:
            problem = str(e)
        else:
            if isinstance(entry, dict) and isinstance(entry.get("param"), str):
                return entry["param"]
            problem = f"found {line[:80]!r}"
        raise ConvertError(
            f"{self.path}: line {number} is not a journal entry ({problem}); the journal is "
            f"damaged: pass --overwrite to start over"
        )

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
                raise ConvertError(
                    f"{self.path}: an unfinished conversion to {self.dst} is there; pass --resume to "
                    f"continue it or --overwrite to start over"
                )
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
        except (OSError, ValueError) as e:
            raise ConvertError(
                f"{file}: cannot read the unfinished conversion's job ({e}); pass --overwrite to start over"
            ) from e
        if started != job:
            raise ConvertError(
                f"{file}: the unfinished conversion is {started}, not {job}; pass --overwrite to start over"
            )

    def publish(self, overwrite: bool) -> None:
        """Drop the bookkeeping and move the finished checkpoint to DST, replacing the earlier output there
        (checked again: the conversion may have taken hours) only once the new one is in place."""
        try:
            check_destination(self.dst, overwrite)
        except ConvertError as e:
            raise ConvertError(f"{e} (DST changed while converting; the finished conversion is in {self.path})") from e
        for entry in os.listdir(self.path):
            if entry == JOB_FILE or entry.startswith("journal."):
                os.remove(os.path.join(self.path, entry))
        replaced = self.path + ".replaced"
        if os.path.exists(self.dst):
            if os.path.exists(replaced):  # an older output a crash after the swap left behind
                shutil.rmtree(replaced)
            os.rename(self.dst, replaced)
        os.rename(self.path, self.dst)
        if os.path.exists(replaced):
            shutil.rmtree(replaced)
