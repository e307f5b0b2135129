"""What the tests share: clips and their oracles, real workers and requests against them,
processes and segments. Fixtures live in tests/conftest.py; nothing here imports a test."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the suite installs for itself once per machine, whichever clone runs it: hls.js,
# the engines' sites, the GPU host's stand-in.
CACHE = Path.home() / ".cache" / "framewire-tests"
