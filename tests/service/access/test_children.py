"""What the worker's children import: nothing from the directory the worker was started in.

A worker started from a directory others can write (``/tmp``) must not run a module
planted there: ``python -m`` puts the working directory first on ``sys.path``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from framewire.client import Client

from tests.support.engines import vllm_omni_quantize, vllm_omni_save
from tests.support.media import make_clip


def test_a_module_planted_where_the_worker_runs_is_not_imported(workers, tmp_path):
    planted = Path(tempfile.mkdtemp(prefix="framewire-cwd-"))
    try:
        planted.chmod(0o1777)  # like /tmp: anyone may leave a file here
        ran = planted / "ran"
        (planted / "av.py").write_text(
            f"open({str(ran)!r}, 'w').write('imported')\nraise ImportError('planted')\n"
        )
        w = workers.start(cwd=planted)
        clip = make_clip(6, 32, 48) * 2 - 1
        want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=16)
        with Client(w.uds_url) as c:
            result = c.save_video(
                clip, "child.mp4", fps=16, profile="vllm-omni", value_range=(-1.0, 1.0)
            )
        assert not ran.exists(), "the PyAV child imported the planted av.py"
        assert result.sha256 == want
    finally:
        shutil.rmtree(planted)
