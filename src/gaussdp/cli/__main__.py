"""``python -m gaussdp.cli``: the same as the ``gaussdp`` console script."""

from gaussdp.cli import main

main()
