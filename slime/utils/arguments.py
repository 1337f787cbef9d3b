"""Upstream slime's path of the command line, kept for users' code and launch scripts
(`python -m slime.utils.arguments ARGS...`, a dry run that prints "ok"). The code lives in `slime.config`; nothing in
this project imports through here."""

from slime.config import *  # noqa: F403
from slime.config import __all__  # noqa: F401

if __name__ == "__main__":
    from slime.config.parser import main

    main()
