"""The quickstart notebook runs top to bottom against the test session's cluster."""

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(ray_cluster, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits RAY_ADDRESS from this process, so the notebook attaches to the session's cluster.
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    # One request per rank (which rank gets which depends on the order they arrive in).
    ran = set(re.findall(r"rank (\d): seed (\d), \(64, 64\)", outputs))
    assert {rank for rank, _ in ran} == {"0", "1"} and {seed for _, seed in ran} == {"0", "1"}, outputs
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the notebook shows the generated image"
    assert "completed: 9 frames at 16 fps, 64x64" in outputs
    videos = [
        o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})
    ]
    assert any("<video" in html and "data:video/mp4;base64," in html for html in videos), "the notebook plays the video"
