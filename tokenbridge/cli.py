"""How every tokenbridge command ends when it fails: one line, an exit code, no traceback.

Every command runs its ``main`` through `run` (tests/unit/test_cli.py checks each ``__main__``),
which prints a failure the user can act on as ``tokenbridge <command>[ [rank R/N]]: <ErrorType>:
<what failed, where>[; <what to do>]`` and exits 2 for wrong inputs, 1 for a failed run, 130 on
Ctrl-C (README, "When something fails"). Which exception is which is a list of `Rule`s, the
command's own before `BASE_RULES` (this module must not import the trainer); one no rule knows
is a bug, and its traceback is always printed.
Under torchrun an error every rank meets alike is said once: by rank 0, and on several nodes
by the first rank of each other node too (its log is another machine's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEBUG_ENV = "TOKENBRIDGE_DEBUG"
LAUNCHER_ENV = "TOKENBRIDGE_LAUNCHER"  # set by trainer.launch for the ranks it starts
EXIT_RUN, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
# How long a rank other than 0 waits for rank 0 to report an error every rank raised: torchrun
# stops the other ranks within its monitor interval (0.1 s) of rank 0's exit.
PEER_WAIT_S = 3.0
MAX_LINE = 2000  # characters of a message kept on the line (a repr of a huge array, say)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


class UsageError(ValueError):
    """The command line itself is wrong (an unknown option, a missing argument)."""


@dataclass(frozen=True)
class Rule:
    """Exceptions matching ``types`` (or ``match``) end the command with ``code``.

    hint: what to do, appended to the message (a string, or a function of the exception that
    returns one or ""). everywhere: every rank raises it alike, rank 0 reports it. quiet: a
    consequence of another process's failure, reported by that process, not here.
    """

    types: tuple[type[BaseException] | str, ...] = ()
    code: int = EXIT_RUN
    hint: str | Callable[[BaseException], str] = ""
    everywhere: bool = False
    quiet: bool = False
    match: Callable[[BaseException], bool] | None = None

    def matches(self, e: BaseException) -> bool:
        if self.types and not any(is_a(e, t) for t in self.types):
            return False
        return self.match(e) if self.match is not None else bool(self.types)

    def hint_for(self, e: BaseException) -> str:
        return self.hint(e) if callable(self.hint) else self.hint


def is_a(e: BaseException, t: type[BaseException] | str) -> bool:
    """isinstance, or for ``"module.Class"`` a class of that name among e's bases: a rule can
    name the trainer's errors without importing them (and torch) before anything failed."""
    if not isinstance(t, str):
        return isinstance(e, t)
    return any(f"{c.__module__}.{c.__qualname__}" == t for c in type(e).__mro__)


BASE_RULES: tuple[Rule, ...] = (
    Rule((KeyboardInterrupt,), EXIT_INTERRUPTED, everywhere=True),
    Rule((FileExistsError,), EXIT_USAGE),
    # a shard or cache directory whose writer did not finish (RuntimeErrors, named here so
    # that every command reading one says it alike without importing its module first)
    Rule(
        (
            "tokenbridge.formats.shards.IncompleteShardsError",
            "tokenbridge.formats.teacher_cache_reader.IncompleteCacheError",
        ),
        EXIT_USAGE,
    ),
    # a download (`make models`, `python -m trainer.eval.datasets fetch`): the network or a checksum
    Rule(("tokenbridge.assets.store.AssetError",), EXIT_RUN),
    Rule((FileNotFoundError, NotADirectoryError, IsADirectoryError), EXIT_USAGE),
    Rule((PermissionError,), EXIT_USAGE, "check the path's permissions"),
    # our input errors (config, tokenizers, fingerprints, damaged shards, projections) are
    # ValueErrors that name the file or field; pyarrow's ArrowInvalid is one too
    Rule((ValueError,), EXIT_USAGE),
    Rule((MemoryError,), EXIT_RUN, "out of memory: use smaller batches or a bigger machine"),
    Rule((OSError,), EXIT_RUN),
    # an object store that failed a request the jobs' and trainer's store layers did not
    # word themselves (a server that went away mid-upload): the run failed, in one line
    Rule(
        (
            "apache_beam.io.aws.clients.s3.messages.S3ClientError",
            "botocore.exceptions.BotoCoreError",
            "botocore.exceptions.ClientError",
        ),
        EXIT_RUN,
        "the object store (AWS_ENDPOINT_URL) failed a request; re-run once it answers",
    ),
)


def same_on_every_rank(e: BaseException) -> BaseException:
    """Mark ``e`` as raised alike on every rank (rank 0 reports it); returns it, to re-raise."""
    e.tokenbridge_everywhere = True  # type: ignore[attr-defined]
    return e


def first_line(e: BaseException) -> str:
    """The line a failure prints: what follows it (a worker's traceback) is detail, shown with
    ``TOKENBRIDGE_DEBUG=1``."""
    text = str(e).strip()
    line = text.splitlines()[0].strip() if text else ""
    return line if len(line) <= MAX_LINE else line[:MAX_LINE] + " ..."


def format_line(prog: str, e: BaseException, *, hint: str = "", rank: int = 0, world: int = 1):
    where = f"tokenbridge {prog}" + (f" [rank {rank}/{world}]" if world > 1 else "")
    if isinstance(e, KeyboardInterrupt):
        return f"{where}: interrupted"
    msg = first_line(e)
    line = f"{where}: {type(e).__name__}" + (f": {msg}" if msg else "")
    if hint and hint not in msg:
        line += f"; {hint}"
    return line


def run(
    main: Callable[[list[str] | None], object],
    argv: list[str] | None = None,
    *,
    prog: str,
    rules: Sequence[Rule] = (),
    rank: int = 0,
    world_size: int = 1,
) -> int:
    """``main(argv)``; its failure -> one line on stderr and the exit code (see the module
    docstring), said once over several ranks: an error every rank meets alike by rank 0, any
    other by the rank it happened on, none by a rank that only lost a peer (`Rule`). Returns
    ``main``'s int result, or 0 (a main that returns something else)."""
    try:
        result = main(argv)
    except (Exception, KeyboardInterrupt) as e:  # SystemExit (argparse, --help) passes through
        return _fail(e, prog, (*rules, *BASE_RULES), rank, world_size)
    return result if isinstance(result, int) else 0


def _fail(e: BaseException, prog: str, rules: Sequence[Rule], rank: int, world: int) -> int:
    rule = next((r for r in rules if r.matches(e)), None)
    debug = debug_enabled()
    if rule is None:
        # not a failure we know how to explain: a bug, and its traceback is what helps
        traceback.print_exception(e, file=sys.stderr)
        line = format_line(prog, e, rank=rank, world=world)
        with _no_sigterm():
            _say(f"{line} (an internal error: please report it with the traceback above)")
            _tell_launcher(line, e, "printed", EXIT_RUN)
        return EXIT_RUN
    everywhere = rule.everywhere or getattr(e, "tokenbridge_everywhere", False)
    hint = rule.hint_for(e)
    line = format_line(prog, e, hint=hint, rank=rank, world=world)
    if everywhere and not debug:  # said once for every rank: no rank in the line
        line = format_line(prog, e, hint=hint)
    if rule.code == EXIT_RUN and not debug:
        line += f" ({DEBUG_ENV}=1 shows the traceback)"
    if rule.quiet and not debug:
        _tell_launcher(line, e, "quiet", rule.code)
        return rule.code
    if everywhere and rank != 0 and world > 1 and not debug and not _first_of_another_node(rank):
        # Rank 0 says it. Under trainer.launch this rank leaves it to the launcher (said there
        # if rank 0 was stopped before it could) and ends now; Ctrl-C reaches every rank.
        if _tell_launcher(line, e, "held", rule.code) or isinstance(e, KeyboardInterrupt):
            return rule.code
        # plain torchrun stops this rank once rank 0 has exited; still alive after the wait,
        # rank 0 did not fail, and this rank says it
        time.sleep(PEER_WAIT_S)
        line = format_line(prog, e, hint=hint, rank=rank, world=world)
    with _no_sigterm():
        if debug:
            traceback.print_exception(e, file=sys.stderr)
        _say(line)
        _tell_launcher(line, e, "printed", rule.code)
    return rule.code


def _first_of_another_node(rank: int) -> bool:
    """Is this rank the first one (local rank 0) of a node that rank 0 is not on? Rank 0's line
    goes to its own node's log; each other node says an error every rank met in its own."""
    node = os.environ.get("GROUP_RANK", "0")
    return rank != 0 and node not in ("", "0") and os.environ.get("LOCAL_RANK", "") == "0"


@contextlib.contextmanager
def _no_sigterm():
    """Ignore SIGTERM while the line is printed and noted: torchrun stops the other ranks as
    soon as one exits, and a rank stopped between the two would have its line said twice (by
    the launcher too) or not at all. The report takes milliseconds; the rank exits right after."""
    try:
        before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are the main thread's to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _say(line: str) -> None:
    sys.stderr.flush()
    print(line, file=sys.stderr, flush=True)


def _tell_launcher(line: str, e: BaseException, kind: str, code: int) -> bool:
    """Under `trainer.launch`, leave the line in torchrun's error file (``TORCHELASTIC_ERROR_FILE``,
    in the layout torchrun reads), so the launcher knows whether a rank already said it
    ("printed"), left an error every rank met to be said ("held"), or only lost a peer ("quiet").
    True when the note was written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not os.environ.get(LAUNCHER_ENV):
        return False  # plain torchrun would log an error of its own about a file it cannot copy
    data = {
        "message": {
            "message": f"{type(e).__name__}: {first_line(e)}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(e)) if debug_enabled() else line,
                "timestamp": str(int(time.time())),
            },
            "tokenbridge": {"kind": kind, "line": line, "code": code},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False  # the launcher then prints its own line
    return True
