"""The library's own commands: ``python -m tokenbridge.commands.verify`` (``make verify``) and
``python -m tokenbridge.commands.pair_report``. Both fail the way every command does
(`tokenbridge.cli`: one line, an exit code)."""
