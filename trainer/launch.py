"""``python -m trainer.launch [torchrun options] trainer/main.py conf=<name> [overrides]``

torchrun, with its failure report cut to what the ranks already said. Plain torchrun's launcher
ends a failed run with a traceback and a ``ChildFailedError`` box of its own, which nothing
inside a rank can turn off; this calls the same ``torch.distributed.run.run`` and catches that
exception: nothing more when a rank printed its line, else one line for the failure that
explains most, and the failing rank's exit code (README, "When something fails").
``TOKENBRIDGE_DEBUG=1`` restores torchrun's own logging and report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tokenbridge import cli


def explain(failures: dict) -> tuple[str | None, int]:
    """What to print for a failed launch (None: a rank already printed its line) and the exit
    code: that rank's, or the one of the failure the line describes (1 for a signal).

    ``failures``: global rank -> torchrun's ``ProcessFailure`` (exitcode, pid, timestamp, error
    file data with the rank's note, `tokenbridge.cli`).
    """
    notes = {r: _note(f) for r, f in failures.items()}
    by_time = sorted(failures, key=lambda r: (failures[r].timestamp, r))
    printed = [r for r in by_time if notes[r].get("kind") == "printed"]
    if printed:
        return None, _code(failures[printed[0]], notes[printed[0]])

    def telling(r: int) -> int:
        # nobody spoke: a rank killed from outside (the OOM killer) explains most, then an
        # error every rank met (its reporter, rank 0, stopped first), then a lost link; a rank
        # stopped by torchrun itself (SIGTERM, SIGINT) explains nothing
        f, kind = failures[r], notes[r].get("kind")
        if f.exitcode < 0 and -f.exitcode not in (signal.SIGTERM, signal.SIGINT):
            return 0
        return {"held": 1, "quiet": 2}.get(kind, 3)

    rank = min(by_time, key=telling)
    f = failures[rank]
    if notes[rank]:
        return notes[rank]["line"], _code(f, notes[rank])
    if f.exitcode < 0:
        name = signal.Signals(-f.exitcode).name
        what = f"was killed by signal {name}"
        if name == "SIGKILL":
            what += " (if no one did, the kernel's out-of-memory killer probably did: `dmesg`)"
    else:
        what = f"exited with code {f.exitcode} without a message"
    return f"tokenbridge train [rank {rank}]: the process (pid {f.pid}) {what}", _code(f)


def _note(failure) -> dict:
    data = getattr(failure, "error_file_data", None) or {}
    msg = data.get("message")
    return msg.get("tokenbridge", {}) if isinstance(msg, dict) else {}


def _code(failure, note: dict | None = None) -> int:
    # the code the rank meant to exit with (torchrun may have stopped it a moment later)
    if note and isinstance(note.get("code"), int):
        return note["code"]
    return failure.exitcode if failure.exitcode > 0 else cli.EXIT_RUN


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    debug = cli.debug_enabled()
    if not debug:
        # "Sending process N closing signal SIGTERM", "failed (exitcode: 1) local_rank: 0 ...":
        # the ranks' own lines say it better
        # (each of torch's elastic modules sets its own logger's level: set them all)
        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ[cli.LAUNCHER_ENV] = "1"  # the ranks inherit it: they leave notes (tokenbridge.cli)
    try:
        run(args)
    except ChildFailedError as e:
        line, code = explain(e.failures)
        if debug:
            line = traceback.format_exc()
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:  # Ctrl-C / SIGTERM to the launcher: the ranks were stopped
        return 128 + int(e.sigval)
    except RendezvousError as e:
        # several nodes: the agent that hosts the rendezvous store ended first (its ranks
        # failed or finished) while this one still asked the store about its peers
        if debug:
            raise
        print(
            f"tokenbridge train: {type(e).__name__}: the rendezvous store stopped answering "
            "(the node that hosts it, the one --rdzv_endpoint names, ended first); this "
            "node's ranks said above why they stopped, if they failed",
            file=sys.stderr,
            flush=True,
        )
        return cli.EXIT_RUN
    return 0


if __name__ == "__main__":
    sys.exit(main())
