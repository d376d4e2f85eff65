"""``unbroken``: the operator API from the user's terminal (submit a script, watch it recover, act on it).

Only the console script imports this package, so the SDK (``import unbroken``) never needs click, rich
or httpx2. It speaks the operator API alone (``/api/v1/...`` with an API token), never Django.
"""


def main() -> None:
    """The console script: the command line, or why it cannot run here."""
    try:
        from trainer.cli.main import cli
    except ImportError as e:  # pip installed the SDK without the command's libraries (Python 3.10: no httpx2)
        raise SystemExit(f"unbroken: the command line needs Python 3.11+ with click, rich and httpx2 ({e}); "
                         "pip install ./trainer on Python 3.11 or newer") from None
    cli(prog_name="unbroken")
